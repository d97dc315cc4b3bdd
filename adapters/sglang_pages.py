"""Where a page's bytes live in an SGLang host pool (L2), as uint8 views the store reads and writes.

A host page is one or more *segments*: contiguous byte ranges of the pool's ``kv_buffer`` that
SGLang's own ``get_page_buffer_meta`` reports (the same pointers zero-copy backends such as Mooncake
register). For ``page_first`` / ``page_first_direct`` / ``page_head`` an MHA page is 2 segments
(K block, V block) and an MLA page 1; ``layer_first`` scatters a page over ``2·layers`` (MHA) or
``layers`` (MLA) small segments. Plans:

* ``parts``: a page is one chunk whose payload is the tuple of its segment views, in SGLang's
  pointer order (:data:`radixkv.tiers.base.ChunkBytes`), so the store copies straight between its
  tiers and the host pool, whatever the layout: no intermediate buffer in either direction, and one
  chunk (one tree node, one file, one Redis value) per page.
* ``flat`` (a pool without usable buffer metadata, the copying interface, and sidecar pools): SGLang's
  flat data page (``get_data_page`` / ``set_from_flat_data_page``). Its byte order is **not** the
  same in every layout (:func:`flat_format`): ``page_first`` flattens a page token-major,
  ``page_head`` head-major, ``layer_first`` and ``page_first_direct`` layer-major.
* ``marker``: a pool whose pages hold no bytes (SGLang's ``LogicalHostPool``, the KV anchor of
  DeepSeek-V4, whose KV lives in its sidecar pools): each page is stored as a one-byte marker
  chunk, as SGLang's own NIXL backend does, so the KV chain that gates the sidecars' hits exists.
  Reading one restores nothing (there is nothing to restore).

A plan's ``mode``, segment count and chunk size are part of the storage namespace, and so is the flat
format's byte order, so chunks written under one plan or order are never read under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixkv.errors import InputError
from radixkv.tiers.base import ChunkParts

__all__ = ["PagePlan", "plan_for", "flat_format"]

_VIEW_CACHE_PAGES = 1 << 16  # bound on cached page views per plan (a few MB of tensor headers)
_MARKER_BYTES = 1  # the chunk of a page without bytes (marker plan)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class PagePlan:
    """How pages of one host pool map to chunk payloads (one chunk per page, ``chunk_bytes`` each)."""

    pool: Any
    mode: str                 # "parts", "flat" or "marker"
    n_segments: int           # segments per page (parts) -- 1 for flat
    segment_bytes: int        # bytes of one host segment (parts) or of the flat page
    chunk_bytes: int
    page_size: int
    _base: torch.Tensor | None = None   # the pool's kv_buffer as flat uint8
    _limit: int = 0
    _affine: tuple[tuple[int, int], ...] = ()  # per segment: (byte offset at token 0, bytes per token)
    _views: dict[int, Any] | None = None  # page start token -> its payload (segment views)

    @property
    def tag(self) -> str:
        return f"{self.mode}{self.n_segments}x{self.chunk_bytes}"

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page (what SGLang's metrics count): ``chunk_bytes``, 0 for a marker."""
        return 0 if self.mode == "marker" else self.chunk_bytes

    def page_starts(self, host_indices: torch.Tensor, n_pages: int) -> list[int]:
        """Token index of each page's first slot (SGLang passes token indices, page-aligned)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() < n_pages * self.page_size:
            got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else type(host_indices).__name__
            raise InputError(f"host_indices has {got} entries for {n_pages} pages of {self.page_size} tokens")
        if host_indices.dtype.is_floating_point or host_indices.dtype.is_complex or host_indices.dtype == torch.bool:
            raise InputError(f"host_indices has dtype {host_indices.dtype}; pass SGLang's integer token indices")
        starts = host_indices[: n_pages * self.page_size : self.page_size].tolist()
        # A page starts at a page boundary (SGLang allocates host slots page by page); anything else
        # would straddle two pages' slots.
        if any(st % self.page_size or st < 0 for st in starts):
            raise InputError(f"host_indices {starts[:8]} are not page-aligned token indices "
                             f"(page size {self.page_size})")
        return starts

    def views(self, starts: Sequence[int]) -> list[Any]:
        """Parts plan: each page's payload aliasing the host pool -- its segment views as a
        :class:`~radixkv.tiers.base.ChunkParts` (SGLang's pointer order), or the one view of a
        one-segment page.

        Offsets are affine in the page's token index (checked against ``get_page_buffer_meta`` when
        the plan is made), so no per-call metadata walk is needed."""
        base, n, sb = self._base, self._limit, self.segment_bytes
        if self._views is None:
            self._views = {}
        cache = self._views
        out: list[Any] = []
        for s in starts:
            page = cache.get(s)
            if page is None:  # a page's views are made once (slicing costs microseconds per call)
                segs = []
                for off0, stride in self._affine:
                    off = off0 + s * stride
                    if off < 0 or off + sb > n:
                        raise InputError(f"host page at token {s} maps outside the pool's kv_buffer ({off}+{sb} > {n})")
                    segs.append(base[off : off + sb])  # type: ignore[index]
                # validated once: the store and tiers take a ChunkParts without re-checking it
                page = segs[0] if len(segs) == 1 else ChunkParts(segs, "host page", s)
                if len(cache) >= _VIEW_CACHE_PAGES:
                    cache.clear()
                cache[s] = page
            out.append(page)
        return out

    def gather(self, starts: Sequence[int]) -> list[torch.Tensor]:
        """Flat plan: payloads copied out of the pool, one contiguous uint8 tensor per page
        (marker plan: one marker per page)."""
        if self.mode == "marker":
            return [torch.ones(_MARKER_BYTES, dtype=torch.uint8) for _ in starts]
        return [_u8(self.pool.get_data_page(s, flat=True).contiguous()) for s in starts]

    def staging(self, n_pages: int) -> list[torch.Tensor]:
        return [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(n_pages)]

    def scatter(self, starts: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """Flat plan: write flat payloads back into the pool pages at ``starts`` (marker plan:
        nothing, a page without bytes)."""
        if not starts or self.mode == "marker":
            return
        dummy = self.pool.get_dummy_flat_data_page()
        for s, p in zip(starts, payloads):
            self.pool.set_from_flat_data_page(s, p.view(dummy.dtype))


# Host layouts whose flat data page is SGLang's canonical order, the order of
# ``get_dummy_flat_data_page``: (K/V, layer, token, head, dim) for MHA, (layer, token, 1, dim) for MLA.
_CANONICAL_FLAT_LAYOUTS = frozenset({"layer_first", "page_first_direct"})


def flat_format(pool: Any) -> str:
    """The name of the byte order of ``pool``'s flat data pages, for the namespace of flat chunks.

    ``get_data_page(i, flat=True)`` flattens the page *as the layout stores it* and
    ``set_from_flat_data_page`` reads it back the same way: ``page_first`` gives (K/V, token, layer,
    ...), ``page_head`` (K/V, head, token, layer, dim), ``layer_first`` and ``page_first_direct``
    the canonical (K/V, layer, token, ...). Bytes written from one order and read into a pool of
    another are the right size and the wrong KV (layers and tokens transposed), so each order is
    its own format: ``"flat-canonical"`` for the canonical one (a pool without a layout too),
    ``"flat-<layout>"`` for any other layout. No order is named plain ``"flat"``: earlier releases
    stored the flat pages of *every* layout under that name, so chunks there may be in any order
    and must stay misses after an upgrade, never load into a canonical pool."""
    layout = getattr(pool, "layout", None)
    if layout is None or str(layout) in _CANONICAL_FLAT_LAYOUTS:
        return "flat-canonical"
    return f"flat-{layout}"


def _flat_plan(pool: Any, page_size: int) -> PagePlan:
    dummy = pool.get_dummy_flat_data_page()
    nbytes = dummy.numel() * dummy.element_size()
    if nbytes == 0:
        # A page of no bytes (DeepSeek-V4's LogicalHostPool KV anchor): a store chunk needs at least
        # one byte, and without the anchor's chain every hit query failed and V4 never hit L3.
        return PagePlan(pool=pool, mode="marker", n_segments=1, segment_bytes=_MARKER_BYTES,
                        chunk_bytes=_MARKER_BYTES, page_size=page_size)
    return PagePlan(pool=pool, mode="flat", n_segments=1, segment_bytes=nbytes, chunk_bytes=nbytes,
                    page_size=page_size)


def plan_for(pool: Any, flat: bool = False) -> PagePlan:
    """The best plan SGLang's host pool allows (``flat=True`` forces the flat data-page format)."""
    page_size = int(getattr(pool, "page_size", 1) or 1)
    if flat:
        return _flat_plan(pool, page_size)
    kv = getattr(pool, "kv_buffer", None)
    meta = getattr(pool, "get_page_buffer_meta", None)
    if not isinstance(kv, torch.Tensor) or meta is None or not kv.is_contiguous() or kv.device.type != "cpu":
        return _flat_plan(pool, page_size)
    base = _u8(kv)
    base_ptr = kv.data_ptr()
    n_pages = int(getattr(pool, "size", 0)) // page_size
    try:
        probes = {p: meta(torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64))
                  for p in sorted({0, min(1, n_pages - 1), max(0, n_pages - 1)})}
    except Exception:  # layouts without metadata (page_first_kv_split, ...) use SGLang's flat page
        return _flat_plan(pool, page_size)
    ptrs, sizes = probes[0]
    if not ptrs or len(set(sizes)) != 1 or n_pages < 2:
        return _flat_plan(pool, page_size)
    seg_bytes, n_seg = int(sizes[0]), len(ptrs)
    if seg_bytes * n_seg != _flat_plan(pool, page_size).chunk_bytes:  # metadata does not cover the page
        return _flat_plan(pool, page_size)
    p1 = probes[1][0]
    affine = tuple((int(a) - base_ptr, (int(b) - int(a)) // page_size) for a, b in zip(ptrs, p1))
    last = n_pages - 1
    for (off0, stride), got in zip(affine, probes[last][0]):
        if off0 + last * page_size * stride != int(got) - base_ptr:  # not affine: do not guess
            return _flat_plan(pool, page_size)
    return PagePlan(pool=pool, mode="parts", n_segments=n_seg, segment_bytes=seg_bytes,
                    chunk_bytes=seg_bytes * n_seg, page_size=page_size, _base=base, _limit=base.numel(),
                    _affine=affine)
