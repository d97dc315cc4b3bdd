"""Bulk copies between host (CPU) byte buffers: glibc ``memmove`` on raw addresses, split across threads.

Why not ``torch.Tensor.copy_``: for contiguous CPU bytes it runs torch's generic element loop, 12-15%
slower than glibc's ``memcpy`` (which picks ``rep movsb`` / wide vector moves per CPU) and ~3-5 us of
dispatch per call; and one thread does not saturate memory bandwidth: on this 2-core machine a 128 MiB
batch of 1 MiB copies takes 22.8 ms on one thread and 13.1 ms on two (docs/benchmarks.md). ``ctypes``
foreign calls release the GIL, so the copy threads run in parallel.

Big batches (``streaming_min_bytes``, 8 MiB by default) use streaming (non-temporal) stores from the
small C helper ``radixkv/csrc/streamcopy.c`` (:mod:`radixkv.native`): a chunk copied into or out of a
tier is not read again by this CPU soon, and skipping the cache moves 2 bytes per byte copied instead
of 3 (~1.2-1.4x faster than memmove on the development VM). Without the helper (no C compiler at
install, ``RADIXKV_NATIVE=0`` or ``RADIXKV_STREAMING_COPY=0``) every copy uses memmove; the bytes are
the same either way.

Contract: every pair is (destination, source) of the same byte length, both CPU, contiguous and not
overlapping each other; the caller keeps them alive until :meth:`HostCopier.copy` returns (it blocks
until every byte is copied). Anything else is an :class:`~radixkv.errors.InputError`, checked before
the first byte moves.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Sequence

import torch

from radixkv import native
from radixkv.errors import ConfigError, InputError
from radixkv.forksafe import ForkSafeExecutor, run_shared
from radixkv.spans import copy_conflict

__all__ = ["HostCopier", "default_copy_threads", "streaming_copy_available"]

_MiB = 1 << 20
# Work is cut into pieces of at most this many bytes, so one huge pair still spreads over threads
# and a parked thread (a loaded machine) leaves little behind for the others.
_PIECE_BYTES = 4 * _MiB
_memmove = ctypes.memmove
# Pieces below this stay on memmove even in a streaming batch: each streaming call ends with a fence,
# and a small piece's partial lines gain nothing (measured: 256 B pairs 25% slower streamed, 4 KiB
# even, 64 KiB 15% faster).
_STREAM_MIN_PAIR_BYTES = 64 << 10
_CopyFn = Callable[[int, int, int], object]
_stream_copy: _CopyFn | None = native.stream_copy


def streaming_copy_available() -> bool:
    """Whether big batches use streaming stores (the C helper was built and is not switched off:
    :mod:`radixkv.native`)."""
    return _stream_copy is not None


def default_copy_threads() -> int:
    """One per CPU, at most 4 (memory bandwidth, not cores, bounds a copy beyond that)."""
    return max(1, min(4, os.cpu_count() or 1))


class HostCopier:
    """Copies batches of (destination, source) byte tensors on up to ``threads`` threads (the calling
    thread included). Batches below ``parallel_min_bytes`` run on the calling thread only: waking a
    helper costs ~50-100 us, more than it saves on a few MiB. Batches of at least
    ``streaming_min_bytes`` use streaming stores where available (None: never). Thread-safe;
    :meth:`close` when done."""

    def __init__(self, threads: int | None = None, parallel_min_bytes: int = 4 * _MiB,
                 streaming_min_bytes: int | None = 8 * _MiB) -> None:
        threads = default_copy_threads() if threads is None else threads
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ConfigError(f"copy threads={threads!r} must be a positive integer (1 = no helper threads)")
        if not isinstance(parallel_min_bytes, int) or parallel_min_bytes < 0:
            raise ConfigError(f"parallel_min_bytes={parallel_min_bytes!r} must be a non-negative integer (bytes)")
        if streaming_min_bytes is not None and (
                not isinstance(streaming_min_bytes, int) or streaming_min_bytes < 0):
            raise ConfigError(f"streaming_min_bytes={streaming_min_bytes!r} must be a non-negative integer "
                              "(bytes) or None (never use streaming stores)")
        self.threads = threads
        self.parallel_min_bytes = parallel_min_bytes
        self.streaming_min_bytes = streaming_min_bytes
        # Started on the first parallel batch (a tier that only sees small ones never starts threads);
        # fork-safe, so a copier built before an engine forks still works in the children.
        self._pool = ForkSafeExecutor(threads - 1, thread_name_prefix="radixkv-copy") if threads > 1 else None

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> int:
        """Copy ``srcs[i]`` into ``dsts[i]`` for every i; returns the bytes copied."""
        if len(dsts) != len(srcs):
            raise InputError(f"{len(dsts)} destinations but {len(srcs)} sources; pass one source per destination")
        jobs: list[tuple[int, int, int]] = []
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            n = _nbytes(d, "destination", i)
            if _nbytes(s, "source", i) != n:
                raise InputError(
                    f"pair {i}: destination has {n} bytes, source {s.numel() * s.element_size()}; "
                    "copy buffers of equal size"
                )
            if n:
                jobs.append((d.data_ptr(), s.data_ptr(), n))
        return self.copy_spans(jobs)

    def copy_spans(self, jobs: Sequence[tuple[int, int, int]], checked: bool = False) -> int:
        """Copy raw spans ``(destination address, source address, nbytes)``; returns the bytes
        copied. For callers that already hold validated tensors (a tier copying parts of a chunk into
        its own slots): the caller vouches that every span is CPU memory it keeps alive until this
        returns. Overlaps are refused (InputError) before the first byte moves, unless ``checked``:
        the caller has proved that no destination overlaps another destination or any source. A
        negative length is an InputError, checked or not."""
        total = 0
        for _d, _s, n in jobs:
            if n < 0:  # ctypes would pass it on as a size_t near 2**64: a copy over all of memory
                raise InputError(f"a span of {n} bytes; span lengths are byte counts >= 0")
            total += n
        if not checked:
            _check_disjoint(jobs)
        # Streaming stores are safe here: no destination overlaps a source (checked above, or vouched).
        # They pay off for big batches of big pieces; small pairs (a fence each, partial lines) stay
        # on memmove.
        stream = self.streaming_min_bytes
        fast: _CopyFn = (_stream_copy if _stream_copy is not None and stream is not None and total >= stream
                         else _memmove)
        k = min(self.threads, -(-total // _PIECE_BYTES)) if total >= self.parallel_min_bytes else 1
        if k <= 1:
            for dst, src, n in jobs:
                (fast if n >= _STREAM_MIN_PAIR_BYTES else _memmove)(dst, src, n)
            return total
        pieces = [(dst + off, src + off, min(_PIECE_BYTES, n - off))
                  for dst, src, n in jobs for off in range(0, n, _PIECE_BYTES)]

        def move(i: int) -> None:
            dst, src, n = pieces[i]
            (fast if n >= _STREAM_MIN_PAIR_BYTES else _memmove)(dst, src, n)

        run_shared(self._pool, k, len(pieces), move)
        return total

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _check_disjoint(jobs: Sequence[tuple[int, int, int]]) -> None:
    """No destination may overlap another destination or any source: the bytes would depend on the
    order the threads' pieces run in. (Sources may overlap each other: reads do not conflict.)"""
    if len(jobs) == 1:
        d, s_, n = jobs[0]
        if d < s_ + n and s_ < d + n:
            raise InputError("pair 0: destination and source overlap; copy between separate buffers")
        return
    conflict = copy_conflict([(d, d + n) for d, _s, n in jobs], [(s_, s_ + n) for _d, s_, n in jobs])
    if conflict == "destinations":
        raise InputError("two destinations overlap; every pair needs its own destination bytes")
    if conflict == "source":
        raise InputError("a source overlaps a destination; copy between separate buffers")


def _nbytes(t: object, what: str, i: int) -> int:
    # is_cpu / nbytes: ~0.9 us less per tensor than device.type and numel() * element_size(), which
    # adds up over the hundreds of chunks a batch copies
    if not isinstance(t, torch.Tensor) or not t.is_cpu or not t.is_contiguous():
        desc = f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else (
            f"a tensor on {t.device}, contiguous={t.is_contiguous()}")
        raise InputError(f"{what} {i} is {desc}; pass contiguous CPU tensors")
    if t.is_conj() or t.is_neg():
        # a lazy conjugate / negative view: its storage holds the untransformed values, which a byte
        # copy would move as they are (wrong values in the destination, or read back through it)
        lazy = "conjugate" if t.is_conj() else "negative"
        fix = ".resolve_conj()" if t.is_conj() else ".resolve_neg()"
        raise InputError(f"{what} {i} is a lazy {lazy} view (its bytes are not its values); "
                         f"pass t{fix} instead")
    return t.nbytes
