"""Eviction racing other writers, and delete() of chunks the store does not track.

Each test holds one tier call open (a slow copy, a slow unlink) with events, so the window a real
machine opens only now and then is open every time. All three failed on the code before their fix.
"""

from __future__ import annotations

import threading

import torch

from radixkv import intents
from radixkv.config import StoreConfig, TierConfig
from radixkv.store import HierarchicalStore
from store_helpers import CHUNK_BYTES, assert_exact, buffers, chain, new_namespace, payload_for


def _put(store: HierarchicalStore, ns, keys: list[str], parent: str | None = None) -> list[bool]:
    return store.put(ns, keys, [payload_for(k) for k in keys], parent_key=parent)


def test_an_eviction_whose_delete_a_concurrent_put_skips_gives_its_room_back():
    # Put A of key X stalls inside the memory tier; put B of X lands; later puts evict X. The
    # eviction must not delete X's bytes under A (it skips them) but must still release the room it
    # reserved for them: before the fix it never did, and the tier shrank for good.
    store = HierarchicalStore(StoreConfig(tiers=[TierConfig(url="mem://", capacity_bytes=6 * CHUNK_BYTES)]))
    try:
        mem = store.tiers[0]
        ns = new_namespace()
        _, x = chain(1, 1)
        gate, entered = threading.Event(), threading.Event()
        put_many = mem.put_many
        stalled = []

        def slow_put(namespace, keys, payloads):
            if not stalled and list(keys) == x:
                stalled.append(True)
                entered.set()
                gate.wait(10)
            return put_many(namespace, keys, payloads)

        mem.put_many = slow_put
        a = threading.Thread(target=_put, args=(store, ns, x))
        a.start()
        assert entered.wait(5)
        assert _put(store, ns, x) == [True]
        for seed in range(2, 8):  # six more single chunks: X, the least recently used, is evicted
            _, k = chain(seed, 1)
            _put(store, ns, k)
        gate.set()
        a.join(10)
        s = store._stack
        with store.lock:
            assert s.reserved == [0], f"room still reserved after every put ended: {s.reserved}"
        for seed in range(100, 110):
            _, k = chain(seed, 1)
            assert _put(store, ns, k) == [True]
        with store.lock:
            assert store.tree.tier_chunks(s.names[0]) == 6  # the whole tier is usable again
        store.check_integrity()
    finally:
        store.close()


def test_a_demoted_chunk_keeps_its_room_until_its_bytes_are_deleted(tmp_path):
    # mem -> diskA -> diskB, write-back. A demotion from diskA to diskB clears its victim from the
    # tree, then deletes its diskA file outside the lock (held open here). A writer meanwhile must
    # not be given the room that file still fills: before the fix it was, diskA went over its
    # capacity and evicted on its own (its LRU, not the tree's leaf-first order), and P, an interior
    # chunk only diskA held, was dropped with its child C.
    frame = CHUNK_BYTES + 200
    tiers = [
        TierConfig(url="mem://", capacity_bytes=3 * CHUNK_BYTES),
        TierConfig(url=f"file://{tmp_path}/a", name="diskA", capacity_bytes=3 * frame),
        TierConfig(url=f"file://{tmp_path}/b", name="diskB", capacity_bytes=20 * frame),
    ]
    store = HierarchicalStore(StoreConfig(tiers=tiers, write_policy="write_back", promote_on_hit=False))
    try:
        ns = new_namespace()
        disk_a = store.tiers[1]
        p, c = chain(1, 2)[1]
        y, z, u, w, q, r, s2 = (chain(seed, 1)[1][0] for seed in (2, 3, 4, 5, 6, 7, 8))
        _put(store, ns, [p, c])
        _put(store, ns, [y])
        _put(store, ns, [z])  # C -> diskA
        _put(store, ns, [u])  # P -> diskA (interior in the tree, only on diskA)
        assert store.get(ns, [p, c], buffers(2)) == 2
        _put(store, ns, [w])  # y -> diskA: diskA is full
        gate, entered = threading.Event(), threading.Event()
        delete_many = disk_a.delete_many

        def slow_delete(namespace, keys):
            if not entered.is_set():
                entered.set()
                gate.wait(10)
            return delete_many(namespace, keys)

        disk_a.delete_many = slow_delete
        t1 = threading.Thread(target=_put, args=(store, ns, [q]))  # demotes a diskA victim to diskB
        t1.start()
        assert entered.wait(5)
        _put(store, ns, [r, s2])  # needs diskA room: must not take the room the held file fills
        gate.set()
        t1.join(10)
        store.flush(10)
        assert disk_a.stats().extra["evictions"] == 0, "diskA evicted on its own: it was overfilled"
        bufs = buffers(2)
        assert store.get(ns, [p, c], bufs) == 2
        assert_exact([p, c], bufs, 2)
        store.check_integrity()
    finally:
        store.close()


def test_a_put_that_outwaits_a_stalled_delete_of_its_key_does_not_count_it_stored(monkeypatch):
    # delete(X) clears X from the tree, then its memory delete stalls (a thread parked between
    # marking the delete and running it). A put of X waits a bounded time for that delete, then
    # goes on: the memory tier still holds X, so the put "stores" it at once. The delete then runs
    # and removes those bytes. Before the fix the put reported [True] and the tree placed X in a
    # tier that lacked it (lookup 1, get 0, check_integrity failed); now a write that outwaited a
    # delete of its key counts as not stored, as one a tier evicted on its own (a miss, books exact).
    monkeypatch.setattr(intents, "_DELETE_WAIT_S", 0.2)  # the bound (5 s), short for the test
    store = HierarchicalStore(StoreConfig(tiers=[TierConfig(url="mem://", capacity_bytes=6 * CHUNK_BYTES)]))
    try:
        mem = store.tiers[0]
        ns = new_namespace()
        _, x = chain(1, 1)
        assert _put(store, ns, x) == [True]
        gate, entered = threading.Event(), threading.Event()
        delete_many = mem.delete_many

        def slow_delete(namespace, keys):
            if not entered.is_set() and list(keys) == x:
                entered.set()
                gate.wait(10)
            return delete_many(namespace, keys)

        mem.delete_many = slow_delete
        d = threading.Thread(target=store.delete, args=(ns, x))
        d.start()
        assert entered.wait(5)
        stored = _put(store, ns, x)  # outwaits the stalled delete
        gate.set()
        d.join(10)
        bufs = buffers(1)
        n = store.get(ns, x, bufs)
        assert stored == [bool(n)], f"put reported {stored} but get then read {n} chunks"
        store.check_integrity()
        assert _put(store, ns, x) == [True]  # nothing stands in the way once the delete ran
        assert store.get(ns, x, bufs) == 1
        assert_exact(x, bufs, 1)
        store.check_integrity()
    finally:
        store.close()


def test_delete_removes_chunks_the_store_has_not_adopted(tmp_path):
    # After a restart the disk tier holds chunks the new store's tree has not adopted yet: delete()
    # must remove them too, or the next get adopts them back (before the fix: 4 chunks served).
    cfg = StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=8 * CHUNK_BYTES),
        TierConfig(url=f"file://{tmp_path}/disk", capacity_bytes=32 * (CHUNK_BYTES + 200)),
    ])
    ns = new_namespace()
    keys = chain(1, 4)[1]
    first = HierarchicalStore(cfg)
    assert _put(first, ns, keys) == [True] * 4
    first.close()
    second = HierarchicalStore(cfg)
    try:
        assert second.delete(ns, keys) == 0  # none tracked yet
        assert second.get(ns, keys, [torch.zeros(CHUNK_BYTES, dtype=torch.uint8) for _ in keys]) == 0
        second.check_integrity()
    finally:
        second.close()
    third = HierarchicalStore(cfg)  # and they are gone from the disk, not just hidden
    try:
        assert third.lookup(ns, keys) == 0
    finally:
        third.close()


def test_delete_removes_untracked_copies_of_a_tracked_chunk(tmp_path):
    # After a restart a write_back store puts a chunk again: the tree places it in memory only, while
    # the disk still holds the copy the first store persisted at close. delete() must remove that
    # copy too, or the next get adopts it back (before the fix: the deleted chunk was served).
    cfg = StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=8 * CHUNK_BYTES),
        TierConfig(url=f"file://{tmp_path}/disk", capacity_bytes=32 * (CHUNK_BYTES + 200)),
    ], write_policy="write_back")
    ns = new_namespace()
    keys = chain(1, 2)[1]
    first = HierarchicalStore(cfg)
    assert _put(first, ns, keys) == [True] * 2
    first.close()  # flushing close: both chunks persisted to the disk
    second = HierarchicalStore(cfg)
    try:
        assert _put(second, ns, keys[:1]) == [True]  # memory only in the tree; disk holds it untracked
        assert second.delete(ns, keys[:1]) == 1
        bufs = buffers(2)
        assert second.get(ns, keys, bufs) == 0
        assert second.lookup(ns, keys) == 0
        second.check_integrity()
    finally:
        second.close()
    third = HierarchicalStore(cfg)  # and it is gone from the disk, not just hidden
    try:
        assert third.lookup(ns, keys[:1], chunk_bytes=CHUNK_BYTES) == 0
    finally:
        third.close()


def test_a_failed_read_never_forgets_the_nodes_a_put_made_again_with_the_same_ids(make_store):
    """Found by an audit: the tree hands freed node ids to its next new nodes, so a chain deleted
    and put again (another thread) while a get read it gets the very ids the get had captured. The
    get's read of the deleted bytes failed, and its cleanup took the new nodes for the ones it read:
    it cleared their residency and deleted their fresh bytes, though that put had reported them
    stored. A ChunkRef now carries the node's creation serial, which a reused id does not share."""
    store = make_store("mem-disk")
    ns = new_namespace()
    _, keys = chain(7, 3)
    data = [payload_for(k) for k in keys]
    assert store.put(ns, keys, data) == [True] * 3
    assert store.flush(10)
    with store.lock:
        before = [store.tree.lookup(ns.digest, k) for k in keys]
    mem = store.tiers[0]
    real_get = mem.get_many
    seen = []

    def racing_get(namespace, ks, bufs):
        if not seen:
            seen.append(store.delete(ns, keys[:1]))  # another thread: delete the chain...
            out = real_get(namespace, ks, bufs)  # (the get's read: its bytes are gone)
            seen.append(store.put(ns, keys, data))  # ...and put it again, before the get's cleanup
            with store.lock:
                seen.append([store.tree.lookup(ns.digest, k) for k in keys])
            return out
        return real_get(namespace, ks, bufs)

    mem.get_many = racing_get
    try:
        store.get(ns, keys, buffers(3))
    finally:
        mem.get_many = real_get
    assert seen[1] == [True] * 3 and seen[2] == before  # the put made new nodes with the old ids
    assert store.lookup(ns, keys) == 3, "the put's chunks were forgotten by another call's failed read"
    bufs = buffers(3)
    assert store.get(ns, keys, bufs) == 3
    assert_exact(keys, bufs, 3)
    assert store.flush(10)
    store.check_integrity()


def test_a_tiers_own_eviction_report_spares_a_key_put_again_since(make_store):
    """Found by an audit (the same class as the failed-read fix above): a tier's report of a chunk
    it evicted on its own names a key, not a put. If the key was deleted and put again (a new node,
    a new file) before the report was drained, the store cleared the new node's residency and kept
    no record of the tier's copy. A key the tier holds again is now spared; one it lacks is still
    forgotten."""
    store = make_store(("mem", "disk"), chunks={"mem": 8, "disk": 8})
    disk = store.tiers[1]
    ns = new_namespace()
    _, keys = chain(71, 2)
    assert _put(store, ns, keys) == [True, True]
    assert store.delete(ns, keys[1:]) >= 1
    assert _put(store, ns, keys[1:], parent=keys[0]) == [True]  # a new node and a new file
    assert store.flush(timeout_s=30)  # its write-through copy is on disk
    tree = store._stack.tree
    n = tree.lookup(ns.digest, keys[1])
    assert disk.name in tree.node_tiers(n)
    disk._evicted.append((ns.digest, keys[1]))  # the report of the first file's eviction, drained late
    _, other = chain(72, 1)
    assert _put(store, ns, other) == [True] and store.flush(timeout_s=30)  # its disk put drains the report
    assert disk.name in tree.node_tiers(tree.lookup(ns.digest, keys[1]))
    disk._evicted.append((ns.digest, keys[0]))  # a report of a key the tier really lost
    assert disk.delete_many(ns.digest, [keys[0]]) == 1
    _, more = chain(73, 1)
    assert _put(store, ns, more) == [True] and store.flush(timeout_s=30)
    assert disk.name not in tree.node_tiers(tree.lookup(ns.digest, keys[0]))
    bufs = buffers(2)
    assert store.get(ns, keys, bufs) == 2  # from memory, exactly
    assert_exact(keys, bufs, 2)
    store.check_integrity()
