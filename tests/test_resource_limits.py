"""A process out of threads: every call still does its work once, or fails, and nothing runs later.

Python reports a process at its thread limit (``RLIMIT_NPROC``, a cgroup's ``pids.max``, no room for
a stack) as ``RuntimeError: can't start new thread`` from ``Thread.start``. Root ignores
``RLIMIT_NPROC``, so these tests make ``Thread.start`` fail for radixkv's threads instead.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from radixkv.forksafe import ForkSafeExecutor
from radixkv.hostcopy import HostCopier
from radixkv.tiers.disk import DiskTier

MiB = 1 << 20
NS = "ns"


class ThreadLimit:
    """While ``on``, starting a thread whose name begins with ``radixkv`` (or ``prefix``) fails as
    at the process's thread limit; ``failed`` counts the refusals."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prefix: str = "radixkv") -> None:
        self.on = False
        self.failed = 0
        start = threading.Thread.start

        def limited(thread: threading.Thread) -> None:
            if self.on and thread.name.startswith(prefix):
                self.failed += 1
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", limited)


def test_a_call_whose_thread_cannot_start_runs_once_on_the_caller(monkeypatch):
    """ThreadPoolExecutor queues a call before starting its thread; when the start failed, the call
    stayed queued and the next thread started (once threads were available again) ran it: work the
    caller had been told failed, done long after it moved on."""
    limit = ThreadLimit(monkeypatch, prefix="rk-test")
    ex = ForkSafeExecutor(2, thread_name_prefix="rk-test")
    ran: list[str] = []
    try:
        limit.on = True
        assert ex.submit(ran.append, "refused").result(timeout=10) is None  # done on this thread
        assert limit.failed == 1 and ran == ["refused"]
        limit.on = False
        assert ex.submit(ran.append, "later").result(timeout=10) is None
        time.sleep(0.1)
        assert ran == ["refused", "later"], "the refused call ran a second time"
    finally:
        ex.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(ran.append, "closed")


def test_a_call_a_busy_thread_took_while_the_start_failed_is_waited_for_not_repeated(monkeypatch):
    """The pool's start can fail after one of its running threads already took the queued call:
    the submitter must wait for that run (its Future), not run the call again or give up on it."""
    ex = ForkSafeExecutor(2, thread_name_prefix="rk-test")
    ran: list[str] = []
    release = threading.Event()
    helper: list[threading.Thread] = []

    class TakenThenRefused:
        def submit(self, fn, *args, **kwargs):
            helper.append(threading.Thread(target=fn, args=args, kwargs=kwargs))
            helper[0].start()  # a busy pool thread that just became free takes the call...
            time.sleep(0.05)
            raise RuntimeError("can't start new thread")  # ...while the start for it fails

    monkeypatch.setattr(ex, "_executor", lambda: TakenThenRefused())

    def call(tag: str) -> str:
        release.wait(10)
        ran.append(tag)
        return tag

    future = ex.submit(call, "once")
    assert not future.done()  # running on the pool's thread, not redone here
    release.set()
    assert future.result(timeout=10) == "once"
    helper[0].join(10)
    assert ran == ["once"]


def test_a_copy_whose_helper_cannot_start_never_writes_later(monkeypatch):
    """A copy's helper that could not start made the copy raise; the queued helper then ran on the
    next copy's thread and wrote the old source into a destination its caller had reused (a memory
    tier's slot freed by the failed put and given to another chunk)."""
    limit = ThreadLimit(monkeypatch)
    copier = HostCopier(threads=2, parallel_min_bytes=0, streaming_min_bytes=None)
    src = torch.full((8 * MiB,), 1, dtype=torch.uint8)
    dst = torch.zeros(8 * MiB, dtype=torch.uint8)
    try:
        limit.on = True
        assert copier.copy([dst], [src]) == 8 * MiB  # done by the calling thread alone
        assert limit.failed >= 1 and torch.equal(dst, src)
        limit.on = False
        dst.zero_()  # the caller reuses its buffer
        other = torch.zeros(8 * MiB, dtype=torch.uint8)
        copier.copy([other], [torch.full((8 * MiB,), 3, dtype=torch.uint8)])
        time.sleep(0.1)
        assert int(dst.count_nonzero()) == 0, "a refused helper copied into the buffer later"
    finally:
        copier.close()


def test_an_overlapped_read_whose_helper_cannot_start_is_a_hit_and_nothing_reads_later(tmp_path, monkeypatch):
    """The overlapped read's helper that could not start made the get raise; the queued read later
    ran into the caller's buffer, through a descriptor number the tier had closed meanwhile."""
    limit = ThreadLimit(monkeypatch)
    tier = DiskTier(root=str(tmp_path / "d"), capacity_bytes=8 * MiB, overlap_min_bytes=1, io_threads=2)
    payload = torch.full((MiB,), 5, dtype=torch.uint8)
    try:
        limit.on = True  # the put's helper is refused too: it writes on the calling thread
        assert tier.put_many(NS, ["a"], [payload]) == [True]
        out = torch.zeros(MiB, dtype=torch.uint8)
        assert tier.get_many(NS, ["a"], [out]) == [True]
        assert torch.equal(out, payload) and limit.failed >= 2
        limit.on = False
        out.zero_()  # a buffer the engine reuses
        assert tier.get_many(NS, ["a"], [torch.zeros(MiB, dtype=torch.uint8)]) == [True]
        time.sleep(0.1)
        assert int(out.count_nonzero()) == 0, "a refused read wrote into the buffer later"
        tier.check_integrity()
    finally:
        tier.close()


@pytest.mark.parametrize("refused", range(4), ids=lambda i: f"start{i}")
def test_a_store_whose_thread_cannot_start_raises_and_leaves_nothing_running(tmp_path, monkeypatch, refused):
    """Its four pool threads (two writers, two prefetchers) start in turn; when one could not, the
    constructor raised with the threads already started left waiting (until the garbage collector
    found their pool) and the tiers it had opened left open."""
    from radixkv.config import StoreConfig, TierConfig
    from radixkv.store import HierarchicalStore
    from radixkv.tiers.memory import MemoryTier

    closed: list[str] = []
    for cls in (MemoryTier, DiskTier):
        monkeypatch.setattr(cls, "close", lambda t, _close=cls.close: (closed.append(t.name), _close(t))[1])
    config = StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=MiB), TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=MiB)],
        io_threads=2, prefetch_threads=2,
    )
    before = set(threading.enumerate())
    fds_before = len(os.listdir("/proc/self/fd"))
    start, starts = threading.Thread.start, [0]

    def limited(thread: threading.Thread) -> None:
        if thread.name.startswith("radixkv"):
            starts[0] += 1
            if starts[0] == refused + 1:
                raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        HierarchicalStore(config)
    assert [t.name for t in set(threading.enumerate()) - before] == []
    assert sorted(closed) == ["disk", "mem"]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    store = HierarchicalStore(config)  # the next try, with threads to spare, works
    try:
        assert store.put(_ns(), ["k"], [torch.ones(4096, dtype=torch.uint8)]) == [True]
        store.check_integrity()
    finally:
        store.close()


def _ns():
    from radixkv.keys import Namespace

    return Namespace(model="m", dtype="bfloat16", layout="page_first", chunk_tokens=16)
