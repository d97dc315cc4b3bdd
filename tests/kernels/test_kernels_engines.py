"""radixkv layouts over the engines' own KV tensors (vLLM 0.33, SGLang 0.5.23), where importable.

The main suite has neither engine: these tests skip there. Run them in the engine environments:
``.envs/vllm/bin/python -m pytest tests/kernels/test_kernels_engines.py -m vllm`` and
``.envs/sglang/bin/python -m pytest tests/kernels/test_kernels_engines.py -m sglang``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _kernel_cases import same_bits
from radixkv.kernels import (
    PagedLayout,
    alloc_chunks,
    gather_chunks,
    pages_from_token_indices,
    scatter_chunks,
)


def _importable(module: str) -> bool:
    # Not find_spec("vllm"/"sglang"): tests/vllm and tests/sglang are namespace packages by those
    # names when tests/ is on sys.path.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAVE_VLLM = _importable("vllm.v1.kv_cache_interface")
HAVE_SGLANG = _importable("sglang.srt.mem_cache")
IDS = [[3, 7], [0, -1]]


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm==0.33.0 (run in .envs/vllm)")
@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize("force_triton", [False, True], ids=["torch", "interpreter"])
def test_vllm_views_match_flash_attention_reading(layout_name: str, force_triton: bool) -> None:
    """Chunks hold FlashAttention's ``kv_cache.transpose(1, 2).split(head_size, -1)`` K and V."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    blocks, heads, block_size, head_size, layers = 10, 4, 16, 32, 3
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_outer = layout_name.startswith("L")
    kvt = KVCacheTensor(
        size=page * blocks * layers,
        layers=names,
        layer_stride=page * blocks if layer_outer else page,
        block_stride=page if layer_outer else page * layers,
    )

    def make(raw: torch.Tensor) -> list[torch.Tensor]:
        return create_kv_cache_views(raw, spec, blocks, KVCacheLayout[layout_name], kvt)

    raw = torch.randint(-128, 128, (kvt.size,), dtype=torch.int8)
    views = make(raw)
    layout = PagedLayout.from_vllm(dict(zip(names, views)))
    chunks = alloc_chunks(layout, 2, 2).zero_()
    gather_chunks(layout, IDS, chunks, force_triton=force_triton)
    for li, view in enumerate(views):
        k, v = view.transpose(1, 2).split(head_size, dim=-1)  # (B, N, H, D) each
        for c, row in enumerate(IDS):
            for j, p in enumerate(row):
                if p >= 0:
                    tokens = slice(j * block_size, (j + 1) * block_size)
                    assert same_bits(chunks[c, li, 0, tokens], k[p].contiguous())
                    assert same_bits(chunks[c, li, 1, tokens], v[p].contiguous())
    raw2 = torch.zeros_like(raw)
    views2 = make(raw2)
    scatter_chunks(PagedLayout.from_vllm(views2), IDS, chunks, force_triton=force_triton)
    for li in range(layers):
        for p in (3, 7, 0):
            assert same_bits(views2[li][p], views[li][p])
        assert int(views2[li][1].view(torch.int16).abs().sum()) == 0  # untouched page


def _sglang_pools(kind: str, layout_name: str):
    stubs = Path(__file__).resolve().parents[1] / "_stubs"
    if not _importable("torchvision") and str(stubs) not in sys.path:
        sys.path.append(str(stubs))  # as tests/sglang/conftest.py: SGLang imports it, never uses it
    from radixkv.adapters.sglang_cpu import PoolSpec, build_pools

    spec = PoolSpec(kind=kind, layout=layout_name, page_size=4, layers=3, host_tokens=64)
    return spec, build_pools(spec)


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang==0.5.23 (run in .envs/sglang)")
@pytest.mark.parametrize("layout_name", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_sglang_host_pool_pages_match_get_data_page(kind: str, layout_name: str) -> None:
    spec, pools = _sglang_pools(kind, layout_name)
    host = pools.host_pool
    host.kv_buffer.view(torch.int16).random_(-(2**15), 2**15)
    mla = kind == "mla"
    layout = PagedLayout.from_sglang_host(
        host.kv_buffer, layout=host.layout, page_tokens=host.page_size, mla=mla
    )
    ids = [[5, 2], [7, 0]]
    token_indices = torch.tensor([t for row in ids for p in row for t in range(4 * p, 4 * p + 4)])
    assert pages_from_token_indices(token_indices, 4).view(2, 2).tolist() == ids
    chunks = alloc_chunks(layout, 2, 2)
    gather_chunks(layout, ids, chunks, force_triton=True)
    L, N = spec.layers, spec.page_size
    for c, row in enumerate(ids):
        for j, p in enumerate(row):
            flat = host.get_data_page(p * N, flat=True)  # SGLang's own page copy
            got = chunks[c, :, :, j * N : (j + 1) * N]  # (L, comps, N, H, D)
            if mla:
                shape = {"layer_first": (L, N), "page_first": (N, L), "page_first_direct": (L, N)}
                want = flat.view(*shape[layout_name], -1)
                want = want.transpose(0, 1) if layout_name == "page_first" else want
                assert same_bits(got[:, 0, :, 0], want.contiguous())
            else:
                H, D = spec.heads, spec.head_dim
                if layout_name == "page_first":  # get_data_page: (2, page, layer, H, D)
                    want = flat.view(2, N, L, H, D).transpose(1, 2)
                else:  # (2, layer, page, H, D)
                    want = flat.view(2, L, N, H, D)
                assert same_bits(got.transpose(0, 1), want.contiguous())
    _, fresh = _sglang_pools(kind, layout_name)
    layout2 = PagedLayout.from_sglang_host(
        fresh.host_pool.kv_buffer, layout=layout_name, page_tokens=N, mla=mla
    )
    scatter_chunks(layout2, ids, chunks)
    for p in (5, 2, 7, 0):
        assert same_bits(fresh.host_pool.get_data_page(p * N), host.get_data_page(p * N))


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang==0.5.23 (run in .envs/sglang)")
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_sglang_device_pool_pages(kind: str) -> None:
    _, pools = _sglang_pools(kind, "page_first")
    dev = pools.device_pool
    bufs = [dev.k_buffer, dev.v_buffer] if kind == "mha" else [dev.kv_buffer]
    for comp in bufs:
        for buf in comp:
            buf.view(torch.int16).random_(-(2**15), 2**15)
    layout = PagedLayout.from_sglang_device(
        bufs[0], bufs[1] if kind == "mha" else None, page_tokens=4
    )
    chunks = alloc_chunks(layout, 1, 2)
    gather_chunks(layout, [[3, 1]], chunks, force_triton=True)
    for li in range(layout.num_layers):
        for c, comp in enumerate(bufs):
            assert same_bits(chunks[0, li, c, :4], comp[li][12:16])
            assert same_bits(chunks[0, li, c, 4:], comp[li][4:8])
