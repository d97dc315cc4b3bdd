"""Tiers forked while in use (engines fork their workers while other threads still serve requests).

Found by the fourth race hunt:

* A thread inside a tier's critical section at the moment of ``os.fork()`` left the child a copy of
  the tier's lock that nobody would ever release: the child hung on its first call to the tier.
* A forked child named its recycled disk files like its parent (``.spare/<seq>.spare`` from the same
  counter): the child's recycling renamed its file over the parent's spare, whose recorded size then
  lied; the parent's next put overwrote it in place without truncating, and the chunk it committed
  read back as corrupt (a miss, and quarantined) -- the child corrupted the parent's tier.
"""

from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch

from fork_helpers import in_child, numpy_bytes, same_bytes
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.memory import MemoryTier
from radixkv.tiers.redis_accounting import ByteLedger

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

KiB = 1 << 10


def _bytes(value: int, n: int = 4 * KiB) -> torch.Tensor:
    return numpy_bytes(value, n)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_fork_while_another_thread_holds_the_tier_lock(kind, tmp_path):
    """Interleaving: thread T is inside put_many's critical section (memory: _alloc; disk:
    _reserve_locked, both under tier._lock); the main thread forks. The child's copy of the lock is
    held by a thread that does not exist there: its first call to the tier must still finish."""
    if kind == "disk":
        tier = DiskTier(root=str(tmp_path / "d"), capacity_bytes=16 << 20, io_threads=1)
        hook = "_reserve_locked"
    else:
        tier = MemoryTier(capacity_bytes=16 << 20, unit_bytes=64 * KiB, slab_target_bytes=256 * KiB,
                          copy_threads=1, prefault=False, huge_pages=False)
        hook = "_alloc"
    keys = [f"k{i}" for i in range(4)]
    data = [_bytes(i) for i in range(4)]
    assert tier.put_many("ns", keys, data) == [True] * 4
    inside, release = threading.Event(), threading.Event()
    real = getattr(tier, hook)

    def blocking(*args, **kwargs):
        if threading.current_thread().name == "racer":
            inside.set()
            release.wait(10)
        return real(*args, **kwargs)

    setattr(tier, hook, blocking)
    racer = threading.Thread(target=lambda: tier.put_many("ns", ["late"], [_bytes(9)]), name="racer")
    racer.start()
    try:
        assert inside.wait(10)
        # T leaves its critical section on its own a little later (a fork may wait for that).
        timer = threading.Timer(0.5, release.set)
        timer.start()

        def child() -> bool:
            got = [_bytes(0) for _ in keys]
            return (tier.get_many("ns", keys, got) == [True] * 4 and same_bytes(got, data)
                    and tier.put_many("ns", ["c0"], [_bytes(77)]) == [True]
                    and tier.delete_many("ns", ["c0"]) == 1)  # the disk directory is the parent's too

        in_child(child, deadline_s=20.0)
    finally:
        release.set()
        racer.join(10)
        setattr(tier, hook, real)
    got = [_bytes(0) for _ in keys]
    assert tier.get_many("ns", keys, got) == [True] * 4 and same_bytes(got, data)
    tier.check_integrity()
    tier.clear()
    tier.close()


def test_forked_child_recycling_never_corrupts_the_parents_spares(tmp_path):
    """Interleaving: fork; the parent deletes chunk A (its file becomes .spare/1.spare, recorded at
    A's size); the child puts and deletes its own chunk B of another size (its file was renamed to
    .spare/1.spare too, over the parent's). The parent's next put overwrote that file in place at
    A's recorded size and committed a file of B's size: a corrupt chunk (a miss, quarantined)."""
    root = str(tmp_path / "d")
    tier = DiskTier(root=root, capacity_bytes=16 << 20, io_threads=1)
    try:
        assert tier.put_many("small", ["a"], [_bytes(1, 4 * KiB)]) == [True]
        parent_recycled_r, parent_recycled_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: wait for the parent's recycling, then recycle a file of its own
            code = 1
            try:
                os.close(parent_recycled_w)
                os.read(parent_recycled_r, 1)
                ok = tier.put_many("big", ["b"], [_bytes(2, 64 * KiB)]) == [True]
                code = 0 if ok and tier.delete_many("big", ["b"]) == 1 else 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(parent_recycled_r)
        assert tier.delete_many("small", ["a"]) == 1  # recycled into a spare file
        os.write(parent_recycled_w, b"x")
        os.close(parent_recycled_w)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert tier.put_many("small", ["c"], [_bytes(3, 4 * KiB)]) == [True]
        out = _bytes(0, 4 * KiB)
        assert tier.get_many("small", ["c"], [out]) == [True]
        assert same_bytes([out], [_bytes(3, 4 * KiB)])
        tier.check_integrity()
    finally:
        tier.close()


def test_forked_child_drops_the_memory_slots_of_the_parents_puts_in_flight():
    """Found by a fifth race hunt. Interleaving: thread T's put reserved a slot (and fixed the slot
    size of its new namespace) and is copying into it, outside the lock; the main thread forks. T
    does not exist in the child, so its put never publishes or frees the slot there: the child's
    tier kept the slot used (lost capacity) and the namespace's slot size fixed forever."""
    tier = MemoryTier(capacity_bytes=16 << 20, unit_bytes=64 * KiB, slab_target_bytes=256 * KiB,
                      copy_threads=1, prefault=False, huge_pages=False)
    keys = [f"k{i}" for i in range(4)]
    data = [_bytes(i) for i in range(4)]
    assert tier.put_many("ns", keys, data) == [True] * 4
    published_bytes = tier.usage_bytes()
    copying, release = threading.Event(), threading.Event()
    real = tier._copier.copy_spans

    def blocking(*args, **kwargs):
        if threading.current_thread().name == "racer":
            copying.set()
            release.wait(10)
        return real(*args, **kwargs)

    tier._copier.copy_spans = blocking
    racer = threading.Thread(target=lambda: tier.put_many("late", ["x"], [_bytes(9, 8 * KiB)]),
                             name="racer")
    racer.start()
    try:
        assert copying.wait(10)
        assert tier.usage_bytes() == published_bytes + 8 * KiB  # T's slot is reserved

        def child() -> bool:
            tier.check_integrity()
            assert tier.usage_bytes() == published_bytes, "the parent's put in flight kept its slot"
            # Nothing of "late" is held: a chunk of another size is a put, not an InputError.
            assert tier.put_many("late", ["y"], [_bytes(5, 2 * KiB)]) == [True]
            tier.check_integrity()
            got = [_bytes(0) for _ in keys]
            return tier.get_many("ns", keys, got) == [True] * 4 and same_bytes(got, data)

        in_child(child, deadline_s=20.0)
    finally:
        release.set()
        racer.join(10)
        tier._copier.copy_spans = real
    got = [_bytes(0, 8 * KiB)]
    assert tier.get_many("late", ["x"], got) == [True] and same_bytes(got, [_bytes(9, 8 * KiB)])
    assert tier.usage_bytes() == published_bytes + 8 * KiB
    tier.check_integrity()
    tier.close()


def test_forked_child_drops_the_redis_ledgers_reservations_of_the_parents_puts_in_flight():
    """The Redis tier's byte ledger had the memory tier's problem above: a put reserves its bytes
    (and now counts itself in flight per key) before its SETs and settles after them; forked in
    between, the child kept that reservation forever (its SETs run on a thread the child lacks)."""
    ledger = ByteLedger(capacity_bytes=100, ttl_s=None)
    assert ledger.reserve("ns", ["a"], [30]) == [True]
    ledger.settle("ns", ["a"], [30], [True], [True])  # settled: the child keeps it
    assert ledger.reserve("ns", ["b", "c"], [40, 30]) == [True, True]  # in flight at the fork

    def child() -> bool:
        ledger.check_integrity()
        assert ledger.used_bytes() == 30
        # The room of the parent's puts in flight is free again in the child.
        assert ledger.reserve("ns", ["d"], [70]) == [True]
        ledger.settle("ns", ["d"], [70], [True], [True])
        ledger.check_integrity()
        return ledger.used_bytes() == 100

    in_child(child, deadline_s=20.0)
    # The parent's puts settle as usual.
    ledger.settle("ns", ["b", "c"], [40, 30], [True, True], [True, True])
    ledger.check_integrity()
    assert ledger.used_bytes() == 100


def test_a_forked_child_does_not_keep_its_parents_root_locked(tmp_path):
    """Found by an audit: the root lock (an flock) went with the open file, which a forked child
    shares: a helper child that never touched the tier kept the root locked after its parent closed
    the tier or was killed, so a restarted engine failed at start. The child now drops its copy,
    close() unlocks explicitly, and a child may open its parent's root afresh (docs/store.md)."""
    import subprocess
    import sys

    root = str(tmp_path / "disk")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
from radixkv.tiers.disk import DiskTier
t = DiskTier(root={root!r}, capacity_bytes=1 << 20)
if os.fork() == 0:  # a helper child that never uses the tier, and outlives its parent
    time.sleep(600)
    os._exit(0)
print("up", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        holder.kill()  # the holder dies; its helper child lives on
        holder.wait()
        t = DiskTier(root=root, capacity_bytes=1 << 20)  # the root is free again
        t.close()
    finally:
        os.killpg(holder.pid, 9)  # the helper child too

    parent = DiskTier(root=root, capacity_bytes=1 << 20)
    assert parent.put_many("ns", ["a"], [_bytes(1)]) == [True]

    def child_opens_the_root_afresh() -> bool:
        t = DiskTier(root=root, capacity_bytes=1 << 20)  # under the parent's lock
        ok = t.contains_many("ns", ["a"]) == 1
        t.close()
        return ok

    in_child(child_opens_the_root_afresh)
    pid = os.fork()
    if pid == 0:  # a helper child holding its copy while the parent closes and reopens
        import time

        time.sleep(30)
        os._exit(0)
    try:
        parent.close()
        again = DiskTier(root=root, capacity_bytes=1 << 20)
        again.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_store_opened_in_a_forked_child_does_not_hang_in_its_memory_tier():
    """Found by an audit: a memory tier prefaulted its buffer with torch's parallel zero_, which
    hangs in a fork child whose parent started torch's OpenMP pool (docs/store.md advises opening a
    new store in the child). In a child the buffer is prefaulted with one libc memset."""
    parent = MemoryTier(capacity_bytes=64 << 20)  # its zero_ starts torch's OpenMP pool here
    torch.zeros(1 << 24, dtype=torch.uint8).fill_(1)  # and a parallel kernel, surely

    def child_opens_a_memory_tier() -> bool:
        t = MemoryTier(capacity_bytes=64 << 20)
        ok = t.put_many("ns", ["a"], [_bytes(3)]) == [True]
        out = [torch.empty(4 * KiB, dtype=torch.uint8)]
        ok = ok and t.get_many("ns", ["a"], out) == [True] and same_bytes(out, [_bytes(3)])
        t.close()
        return ok

    in_child(child_opens_a_memory_tier, deadline_s=60)
    parent.close()
