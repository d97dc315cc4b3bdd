"""clear() as a barrier for copies between tiers: after it returns, no tier holds bytes of the
namespace read before it, so a later put of *other* bytes under the same keys (new weights served
under the same model name; tiers dedupe puts by key) is what every tier serves.

Each test holds a background copy (write-through, promotion) or a clear at the point where the old
code let pre-clear bytes through; the first four were found by reviews of the change.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from store_helpers import buffers, chain, new_namespace, payload_for

def _clear_waits_for(store, blocked_tier, start_copy, monkeypatch) -> None:
    """Block ``blocked_tier``'s next put (a copy between tiers that read its bytes already), start
    the copy, clear() the namespace in a thread: the clear must wait for the copy to land (and find
    its chunk gone) before it wipes the tiers."""
    real_put = blocked_tier.put_many
    inside, release = threading.Event(), threading.Event()

    def blocked_put(*a, **k):
        if threading.current_thread() is threading.main_thread():
            return real_put(*a, **k)  # the test's own puts: only the background copy is held
        inside.set()
        release.wait(10)
        return real_put(*a, **k)

    monkeypatch.setattr(blocked_tier, "put_many", blocked_put)
    ns = start_copy()
    assert inside.wait(10), "the copy never reached the tier"
    th = threading.Thread(target=store.clear, args=(ns,))
    th.start()
    time.sleep(0.3)
    assert th.is_alive(), "clear() returned while a copy holding pre-clear bytes was in flight"
    release.set()
    th.join(10)
    assert not th.is_alive()
    monkeypatch.undo()


@pytest.mark.parametrize("copy", ["write_through", "promotion"])
def test_clear_waits_for_copies_that_read_before_it(make_store, monkeypatch, copy):
    # Known limit of stop 15, fixed: a copy between tiers (write-through, promotion, demotion) that
    # read a chunk's bytes before clear() could write them after the clear wiped the tier. Tiers
    # dedupe by key, so a later put of *other* bytes under that key (new weights, same namespace)
    # kept the old ones there, and reads from that tier served them.
    store = make_store("mem-disk", write_policy="write_through", promote_after_hits=1)
    ns = new_namespace()
    _, keys = chain(99, 1)
    old = payload_for(keys[0])
    new = old ^ 0xFF
    mem, disk = store.tiers

    def start_write_through():
        assert store.put(ns, keys, [old]) == [True]  # queues the copy mem -> disk
        return ns

    def start_promotion():
        assert store.put(ns, keys, [old]) == [True]
        store.flush(30)
        mem.clear(ns.digest)  # memory lost it: the next get is served by the disk
        assert store.reconcile() == 1
        got = buffers(1)
        assert store.get(ns, keys, got) == 1  # queues the promotion disk -> mem with these bytes
        return ns

    if copy == "write_through":
        _clear_waits_for(store, disk, start_write_through, monkeypatch)
    else:
        _clear_waits_for(store, mem, start_promotion, monkeypatch)
    store.flush(30)
    assert store.lookup(ns, keys) == 0
    for t in store.tiers:  # nothing of the cleared namespace is left in any tier
        assert t.contains_many(ns.digest, keys) == 0, t.name
    assert store.put(ns, keys, [new]) == [True]
    store.flush(30)
    got = buffers(1)
    assert store.get(ns, keys, got) == 1 and torch.equal(got[0], new)
    mem.clear(ns.digest)
    store.reconcile()
    got = buffers(1)
    assert store.get(ns, keys, got) == 1 and torch.equal(got[0], new)  # from the disk: new bytes
    store.check_integrity()


def test_write_through_copy_registered_after_clear_began_lands_old_bytes(make_store, monkeypatch):
    # write_through checks masks under the lock, releases it, then copy() registers its token in a
    # second locked step. A clear in between is not waited for; the copy still reads the source tier
    # (not wiped yet) and lands the pre-clear bytes after the wipe. A put after the clear reuses the
    # node id, so write()'s alive check passes and the tree trusts the old bytes in the disk tier.
    store = make_store("mem-disk", write_policy="write_through", io_threads=1)
    s = store._stack
    ns = new_namespace()
    _, keys = chain(77, 1)
    old = payload_for(keys[0])
    new = old ^ 0xFF
    mem, disk = store.tiers

    at_copy, go_copy = threading.Event(), threading.Event()
    in_wipe, go_wipe = threading.Event(), threading.Event()
    in_put, go_put = threading.Event(), threading.Event()
    real_copy, real_mem_clear, real_disk_put = s.copy, mem.clear, disk.put_many
    calls = {"copy": 0, "put": 0}

    def copy(*a, **k):  # the gap between write_through's mask check and copy()'s token
        calls["copy"] += 1
        if calls["copy"] == 1:
            at_copy.set()
            go_copy.wait(10)
        return real_copy(*a, **k)

    def mem_clear(*a, **k):  # the wipe, after clear()'s wait (a Redis SCAN takes seconds)
        in_wipe.set()
        go_wipe.wait(10)
        return real_mem_clear(*a, **k)

    def disk_put(*a, **k):  # the copy read its bytes already; its put is slow
        calls["put"] += 1
        if calls["put"] == 1:
            in_put.set()
            go_put.wait(10)
        return real_disk_put(*a, **k)

    monkeypatch.setattr(s, "copy", copy)
    monkeypatch.setattr(mem, "clear", mem_clear)
    monkeypatch.setattr(disk, "put_many", disk_put)

    assert store.put(ns, keys, [old]) == [True]
    assert at_copy.wait(10)
    th = threading.Thread(target=store.clear, args=(ns,))
    th.start()
    assert in_wipe.wait(10)  # clear() is past its wait: it waited for nothing
    go_copy.set()  # the copy registers now (token after the clear's limit) and reads mem: old bytes
    in_put.wait(2)  # (with a fix the copy finds its chunk gone and puts nothing)
    go_wipe.set()
    th.join(10)
    assert not th.is_alive()
    assert store.put(ns, keys, [new]) == [True]  # same key, reuses the node id
    go_put.set()  # the old bytes land in the disk tier; the node is "alive": resident
    store.flush(30)
    monkeypatch.undo()
    mem.clear(ns.digest)
    store.reconcile()
    got = buffers(1)
    assert store.get(ns, keys, got) == 1
    assert torch.equal(got[0], new), "disk served the bytes of before the clear"


def test_promotion_snapshot_taken_after_the_read(make_store, monkeypatch):
    # Promoter.promote() snapshots the clear counters after get() read the bytes. A clear between
    # the read and the snapshot (then a put of new bytes reusing the node id, which memory evicts)
    # is invisible to the promotion: it writes the pre-clear bytes into memory as resident.
    import radixkv.store_jobs as jobs

    store = make_store("mem-disk", write_policy="write_through", promote_after_hits=1,
                       chunks={"mem": 1})
    ns, other = new_namespace(), new_namespace()
    _, keys = chain(78, 1)
    _, okeys = chain(79, 1)
    old = payload_for(keys[0])
    new = old ^ 0xFF
    mem, disk = store.tiers
    assert store.put(ns, keys, [old]) == [True]
    store.flush(30)
    assert store.put(other, okeys, [payload_for(okeys[0])]) == [True]  # evicts keys[0] from mem
    store.flush(30)

    in_acc, go_acc = threading.Event(), threading.Event()
    real_account = jobs.account

    def account(*a, **k):  # get() has read the bytes; promote() not called yet
        if not in_acc.is_set():
            in_acc.set()
            go_acc.wait(10)
        return real_account(*a, **k)

    monkeypatch.setattr(jobs, "account", account)
    got_old = buffers(1)
    g = threading.Thread(target=store.get, args=(ns, keys, got_old))
    g.start()
    assert in_acc.wait(10)
    store.clear(ns)  # nothing to wait for
    assert store.put(ns, keys, [new]) == [True]  # reuses the node id
    store.flush(30)
    assert store.put(other, okeys, [payload_for(okeys[0])]) == [True]
    assert store.put(other, chain(80, 1)[1], [payload_for(chain(80, 1)[1][0])]) == [True]  # evicts it
    store.flush(30)
    go_acc.set()
    g.join(10)
    store.flush(30)
    monkeypatch.undo()
    got = buffers(1)
    assert store.get(ns, keys, got) == 1
    assert torch.equal(got[0], new), "served the bytes of before the clear"


def test_clear_in_a_child_forked_during_a_copy(make_store, monkeypatch):
    # A child forked while a background copy is in flight inherits its token in _copies, but not the
    # thread that would end it: clear() in the child waits forever (cond.wait() has no timeout).
    store = make_store("mem-disk", write_policy="write_through")
    ns = new_namespace()
    _, keys = chain(81, 1)
    mem, disk = store.tiers
    inside, release = threading.Event(), threading.Event()
    real_put = disk.put_many

    def blocked_put(*a, **k):
        inside.set()
        release.wait(10)
        return real_put(*a, **k)

    monkeypatch.setattr(disk, "put_many", blocked_put)
    assert store.put(ns, keys, [payload_for(keys[0])]) == [True]
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            store.clear(ns)
            code = 0
        finally:
            os._exit(code)
    try:
        end = time.monotonic() + 5
        status = None
        while time.monotonic() < end:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            time.sleep(0.05)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0, "clear() hung in the child"
    finally:
        release.set()
        store.flush(10)
