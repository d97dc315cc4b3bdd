"""HostCopier: bit-exact batched host copies on one thread and on several, and its input checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from radixkv import hostcopy
from radixkv.errors import ConfigError, InputError
from radixkv.hostcopy import HostCopier, default_copy_threads

MiB = 1 << 20


def rnd(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("threads,parallel_min", [(1, 0), (2, 0), (3, 0), (3, 1 << 40)])
def test_copies_every_byte(threads, parallel_min):
    """Odd sizes straddle the 4 MiB pieces the threads share; every destination byte is its source's."""
    sizes = [1, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 9 * MiB + 7, 0, 3]
    srcs = [rnd(i, n) for i, n in enumerate(sizes)]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    c = HostCopier(threads, parallel_min_bytes=parallel_min)
    try:
        assert c.copy(dsts, srcs) == sum(sizes)
        for d, s in zip(dsts, srcs):
            assert torch.equal(d, s)
    finally:
        c.close()


def test_views_and_other_dtypes():
    """Destinations may be views into one big buffer and any dtype: bytes are what is copied."""
    big = torch.zeros(6 * MiB, dtype=torch.uint8)
    src = rnd(7, 6 * MiB).view(torch.int16)
    halves = list(big.split(3 * MiB))
    c = HostCopier(2, parallel_min_bytes=0)
    try:
        c.copy([h.view(torch.int16) for h in halves], list(src.split(3 * MiB // 2)))
        assert torch.equal(big.view(torch.int16), src)
    finally:
        c.close()


def test_size_mismatch_names_both_sizes_and_copies_nothing():
    d = [torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    s = [torch.ones(8, dtype=torch.uint8), torch.ones(5, dtype=torch.uint8)]
    with pytest.raises(InputError, match=r"pair 1: destination has 4 bytes, source 5"):
        HostCopier(1).copy(d, s)
    assert int(d[0].sum()) == 0  # validated before the first byte moved


def test_non_contiguous_and_count_mismatch_rejected():
    t = torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises(InputError, match="destination 0 .*contiguous=False"):
        HostCopier(1).copy([t.t()], [torch.zeros(4, 4, dtype=torch.uint8)])
    with pytest.raises(InputError, match="source 0 is bytes"):
        HostCopier(1).copy([t], [b"x" * 16])
    with pytest.raises(InputError, match="2 destinations but 1 sources"):
        HostCopier(1).copy([t, t], [t])


@pytest.mark.parametrize("lazy", ["conj", "neg"])
@pytest.mark.parametrize("side", ["source", "destination"])
def test_lazy_conj_and_neg_views_are_refused_before_any_byte_moves(lazy, side):
    """A conj/neg view's storage holds the untransformed values: a byte copy would give wrong ones."""
    if lazy == "conj":
        base = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        view, fix = base.conj(), r"\.resolve_conj\(\)"
    else:
        base = torch.tensor([1.0, -2.0])
        view, fix = torch._neg_view(base), r"\.resolve_neg\(\)"
    plain = torch.zeros_like(base)
    first_d, first_s = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    d, s = (plain, view) if side == "source" else (view, base.clone())
    with pytest.raises(InputError, match=rf"{side} 1 is a lazy .*{fix}"):
        HostCopier(1).copy([first_d, d], [first_s, s])
    assert int(first_d.sum()) == 0  # validated before the first byte moved
    # resolved, the same values copy exactly
    if side == "source":
        resolved = view.resolve_conj() if lazy == "conj" else view.resolve_neg()
        HostCopier(1).copy([plain], [resolved])
        assert torch.equal(plain, view)


def test_overlapping_buffers_are_refused_before_any_byte_moves():
    # Documented from the start but unchecked: a 4-thread copy of overlapping halves garbled bytes.
    buf = rnd(3, 40 * MiB)
    before = buf.clone()
    cases = [
        ([buf[MiB : 33 * MiB]], [buf[: 32 * MiB]], "pair 0: destination and source overlap"),
        ([buf[:MiB], buf[MiB // 2 : MiB + MiB // 2]], [rnd(4, MiB), rnd(5, MiB)], "two destinations overlap"),
        ([buf[:MiB], buf[2 * MiB : 3 * MiB]], [buf[2 * MiB + 1 : 3 * MiB + 1], rnd(6, MiB)], "source overlaps"),
    ]
    for dsts, srcs, match in cases:
        with pytest.raises(InputError, match=match):
            HostCopier(4, parallel_min_bytes=0).copy(dsts, srcs)
    assert torch.equal(buf, before)
    shared_source = rnd(7, MiB)  # one source read into two destinations is fine
    d = [torch.empty(MiB, dtype=torch.uint8), torch.empty(MiB, dtype=torch.uint8)]
    HostCopier(2, parallel_min_bytes=0).copy(d, [shared_source, shared_source])
    assert torch.equal(d[0], shared_source) and torch.equal(d[1], shared_source)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_threads(bad):
    with pytest.raises(ConfigError, match="copy threads"):
        HostCopier(bad)


def test_default_threads_bounded():
    assert 1 <= default_copy_threads() <= 4


def test_concurrent_callers_share_the_helpers_without_deadlock():
    """Several threads copying large batches at once through one copier (the store's I/O threads and
    the engine's threads do): every byte lands, and no caller waits forever on a busy helper."""
    import threading

    c = HostCopier(2, parallel_min_bytes=0)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for r in range(5):
                srcs = [rnd(seed * 100 + r * 10 + i, 3 * MiB + i) for i in range(3)]
                dsts = [torch.zeros_like(s) for s in srcs]
                c.copy(dsts, srcs)
                assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads), "a copy never finished"
        assert not errors, errors
    finally:
        c.close()


@pytest.mark.parametrize("streaming_min", [0, None])
def test_streaming_and_plain_copies_are_bit_exact_at_every_alignment(streaming_min):
    """Every destination/source misalignment and every size around the streaming helper's edges
    (tests/test_native.py checks the helper itself at small sizes, which hostcopy gives memmove)."""
    src_buf, dst_buf = rnd(11, 4 * MiB + 64), torch.zeros(4 * MiB + 64, dtype=torch.uint8)
    c = HostCopier(2, parallel_min_bytes=0, streaming_min_bytes=streaming_min)
    try:
        for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 64 * 1024 + 1, 4 * MiB + 3):
            for d_off in (0, 1, 7, 15, 16, 33):
                for s_off in (0, 5, 16):
                    dst_buf.zero_()
                    c.copy([dst_buf[d_off:d_off + n]], [src_buf[s_off:s_off + n]])
                    assert torch.equal(dst_buf[d_off:d_off + n], src_buf[s_off:s_off + n]), (n, d_off, s_off)
                    assert int(dst_buf[:d_off].sum()) == 0 and int(dst_buf[d_off + n:].sum()) == 0, (n, d_off)
    finally:
        c.close()


def test_streaming_can_be_switched_off_by_the_environment():
    code = "import radixkv.hostcopy as h; print(h.streaming_copy_available())"
    env = {**os.environ, "RADIXKV_STREAMING_COPY": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("bad", [-1, 1.5, "8MiB"])
def test_bad_streaming_min_bytes(bad):
    with pytest.raises(ConfigError, match="streaming_min_bytes"):
        HostCopier(1, streaming_min_bytes=bad)


@pytest.mark.parametrize("checked", [False, True])
def test_a_negative_span_length_is_refused_before_any_byte_moves(monkeypatch, checked):
    """ctypes would hand -1 to memmove as a size_t near 2**64 (a crash of the whole process)."""
    calls = []
    monkeypatch.setattr(hostcopy, "_memmove", lambda d, s, n: calls.append(n))
    src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    c = HostCopier(1, streaming_min_bytes=None)
    with pytest.raises(InputError, match="-1 bytes"):
        c.copy_spans([(dst.data_ptr(), src.data_ptr(), 8), (dst.data_ptr() + 8, src.data_ptr(), -1)],
                     checked=checked)
    assert calls == []
