"""Tiny engine caches of every supported layout, each with an independent oracle.

``oracle(layer, component, page) -> [page_tokens, heads, dim]`` indexes the *engine* tensor
directly, following each engine's documented shape, so tests check the layout builders as well as
the copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from radixkv.kernels import PagedLayout, word_dtype

LAYERS, HEADS, DIM, MLA_DIM, PAGE_TOKENS, PAGES = 3, 2, 8, 12, 4, 7

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included): copies must move them unchanged."""
    word = word_dtype(dtype)
    info = torch.iinfo(word)
    return torch.randint(info.min, info.max, shape, dtype=word, generator=gen).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.view(word_dtype(a.dtype)), b.view(word_dtype(b.dtype))
    )


@dataclass
class Case:
    name: str
    layout: PagedLayout
    oracle: Callable[[int, int, int], torch.Tensor]
    # every engine tensor of the case is a view of this one (for whole-state checks)
    storage: torch.Tensor


def _page(p: int, ps: int = PAGE_TOKENS) -> slice:
    return slice(p * ps, (p + 1) * ps)


def make_case(name: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> Case:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return random_bits(shape, dtype, g).to(device)

    L, H, D, N, P = LAYERS, HEADS, DIM, PAGE_TOKENS, PAGES
    size = P * N
    if name == "vllm_lbnhc":  # physical [L, B, N, H, 2D], per-layer view [B, H, N, 2D]
        s = rand(L, P, N, H, 2 * D)
        lay = PagedLayout.from_vllm(
            {f"model.layers.{i}.attn": s[i].permute(0, 2, 1, 3) for i in range(L)}
        )
        return Case(name, lay, lambda ly, c, p: s[ly, p, :, :, c * D : (c + 1) * D], s)
    if name == "vllm_lbhnc":  # physical [L, B, H, N, 2D], contiguous per-layer view
        s = rand(L, P, H, N, 2 * D)
        lay = PagedLayout.from_vllm([s[i] for i in range(L)])
        return Case(
            name, lay, lambda ly, c, p: s[ly, p, :, :, c * D : (c + 1) * D].transpose(0, 1), s
        )
    if name == "vllm_mla":  # [B, 1, N, latent]
        s = rand(L, P, 1, N, MLA_DIM)
        lay = PagedLayout.from_vllm([s[i] for i in range(L)], mla=True)
        return Case(name, lay, lambda ly, c, p: s[ly, p].transpose(0, 1), s)
    # per-layer K and V [tokens, H, D]; 2 tail tokens beyond the last page
    if name == "sglang_device":
        s = rand(2, L, size + 2, H, D)
        lay = PagedLayout.from_sglang_device(list(s[0]), list(s[1]), page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[c, ly, _page(p)], s)
    if name == "sglang_device_mla":
        s = rand(L, size, 1, MLA_DIM)
        lay = PagedLayout.from_sglang_device(list(s), None, page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[ly, _page(p)], s)
    if name == "sglang_host_layer_first":  # (2, L, size, H, D)
        s = rand(2, L, size, H, D)
        lay = PagedLayout.from_sglang_host(s, layout="layer_first", page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[c, ly, _page(p)], s)
    if name == "sglang_host_page_first":  # (2, size, L, H, D)
        s = rand(2, size, L, H, D)
        lay = PagedLayout.from_sglang_host(s, layout="page_first", page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[c, _page(p), ly], s)
    if name == "sglang_host_page_first_direct":  # (2, page_num, L, page_size, H, D)
        s = rand(2, P, L, N, H, D)
        lay = PagedLayout.from_sglang_host(s, layout="page_first_direct", page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[c, p, ly], s)
    if name == "sglang_host_page_head":  # (2, page_num, H, page_size, L, D)
        s = rand(2, P, H, N, L, D)
        lay = PagedLayout.from_sglang_host(s, layout="page_head", page_tokens=N)
        return Case(name, lay, lambda ly, c, p: s[c, p, :, :, ly].transpose(0, 1), s)
    if name == "sglang_host_mla_layer_first":  # (L, size, 1, D)
        s = rand(L, size, 1, MLA_DIM)
        lay = PagedLayout.from_sglang_host(s, layout="layer_first", page_tokens=N, mla=True)
        return Case(name, lay, lambda ly, c, p: s[ly, _page(p)], s)
    if name == "sglang_host_mla_page_first":  # (size, L, 1, D)
        s = rand(size, L, 1, MLA_DIM)
        lay = PagedLayout.from_sglang_host(s, layout="page_first", page_tokens=N, mla=True)
        return Case(name, lay, lambda ly, c, p: s[_page(p), ly], s)
    if name == "sglang_host_mla_page_first_direct":  # (page_num, L, page_size, 1, D)
        s = rand(P, L, N, 1, MLA_DIM)
        lay = PagedLayout.from_sglang_host(s, layout="page_first_direct", page_tokens=N, mla=True)
        return Case(name, lay, lambda ly, c, p: s[p, ly], s)
    if name == "strided_dim":  # every other element of the last dim: stride_dim = 2
        s = rand(L, 2, P, N, H, 2 * D)
        lay = PagedLayout.from_views([[s[i, c, ..., ::2] for c in range(2)] for i in range(L)])
        return Case(name, lay, lambda ly, c, p: s[ly, c, p, ..., ::2], s)
    raise KeyError(name)


CASE_NAMES = [
    "vllm_lbnhc",
    "vllm_lbhnc",
    "vllm_mla",
    "sglang_device",
    "sglang_device_mla",
    "sglang_host_layer_first",
    "sglang_host_page_first",
    "sglang_host_page_first_direct",
    "sglang_host_page_head",
    "sglang_host_mla_layer_first",
    "sglang_host_mla_page_first",
    "sglang_host_mla_page_first_direct",
    "strided_dim",
]


def random_page_ids(
    num_chunks: int, pages_per_chunk: int, seed: int, holes: bool = True
) -> torch.Tensor:
    """Distinct random pages (valid for scatter), with some -1 holes when ``holes``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(PAGES, generator=g)[: num_chunks * pages_per_chunk].view(num_chunks, -1)
    if holes:
        ids[torch.rand(ids.shape, generator=g) < 0.3] = -1
        ids[-1, -1] = -1  # a ragged last chunk
    return ids


def expected_chunk(
    case: Case, ids: torch.Tensor, chunk: torch.Tensor, layers: range
) -> torch.Tensor:
    """Oracle for gather: ``chunk`` with each selected (layer, component, page) slab overwritten."""
    out = chunk.clone()
    N = case.layout.page_tokens
    for ly in layers:
        for c in range(case.layout.num_components):
            for j, p in enumerate(ids.tolist()):
                if p >= 0:
                    out[ly, c, j * N : (j + 1) * N] = case.oracle(ly, c, p)
    return out
