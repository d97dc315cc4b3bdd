"""Tiers and pools built before a fork keep working in the child (engines fork their workers).

A forked child inherits objects but no threads: a plain ThreadPoolExecutor built in the parent queues
the child's work forever. Each test uses a pool or tier in the parent (so its threads exist), forks,
uses it again in the child and requires the child to finish, correctly, within a deadline.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from fork_helpers import in_child, numpy_bytes, same_bytes
from radixkv.background import WorkerPool
from radixkv.forksafe import ForkSafeExecutor
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.memory import MemoryTier

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

MiB = 1 << 20


def _bytes(value: int) -> torch.Tensor:
    return numpy_bytes(value, MiB)


def test_executor_used_before_fork_runs_in_the_child():
    ex = ForkSafeExecutor(2, thread_name_prefix="t")
    try:
        assert ex.submit(lambda: 41 + 1).result(timeout=10) == 42
        in_child(lambda: ex.submit(lambda: os.getpid()).result(timeout=10) == os.getpid())
        assert ex.submit(lambda: 7).result(timeout=10) == 7  # the parent's pool is untouched
    finally:
        ex.shutdown()


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_tier_used_before_fork_serves_the_child(kind, tmp_path):
    if kind == "disk":
        tier = DiskTier(root=str(tmp_path / "d"), capacity_bytes=64 * MiB, io_threads=2)
    else:
        tier = MemoryTier(capacity_bytes=64 * MiB, copy_threads=2)  # batches of 8 MiB: parallel copies
    try:
        keys = [f"k{i}" for i in range(8)]
        data = [_bytes(i) for i in range(8)]
        assert tier.put_many("ns", keys, data) == [True] * 8
        outs = [_bytes(0) for _ in keys]
        assert tier.get_many("ns", keys, outs) == [True] * 8  # the parent's threads now exist

        def child() -> bool:
            got = [_bytes(0) for _ in keys]
            more = [_bytes(100 + i) for i in range(8)]
            return (tier.get_many("ns", keys, got) == [True] * 8 and same_bytes(got, data)
                    and tier.put_many("ns", [f"c{i}" for i in range(8)], more) == [True] * 8)

        in_child(child)
        assert tier.get_many("ns", keys, outs) == [True] * 8 and same_bytes(outs, data)
    finally:
        tier.close()


def test_worker_pool_used_before_fork_runs_the_childs_jobs():
    pool = WorkerPool("t", n_threads=2, max_queue=8)
    try:
        assert pool.submit(lambda job: 1, 0).wait(10) == 1

        def child() -> bool:
            jobs = [pool.submit(lambda job, i=i: i * i, -1) for i in range(5)]
            ok = [j.wait(10) for j in jobs] == [0, 1, 4, 9, 16] and pool.drain(10)
            return ok and pool.close(flush=True, timeout_s=10)

        in_child(child)
        assert pool.submit(lambda job: 2, 0).wait(10) == 2
    finally:
        pool.close(flush=False, timeout_s=10)


def test_run_shared_waits_for_started_helpers_when_a_later_submit_fails():
    # Found by a review: helpers were submitted outside the try/finally, so when a later submit
    # failed (the pool shut down by a concurrent close), the call raised while an earlier helper was
    # still writing into the caller's buffers.
    import threading

    from radixkv.forksafe import run_shared

    done: list[int] = []
    started = threading.Event()

    ex = ForkSafeExecutor(1, "test-run-shared")

    class Pool:
        calls = 0

        def submit(self, fn):
            Pool.calls += 1
            if Pool.calls > 1:
                raise RuntimeError("pool is shut down")
            return ex.submit(fn)

    def item(i: int) -> int:
        started.set()
        time.sleep(0.05)
        done.append(i)
        return i

    with pytest.raises(RuntimeError, match="shut down"):
        run_shared(Pool(), 3, 8, item)
    n = len(done)
    time.sleep(0.3)
    assert len(done) == n, "a helper kept working after run_shared returned"
    ex.shutdown(wait=True)
