"""Paged gather/scatter between engine pages and contiguous chunks (installed as radixkv.kernels).

See docs/kernels.md for the model, the chunk byte layout and the dispatch rules.
"""

from __future__ import annotations

from radixkv.kernels.layer_pipeline import LayerPipeline
from radixkv.kernels.paged_copy import (
    CopyResult,
    PreparedCopy,
    gather_chunks,
    gather_chunks_reference,
    prepare_gather,
    prepare_scatter,
    scatter_chunks,
    scatter_chunks_reference,
)
from radixkv.kernels.paged_layout import (
    PagedLayout,
    alloc_chunks,
    chunk_from_payload,
    chunk_payload,
    pages_from_token_indices,
    word_dtype,
)

__all__ = [
    "CopyResult",
    "LayerPipeline",
    "PagedLayout",
    "PreparedCopy",
    "alloc_chunks",
    "chunk_from_payload",
    "chunk_payload",
    "gather_chunks",
    "gather_chunks_reference",
    "pages_from_token_indices",
    "prepare_gather",
    "prepare_scatter",
    "scatter_chunks",
    "scatter_chunks_reference",
    "word_dtype",
]
