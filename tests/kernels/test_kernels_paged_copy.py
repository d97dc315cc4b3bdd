"""gather_chunks / scatter_chunks: Triton (interpreter) vs torch reference vs an oracle."""

from __future__ import annotations

import pytest
import torch
from _kernel_cases import (
    CASE_NAMES,
    DTYPES,
    expected_chunk,
    make_case,
    random_bits,
    random_page_ids,
    same_bits,
)
from radixkv.kernels import (
    PagedLayout,
    alloc_chunks,
    chunk_payload,
    gather_chunks,
    gather_chunks_reference,
    paged_copy,
    scatter_chunks,
    scatter_chunks_reference,
)

from radixkv.errors import InputError

NUM_CHUNKS, PAGES_PER_CHUNK = 2, 3


def _filled_chunks(layout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return random_bits((NUM_CHUNKS, *layout.chunk_shape(PAGES_PER_CHUNK)), layout.dtype, g)


def _check_gather(case, ids, layers=None) -> None:
    layout = case.layout
    sel = (
        range(layout.num_layers)
        if layers is None
        else (range(layers, layers + 1) if isinstance(layers, int) else layers)
    )
    before = _filled_chunks(layout, 0)  # sentinel content: skipped regions must stay as they are
    tri, ref = before.clone(), before.clone()
    res = gather_chunks(layout, ids, tri, layers=layers, force_triton=True)
    ref_res = gather_chunks_reference(layout, ids, ref, layers=layers)
    for c in range(NUM_CHUNKS):
        want = expected_chunk(case, ids[c], before[c], sel)
        assert same_bits(tri[c], want), f"triton chunk {c} differs from the oracle"
        assert same_bits(ref[c], want), f"torch chunk {c} differs from the oracle"
    assert res.backend == "triton-interpreter" and res.launches == 1
    valid = int((ids >= 0).sum())
    assert res.page_copies == ref_res.page_copies == valid * len(sel) * layout.num_components
    assert res.bytes_copied == res.page_copies * layout.page_bytes


def _check_scatter(case, ids, layers=None) -> None:
    layout = case.layout
    chunks = _filled_chunks(layout, 1)
    original = case.storage.clone()
    scatter_chunks(layout, ids, chunks, layers=layers, force_triton=True)
    after_triton = case.storage.clone()
    case.storage.copy_(original)
    scatter_chunks_reference(layout, ids, chunks, layers=layers)
    assert same_bits(after_triton, case.storage), "triton and torch scatter wrote different bytes"
    # Oracle: the written pages hold the chunk slabs, and nothing else changed.
    sel = range(layout.num_layers) if layers is None else layers
    case.storage.copy_(original)  # oracle() views case.storage: write the expected slabs through it
    N = layout.page_tokens
    for c in range(NUM_CHUNKS):
        for ly in sel:
            for comp in range(layout.num_components):
                for j, p in enumerate(ids[c].tolist()):
                    if p >= 0:
                        case.oracle(ly, comp, p).copy_(chunks[c, ly, comp, j * N : (j + 1) * N])
    assert same_bits(after_triton, case.storage), "scatter differs from the oracle"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_layout_bf16_gather_scatter(name: str) -> None:
    case = make_case(name, torch.bfloat16, seed=CASE_NAMES.index(name))
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=CASE_NAMES.index(name))
    _check_gather(case, ids)
    _check_scatter(case, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["vllm_lbnhc", "sglang_host_page_first", "sglang_device_mla"])
def test_every_dtype(name: str, dtype: torch.dtype) -> None:
    case = make_case(name, dtype, seed=7)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=DTYPES.index(dtype))
    _check_gather(case, ids)
    _check_scatter(case, ids)


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming-hints"])
@pytest.mark.parametrize("fuse", [True, False], ids=["kv-fused", "per-component"])
@pytest.mark.parametrize("name", ["vllm_lbnhc", "sglang_device", "sglang_device_mla"])
def test_component_fusion_on_and_off(name: str, fuse: bool, streaming: bool) -> None:
    """Both program shapes (one per page and layer, or per page, layer and component) copy alike."""
    case = make_case(name, torch.float16, seed=11)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=11)
    with paged_copy._tile_config(2048, 4, fuse=fuse, streaming=streaming):
        _check_gather(case, ids, layers=range(1, 3))
        _check_scatter(case, ids, layers=range(1, 3))


def test_64_bit_in_page_offsets_copy_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64 in-page offset path (pages whose own span passes 2**31 elements) copies alike."""
    case = make_case("vllm_lbnhc", torch.bfloat16, seed=12)
    assert paged_copy._page_offsets_fit_int32(case.layout)
    monkeypatch.setattr(paged_copy, "_page_offsets_fit_int32", lambda layout: False)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=12)
    _check_gather(case, ids)
    _check_scatter(case, ids)


def test_in_page_offset_width_follows_the_strides() -> None:
    base = torch.zeros(2, 8, 4, 64, dtype=torch.float16)  # [pages, tokens, heads, dim]
    layout = PagedLayout.from_views([[base, base]])
    assert paged_copy._page_offsets_fit_int32(layout)
    # A token stride of 2**28 elements (no such tensor is allocated): token 7 lies at 1.75 * 2**30,
    # still inside int32; at 2**29 it lies past 2**31.
    object.__setattr__(layout, "page_strides", (2**31, 2**28, 64, 1))
    assert paged_copy._page_offsets_fit_int32(layout)
    object.__setattr__(layout, "page_strides", (2**32, 2**29, 64, 1))
    assert not paged_copy._page_offsets_fit_int32(layout)


def test_in_page_offset_width_counts_the_masked_lanes_of_the_last_tile() -> None:
    """With head_dim 1 a tile is 8192 rows: the last row tile of an 8193-row page forms offsets
    (masked off) up to row 16383, not 4096 rows past the page (the fixed slack it once assumed)."""
    base = torch.zeros(1, 8193, 1, 1, dtype=torch.int8)  # [pages, tokens, heads, dim]
    layout = PagedLayout.from_views([[base]])
    assert paged_copy._tile(layout)[:2] == (8192, 1)
    assert paged_copy._page_offsets_fit_int32(layout)
    # token stride 150000 (no such tensor is allocated): row 8192 lies at 1.23e9 elements, the
    # last lane of its tile at 16383 * 150000 = 2.46e9 > 2**31.
    object.__setattr__(layout, "page_strides", (8193 * 150_000, 150_000, 1, 1))
    assert not paged_copy._page_offsets_fit_int32(layout)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_engine_layout_gets_int32_in_page_offsets(name: str) -> None:
    assert paged_copy._page_offsets_fit_int32(make_case(name, torch.bfloat16).layout)


@pytest.mark.parametrize("max_elems, num_warps", [(6000, 8), (8192, 6), (0, 8), (8192, True)])
def test_tile_config_rejects_tiles_triton_cannot_build(max_elems, num_warps) -> None:
    with pytest.raises(InputError, match="must be a power of two"), paged_copy._tile_config(
        max_elems, num_warps
    ):
        pass
    assert paged_copy._tile(make_case("vllm_lbnhc", torch.float16).layout)[2] == 8  # restored


def test_stacked_chunks_inside_the_engine_name_the_offending_chunk() -> None:
    """One stacked buffer whose second chunk lies in the engine's storage: the error names chunk
    1 (the stacked fast path named chunk 0 whichever chunk it was)."""
    np = pytest.importorskip("numpy")
    words = np.zeros(32 + 128, dtype=np.int16)  # 2 chunks of 32 elements, then the engine (128)
    engine = torch.from_numpy(words[32:]).view(torch.bfloat16)  # its storage starts at chunk 1
    k, v = engine[:64].view(4, 2, 1, 8), engine[64:].view(4, 2, 1, 8)
    layout = PagedLayout.from_views([[k, v]])
    chunks = torch.from_numpy(words[:64]).view(torch.bfloat16).view(2, *layout.chunk_shape(1))
    assert paged_copy._stacked_chunks(layout, chunks, 2, 1) is chunks
    for fn in (gather_chunks, scatter_chunks, gather_chunks_reference):
        with pytest.raises(InputError, match="chunk 1 lies inside the engine's page storage"):
            fn(layout, [[0], [1]], chunks)


@pytest.mark.parametrize("bad", [None, 5, 1.5], ids=repr)
def test_chunks_that_are_not_a_sequence_are_an_input_error(bad) -> None:
    """list(chunks) raised a bare TypeError; docs/kernels.md promises InputError."""
    from radixkv.kernels import prepare_gather, prepare_scatter

    layout = make_case("vllm_lbnhc", torch.float16).layout
    for fn in (gather_chunks, scatter_chunks, gather_chunks_reference, scatter_chunks_reference,
               prepare_gather, prepare_scatter):
        with pytest.raises(InputError, match="chunks must be one tensor of all chunks or a sequence"):
            fn(layout, [[0, 1]], bad)


@pytest.mark.parametrize("layers", [0, 2, range(1, 3)], ids=["first", "last", "range"])
def test_per_layer_touches_only_selected_layers(layers) -> None:
    case = make_case("vllm_lbnhc", torch.float16, seed=3)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=3)
    _check_gather(case, ids, layers=layers)
    sel = range(layers, layers + 1) if isinstance(layers, int) else layers
    _check_scatter(case, ids, layers=sel)


def test_all_pages_skipped_is_a_no_op() -> None:
    case = make_case("sglang_device", torch.bfloat16)
    ids = torch.full((NUM_CHUNKS, PAGES_PER_CHUNK), -1)
    chunks = _filled_chunks(case.layout, 2)
    before, storage = chunks.clone(), case.storage.clone()
    assert gather_chunks(case.layout, ids, chunks, force_triton=True).page_copies == 0
    assert scatter_chunks(case.layout, ids, chunks, force_triton=True).bytes_copied == 0
    assert same_bits(chunks, before) and same_bits(case.storage, storage)


def test_gather_duplicate_pages_allowed() -> None:
    case = make_case("vllm_lbhnc", torch.float32)
    ids = torch.tensor([[2, 2, 5], [5, -1, 2]])
    _check_gather(case, ids)


@pytest.mark.parametrize("form", ["typed_list", "payload_list", "stacked_payload"])
def test_chunk_forms_give_identical_bytes(form: str) -> None:
    case = make_case("sglang_host_layer_first", torch.bfloat16, seed=5)
    layout = case.layout
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=5)
    want = torch.zeros(NUM_CHUNKS, *layout.chunk_shape(PAGES_PER_CHUNK), dtype=layout.dtype)
    gather_chunks_reference(layout, ids, want)
    # Separate allocations per chunk: the kernel walks a pointer table, no staging copy.
    typed = [
        torch.zeros(layout.chunk_shape(PAGES_PER_CHUNK), dtype=layout.dtype)
        for _ in range(NUM_CHUNKS)
    ]
    if form == "typed_list":
        arg = typed
    elif form == "payload_list":
        arg = [chunk_payload(t) for t in typed]
    else:
        stacked = torch.zeros(NUM_CHUNKS, layout.chunk_bytes(PAGES_PER_CHUNK), dtype=torch.uint8)
        typed = [
            stacked[i].view(layout.dtype).view(layout.chunk_shape(PAGES_PER_CHUNK))
            for i in range(NUM_CHUNKS)
        ]
        arg = stacked
    gather_chunks(layout, ids, arg, force_triton=True)
    for i in range(NUM_CHUNKS):
        assert same_bits(typed[i], want[i])
    # and back: scatter from the same form reproduces the engine state
    saved = case.storage.clone()
    case.storage.zero_()
    scatter_chunks(layout, ids, arg, force_triton=True)
    for c in range(NUM_CHUNKS):
        for j, p in enumerate(ids[c].tolist()):
            if p >= 0:
                for ly in range(layout.num_layers):
                    for comp in range(2):
                        assert same_bits(case.oracle(ly, comp, p), saved_oracle(saved, ly, comp, p))


def saved_oracle(saved: torch.Tensor, ly: int, c: int, p: int) -> torch.Tensor:
    """sglang_host_layer_first oracle over a saved copy of the storage."""
    from _kernel_cases import PAGE_TOKENS

    return saved[c, ly, p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS]


def test_round_trip_between_two_engines_of_different_layouts() -> None:
    """vLLM LBNHC pages -> chunks -> SGLang page_first_direct pages: same per-token KV."""
    src = make_case("vllm_lbnhc", torch.bfloat16, seed=11)
    dst = make_case("sglang_host_page_first_direct", torch.bfloat16, seed=12)
    ids_src = torch.tensor([[4, 0, 6], [1, 3, -1]])
    ids_dst = torch.tensor([[0, 1, 2], [3, 4, -1]])
    chunks = alloc_chunks(src.layout, NUM_CHUNKS, PAGES_PER_CHUNK)
    gather_chunks(src.layout, ids_src, chunks, force_triton=True)
    scatter_chunks(dst.layout, ids_dst, chunks, force_triton=True)
    for a, b in zip(ids_src.flatten().tolist(), ids_dst.flatten().tolist()):
        if a >= 0:
            for ly in range(src.layout.num_layers):
                for c in range(2):
                    assert same_bits(src.oracle(ly, c, a), dst.oracle(ly, c, b))


def test_dispatch_cpu_uses_torch_unless_interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case("vllm_lbnhc", torch.bfloat16)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=0)
    chunks = alloc_chunks(case.layout, NUM_CHUNKS, PAGES_PER_CHUNK)
    assert gather_chunks(case.layout, ids, chunks).backend == "triton-interpreter"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert gather_chunks(case.layout, ids, chunks).backend == "torch"
    assert (
        gather_chunks(case.layout, ids, chunks, force_triton=True).backend == "triton-interpreter"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert scatter_chunks(case.layout, ids, chunks).backend == "torch"


def test_page_ids_as_lists_and_int32() -> None:
    case = make_case("sglang_device", torch.float16)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=2)
    a = alloc_chunks(case.layout, NUM_CHUNKS, PAGES_PER_CHUNK).zero_()
    b, c = a.clone(), a.clone()
    gather_chunks(case.layout, ids, a, force_triton=True)
    gather_chunks(case.layout, ids.tolist(), b, force_triton=True)
    gather_chunks(case.layout, ids.to(torch.int32), c, force_triton=True)
    assert same_bits(a, b) and same_bits(a, c)


def test_page_ids_as_uint64() -> None:
    # torch has no uint64 max/compare on CPU: the wrap guard raised NotImplementedError for every
    # uint64 id tensor. Valid ids copy like int64 ones; ids >= 2**63 (-1 as uint64 included) are
    # an InputError naming the id, never a skip.
    case = make_case("sglang_device", torch.float16)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=2, holes=False)
    a = alloc_chunks(case.layout, NUM_CHUNKS, PAGES_PER_CHUNK).zero_()
    b = a.clone()
    gather_chunks(case.layout, ids, a, force_triton=True)
    gather_chunks(case.layout, ids.to(torch.uint64), b, force_triton=True)
    assert same_bits(a, b)
    bad = ids.clone()
    bad[1, 2] = -1  # as uint64: 2**64 - 1
    for fn in (gather_chunks, scatter_chunks, gather_chunks_reference):
        with pytest.raises(InputError, match=f"page id {2**64 - 1} out of range"):
            fn(case.layout, bad.view(torch.uint64), a)


class TestValidation:
    """Bad input raises InputError naming the value; nothing is copied."""

    def setup_method(self) -> None:
        self.case = make_case("vllm_lbnhc", torch.bfloat16)
        self.layout = self.case.layout
        self.chunks = alloc_chunks(self.layout, NUM_CHUNKS, PAGES_PER_CHUNK)

    @pytest.mark.parametrize("bad, match", [(7, "page id 7 out of range"), (-2, "page id -2")])
    def test_page_id_out_of_range(self, bad: int, match: str) -> None:
        ids = [[0, 1, 2], [3, 4, bad]]
        for fn in (gather_chunks, scatter_chunks, gather_chunks_reference):
            with pytest.raises(InputError, match=match):
                fn(self.layout, ids, self.chunks)

    def test_scatter_rejects_duplicate_pages(self) -> None:
        with pytest.raises(InputError, match="twice"):
            scatter_chunks(self.layout, [[0, 1, 2], [2, -1, -1]], self.chunks)

    def test_gather_rejects_aliased_chunks(self) -> None:
        with pytest.raises(InputError, match="share one buffer"):
            gather_chunks(self.layout, [[0, 1, 2], [3, 4, 5]], [self.chunks[0], self.chunks[0]])

    def test_overlapping_or_engine_aliased_chunks(self) -> None:
        # Overlapping gather targets, or a chunk inside the engine's pages: the bytes would depend
        # on the copy order (the torch path raised a bare RuntimeError, the interpreter went on).
        flat = torch.empty(2 * self.chunks[0].numel() + 8, dtype=self.layout.dtype)
        n = self.chunks[0].numel()
        shape = self.chunks[0].shape
        a, b = flat[:n].view(shape), flat[4 : 4 + n].view(shape)
        with pytest.raises(InputError, match="overlap"):
            gather_chunks(self.layout, [[0, 1, 2], [3, 4, 5]], [a, b])
        from radixkv.kernels import PagedLayout

        k, v = torch.zeros(16, 4, 1, 8, dtype=torch.bfloat16), torch.zeros(16, 4, 1, 8, dtype=torch.bfloat16)
        small = PagedLayout.from_views([[k, v]])
        (chunk,) = alloc_chunks(small, 1, 1)
        inside = k.reshape(-1)[: chunk.numel()].view(chunk.shape)
        for fn in (gather_chunks, scatter_chunks):
            with pytest.raises(InputError, match="engine's page storage"):
                fn(small, [[3]], [inside])

    def test_page_ids_must_be_integers_not_truncated(self) -> None:
        for ids in ([[0, 1, 2.7], [3, 4, 5]], [[True, False, 2], [3, 4, 5]]):
            with pytest.raises(InputError, match="ints"):
                gather_chunks(self.layout, ids, self.chunks)

    def test_bad_page_id_shapes_and_types(self) -> None:
        for ids, match in [
            (torch.zeros(6, dtype=torch.int64), "2-D"),
            (torch.zeros(2, 3), "integers"),
            ([[0, 1, 2], [3, 4]], "equal-length"),
            (torch.zeros(2, 3, dtype=torch.int64, device="meta"), "CPU tensor"),
        ]:
            with pytest.raises(InputError, match=match):
                gather_chunks(self.layout, ids, self.chunks)

    def test_chunk_count_shape_dtype_contiguity(self) -> None:
        ids = [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(InputError, match="2 rows but 1 chunk"):
            gather_chunks(self.layout, ids, self.chunks[:1])
        with pytest.raises(InputError, match="expected torch.bfloat16"):
            gather_chunks(self.layout, ids, self.chunks.float())
        with pytest.raises(InputError, match="payload has"):
            gather_chunks(self.layout, ids, [torch.zeros(10, dtype=torch.uint8)] * 2)
        wide = torch.zeros(
            NUM_CHUNKS, *self.layout.chunk_shape(PAGES_PER_CHUNK)[:-1], 2 * 8, dtype=torch.bfloat16
        )[..., ::2]
        with pytest.raises(InputError, match="not contiguous"):
            gather_chunks(self.layout, ids, wide)
        with pytest.raises(InputError, match="is on meta"):
            gather_chunks(self.layout, ids, self.chunks.to("meta"))

    def test_layers_argument(self) -> None:
        ids = [[0, 1, 2], [3, 4, 5]]
        for layers in (3, -1, range(2, 5), range(0, 3, 2), range(1, 1), "0"):
            with pytest.raises(InputError, match="layers"):
                gather_chunks(self.layout, ids, self.chunks, layers=layers)


def test_uint8_layouts_take_flat_payloads() -> None:
    # fp8 KV caches are stored as uint8 by engines; a flat uint8 payload (the form the adapters
    # move) was rejected for them because its dtype already matched.
    from radixkv.kernels import PagedLayout

    v = torch.randint(0, 256, (4, 16, 1, 8), dtype=torch.uint8)
    layout = PagedLayout.from_views([[v, v.clone()]])
    payload = torch.empty(layout.chunk_bytes(1), dtype=torch.uint8)
    gather_chunks(layout, [[2]], [payload])
    typed = alloc_chunks(layout, 1, 1)
    gather_chunks_reference(layout, [[2]], typed)
    assert torch.equal(payload, chunk_payload(typed[0]))


_BIG_OFFSETS_SCRIPT = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from radixkv.kernels import PagedLayout, gather_chunks, gather_chunks_reference, scatter_chunks
# 3 pages 2**30 int8 elements apart: page 2 starts at element 2**31 (int32 would wrap negative).
# torch.empty only reserves address space; the kernel touches a few bytes per page.
storage = torch.empty((1 << 31) + (1 << 20), dtype=torch.int8)
view = storage.as_strided((3, 2, 1, 8), (1 << 30, 1 << 19, 8, 1))
gen = torch.Generator().manual_seed(0)
view.copy_(torch.randint(-128, 127, (3, 2, 1, 8), dtype=torch.int8, generator=gen))
layout = PagedLayout.from_views([[view]])
ids = torch.tensor([[2, 0, 1]])
tri = torch.zeros((1, *layout.chunk_shape(3)), dtype=torch.int8)
ref = tri.clone()
gather_chunks(layout, ids, tri, force_triton=True)
gather_chunks_reference(layout, ids, ref)
assert torch.equal(tri, ref) and torch.equal(tri[0, 0, 0, :2], view[2]), "gather differs"
pages = view.clone()
view.zero_()
scatter_chunks(layout, ids, tri, force_triton=True)
assert torch.equal(view, pages), "scatter differs"
print("OK")
"""


def test_page_offsets_beyond_2_pow_31_elements_in_interpreter() -> None:
    """page * stride_page past 2**31 elements (pools > 2 GiB): the interpreter computes in the
    kernel's own dtypes, so int32 offset arithmetic would wrap and read out of bounds (a crash,
    hence the subprocess). The CUDA counterpart is test_int64_offsets_beyond_2_pow_31_elements."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _BIG_OFFSETS_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )


@pytest.mark.parametrize("name", ["vllm_lbnhc", "sglang_host_page_first", "sglang_device_mla"])
def test_prepared_copies_run_layer_by_layer_like_one_call(name: str) -> None:
    """prepare_gather / prepare_scatter, run one layer at a time (as a layer pipeline does), write
    the same bytes as one gather_chunks / scatter_chunks call over all layers, in the interpreter."""
    from radixkv.kernels import prepare_gather, prepare_scatter

    case = make_case(name, torch.bfloat16, seed=21)
    layout = case.layout
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=21)
    want = _filled_chunks(layout, 0)
    got = want.clone()
    gather_chunks(layout, ids, want, force_triton=True)
    prep = prepare_gather(layout, ids, [got[c] for c in range(NUM_CHUNKS)], force_triton=True)
    assert prep.num_chunks == NUM_CHUNKS and prep.to_chunk
    results = [prep.run(layers=i) for i in range(layout.num_layers)]
    assert same_bits(got, want)
    assert {r.backend for r in results} == {"triton-interpreter"}
    valid = int((ids >= 0).sum())
    assert all(r.launches == 1 and r.page_copies == valid * layout.num_components for r in results)

    chunks = _filled_chunks(layout, 1)
    original = case.storage.clone()
    scatter_chunks(layout, ids, chunks, force_triton=True)
    expected = case.storage.clone()
    case.storage.copy_(original)
    prep = prepare_scatter(layout, ids, chunks, force_triton=True)
    for i in reversed(range(layout.num_layers)):  # any order, any subset
        prep.run(layers=range(i, i + 1))
    assert same_bits(case.storage, expected)
    case.storage.copy_(original)
    prep.run()  # all layers at once
    assert same_bits(case.storage, expected)
    prep.check_integrity()


def test_prepared_copy_torch_path_and_bad_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.kernels import prepare_scatter

    monkeypatch.delenv("TRITON_INTERPRET")  # CPU without the interpreter: the torch reference

    case = make_case("vllm_lbnhc", torch.float16, seed=22)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=22)
    chunks = _filled_chunks(case.layout, 2)
    original = case.storage.clone()
    scatter_chunks_reference(case.layout, ids, chunks, layers=1)
    expected = case.storage.clone()
    case.storage.copy_(original)
    prep = prepare_scatter(case.layout, ids, chunks)
    assert prep.run(layers=1).backend == "torch"
    assert same_bits(case.storage, expected)
    with pytest.raises(InputError, match="outside the layout"):
        prep.run(layers=case.layout.num_layers)
    with pytest.raises(InputError, match="name a page twice"):
        prepare_scatter(case.layout, [[0, 1, 2], [2, 3, 4]], chunks)


@pytest.mark.parametrize("path", ["torch", "interpreter-small", "interpreter-large"])
def test_prepared_copy_copies_the_page_ids_it_checked(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: an int64 id tensor was kept as given, and runs read it later (the torch path
    every run, the first upload for batches past _SMALL_IDS), so ids the caller wrote after
    prepare_scatter were copied unchecked (out of range: past the engine's pages; a page twice). A
    prepared copy now copies the ids it checked."""
    from radixkv.kernels import prepare_scatter

    force = path != "torch"
    if not force:
        monkeypatch.delenv("TRITON_INTERPRET")
    if path == "interpreter-large":
        monkeypatch.setattr(paged_copy, "_SMALL_IDS", 0)  # the tensor path of large batches
    case = make_case("vllm_lbnhc", torch.float16, seed=24)
    layout = case.layout
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=24, holes=False)
    unused = next(p for p in range(layout.num_pages) if p not in ids.tolist()[0] + ids.tolist()[1])
    chunks = _filled_chunks(layout, 4)
    original = case.storage.clone()
    want = scatter_chunks_reference(layout, ids, chunks)
    expected = case.storage.clone()
    case.storage.copy_(original)
    prep = prepare_scatter(layout, ids, chunks, force_triton=force)
    ids[0, 0] = unused  # the caller refills its id tensor for its next batch
    got = prep.run()
    assert same_bits(case.storage, expected), "the run copied ids written after prepare"
    assert (got.page_copies, got.bytes_copied) == (want.page_copies, want.bytes_copied)


def test_prepared_copy_direction_and_layout_are_fixed() -> None:
    """The plan was checked for one direction (scatter: no page twice; gather: disjoint chunks):
    flipping `to_chunk` would run it unchecked the other way."""
    from radixkv.kernels import prepare_gather

    case = make_case("vllm_lbnhc", torch.float16, seed=25)
    prep = prepare_gather(case.layout, [[0, 0, 1], [1, 2, 2]], _filled_chunks(case.layout, 5))
    with pytest.raises(AttributeError):
        prep.to_chunk = False
    with pytest.raises(AttributeError):
        prep.layout = make_case("sglang_device_mla", torch.float16).layout


class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[tuple[_FakeStream, int] | None] = []

    def wait_event(self, event: _FakeEvent) -> None:
        # What the wait orders after: the event's record *now* (CUDA: waiting on an event not yet
        # recorded returns at once).
        self.waited.append(event.recorded)


class _FakeEvent:
    def __init__(self, clock: list[int]) -> None:
        self.clock = clock
        self.recorded: tuple[_FakeStream, int] | None = None

    def record(self, stream: _FakeStream) -> None:
        self.clock[0] += 1
        self.recorded = (stream, self.clock[0])


class _FakeMeta:
    """A device tensor: the stream (and time) it was uploaded on, the streams recorded on it."""

    def __init__(self, stream: _FakeStream, at: int) -> None:
        self.stream, self.at, self.streams = stream, at, {stream}

    def record_stream(self, stream: _FakeStream) -> None:
        self.streams.add(stream)


def _safe_use(meta: _FakeMeta, stream: _FakeStream, waited: list) -> bool:
    """A launch on ``stream`` may read ``meta``: it was uploaded on that stream, or that stream waited
    (``waited``: its waits before the launch) for an event recorded after the upload on the
    uploading stream, and is recorded on the tensor."""
    if meta.stream is stream:
        return True
    after_upload = any(
        rec is not None and rec[0] is meta.stream and rec[1] > meta.at for rec in waited
    )
    return after_upload and stream in meta.streams


def test_meta_cache_stream_protocol_and_a_racing_first_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_MetaCache` on CUDA, with fake streams (no GPU needed): a run on the uploading stream adds no
    wait; a run on another stream waits for the upload's event and records its stream. Found by
    review: the tensor was published before its stream and event, so a run on another thread (its own
    current stream) that came in between got the tensor without a wait for the upload; the tuple is
    now published whole, after the event."""
    clock = [0]
    current: list[_FakeStream] = []
    uploads: list[_FakeMeta] = []
    used: list[tuple[_FakeMeta, _FakeStream, list]] = []
    layout = type("L", (), {"device": torch.device("cuda", 0)})()
    race: dict = {"to": None}

    def fake_upload(layout, plan, offsets):
        clock[0] += 1
        uploads.append(_FakeMeta(current[0], clock[0]))
        return uploads[-1]

    def run_on(cache, stream: _FakeStream) -> None:
        current[:] = [stream]
        meta = cache.meta(layout, None, [])
        used.append((meta, stream, list(stream.waited)))  # what this launch is ordered after

    class Event(_FakeEvent):
        def __init__(self) -> None:
            super().__init__(clock)

        def record(self, stream) -> None:
            if race["to"] is not None:  # another thread's run, on its own stream, before this record
                cache, other = race["to"]
                race["to"] = None
                mine = current[0]
                run_on(cache, other)
                current[:] = [mine]
            super().record(stream)

    monkeypatch.setattr(paged_copy, "_meta", fake_upload)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "Event", Event)

    default, side = _FakeStream("default"), _FakeStream("side")
    cache = paged_copy._MetaCache()
    run_on(cache, default)  # first run: uploads on the default stream
    run_on(cache, default)
    assert default.waited == [] and len(uploads) == 1
    run_on(cache, side)  # later runs on a side stream: wait for the upload, keep the tensor for it
    run_on(cache, side)
    assert len(uploads) == 1 and side in uploads[0].streams
    assert all(_safe_use(*u) for u in used), [(m.stream.name, s.name) for m, s, _ in used]

    used.clear()
    side, other = _FakeStream("side"), _FakeStream("other")
    cache = paged_copy._MetaCache()
    race["to"] = (cache, other)
    run_on(cache, side)  # first run; another thread's run lands between its upload and its event
    run_on(cache, other)
    run_on(cache, side)
    assert all(_safe_use(*u) for u in used), [(m.stream.name, s.name) for m, s, _ in used]


def test_prepared_copy_check_integrity_notices_moved_buffers() -> None:
    from radixkv.kernels import prepare_gather

    case = make_case("vllm_lbnhc", torch.float16, seed=23)
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=23)
    chunks = [c.clone() for c in _filled_chunks(case.layout, 3)]
    prep = prepare_gather(case.layout, ids, chunks)
    prep.run(layers=0)
    prep.check_integrity()
    chunks[1].set_(chunks[1].clone())  # the buffer now lives elsewhere
    with pytest.raises(RuntimeError, match="moved since the copy was prepared"):
        prep.check_integrity()
