"""`PagedLayout`: a validated description of an engine's paged KV cache, and chunk-buffer helpers.

An engine cache is modelled as ``views[layer][component]``, each a 4-D strided view ``[num_pages,
page_tokens, num_heads, head_dim]`` over the engine's own memory (components: K and V, or the single
MLA latent). A chunk buffer holds ``pages_per_chunk`` pages of every layer and component as one
contiguous C-order array ``[layer][component][chunk_token][head][dim]`` (docs/kernels.md §2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from radixkv.errors import InputError
from radixkv.spans import merged

__all__ = [
    "PagedLayout",
    "alloc_chunks",
    "chunk_payload",
    "chunk_from_payload",
    "pages_from_token_indices",
    "word_dtype",
]

# Copies move integer words of the element's width: bit-exact for every float format (NaN payloads,
# fp8) and independent of what the Triton interpreter's numpy backend supports.
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width as ``dtype`` (what the kernels copy)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if itemsize not in _WORD_DTYPES:
        raise InputError(
            f"dtype {dtype} has {itemsize}-byte elements; supported widths are 1, 2, 4, 8"
        )
    return _WORD_DTYPES[itemsize]


@dataclass(slots=True)
class PagedLayout:
    """Engine pages as ``views[layer][component]``, each ``[pages, page_tokens, heads, head_dim]``.

    Contract: every view has the same shape, strides, dtype and device (layers may live in different
    allocations). The views alias the engine's memory: building a layout copies nothing, and a
    layout stays valid only while the engine keeps those tensors. Build one with `from_views` or an
    engine builder (`from_vllm`, `from_sglang_device`, `from_sglang_host`).
    """

    views: tuple[tuple[torch.Tensor, ...], ...]
    num_layers: int = field(init=False)
    num_components: int = field(init=False)
    num_pages: int = field(init=False)
    page_tokens: int = field(init=False)
    num_heads: int = field(init=False)
    head_dim: int = field(init=False)
    dtype: torch.dtype = field(init=False)
    device: torch.device = field(init=False)
    page_strides: tuple[int, int, int, int] = field(init=False)
    itemsize: int = field(init=False)  # bytes per element
    # True when every view offset is a multiple of 16 elements (lets the kernel vectorise); fixed for
    # the layout's lifetime, so computed once (every launch asks).
    views_aligned: bool = field(init=False)
    # views[0][0] as integer words: the base pointer every kernel address is an offset from.
    word_base: torch.Tensor = field(init=False, repr=False)
    _view_offsets: dict = field(init=False, repr=False)
    # Byte ranges of the engine's storage behind the views, sorted and merged (aliasing checks).
    storage_spans: tuple[tuple[int, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        views = _nested_views(self.views)
        if not views:
            raise InputError("a PagedLayout needs at least one layer; got views=[]")
        first = views[0]
        if len(first) not in (1, 2):
            raise InputError(
                f"each layer needs 2 components (K, V) or 1 (MLA latent); layer 0 has {len(first)}"
            )
        ref = first[0]
        if not isinstance(ref, torch.Tensor) or ref.dim() != 4:
            raise InputError(
                "each view must be a 4-D tensor [num_pages, page_tokens, num_heads, head_dim]; "
                f"layer 0 component 0 is {type(ref).__name__} of shape "
                f"{getattr(ref, 'shape', None)}"
            )
        if ref.device.type == "meta":
            # Meta tensors have no memory: a copy would move nothing (and the aliasing checks, all
            # at address 0, would blame the chunk buffers).
            raise InputError(
                "the views are meta tensors (shapes without memory); build the layout over the "
                "engine's allocated KV tensors (CPU or CUDA)"
            )
        word_dtype(ref.dtype)
        for li, layer in enumerate(views):
            if len(layer) != len(first):
                raise InputError(
                    f"layer {li} has {len(layer)} components, layer 0 has {len(first)}; all layers "
                    "must have the same components"
                )
            for ci, view in enumerate(layer):
                _check_like(view, ref, f"layer {li} component {ci}")
        if min(ref.shape) < 1:
            raise InputError(
                f"views must be non-empty in every dimension; got shape {tuple(ref.shape)}"
            )
        if min(ref.stride()) < 0:
            raise InputError(f"negative strides are not supported; got {ref.stride()}")
        if _overlaps_itself(tuple(ref.shape), tuple(ref.stride())):
            # Two pages (tokens, ...) sharing memory: a scatter to one page would write into
            # another (outside its destination), and the bytes would depend on the copy order.
            raise InputError(
                f"views of shape {tuple(ref.shape)} with strides {ref.stride()} overlap "
                "themselves (a stride smaller than the extent of the dims inside it, e.g. a page "
                "stride shorter than a page, or an expanded dim); each page needs its own memory"
            )
        self.views = views
        self.num_layers = len(views)
        self.num_components = len(first)
        self.num_pages, self.page_tokens, self.num_heads, self.head_dim = (
            int(s) for s in ref.shape
        )
        self.dtype = ref.dtype
        self.device = ref.device
        self.page_strides = tuple(int(s) for s in ref.stride())  # type: ignore[assignment]
        self.itemsize = ref.element_size()
        self.word_base = ref.view(word_dtype(ref.dtype))
        self._view_offsets = {}
        self.views_aligned = all(
            self.element_offset(v.data_ptr()) % 16 == 0 for layer in views for v in layer
        )
        self.storage_spans = merged(
            (v.untyped_storage().data_ptr(), v.untyped_storage().data_ptr() + v.untyped_storage().nbytes())
            for layer in views for v in layer
        )

    # --- builders -------------------------------------------------------------------------------

    @classmethod
    def from_views(cls, views: Sequence[Sequence[torch.Tensor]]) -> PagedLayout:
        """Layout from ``views[layer][component]``, 4-D ``[pages, page_tokens, heads, dim]``."""
        return cls(_nested_views(views))

    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        *,
        head_size: int | None = None,
        mla: bool = False,
    ) -> PagedLayout:
        """vLLM 0.33 per-layer views ``[blocks, kv_heads, block_size, C]``, K||V in the last dim."""
        from radixkv.kernels.engine_layouts import vllm_views

        return cls(vllm_views(kv_caches, head_size=head_size, mla=mla))

    @classmethod
    def from_sglang_device(
        cls,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor] | None,
        *,
        page_tokens: int,
    ) -> PagedLayout:
        """SGLang device pool: per-layer ``[tokens, heads, dim]`` K and V buffers (MLA: no V)."""
        from radixkv.kernels.engine_layouts import sglang_device_views

        return cls(sglang_device_views(k_buffers, v_buffers, page_tokens=page_tokens))

    @classmethod
    def from_sglang_host(
        cls, kv_buffer: torch.Tensor, *, layout: str, page_tokens: int, mla: bool = False
    ) -> PagedLayout:
        """SGLang host pool ``kv_buffer`` in layout layer_first, page_first or page_first_direct."""
        from radixkv.kernels.engine_layouts import sglang_host_views

        return cls(sglang_host_views(kv_buffer, layout=layout, page_tokens=page_tokens, mla=mla))

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one (layer, component)."""
        return self.page_tokens * self.num_heads * self.head_dim * self.itemsize

    def chunk_shape(self, pages_per_chunk: int) -> tuple[int, int, int, int, int]:
        """``(layers, components, chunk_tokens, heads, dim)`` of a chunk of ``pages_per_chunk``."""
        _check_positive(pages_per_chunk, "pages_per_chunk")
        return (
            self.num_layers,
            self.num_components,
            pages_per_chunk * self.page_tokens,
            self.num_heads,
            self.head_dim,
        )

    def chunk_bytes(self, pages_per_chunk: int) -> int:
        """Bytes of one chunk buffer of ``pages_per_chunk`` pages (all layers and components)."""
        _check_positive(pages_per_chunk, "pages_per_chunk")
        return self.num_layers * self.num_components * pages_per_chunk * self.page_bytes

    def element_offset(self, address: int) -> int:
        """Offset of ``address`` from ``views[0][0]`` in elements (how the kernel addresses all).

        Measured from `word_base`, the pointer the kernels add every offset to (views[0][0] as
        built), so view and chunk offsets always match the base they are applied to. Any address
        works (another allocation, pinned host memory: one unified address space on CUDA); it must
        be aligned to the element size.
        """
        delta = address - self.word_base.data_ptr()
        if delta % self.itemsize:
            raise InputError(
                f"address {address:#x} is not aligned to the {self.itemsize}-byte elements of "
                f"{self.dtype}; allocate buffers with torch.empty"
            )
        return delta // self.itemsize

    def view_offsets(self) -> torch.Tensor:
        """int64 ``[num_layers * num_components]`` element offsets of the views from views[0][0].

        On the layout's device; cached, since the views are fixed for the layout's lifetime.
        """
        key = str(self.device)
        table = self._view_offsets.get(key)
        if table is None:
            offsets = [self.element_offset(v.data_ptr()) for layer in self.views for v in layer]
            table = torch.tensor(offsets, dtype=torch.int64).to(self.device)
            if self.device.type == "cuda":
                # Cached and later read from any stream: finish the upload on this one first (once).
                torch.cuda.current_stream(self.device).synchronize()
            self._view_offsets[key] = table
        return table

    def check_integrity(self) -> None:
        """Re-check the invariants (the engine tensors must not have been resized or moved)."""
        ref = self.views[0][0]
        for li, layer in enumerate(self.views):
            if len(layer) != self.num_components:
                raise RuntimeError(
                    f"layer {li} has {len(layer)} components, expected {self.num_components}"
                )
            for ci, view in enumerate(layer):
                _check_like(view, ref, f"layer {li} component {ci}")
        expected = (self.num_pages, self.page_tokens, self.num_heads, self.head_dim)
        if tuple(ref.shape) != expected or tuple(ref.stride()) != self.page_strides:
            raise RuntimeError(f"views changed: shape {tuple(ref.shape)} vs recorded {expected}")
        table = self._view_offsets.get(str(self.device))
        if table is not None:
            base = ref.data_ptr()
            offsets = [
                (v.data_ptr() - base) // self.itemsize for layer in self.views for v in layer
            ]
            if table.cpu().tolist() != offsets:
                raise RuntimeError("cached view offsets no longer match the views' addresses")
        # Also cached at construction (every launch uses them): the kernels' base pointer, and
        # their promise that every view offset is a multiple of 16 elements (a false one makes
        # vectorised accesses misaligned).
        if (
            self.word_base.data_ptr() != ref.data_ptr()
            or ref.dtype != self.dtype
            or ref.device != self.device
        ):
            raise RuntimeError(
                f"views moved: views[0][0] is {ref.dtype} at {ref.data_ptr():#x} on {ref.device}, "
                f"but the layout was built with the base {self.dtype} at "
                f"{self.word_base.data_ptr():#x} on {self.device}; rebuild the PagedLayout"
            )
        base, unit = self.word_base.data_ptr(), 16 * self.itemsize
        aligned = all((v.data_ptr() - base) % unit == 0 for layer in self.views for v in layer)
        if aligned != self.views_aligned:
            raise RuntimeError(
                f"views moved: their offsets are {'' if aligned else 'no longer '}multiples of 16 "
                f"elements but views_aligned={self.views_aligned} (the kernels' alignment "
                "promise); rebuild the PagedLayout"
            )


def _nested_views(views: object) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``views[layer][component]`` as tuples; InputError unless it is a sequence of sequences."""
    try:
        return tuple(tuple(layer) for layer in views)  # type: ignore[union-attr]
    except TypeError as exc:
        raise InputError(
            "views must be a sequence of layers, each a sequence of 4-D tensors [num_pages, "
            f"page_tokens, num_heads, head_dim] (views[layer][component]); got {type(views).__name__}"
            f": {exc}"
        ) from None


def _overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a strided view may map two indices to one element: checked as nesting (each stride,
    in increasing order, must pass the furthest element the smaller-stride dims reach). Engine
    layouts nest; an interleaving that happens not to collide is refused too."""
    reach = 0  # furthest element offset reachable with the dims checked so far
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _check_like(view: object, ref: torch.Tensor, what: str) -> None:
    if not isinstance(view, torch.Tensor):
        raise InputError(f"{what} is a {type(view).__name__}, expected a torch.Tensor")
    for name, got, want in (
        ("shape", tuple(view.shape), tuple(ref.shape)),
        ("strides", tuple(view.stride()), tuple(ref.stride())),
        ("dtype", view.dtype, ref.dtype),
        ("device", view.device, ref.device),
    ):
        if got != want:
            raise InputError(
                f"{what} has {name} {got} but layer 0 component 0 has {want}; every view of a "
                "layout "
                "must share shape, strides, dtype and device"
            )


def _check_positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a positive int; got {value!r}")


def alloc_chunks(
    layout: PagedLayout,
    num_chunks: int,
    pages_per_chunk: int,
    *,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Uninitialised typed chunk buffers ``[num_chunks, L, C, T, H, D]`` (default: layout's device).

    ``pin_memory=True`` allocates page-locked host memory (for the zero-copy GPU path).
    """
    _check_positive(num_chunks, "num_chunks")
    shape = (num_chunks, *layout.chunk_shape(pages_per_chunk))
    target = torch.device(device) if device is not None else layout.device
    if pin_memory:
        if target.type != "cpu":
            raise InputError(f"pin_memory=True needs a CPU device; got device={target}")
        if not torch.cuda.is_available():
            raise InputError(
                "pin_memory=True needs CUDA (page-locked memory is a CUDA allocation) and none is "
                "available; pass pin_memory=False (CPU layouts read pageable memory)"
            )
        return torch.empty(shape, dtype=layout.dtype, pin_memory=True)
    return torch.empty(shape, dtype=layout.dtype, device=target)


def chunk_payload(chunk: torch.Tensor) -> torch.Tensor:
    """1-D ``torch.uint8`` view of a contiguous typed chunk (no copy)."""
    if not chunk.is_contiguous():
        raise InputError(
            f"chunk of shape {tuple(chunk.shape)} strides {chunk.stride()} is not contiguous; "
            "payload views need contiguous chunks (call .contiguous() first)"
        )
    return chunk.reshape(-1).view(torch.uint8)


def chunk_from_payload(
    payload: torch.Tensor, layout: PagedLayout, pages_per_chunk: int
) -> torch.Tensor:
    """Typed ``[L, C, T, H, D]`` view of a 1-D uint8 payload of ``layout.chunk_bytes`` (no copy)."""
    want = layout.chunk_bytes(pages_per_chunk)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise InputError(
            f"payload must be a contiguous 1-D torch.uint8 tensor; got dtype {payload.dtype}, "
            f"shape {tuple(payload.shape)}"
        )
    if payload.numel() != want:
        raise InputError(
            f"payload has {payload.numel()} bytes but a chunk of {pages_per_chunk} pages of this "
            f"layout has {want}; check pages_per_chunk and the layout"
        )
    if payload.data_ptr() % layout.itemsize:
        raise InputError(
            f"payload address is not aligned to {layout.itemsize} bytes ({layout.dtype}); "
            "allocate payloads with torch.empty"
        )
    return payload.view(layout.dtype).view(layout.chunk_shape(pages_per_chunk))


def check_integer_dtype(dtype: torch.dtype, what: str) -> None:
    """Ids and indices must be integers: a cast to int64 would silently truncate floats and bools."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise InputError(f"{what} must be integers; got dtype {dtype}")


def pages_from_token_indices(token_indices: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Page ids of a token-index list that covers whole pages (SGLang ``host_indices``).

    SGLang passes token indices, ``page_tokens`` per page, page ``i`` starting at ``token_indices[i
    * page_tokens]``. Returns CPU int64 ``[num_pages]`` (``token // page_tokens``), after checking
    that each page's indices are one aligned run of consecutive tokens.
    """
    _check_positive(page_tokens, "page_tokens")
    if token_indices is None or isinstance(token_indices, (str, bytes)):
        raise InputError(
            f"token_indices must be a 1-D integer tensor or a list of ints; got {token_indices!r:.80}"
        )
    try:
        raw = torch.as_tensor(token_indices)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise InputError(
            f"token_indices must be a 1-D integer tensor or a list of ints: {exc}"
        ) from None
    check_integer_dtype(raw.dtype, "token indices")
    idx = raw.to("cpu", torch.int64).reshape(-1)
    if idx.numel() == 0 or idx.numel() % page_tokens:
        raise InputError(
            f"{idx.numel()} token indices do not cover whole pages of {page_tokens} tokens"
        )
    pages = idx.view(-1, page_tokens)
    starts = pages[:, 0]
    if bool((starts % page_tokens != 0).any()) or bool((starts < 0).any()):
        bad = int(starts[(starts % page_tokens != 0) | (starts < 0)][0])
        raise InputError(f"token index {bad} does not start a page of {page_tokens} tokens")
    if not torch.equal(pages - starts[:, None], torch.arange(page_tokens).expand_as(pages)):
        raise InputError("token indices within a page must be consecutive (one page = one run)")
    return starts // page_tokens
