"""Property test: any geometry and physical order of the engine memory round-trips bit-exactly."""

from __future__ import annotations

import torch
from _kernel_cases import random_bits, same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixkv.kernels import (
    PagedLayout,
    gather_chunks,
    gather_chunks_reference,
    scatter_chunks,
)


@st.composite
def geometries(draw):
    dims = {
        "layers": draw(st.integers(1, 3)),
        "comps": draw(st.integers(1, 2)),
        "pages": draw(st.integers(1, 6)),
        "tokens": draw(st.integers(1, 5)),
        "heads": draw(st.integers(1, 3)),
        "dim": draw(st.integers(1, 20)),
    }
    order = draw(st.permutations(range(6)))  # physical order of [L, C, P, N, H, D]
    num_chunks = draw(st.integers(1, 3))
    pages_per_chunk = draw(st.integers(1, 3))
    ids = draw(
        st.lists(
            st.integers(-1, dims["pages"] - 1),
            min_size=num_chunks * pages_per_chunk,
            max_size=num_chunks * pages_per_chunk,
        )
    )
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e5m2]))
    return dims, list(order), num_chunks, pages_per_chunk, ids, dtype


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(geometries())
def test_interpreter_matches_oracle_for_any_strides(geometry) -> None:
    dims, order, num_chunks, ppc, flat_ids, dtype = geometry
    shape = [dims[k] for k in ("layers", "comps", "pages", "tokens", "heads", "dim")]
    gen = torch.Generator().manual_seed(sum(shape) + len(flat_ids))
    physical = random_bits(tuple(shape[i] for i in order), dtype, gen)
    logical = physical.permute(
        *[order.index(i) for i in range(6)]
    )  # [L, C, P, N, H, D], any strides
    assert logical.shape == tuple(shape)
    layout = PagedLayout.from_views(
        [[logical[li, c] for c in range(shape[1])] for li in range(shape[0])]
    )
    ids = torch.tensor(flat_ids).view(num_chunks, ppc)
    chunks = random_bits((num_chunks, *layout.chunk_shape(ppc)), dtype, gen)
    before = chunks.clone()
    gather_chunks(layout, ids, chunks, force_triton=True)
    ref = before.clone()
    gather_chunks_reference(layout, ids, ref)
    assert same_bits(chunks, ref)
    N = shape[3]
    for c in range(num_chunks):
        for j, p in enumerate(ids[c].tolist()):
            region = chunks[c, :, :, j * N : (j + 1) * N]
            if p >= 0:
                assert same_bits(region, logical[:, :, p].contiguous())
            else:
                assert same_bits(region, before[c, :, :, j * N : (j + 1) * N])
    # scatter back into zeroed memory: exactly the named pages reappear (when ids are distinct)
    valid = [p for p in flat_ids if p >= 0]
    if len(valid) == len(set(valid)):
        original = physical.clone()
        physical.zero_()
        scatter_chunks(layout, ids, chunks, force_triton=True)
        for p in range(shape[2]):
            want = original.permute(*[order.index(i) for i in range(6)])[:, :, p]
            got = logical[:, :, p]
            if p in valid:
                assert same_bits(got.contiguous(), want.contiguous())
            else:
                assert same_bits(got.contiguous(), torch.zeros_like(got.contiguous()))
