"""Builders of ``views[layer][component]`` (see `PagedLayout`) from engine KV tensors. No copies.

Shapes follow docs/kernels.md §3: vLLM 0.33 per-layer ``[blocks, kv_heads, block_size, C]`` views with
K||V in the last dim (any physical order, e.g. LBNHC or LBHNC), SGLang device pools (per-layer
``[tokens, heads, dim]``) and SGLang host pools (layer_first, page_first, page_first_direct for MHA
and MLA; page_head for MHA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from radixkv.errors import InputError

__all__ = ["vllm_views", "sglang_device_views", "sglang_host_views", "SGLANG_HOST_LAYOUTS"]

Views = tuple[tuple[torch.Tensor, ...], ...]

SGLANG_HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def _tensor(t: object, what: str, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} is a {type(t).__name__}, expected a torch.Tensor")
    if t.dim() != dims:
        raise InputError(f"{what} must be {dims}-D; got shape {tuple(t.shape)}")
    return t


def vllm_views(
    kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    head_size: int | None = None,
    mla: bool = False,
) -> Views:
    """Per-layer vLLM views ``[B, H, N, C]`` -> ``[B, N, H, D]`` K and V views (MLA: one view).

    ``head_size`` defaults to ``C // 2``; K is ``[..., :head_size]`` and V ``[..., head_size:]``,
    which must have the same width (vLLM models with ``head_size_v != head_size`` are not
    supported).
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not tensors:
        raise InputError("kv_caches is empty; pass the dict given to register_kv_caches")
    views = []
    for i, t in enumerate(tensors):
        t = _tensor(t, f"kv_caches[{i}]", 4).permute(0, 2, 1, 3)  # [B, N, H, C]
        width = t.shape[-1]
        if mla:
            if t.shape[2] != 1:
                raise InputError(f"MLA caches have 1 KV head; kv_caches[{i}] has {t.shape[2]}")
            views.append((t,))
            continue
        size = width // 2 if head_size is None else head_size
        if size < 1 or 2 * size != width:
            raise InputError(
                f"kv_caches[{i}] last dim is {width}, expected 2*head_size = {2 * size} (K||V); "
                "pass head_size=..., or mla=True for latent caches"
            )
        views.append((t[..., :size], t[..., size:]))
    return tuple(views)


def _check_page_tokens(page_tokens: object) -> None:
    # bool is an int: True would be taken as pages of 1 token
    if not isinstance(page_tokens, int) or isinstance(page_tokens, bool) or page_tokens < 1:
        raise InputError(f"page_tokens must be a positive int; got {page_tokens!r}")


def _pages(t: torch.Tensor, page_tokens: int, what: str) -> torch.Tensor:
    """``[tokens, heads, dim]`` -> ``[tokens // page_tokens, page_tokens, heads, dim]`` view."""
    _check_page_tokens(page_tokens)
    num_pages = t.shape[0] // page_tokens
    if num_pages < 1:
        raise InputError(f"{what} has {t.shape[0]} tokens, fewer than one page of {page_tokens}")
    return t.narrow(0, 0, num_pages * page_tokens).unflatten(0, (num_pages, page_tokens))


def sglang_device_views(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    *,
    page_tokens: int,
) -> Views:
    """SGLang ``MHATokenToKVPool`` (``k_buffer``/``v_buffer`` lists) or ``MLATokenToKVPool``
    (``kv_buffer`` list, ``v_buffers=None``). Page ``p`` = tokens
    ``[p*page_tokens, (p+1)*page_tokens)``."""
    ks = list(k_buffers)
    if not ks:
        raise InputError("k_buffers is empty; pass the pool's per-layer buffers")
    if v_buffers is not None and len(v_buffers) != len(ks):
        raise InputError(f"{len(ks)} K buffers but {len(v_buffers)} V buffers; they must match")
    views = []
    for i, k in enumerate(ks):
        kv = _pages(_tensor(k, f"k_buffers[{i}]", 3), page_tokens, f"k_buffers[{i}]")
        if v_buffers is None:
            if kv.shape[2] != 1:
                # An MHA pool's k_buffer is 3-D too: a K-only layout would leave V unrestored.
                raise InputError(
                    f"v_buffers=None means an MLA pool (1 KV head), but k_buffers[{i}] has {kv.shape[2]} "
                    "heads; pass the MHA pool's v_buffer list as v_buffers"
                )
            views.append((kv,))
        else:
            v = _tensor(v_buffers[i], f"v_buffers[{i}]", 3)
            views.append((kv, _pages(v, page_tokens, f"v_buffers[{i}]")))
    return tuple(views)


def sglang_host_views(
    kv_buffer: torch.Tensor, *, layout: str, page_tokens: int, mla: bool = False
) -> Views:
    """SGLang host pool ``kv_buffer`` -> per-layer views. Shapes (size = tokens, L = layers):

    =================  ==================================  ================================
    layout             MHA                                 MLA
    =================  ==================================  ================================
    layer_first        (2, L, size, H, D)                  (L, size, 1, D)
    page_first         (2, size, L, H, D)                  (size, L, 1, D)
    page_first_direct  (2, page_num, L, page_size, H, D)   (page_num, L, page_size, 1, D)
    page_head          (2, page_num, H, page_size, L, D)   not an MLA layout
    =================  ==================================  ================================
    """
    _check_page_tokens(page_tokens)  # also for the layouts that only compare it with a page size
    if layout not in SGLANG_HOST_LAYOUTS or (mla and layout == "page_head"):
        raise InputError(
            f"unsupported SGLang host layout {layout!r}{' for MLA' if mla else ''}; choose one of "
            f"{', '.join(x for x in SGLANG_HOST_LAYOUTS if not (mla and x == 'page_head'))}"
        )
    if layout == "page_head":
        kv = _tensor(kv_buffer, "kv_buffer (page_head, MHA)", 6)
        if kv.shape[0] != 2:
            raise InputError(
                f"MHA kv_buffer (page_head) must have 2 (K, V) in its first dim; got shape "
                f"{tuple(kv.shape)}"
            )
        if kv.shape[3] != page_tokens:
            raise InputError(
                f"page_head kv_buffer has page_size {kv.shape[3]} but page_tokens={page_tokens}; "
                "pass the pool's page_size"
            )
        # [2, page_num, H, page_size, L, D] -> per layer [page_num, page_size, H, D] views
        return tuple(
            tuple(kv[c, :, :, :, layer].transpose(1, 2) for c in range(2))
            for layer in range(kv.shape[4])
        )
    direct = layout == "page_first_direct"
    dims = (5 if direct else 4) + (0 if mla else 1)
    kv = _tensor(kv_buffer, f"kv_buffer ({layout}, {'MLA' if mla else 'MHA'})", dims)
    if not mla and kv.shape[0] != 2:
        raise InputError(
            f"MHA kv_buffer ({layout}) must have 2 (K, V) in its first dim; got shape "
            f"{tuple(kv.shape)} (pass mla=True for latent caches)"
        )
    comps = [kv] if mla else [kv[0], kv[1]]  # each: the MLA shape of the table above
    if mla and comps[0].shape[-2] != 1:
        raise InputError(
            f"mla=True needs a latent kv_buffer ({layout}) with 1 KV head; got shape {tuple(kv.shape)} "
            "(an MHA host pool: leave mla=False)"
        )
    if direct and comps[0].shape[2] != page_tokens:
        raise InputError(
            f"page_first_direct kv_buffer has page_size {comps[0].shape[2]} but page_tokens="
            f"{page_tokens}; pass the pool's page_size"
        )
    layer_dim = 0 if layout == "layer_first" else 1
    num_layers = comps[0].shape[layer_dim]
    views = []
    for layer in range(num_layers):
        per_comp = []
        for c in comps:
            t = c.select(layer_dim, layer)  # [size, H, D] or [page_num, page_size, H, D]
            per_comp.append(t if direct else _pages(t, page_tokens, f"kv_buffer layer {layer}"))
        views.append(tuple(per_comp))
    return tuple(views)
