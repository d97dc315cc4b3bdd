"""CUDA checks: compiled kernels vs torch reference, zero-copy pinned host, int64 offsets, streams.

All tests carry the ``gpu`` marker and skip without CUDA (tests/conftest.py).
"""

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
    LayerPipeline,
    PagedLayout,
    alloc_chunks,
    gather_chunks,
    gather_chunks_reference,
    scatter_chunks,
    scatter_chunks_reference,
)

from radixkv.errors import InputError

pytestmark = pytest.mark.gpu
NUM_CHUNKS, PAGES_PER_CHUNK = 2, 3


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides the directory fixture: these tests run compiled kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _chunks(layout, device: str, pin: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    host = random_bits((NUM_CHUNKS, *layout.chunk_shape(PAGES_PER_CHUNK)), layout.dtype, g)
    return host.pin_memory() if pin else host.to(device)


def _gather_and_scatter(case, chunk_device: str, pin: bool) -> None:
    layout = case.layout
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=3)
    before = _chunks(layout, chunk_device, pin)
    tri = before.clone().pin_memory() if pin else before.clone()
    res = gather_chunks(layout, ids, tri)
    torch.cuda.synchronize()
    assert res.backend == "triton" and res.launches == 1
    for c in range(NUM_CHUNKS):
        want = expected_chunk(case, ids[c], before[c], range(layout.num_layers))
        assert same_bits(tri[c].cpu(), want.cpu())
    original = case.storage.clone()
    scatter_chunks(layout, ids, tri)
    torch.cuda.synchronize()
    after = case.storage.clone()
    case.storage.copy_(original)
    scatter_chunks_reference(layout, ids, tri)
    torch.cuda.synchronize()
    assert same_bits(after, case.storage)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_cuda_every_layout(name: str) -> None:
    _gather_and_scatter(make_case(name, torch.bfloat16, device="cuda"), "cuda", pin=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_every_dtype(dtype: torch.dtype) -> None:
    _gather_and_scatter(make_case("vllm_lbnhc", dtype, device="cuda"), "cuda", pin=False)


@pytest.mark.parametrize("name", ["vllm_lbnhc", "sglang_device", "sglang_device_mla"])
def test_zero_copy_pinned_host(name: str) -> None:
    """The kernel reads/writes pinned host chunks directly: no staging copy."""
    _gather_and_scatter(make_case(name, torch.float16, device="cuda"), "cpu", pin=True)


def test_pageable_host_chunks_rejected() -> None:
    case = make_case("vllm_lbnhc", torch.bfloat16, device="cuda")
    chunks = alloc_chunks(case.layout, NUM_CHUNKS, PAGES_PER_CHUNK, device="cpu")
    with pytest.raises(InputError, match="pinned"):
        gather_chunks(case.layout, [[0, 1, 2], [3, 4, 5]], chunks)


def test_int64_offsets_beyond_2_pow_31_elements() -> None:
    page_elems = 16 * 1024
    num_pages = (2**31 + 2**22) // page_elems + 1
    pool = torch.zeros(num_pages * 16, 1, 1024, dtype=torch.int8, device="cuda")
    last = num_pages - 1
    pool[last * 16 : (last + 1) * 16].fill_(7)
    pool[(last - 1) * 16 : last * 16].fill_(-3)
    layout = PagedLayout.from_sglang_device([pool], None, page_tokens=16)
    chunks = torch.zeros(1, *layout.chunk_shape(2), dtype=torch.int8, device="cuda")
    gather_chunks(layout, [[last, last - 1]], chunks)
    assert int(chunks[0, 0, 0, :16].min()) == 7 and int(chunks[0, 0, 0, 16:].max()) == -3
    chunks.fill_(5)
    scatter_chunks(layout, [[-1, last]], chunks)
    assert int(pool[last * 16 :].min()) == 5


def test_one_launch_for_a_large_batch_matches_reference() -> None:
    base = torch.randn(4, 64, 16, 8, 256, device="cuda").to(torch.bfloat16)  # [L, B, N, H, 2D]
    layout = PagedLayout.from_vllm([base[i].permute(0, 2, 1, 3) for i in range(4)])
    ids = torch.randperm(64)[:48].view(12, 4)
    a = alloc_chunks(layout, 12, 4)
    b = torch.zeros_like(a)
    assert gather_chunks(layout, ids, a).launches == 1
    gather_chunks_reference(layout, ids, b)
    assert same_bits(a, b)


def test_pipeline_save_waits_for_compute_and_load_precedes_use() -> None:
    case = make_case("vllm_lbnhc", torch.bfloat16, device="cuda")
    layout = case.layout
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    pipe = LayerPipeline("cuda")
    assert pipe.is_async
    saved = alloc_chunks(layout, NUM_CHUNKS, PAGES_PER_CHUNK, device="cpu", pin_memory=True)
    for layer in range(layout.num_layers):
        torch.cuda._sleep(50_000_000)  # a slow "attention" on the compute stream ...
        case.storage[layer].fill_(float(layer + 1))  # ... that writes this layer's KV
        pipe.save_layer(layer, lambda ly=layer: gather_chunks(layout, ids, saved, layers=ly))
    pipe.wait_all()
    pipe.check_integrity()
    for layer in range(layout.num_layers):
        assert bool((saved[:, layer].float() == layer + 1).all())
    # loads: layer i's pages are in place when the compute stream reads them after wait_layer(i)
    src = alloc_chunks(layout, NUM_CHUNKS, PAGES_PER_CHUNK, device="cpu", pin_memory=True)
    src.copy_(torch.arange(src.numel()).view(src.shape).to(src.dtype))
    case.storage.zero_()
    pipe.start_loads(
        [
            lambda ly=ly: scatter_chunks(layout, ids, src, layers=ly)
            for ly in range(layout.num_layers)
        ]
    )
    seen = []
    for layer in range(layout.num_layers):
        pipe.wait_layer(layer)
        seen.append(layout.views[layer][0][ids[0, 0].item()].clone())  # on the compute stream
    torch.cuda.synchronize()
    for layer in range(layout.num_layers):
        N = layout.page_tokens
        assert same_bits(seen[layer].cpu(), src[0, layer, 0, :N])


def test_prepared_copies_on_side_streams_match_reference() -> None:
    """One page-id upload shared by runs on the pipeline's side stream and on another stream."""
    from radixkv.kernels import prepare_gather, prepare_scatter

    case = make_case("vllm_lbnhc", torch.bfloat16, device="cuda")
    layout = case.layout
    ids = random_page_ids(NUM_CHUNKS, PAGES_PER_CHUNK, seed=5)
    src = _chunks(layout, "cpu", pin=True, seed=6)
    original = case.storage.clone()
    scatter_chunks_reference(layout, ids, src)
    expected = case.storage.clone()
    case.storage.copy_(original)
    torch.cuda.synchronize()
    prep = prepare_scatter(layout, ids, src)
    pipe = LayerPipeline("cuda")
    pipe.start_loads([lambda i=i: prep.run(layers=i) for i in range(layout.num_layers - 1)])
    for i in range(layout.num_layers - 1):
        pipe.wait_layer(i)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # the last layer from a stream that did not upload the ids
        assert prep.run(layers=layout.num_layers - 1).launches == 1
    torch.cuda.synchronize()
    assert same_bits(case.storage, expected)
    out = torch.zeros_like(src).pin_memory()  # zero-copy gather into pinned host chunks
    g = prepare_gather(layout, ids, out)
    for i in range(layout.num_layers):
        g.run(layers=i)
    torch.cuda.synchronize()
    want = torch.zeros_like(src)
    gather_chunks_reference(layout, ids, want)
    assert same_bits(out, want)
