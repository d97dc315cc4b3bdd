"""Gather engine pages into contiguous chunk buffers and scatter them back: one launch per batch.

Kernel (`_paged_chunk_copy_kernel`), launchers (`gather_chunks`, `scatter_chunks`) and their torch
references (`gather_chunks_reference`, `scatter_chunks_reference`, also the CPU fallback) live
together so that every path shares one validated plan and one chunk byte layout (docs/kernels.md
§2).

Grid: ``(num_chunks * pages_per_chunk, selected_layers)``; each program copies one page of one layer,
all its components (K and V) together, as ``[BLOCK_R (token, head) rows x BLOCK_D dims]`` tiles (or
``selected_layers * num_components`` programs, one per component, when `_FUSE_COMPONENTS` is off).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from numbers import Integral
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from radixkv.kernels.paged_layout import PagedLayout, check_integer_dtype, chunk_from_payload, word_dtype

from radixkv.errors import InputError
from radixkv.spans import first_overlap, overlaps_any

__all__ = [
    "CopyResult",
    "PreparedCopy",
    "prepare_gather",
    "prepare_scatter",
    "gather_chunks",
    "scatter_chunks",
    "gather_chunks_reference",
    "scatter_chunks_reference",
]


@triton.jit
def _paged_chunk_copy_kernel(
    # Pointers
    base_ptr,  # the layout's first view: every address below is an element offset from it
    view_offsets_ptr,  # int64 [layers * components]: offset of each (layer, component) view
    meta_ptr,  # int64 [num_chunks + num_chunks * pages_per_chunk]: chunk offsets, then page ids
    # Engine view strides, in elements
    stride_page,
    stride_token,
    stride_head,
    stride_dim,
    # Shapes
    num_chunks,
    pages_per_chunk,
    layer_start,
    page_tokens,
    num_heads,
    head_dim,
    # Meta-parameters
    NUM_COMPONENTS: tl.constexpr,  # 2 (K, V) or 1 (MLA latent)
    FUSE_COMPONENTS: tl.constexpr,  # one program copies every component of its (page, layer)
    TO_CHUNK: tl.constexpr,
    ALIGNED: tl.constexpr,  # every view and chunk offset is a multiple of 16 elements
    # Offsets inside one page fit int32 (bases stay int64): half the integer work per element, which
    # a copy at HBM speed notices.
    OFFSETS_32: tl.constexpr,
    # Cache hints: "" (default), or "evict_first" / ".cs" for streaming (copied bytes are not reread).
    LOAD_EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    chunk_page = tl.program_id(0)  # chunk * pages_per_chunk + page_in_chunk
    page = tl.load(meta_ptr + num_chunks + chunk_page)
    if page >= 0:  # -1 = skip this page
        # FUSE_COMPONENTS: program (page, layer) copies K and V together, so the two halves of an
        # interleaved K||V row (vLLM) are read back to back, and two tiles are in flight at once.
        # Else program (page, layer * components + component) copies one.
        if FUSE_COMPONENTS:
            view_idx = (layer_start + tl.program_id(1)) * NUM_COMPONENTS
        else:
            view_idx = layer_start * NUM_COMPONENTS + tl.program_id(1)
        view_off = tl.load(view_offsets_ptr + view_idx)
        chunk_off = tl.load(meta_ptr + chunk_page // pages_per_chunk)
        if ALIGNED:  # offsets read from memory carry no alignment: state it, so accesses vectorise
            view_off = tl.multiple_of(view_off, 16)
            chunk_off = tl.multiple_of(chunk_off, 16)
        # Integer arguments equal to 1 arrive as constexprs (Triton specialises them): tl.cast, not
        # .to(), turns such products into tensors. int64 everywhere: engine pools and chunk batches
        # exceed 2**31 elements.
        rows = page_tokens * num_heads
        page_elems = tl.cast(rows, tl.int64) * head_dim
        page_ptr = base_ptr + view_off + page.to(tl.int64) * stride_page
        slab = view_idx.to(tl.int64) * pages_per_chunk + chunk_page % pages_per_chunk
        chunk_ptr = base_ptr + chunk_off + slab * page_elems
        if FUSE_COMPONENTS and NUM_COMPONENTS == 2:
            v_off = tl.load(view_offsets_ptr + view_idx + 1)
            if ALIGNED:
                v_off = tl.multiple_of(v_off, 16)
            v_page_ptr = base_ptr + v_off + page.to(tl.int64) * stride_page
            v_chunk_ptr = chunk_ptr + pages_per_chunk * page_elems  # the next slab: same page, V
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < rows
            tok = r // num_heads
            head = r % num_heads
            if not OFFSETS_32:  # offsets inside one page can pass 2**31: widen before multiplying
                tok = tok.to(tl.int64)
                head = head.to(tl.int64)
                r = r.to(tl.int64)
            page_row = tok * stride_token + head * stride_head
            chunk_row = r * head_dim
            for d0 in range(0, head_dim, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                if not OFFSETS_32:
                    d = d.to(tl.int64)
                mask = r_mask[:, None] & (d < head_dim)[None, :]
                page_off = page_row[:, None] + d[None, :] * stride_dim
                chunk_off2 = chunk_row[:, None] + d[None, :]
                if TO_CHUNK:
                    words = tl.load(page_ptr + page_off, mask=mask, eviction_policy=LOAD_EVICT)
                    if FUSE_COMPONENTS and NUM_COMPONENTS == 2:
                        v_words = tl.load(v_page_ptr + page_off, mask=mask, eviction_policy=LOAD_EVICT)
                    tl.store(chunk_ptr + chunk_off2, words, mask=mask, cache_modifier=STORE_CACHE)
                    if FUSE_COMPONENTS and NUM_COMPONENTS == 2:
                        tl.store(v_chunk_ptr + chunk_off2, v_words, mask=mask, cache_modifier=STORE_CACHE)
                else:
                    words = tl.load(chunk_ptr + chunk_off2, mask=mask, eviction_policy=LOAD_EVICT)
                    if FUSE_COMPONENTS and NUM_COMPONENTS == 2:
                        v_words = tl.load(v_chunk_ptr + chunk_off2, mask=mask, eviction_policy=LOAD_EVICT)
                    tl.store(page_ptr + page_off, words, mask=mask, cache_modifier=STORE_CACHE)
                    if FUSE_COMPONENTS and NUM_COMPONENTS == 2:
                        tl.store(v_page_ptr + page_off, v_words, mask=mask, cache_modifier=STORE_CACHE)


@dataclass(frozen=True, slots=True)
class CopyResult:
    """What one gather/scatter call did. ``backend``: "triton", "triton-interpreter" or "torch"."""

    backend: str
    launches: int
    page_copies: int  # pages x selected layers x components actually copied (skips excluded)
    bytes_copied: int


@dataclass(frozen=True, slots=True)
class _Plan:
    page_ids: torch.Tensor  # CPU int64 [num_chunks, pages_per_chunk]
    # typed contiguous [L, C, T, H, D] views, or one stacked [num_chunks, L, C, T, H, D] tensor
    chunks: tuple[torch.Tensor, ...] | torch.Tensor
    layers: range
    valid_pages: int
    # The page ids as a flat list when they were checked in Python (small batches), else None.
    flat_ids: list[int] | None = None
    # Element offsets of the chunks from the layout's base when the chunks are one stacked buffer
    # (computed without touching each view) or the plan is prepared (measured once), else None.
    chunk_offsets: list[int] | None = None


def gather_chunks(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    layers: int | range | None = None,
    force_triton: bool = False,
) -> CopyResult:
    """Copy pages ``page_ids[c][p]`` of the selected layers into chunk ``c`` (engine -> chunks).

    One Triton launch on CUDA (chunks on the layout's GPU or in pinned host memory: zero-copy). On
    CPU the torch reference runs, unless ``force_triton`` or ``TRITON_INTERPRET=1`` (then the
    interpreter). ``-1`` pages are skipped and leave their chunk region untouched. Launches go to
    the current stream of the layout's device.
    """
    return _run(layout, page_ids, chunks, layers, to_chunk=True, force_triton=force_triton)


def scatter_chunks(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    layers: int | range | None = None,
    force_triton: bool = False,
) -> CopyResult:
    """Copy chunk ``c`` into pages ``page_ids[c][p]`` of the selected layers (chunks -> engine).

    Same dispatch as `gather_chunks`. A page may appear only once in ``page_ids`` (checked).
    """
    return _run(layout, page_ids, chunks, layers, to_chunk=False, force_triton=force_triton)


def gather_chunks_reference(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    layers: int | range | None = None,
) -> CopyResult:
    """Torch reference of `gather_chunks` (any device; chunks may be on another device)."""
    plan = _plan(layout, page_ids, chunks, layers, to_chunk=True)
    return _reference(layout, plan, to_chunk=True)


def scatter_chunks_reference(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    layers: int | range | None = None,
) -> CopyResult:
    """Torch reference of `scatter_chunks`."""
    plan = _plan(layout, page_ids, chunks, layers, to_chunk=False)
    return _reference(layout, plan, to_chunk=False)


class PreparedCopy:
    """A gather or scatter checked once and run for any layers: what a layer-wise pipeline wants.

    `gather_chunks` / `scatter_chunks` validate the page ids and every chunk buffer and upload the
    page ids on each call; for one batch copied layer by layer (32 calls for a Llama-8B step) that
    host work repeats per layer. `prepare_gather` / `prepare_scatter` do it once; `run(layers)` then
    costs a launch (on CUDA) and reuses one upload of the page ids, from any stream and any thread.

    Contract: the engine tensors and chunk buffers must stay as they were prepared (alive, not
    resized, not moved) until the last run's copy has finished; the caller keeps them alive, as with
    `LayerPipeline`. The page ids are copied when prepared: every run copies the pages that were
    checked, whatever the caller later writes into its id tensor. Each run dispatches like the
    one-shot calls (Triton on CUDA, the torch reference on CPU unless ``force_triton`` or
    ``TRITON_INTERPRET=1``) and returns the same `CopyResult`.
    """

    __slots__ = ("_cache", "_force_triton", "_layout", "_plan", "_to_chunk")

    def __init__(self, layout: PagedLayout, plan: _Plan, *, to_chunk: bool, force_triton: bool):
        self._layout = layout
        self._to_chunk = to_chunk
        self._plan = plan
        self._force_triton = force_triton
        self._cache = _MetaCache()

    # Read-only: the plan was checked for this layout and direction (scatter: no page twice;
    # gather: disjoint chunks), so neither may change under it.
    @property
    def layout(self) -> PagedLayout:
        return self._layout

    @property
    def to_chunk(self) -> bool:
        return self._to_chunk

    @property
    def num_chunks(self) -> int:
        return int(self._plan.page_ids.shape[0])

    def check_integrity(self) -> None:
        """The layout's invariants, and the chunk buffers and uploaded page ids as prepared."""
        self._layout.check_integrity()
        plan = self._plan
        if _measure_chunk_offsets(self._layout, plan) != plan.chunk_offsets:
            raise RuntimeError("chunk buffers moved since the copy was prepared; prepare it again")
        num_chunks, pages_per_chunk = plan.page_ids.shape
        if int((plan.page_ids >= 0).sum()) != plan.valid_pages:
            raise RuntimeError("the prepared page ids changed since they were checked")
        state = self._cache._state
        if state is not None and state[0].numel() != num_chunks * (1 + pages_per_chunk):
            raise RuntimeError(
                f"uploaded page-id table holds {state[0].numel()} entries, expected "
                f"{num_chunks * (1 + pages_per_chunk)}"
            )

    def run(self, layers: int | range | None = None) -> CopyResult:
        """Copy the selected layers (default all) of the prepared batch; one launch on CUDA."""
        plan = self._plan
        selected = _layers(self._layout, layers)
        if selected != plan.layers:
            plan = replace(plan, layers=selected)
        return _dispatch(
            self._layout, plan, to_chunk=self._to_chunk, force_triton=self._force_triton,
            cache=self._cache,
        )


def prepare_gather(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    force_triton: bool = False,
) -> PreparedCopy:
    """`gather_chunks` checked once for all layers; ``.run(layers)`` copies (see `PreparedCopy`)."""
    return _prepare(layout, page_ids, chunks, to_chunk=True, force_triton=force_triton)


def prepare_scatter(
    layout: PagedLayout,
    page_ids: torch.Tensor | Sequence[Sequence[int]],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    force_triton: bool = False,
) -> PreparedCopy:
    """`scatter_chunks` checked once for all layers; ``.run(layers)`` copies (see `PreparedCopy`)."""
    return _prepare(layout, page_ids, chunks, to_chunk=False, force_triton=force_triton)


def _prepare(layout, page_ids, chunks, *, to_chunk: bool, force_triton: bool) -> PreparedCopy:
    plan = _plan(layout, page_ids, chunks, None, to_chunk=to_chunk)
    ids = plan.page_ids
    if isinstance(page_ids, torch.Tensor) and ids.untyped_storage().data_ptr() == (
        page_ids.untyped_storage().data_ptr()
    ):
        # An int64 tensor is used as given (a one-shot call reads it at once). A prepared copy reads
        # it at later runs (the torch path every run, the first CUDA run's upload for large
        # batches): the caller refilling it for its next batch would copy unchecked ids (out of
        # range: writes past the engine's pages; a page twice: scatter bytes that depend on order).
        ids = ids.clone()
    # Fixed for the plan's life: measured once, so every run's alignment promise (ALIGNED) and the
    # one uploaded offset table come from the same addresses, and runs skip the per-chunk walk.
    plan = replace(plan, page_ids=ids, chunk_offsets=_chunk_offsets(layout, plan))
    return PreparedCopy(layout, plan, to_chunk=to_chunk, force_triton=force_triton)


# --- dispatch ------------------------------------------------------------------------------------


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}


def _run(layout, page_ids, chunks, layers, *, to_chunk: bool, force_triton: bool) -> CopyResult:
    plan = _plan(layout, page_ids, chunks, layers, to_chunk=to_chunk)
    return _dispatch(layout, plan, to_chunk=to_chunk, force_triton=force_triton, cache=None)


def _dispatch(
    layout: PagedLayout, plan: _Plan, *, to_chunk: bool, force_triton: bool, cache: _MetaCache | None
) -> CopyResult:
    dev = layout.device.type
    if dev == "cuda":
        index = layout.device.index
        # Triton launches on the current device (and its current stream): make that the layout's,
        # so the kernel and the page-id upload run where the pages are.
        switch = index is not None and index != torch.cuda.current_device()
        with torch.cuda.device(index) if switch else nullcontext():
            return _launch(layout, plan, to_chunk=to_chunk, interpret=False, cache=cache)
    if dev == "cpu" and (force_triton or _interpret_env()):
        return _launch(layout, plan, to_chunk=to_chunk, interpret=True, cache=cache)
    return _reference(layout, plan, to_chunk=to_chunk)


_KERNELS: dict[bool, object] = {}


def _kernel(interpret: bool):
    """The kernel compiled (JIT) or interpreted, whatever TRITON_INTERPRET was at import time.

    Built lazily from the same Python function, so the choice follows the call, not import order.
    """
    kernel = _KERNELS.get(interpret)
    if kernel is None:
        fn = _paged_chunk_copy_kernel.fn
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            kernel = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction

            kernel = (
                _paged_chunk_copy_kernel
                if isinstance(_paged_chunk_copy_kernel, JITFunction)
                else JITFunction(fn)
            )
        _KERNELS[interpret] = kernel
    return kernel


def _launch(
    layout: PagedLayout, plan: _Plan, *, to_chunk: bool, interpret: bool, cache: _MetaCache | None
) -> CopyResult:
    grid, args, meta_params = _launch_args(layout, plan, to_chunk=to_chunk, cache=cache)
    _kernel(interpret)[grid](*args, **meta_params)
    return _result(layout, plan, "triton-interpreter" if interpret else "triton", launches=1)


# One program's tile: at most this many elements, run by this many warps. Measured on an H200
# (docs/benchmarks.md, `python -m radixkv.bench kernels --tune`); `_tile_config` overrides both.
_TILE_MAX_ELEMS = 8192
_NUM_WARPS = 8
_FUSE_COMPONENTS = True
_STREAMING_HINTS = False  # evict-first loads and streaming (.cs) stores


@contextmanager
def _tile_config(
    max_elems: int, num_warps: int, fuse: bool = True, streaming: bool = False
) -> Iterator[None]:
    """Launch with another tile, warp count, fusion or cache hints inside the block (bench --tune).

    ``max_elems`` and ``num_warps`` must be powers of two (tl.arange and the warp layout need
    them); checked here, not at the first launch deep inside Triton.
    """
    global _TILE_MAX_ELEMS, _NUM_WARPS, _FUSE_COMPONENTS, _STREAMING_HINTS
    for name, value in (("max_elems", max_elems), ("num_warps", num_warps)):
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or value < 1 or value & (value - 1):
            raise InputError(f"{name} must be a power of two >= 1; got {value!r}")
    saved = _TILE_MAX_ELEMS, _NUM_WARPS, _FUSE_COMPONENTS, _STREAMING_HINTS
    _TILE_MAX_ELEMS, _NUM_WARPS, _FUSE_COMPONENTS, _STREAMING_HINTS = (
        max_elems, num_warps, fuse, streaming
    )
    try:
        yield
    finally:
        _TILE_MAX_ELEMS, _NUM_WARPS, _FUSE_COMPONENTS, _STREAMING_HINTS = saved


def _tile(layout: PagedLayout) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)``: a [rows x dims] tile of at most `_TILE_MAX_ELEMS`."""
    block_d = min(128, _pow2_at_least(layout.head_dim))
    rows = layout.page_tokens * layout.num_heads
    block_r = min(_pow2_at_least(rows), max(1, _TILE_MAX_ELEMS // block_d))
    return block_r, block_d, _NUM_WARPS


def _page_offsets_fit_int32(layout: PagedLayout) -> bool:
    """True when every element offset the kernel forms inside one page, engine side and chunk side,
    is < 2**31, with the tile it is launched with (`_tile`).

    The masked-off lanes of the last row and dim tiles count too: they still form (unused) offsets,
    up to a whole tile past the page (BLOCK_R rows: 8192 when head_dim is 1), so the bound follows
    the tile rather than a fixed slack.
    """
    block_r, block_d, _ = _tile(layout)
    rows = layout.page_tokens * layout.num_heads
    r_last = -(-rows // block_r) * block_r - 1  # last row index of the last row tile
    d_last = -(-layout.head_dim // block_d) * block_d - 1
    st_token, st_head, st_dim = layout.page_strides[1:]
    engine_last = (
        (r_last // layout.num_heads) * st_token
        + (layout.num_heads - 1) * st_head
        + d_last * st_dim
    )
    chunk_last = r_last * layout.head_dim + d_last
    return max(engine_last, chunk_last) < 2**31


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()  # triton.next_power_of_2, without its per-call overhead


def _chunk_offsets(layout: PagedLayout, plan: _Plan) -> list[int]:
    """Element offsets of the plan's chunks from the layout's base: as recorded, else measured."""
    if plan.chunk_offsets is not None:
        return plan.chunk_offsets
    return _measure_chunk_offsets(layout, plan)


def _measure_chunk_offsets(layout: PagedLayout, plan: _Plan) -> list[int]:
    return [layout.element_offset(c.data_ptr()) for c in plan.chunks]


def _meta(layout: PagedLayout, plan: _Plan, chunk_offsets: list[int]) -> torch.Tensor:
    """The kernel's int64 chunk offsets and page ids, on the layout's device (current stream)."""
    # One small host->device copy. On CUDA it is staged through pinned memory from torch's caching
    # host allocator, so the copy is truly asynchronous (a pageable source makes the driver stage it
    # synchronously) and the block is reused only after the copy has finished (the allocator
    # records the stream).
    pin = layout.device.type == "cuda"
    if plan.flat_ids is not None:
        meta = torch.tensor(chunk_offsets + plan.flat_ids, dtype=torch.int64, pin_memory=pin)
    else:
        meta = torch.cat([torch.tensor(chunk_offsets, dtype=torch.int64), plan.page_ids.view(-1)])
        meta = meta.pin_memory() if pin else meta
    return meta.to(layout.device, non_blocking=True)


class _MetaCache:
    """One upload of a prepared copy's page ids, shared by all its runs, on any stream.

    The upload is made on the stream of the first CUDA run; a run on another stream first waits for
    it (an event recorded on the uploading stream right after the copy) and records that stream on
    the tensor, so the caching allocator keeps it until that stream's launches are done.

    Thread-safe without a lock: ``(meta, stream, event)`` is published as one tuple, and only once
    the event marks the upload. A run that finds no tuple uploads its own copy (two first runs racing
    both upload, the last one is kept; the other's tensor lives on its own stream's order). Were the
    tensor visible before its event, a run on another thread's stream would read it with no wait.
    """

    __slots__ = ("_state",)

    def __init__(self) -> None:
        # (device tensor, uploading stream or None off CUDA, event after the upload or None). The
        # stream is held only to compare: equal handles are one CUDA stream, ordered by itself.
        self._state: tuple[torch.Tensor, object, object] | None = None

    def meta(self, layout: PagedLayout, plan: _Plan, chunk_offsets: list[int]) -> torch.Tensor:
        state = self._state
        if state is None:
            meta = _meta(layout, plan, chunk_offsets)
            stream = event = None
            if layout.device.type == "cuda":
                stream = torch.cuda.current_stream(layout.device)  # the one `_meta` copied on
                event = torch.cuda.Event()
                event.record(stream)
            self._state = (meta, stream, event)
            return meta
        meta, uploaded_on, event = state
        if uploaded_on is not None:
            stream = torch.cuda.current_stream(layout.device)
            if stream != uploaded_on:
                stream.wait_event(event)
                meta.record_stream(stream)
        return meta


def _launch_args(
    layout: PagedLayout, plan: _Plan, *, to_chunk: bool, cache: _MetaCache | None = None
) -> tuple[tuple, list, dict]:
    """Grid, positional arguments and meta-parameters of one launch (tests compile from these)."""
    num_chunks, pages_per_chunk = plan.page_ids.shape
    chunk_offsets = _chunk_offsets(layout, plan)
    aligned = layout.views_aligned and all(o % 16 == 0 for o in chunk_offsets)
    meta = _meta(layout, plan, chunk_offsets) if cache is None else cache.meta(layout, plan, chunk_offsets)
    block_r, block_d, num_warps = _tile(layout)
    fuse = _FUSE_COMPONENTS
    grid = (num_chunks * pages_per_chunk, len(plan.layers) * (1 if fuse else layout.num_components))
    args = [
        layout.word_base,
        layout.view_offsets(),
        meta,
        *layout.page_strides,
        num_chunks,
        pages_per_chunk,
        plan.layers.start,
        layout.page_tokens,
        layout.num_heads,
        layout.head_dim,
    ]
    meta_params = {
        "NUM_COMPONENTS": layout.num_components,
        "FUSE_COMPONENTS": fuse,
        "TO_CHUNK": to_chunk,
        "ALIGNED": aligned,
        "OFFSETS_32": _page_offsets_fit_int32(layout),
        "LOAD_EVICT": "evict_first" if _STREAMING_HINTS else "",
        "STORE_CACHE": ".cs" if _STREAMING_HINTS else "",
        "BLOCK_R": block_r,
        "BLOCK_D": block_d,
        "num_warps": num_warps,
    }
    return grid, args, meta_params


def _result(layout: PagedLayout, plan: _Plan, backend: str, *, launches: int) -> CopyResult:
    copies = plan.valid_pages * len(plan.layers) * layout.num_components
    return CopyResult(backend, launches, copies, copies * layout.page_bytes)


# --- validation ----------------------------------------------------------------------------------


# Below this many page ids, they are checked as a Python list: cheaper than torch's per-op dispatch
# (a launch's host work is part of its cost: a 32 MiB chunk moves in ~16 us on an H200).
_SMALL_IDS = 4096


def _plan(layout, page_ids, chunks, layers, *, to_chunk: bool) -> _Plan:
    if not isinstance(layout, PagedLayout):
        raise InputError(f"layout must be a PagedLayout; got {type(layout).__name__}")
    ids, flat, valid = _page_ids(layout, page_ids, unique=not to_chunk)
    num_chunks, pages_per_chunk = ids.shape
    stacked = _stacked_chunks(layout, chunks, num_chunks, pages_per_chunk)
    if stacked is not None:
        # One contiguous [num_chunks, L, C, T, H, D] buffer: its chunks are disjoint by construction.
        _check_chunk_device(layout, stacked, 0)
        if _overlaps_engine(layout, stacked):
            # Name the first chunk that does (the one buffer may straddle the engine's storage).
            for i in range(num_chunks):
                _check_outside_engine(layout, stacked[i], i)
        step = stacked[0].numel()
        first = layout.element_offset(stacked.data_ptr())
        offsets = [first + i * step for i in range(num_chunks)]
        return _Plan(ids, stacked, _layers(layout, layers), valid, flat, offsets)
    views = _chunk_views(layout, chunks, num_chunks, pages_per_chunk)
    _check_aliasing(layout, views, to_chunk)
    return _Plan(ids, views, _layers(layout, layers), valid, flat)


def _stacked_chunks(layout, chunks, num_chunks: int, pages_per_chunk: int) -> torch.Tensor | None:
    """``chunks`` itself when it is one contiguous typed ``[num_chunks, *chunk_shape]`` tensor."""
    if (
        isinstance(chunks, torch.Tensor)
        and chunks.dtype == layout.dtype
        and chunks.dim() == 6
        and chunks.shape[0] == num_chunks
        and tuple(chunks.shape[1:]) == layout.chunk_shape(pages_per_chunk)
        and chunks.is_contiguous()
    ):
        return chunks
    return None


def _check_aliasing(layout: PagedLayout, views: Sequence[torch.Tensor], to_chunk: bool) -> None:
    """Gather targets must be disjoint (else the bytes depend on the copy order), and no chunk may
    lie inside the engine's page storage (a copy would read what it writes)."""
    spans = [(v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views]
    pair = first_overlap(spans) if to_chunk else None
    if pair is not None:
        raise InputError(f"chunks {pair[0]} and {pair[1]} share one buffer or overlap; gather needs a "
                         "distinct buffer per chunk")
    for i, view in enumerate(views):
        _check_outside_engine(layout, view, i)


def _overlaps_engine(layout: PagedLayout, chunk: torch.Tensor) -> bool:
    """Whether ``chunk``'s bytes overlap the engine's storage (another device's addresses cannot
    alias the engine's pages)."""
    span = (chunk.data_ptr(), chunk.data_ptr() + chunk.numel() * chunk.element_size())
    return chunk.device == layout.device and overlaps_any(span, layout.storage_spans)


def _check_outside_engine(layout: PagedLayout, chunk: torch.Tensor, i: int) -> None:
    if _overlaps_engine(layout, chunk):
        raise InputError(f"chunk {i} lies inside the engine's page storage; chunks must be separate "
                         "buffers (alloc_chunks)")


def _page_ids(layout: PagedLayout, page_ids, *, unique: bool) -> tuple[torch.Tensor, list[int] | None, int]:
    """``(ids, flat ids or None, valid page count)``: ids a CPU int64 ``[chunks, pages]`` tensor."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.device.type != "cpu":
            raise InputError(
                f"page_ids must be a CPU tensor or lists (validated on the host); got device "
                f"{page_ids.device}"
            )
        check_integer_dtype(page_ids.dtype, "page_ids")
        # Viewed as int64, exactly the ids >= 2**63 are negative (torch has no uint64 max or
        # comparison on CPU: the check itself raised NotImplementedError for every uint64 tensor).
        if page_ids.dtype == torch.uint64:
            wrapped = page_ids.view(torch.int64)
            if bool((wrapped < 0).any()):
                first = int(wrapped[wrapped < 0][0]) + (1 << 64)
                raise InputError(
                    f"page id {first} out of range: uint64 ids >= 2**63 would wrap to negative ids"
                )
        ids = page_ids if page_ids.dtype == torch.int64 else page_ids.to(torch.int64)
    else:
        try:
            rows = [list(row) for row in page_ids]
        except TypeError as exc:
            raise InputError(f"page_ids must be [num_chunks][pages_per_chunk] ints: {exc}") from exc
        # torch.tensor(..., int64) would truncate 1.7 to 1 and turn True into 1: ids must be ints.
        odd = next((x for row in rows for x in row if isinstance(x, bool) or not isinstance(x, Integral)), None)
        if odd is not None:
            raise InputError(f"page_ids must be [num_chunks][pages_per_chunk] ints; got {odd!r}")
        try:
            ids = torch.tensor(rows, dtype=torch.int64)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise InputError(
                f"page_ids must be [num_chunks][pages_per_chunk] ints (equal-length rows): {exc}"
            ) from exc
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(
            f"page_ids must be 2-D [num_chunks, pages_per_chunk] with both >= 1; got shape "
            f"{tuple(ids.shape)}"
        )
    ids = ids.contiguous()
    num_pages = layout.num_pages
    if ids.numel() <= _SMALL_IDS:
        flat = ids.view(-1).tolist()
        if min(flat) < -1 or max(flat) >= num_pages:
            first = next(x for x in flat if x < -1 or x >= num_pages)
            raise InputError(
                f"page id {first} out of range: pages are 0..{num_pages - 1}, -1 = skip"
            )
        valid = [x for x in flat if x >= 0] if min(flat) < 0 else flat
        if unique and len(set(valid)) != len(valid):
            raise InputError("scatter page_ids name a page twice; each destination page once")
        return ids, flat, len(valid)
    bad = (ids < -1) | (ids >= num_pages)
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise InputError(
            f"page id {first} out of range: pages are 0..{num_pages - 1}, -1 = skip"
        )
    valid_ids = ids[ids >= 0]
    if unique and valid_ids.numel() != torch.unique(valid_ids).numel():
        raise InputError("scatter page_ids name a page twice; each destination page once")
    return ids, None, int(valid_ids.numel())


def _layers(layout: PagedLayout, layers) -> range:
    if layers is None:
        return range(layout.num_layers)
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = range(layers, layers + 1)
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise InputError(f"layers must be None, an int or a non-empty step-1 range; got {layers!r}")
    if layers.start < 0 or layers.stop > layout.num_layers:
        raise InputError(f"layers {layers!r} outside the layout's 0..{layout.num_layers - 1}")
    return layers


def _chunk_views(layout, chunks, num_chunks: int, pages_per_chunk: int) -> tuple[torch.Tensor, ...]:
    shape = layout.chunk_shape(pages_per_chunk)
    if isinstance(chunks, torch.Tensor):
        items = [chunks[i] for i in range(chunks.shape[0])] if chunks.dim() > 0 else []
    else:
        try:
            items = list(chunks)
        except TypeError:
            raise InputError(
                f"chunks must be one tensor of all chunks or a sequence of chunk tensors; got "
                f"{type(chunks).__name__} (allocate them with alloc_chunks)"
            ) from None
    if len(items) != num_chunks:
        raise InputError(
            f"page_ids has {num_chunks} rows but {len(items)} chunk buffers were given"
        )
    views = []
    for i, c in enumerate(items):
        if not isinstance(c, torch.Tensor):
            raise InputError(f"chunk {i} is a {type(c).__name__}, expected a torch.Tensor")
        if c.dtype == torch.uint8 and (layout.dtype != torch.uint8 or tuple(c.shape) != shape):
            # A payload: also for uint8 layouts (fp8 KV caches stored as uint8), whose chunk shape a
            # flat payload does not have.
            c = chunk_from_payload(c, layout, pages_per_chunk)
        elif c.dtype != layout.dtype or tuple(c.shape) != shape:
            raise InputError(
                f"chunk {i} is {c.dtype} {tuple(c.shape)}; expected {layout.dtype} {shape} "
                f"or a uint8 payload of {layout.chunk_bytes(pages_per_chunk)} bytes"
            )
        if not c.is_contiguous():
            raise InputError(
                f"chunk {i} is not contiguous (strides {c.stride()}); use .contiguous()"
            )
        _check_chunk_device(layout, c, i)
        views.append(c)
    return tuple(views)


def _check_chunk_device(layout: PagedLayout, chunk: torch.Tensor, i: int) -> None:
    dev = layout.device
    if chunk.device == dev:
        return
    if dev.type == "cuda" and chunk.device.type == "cpu":
        if not chunk.is_pinned():
            raise InputError(
                f"chunk {i} is in pageable host memory; the GPU can only reach pinned memory: "
                "allocate with alloc_chunks(..., pin_memory=True) or tensor.pin_memory()"
            )
        return
    raise InputError(f"chunk {i} is on {chunk.device} but the layout is on {dev}")


# --- torch reference -----------------------------------------------------------------------------


def _reference(layout: PagedLayout, plan: _Plan, *, to_chunk: bool) -> CopyResult:
    n_tok, heads, dim = layout.page_tokens, layout.num_heads, layout.head_dim
    word = word_dtype(layout.dtype)  # integer words: bit-exact, and fp8 has no index_copy_ on CPU
    for typed_chunk, ids in zip(plan.chunks, plan.page_ids):  # (iterating a stacked tensor: its chunks)
        chunk = typed_chunk.view(word)
        slots = torch.nonzero(ids >= 0).flatten()
        if slots.numel() == 0:
            continue
        complete = slots.numel() == ids.numel()
        src_ids = ids.to(layout.device) if complete else ids[slots].to(layout.device)
        slots = slots.to(chunk.device)
        for layer in plan.layers:
            for comp, typed_view in enumerate(layout.views[layer]):
                view = typed_view.view(word)
                pages = chunk[layer, comp].view(ids.numel(), n_tok, heads, dim)
                if to_chunk and complete and view.device == pages.device:
                    torch.index_select(view, 0, src_ids, out=pages)  # straight into the chunk
                elif to_chunk:
                    picked = view.index_select(0, src_ids).to(pages.device)
                    if complete:
                        pages.copy_(picked)
                    else:
                        pages.index_copy_(0, slots, picked)
                else:
                    data = pages if complete else pages.index_select(0, slots)
                    # index_put_ (page ids are unique): faster than index_copy_ on CPU.
                    view.index_put_((src_ids,), data.to(view.device))
    return _result(layout, plan, "torch", launches=0)
