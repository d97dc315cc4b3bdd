"""Where a page's bytes live in an SGLang host pool (L2), as uint8 views the store reads and writes.

A host page is one or more *segments*: contiguous byte ranges of the pool's ``kv_buffer`` that
SGLang's own ``get_page_buffer_meta`` reports (the same pointers zero-copy backends such as Mooncake
register). For ``page_first`` / ``page_first_direct`` / ``page_head`` an MHA page is 2 segments
(K block, V block) and an MLA page 1; ``layer_first`` scatters a page over ``2·layers`` (MHA) or
``layers`` (MLA) small segments. Some pools keep a page in several buffers, in segments of unequal
sizes: ``AsymmetricMHATokenToKVPoolHost`` (``head_dim != v_head_dim``, e.g. MiMo-V2: a K block and
a smaller V block, in two buffers) and the MLA pool's ``page_first_kv_split`` layout (Ascend: latent
K, RoPE V, and where the model has an indexer its keys and FP32 scales, four buffers). Plans:

* ``parts``: a page is one chunk whose payload is the tuple of its segment views, in SGLang's
  pointer order (:data:`radixkv.tiers.base.ChunkBytes`), so the store copies straight between its
  tiers and the host pool, whatever the layout: no intermediate buffer in either direction, and one
  chunk (one tree node, one file, one Redis value) per page. Segments may lie in several of the
  pool's buffers and differ in size (a chunk is their concatenation); such pools have no usable
  flat page (:attr:`PagePlan.has_flat`), so they need SGLang's zero-copy interface.
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

from radixkv.errors import ConfigError, InputError
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
    segment_sizes: tuple[int, ...]  # bytes of each host segment (parts) or of the flat page
    chunk_bytes: int
    page_size: int
    # Whether the pool has a flat data page of the same bytes (SGLang's copying interface works):
    # False for the asymmetric-K/V pool and page_first_kv_split, whose SGLang flattens none.
    has_flat: bool = True
    _bases: tuple[torch.Tensor, ...] = ()  # the host buffers the segments lie in, as flat uint8
    # per segment: (index in _bases, byte offset at token 0, bytes per token, bytes)
    _affine: tuple[tuple[int, int, int, int], ...] = ()
    _views: dict[int, Any] | None = None  # page start token -> its payload (segment views)

    @property
    def tag(self) -> str:
        sizes = self.segment_sizes
        if len(set(sizes)) > 1:  # the cut is part of the format: "parts256+128" (K, then V)
            return f"{self.mode}{'+'.join(str(n) for n in sizes)}"
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
        bases = self._bases
        if self._views is None:
            self._views = {}
        cache = self._views
        out: list[Any] = []
        for s in starts:
            page = cache.get(s)
            if page is None:  # a page's views are made once (slicing costs microseconds per call)
                segs = []
                for b, off0, stride, sb in self._affine:
                    off, n = off0 + s * stride, bases[b].numel()
                    if off < 0 or off + sb > n:
                        raise InputError(f"host page at token {s} maps outside the pool's buffer ({off}+{sb} > {n})")
                    segs.append(bases[b][off : off + sb])
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
        self._check_flat()
        if self.mode == "marker":
            return [torch.ones(_MARKER_BYTES, dtype=torch.uint8) for _ in starts]
        return [_u8(self.pool.get_data_page(s, flat=True).contiguous()) for s in starts]

    def _check_flat(self) -> None:
        if not self.has_flat:
            raise InputError(f"host pool {type(self.pool).__name__} (layout {getattr(self.pool, 'layout', None)!r}) "
                             "has no flat data page; only the zero-copy path (interface_v1: 1) can store it")

    def staging(self, n_pages: int) -> list[torch.Tensor]:
        self._check_flat()
        return [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(n_pages)]

    def scatter(self, starts: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """Flat plan: write flat payloads back into the pool pages at ``starts`` (marker plan:
        nothing, a page without bytes)."""
        self._check_flat()
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


# Layouts whose flat data page SGLang 0.5.23 cannot make: ``MLATokenToKVPoolHost.get_data_page``
# raises for ``page_first_kv_split`` (a page spans up to four buffers), though its dummy page exists.
_NO_FLAT_LAYOUTS = frozenset({"page_first_kv_split"})

# The attributes where SGLang's host pools keep page bytes: ``kv_buffer`` (a tensor, or the (K, V)
# tuple of an asymmetric MHA pool), the split buffers of ``page_first_kv_split`` and of
# ``AsymmetricMHATokenToKVPoolHost``. Only these are mapped: a pointer elsewhere (a pool that
# translates indices through a shared backing) keeps the pool on its flat page.
_PAGE_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


def _unstorable(pool: Any, cause: object) -> ConfigError:
    """The error for a host pool radixkv cannot store (it has neither buffer metadata that covers
    its pages nor a flat data page), naming the pool, the cause and the way out."""
    cls = type(pool).__name__
    if any(c.__name__ == "MHATokenToKVPoolMXFP8Host" for c in type(pool).__mro__):
        return ConfigError(
            f"radixkv cannot store SGLang's {cls} (--kv-cache-dtype mxfp8): SGLang 0.5.23 keeps each "
            "page's UE8M0 scales outside kv_buffer and exposes no storage pages for this pool (every "
            "storage method raises NotImplementedError), so no L3 backend can store it. Use another "
            "--kv-cache-dtype (auto, fp8_e4m3, ...) or HiCache without an L3 storage backend "
            "(no --hicache-storage-backend)")
    return ConfigError(
        f"radixkv cannot store SGLang's host pool {cls} (layout {getattr(pool, 'layout', None)!r}): its "
        f"buffer metadata does not describe its pages and it has no flat data page ({cause}). Use "
        "another --hicache-mem-layout (page_first, page_first_direct, layer_first) or KV cache setting, "
        "or HiCache without an L3 storage backend (no --hicache-storage-backend)")


def _flat_plan(pool: Any, page_size: int) -> PagePlan:
    layout = getattr(pool, "layout", None)
    if str(layout) in _NO_FLAT_LAYOUTS:
        raise _unstorable(pool, f"SGLang flattens no page of layout {layout!r}")
    try:
        dummy = pool.get_dummy_flat_data_page()
    except NotImplementedError as e:  # SGLang's MXFP8 and asymmetric-K/V pools
        raise _unstorable(pool, f"{type(e).__name__}: {e}") from e
    nbytes = dummy.numel() * dummy.element_size()
    if nbytes == 0:
        # A page of no bytes (DeepSeek-V4's LogicalHostPool KV anchor): a store chunk needs at least
        # one byte, and without the anchor's chain every hit query failed and V4 never hit L3.
        return PagePlan(pool=pool, mode="marker", n_segments=1, segment_sizes=(_MARKER_BYTES,),
                        chunk_bytes=_MARKER_BYTES, page_size=page_size)
    return PagePlan(pool=pool, mode="flat", n_segments=1, segment_sizes=(nbytes,), chunk_bytes=nbytes,
                    page_size=page_size)


def _page_buffers(pool: Any) -> list[torch.Tensor]:
    """The pool's page buffers (:data:`_PAGE_BUFFERS`) that are contiguous CPU tensors, each as flat
    uint8, ``kv_buffer`` first, each allocation once."""
    out: dict[int, torch.Tensor] = {}
    for name in _PAGE_BUFFERS:
        v = getattr(pool, name, None)
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                    and t.numel() and t.data_ptr() not in out):
                out[t.data_ptr()] = _u8(t)
    return list(out.values())


def _pages_move(pool: Any) -> bool:
    """A pool whose pages have no fixed address: SGLang's unified host pool
    (``UnifiedPageEnvelopeHostPool``, the one with a page format of its own) translates logical pages
    to physical ones per call and moves them when it compacts, so addresses read from three probe
    pages (which may look affine at the time) would name other pages later. Its own page calls
    translate under its layout lease: it is stored through its flat page."""
    return getattr(pool, "storage_format_tag", None) is not None or hasattr(pool, "_shared_backing")


def plan_for(pool: Any, flat: bool = False) -> PagePlan:
    """The best plan SGLang's host pool allows (``flat=True`` forces the flat data-page format).
    Raises :class:`ConfigError` for a pool radixkv cannot store (neither plan works)."""
    page_size = int(getattr(pool, "page_size", 1) or 1)
    if flat or _pages_move(pool):
        return _flat_plan(pool, page_size)
    meta = getattr(pool, "get_page_buffer_meta", None)
    bases = _page_buffers(pool)
    n_pages = int(getattr(pool, "size", 0)) // page_size
    if meta is None or not bases or n_pages < 2:
        return _flat_plan(pool, page_size)
    try:
        probes = {p: meta(torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64))
                  for p in sorted({0, 1, n_pages - 1})}
    except Exception:  # layouts without metadata (page_head split heads, DCP kv_split, ...)
        return _flat_plan(pool, page_size)
    ptrs, sizes = probes[0]
    if not ptrs or any(list(sz) != list(sizes) or len(pt) != len(ptrs) for pt, sz in probes.values()):
        return _flat_plan(pool, page_size)
    sizes = tuple(int(n) for n in sizes)
    last = n_pages - 1
    affine = []
    for i, (a, nb) in enumerate(zip(ptrs, sizes)):
        a, a1, a_last = int(a), int(probes[1][0][i]), int(probes[last][0][i])
        stride = (a1 - a) // page_size
        if a1 - a != page_size * stride or a_last - a != last * page_size * stride:
            return _flat_plan(pool, page_size)  # not affine in the page: do not guess
        # the buffer that holds this segment on the first and the last page
        where = [b for b, t in enumerate(bases)
                 if t.data_ptr() <= min(a, a_last) and max(a, a_last) + nb <= t.data_ptr() + t.numel()]
        if not where:
            return _flat_plan(pool, page_size)
        affine.append((where[0], a - bases[where[0]].data_ptr(), stride, nb))
    chunk = sum(sizes)
    if len(set(sizes)) == 1 and all(b == 0 for b, *_ in affine):
        # Equal segments in one buffer (kv_buffer): the page is SGLang's flat page, cut into segments.
        if chunk != _flat_plan(pool, page_size).chunk_bytes:  # metadata does not cover the page
            return _flat_plan(pool, page_size)
        has_flat = True
    else:
        # Segments of unequal sizes or in several buffers (asymmetric K/V, page_first_kv_split):
        # no flat page to compare with, so the metadata must cover the pool's whole page (bytes per
        # token): storing part of a page would restore the rest stale.
        per_token = getattr(pool, "get_size_per_token", None)
        try:
            page_bytes = page_size * int(per_token()) if per_token is not None else -1
        except Exception:
            page_bytes = -1
        if chunk != page_bytes:
            try:  # SGLang's flat page, if the pool has one
                return _flat_plan(pool, page_size)
            except ConfigError as e:
                raise _unstorable(pool, f"its buffer metadata covers {chunk} bytes of a {page_bytes}-byte page") from e
        try:  # SGLang's copying interface needs a flat page of the same bytes
            has_flat = _flat_plan(pool, page_size).chunk_bytes == chunk
        except ConfigError:  # none (asymmetric K/V, page_first_kv_split)
            has_flat = False
    return PagePlan(pool=pool, mode="parts", n_segments=len(sizes), segment_sizes=sizes, chunk_bytes=chunk,
                    page_size=page_size, has_flat=has_flat, _bases=tuple(bases), _affine=tuple(affine))
