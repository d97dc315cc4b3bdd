"""A put's room-making never drops the chunk its chain hangs from (``parent_key``), in whichever tier
that chunk is when eviction reaches it. It may demote it (the chain stays reachable), but not drop it
from the last tier, nor drop it from a tier after its demotion failed: the put's insert would then
find its parent gone and store nothing, after evicting room for chunks it discarded.

Found replaying the synthetic ``mix`` workload through memory + disk (tests/store/test_store_vs_sim.py
drives the store the same way): with ``lfu``, ``cost``, ``agedref`` or ``oddsref`` on both tiers,
puts whose parent was in memory when they began demoted it to the disk and then, making room there
for the next victim, dropped it (lfu: 22 of 976 puts stored nothing, 694 chunks). Before, only a
parent that the last tier alone held when the put began was pinned."""

from __future__ import annotations

from radixkv.config import StoreConfig, TierConfig
from radixkv.store import HierarchicalStore
from store_helpers import CHUNK_BYTES, FRAME_SLACK, assert_exact, buffers, new_namespace, payload_for


def _store(tmp_path, mem_chunks: int, disk_chunks: int) -> HierarchicalStore:
    return HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=mem_chunks * CHUNK_BYTES, name="mem"),
               TierConfig(url=f"file://{tmp_path / 'disk'}", name="disk",
                          capacity_bytes=disk_chunks * (CHUNK_BYTES + FRAME_SLACK))],
        policy="lru", write_policy="write_back", metrics=False, probe_tiers=False))


def _put(store: HierarchicalStore, ns, keys: list[str], parent: str | None = None) -> list[bool]:
    return store.put(ns, keys, [payload_for(k) for k in keys], parent_key=parent)


def _mask(store: HierarchicalStore, ns, key: str) -> int | None:
    with store.lock:
        n = store.tree.lookup(ns.digest, key)
        return None if n is None else store.tree.node_tier_mask(n)


def _assert_reads_back(store, ns, keys: list[str]) -> None:
    """The chain reads back whole and bit-exact, and the store's books hold once it is quiescent."""
    bufs = buffers(len(keys))
    assert store.get(ns, keys, bufs) == len(keys)
    assert_exact(keys, bufs, len(keys))
    store.flush()
    store.check_integrity()


def test_a_parent_demoted_by_the_put_is_not_dropped_from_the_disk_by_the_next_demotion(tmp_path) -> None:
    """Memory holds the parent p and another chain x (lru: p oldest), the disk room for one chunk.
    Two new chunks under p: the first victim is p, demoted to the disk; the second is x, whose
    demotion needs the disk's one chunk of room, and the disk's only candidate is p. p must stay
    (x's demotion fails and x is dropped instead): before, p was dropped and the put returned
    [False, False] with memory emptied for nothing."""
    store = _store(tmp_path, mem_chunks=2, disk_chunks=1)
    try:
        ns = new_namespace()
        assert _put(store, ns, ["p"]) == [True]
        assert _put(store, ns, ["x"]) == [True]
        assert _put(store, ns, ["c1", "c2"], parent="p") == [True, True]
        assert (_mask(store, ns, "p"), _mask(store, ns, "c1"), _mask(store, ns, "c2")) == (2, 1, 1)
        assert _mask(store, ns, "x") is None
        _assert_reads_back(store, ns, ["p", "c1", "c2"])
    finally:
        store.close()


def test_a_parent_whose_demotion_fails_is_kept_and_the_next_victim_makes_the_room(tmp_path) -> None:
    """The disk holds one chunk, pinned (a reader of it): the demotion of the parent p fails. p has
    no children yet, so a failed demotion used to drop it, and the put stored nothing; now p stays in
    memory and the next victim in policy order (x) makes the room."""
    store = _store(tmp_path, mem_chunks=2, disk_chunks=1)
    try:
        ns = new_namespace()
        for k in ("y", "p", "x"):  # y, the oldest, is demoted to the disk by x's put
            assert _put(store, ns, [k]) == [True]
        assert (_mask(store, ns, "y"), _mask(store, ns, "p"), _mask(store, ns, "x")) == (2, 1, 1)
        with store.lock:
            y = store.tree.lookup(ns.digest, "y")
            store.tree.pin([y], "reader", 60.0)
        assert _put(store, ns, ["c"], parent="p") == [True]
        assert (_mask(store, ns, "p"), _mask(store, ns, "c"), _mask(store, ns, "x")) == (1, 1, None)
        with store.lock:
            store.tree.unpin([y], "reader")
            assert store.tree.pinned_count() == 0  # the put released the pin it took on p
        _assert_reads_back(store, ns, ["p", "c"])
    finally:
        store.close()


def test_a_parent_memory_and_disk_both_hold_leaves_memory_for_free(tmp_path) -> None:
    """Memory holds the parent p (the disk holds it too) and another chunk x (lru: x oldest); the disk
    has room for one chunk, p's copy. Two new chunks under p: the first victim x needs the disk's
    room, whose only candidate is p; dropping p's disk copy keeps p reachable (memory holds it), so
    x is demoted, and p, the next victim, is demoted in turn (the disk drops x). Before, the disk's
    room-making pinned p as the put's anchor, a pin that held it in memory too: x was dropped, p
    could not leave memory, and the put stored one chunk of two (found by an optimality fuzz)."""
    store = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=2 * CHUNK_BYTES, name="mem"),
               TierConfig(url=f"file://{tmp_path / 'disk'}", name="disk",
                          capacity_bytes=1 * (CHUNK_BYTES + FRAME_SLACK))],
        policy="lru", write_policy="write_through", metrics=False, probe_tiers=False,
        promote_on_hit=False))
    try:
        ns = new_namespace()
        assert _put(store, ns, ["p"]) == [True]
        store.flush()  # write-through: the disk holds p too
        with store.lock:
            p = store.tree.lookup(ns.digest, "p")
            store.tree.pin([p], "reader", 60.0)  # x's write-through copy finds the disk full
        assert _put(store, ns, ["x"]) == [True]
        store.flush()
        with store.lock:
            store.tree.unpin([p], "reader")
        assert store.get(ns, ["p"], buffers(1)) == 1  # lru: x is now memory's oldest
        assert (_mask(store, ns, "p"), _mask(store, ns, "x")) == (3, 1)
        assert _put(store, ns, ["c1", "c2"], parent="p") == [True, True]
        store.flush()
        masks = [_mask(store, ns, k) for k in ("p", "x", "c1", "c2")]
        assert masks == [2, None, 1, 1], masks  # the disk keeps p, the chain's only way in
        _assert_reads_back(store, ns, ["p", "c1", "c2"])
    finally:
        store.close()


def test_a_victim_that_must_stay_does_not_end_the_room_making(tmp_path) -> None:
    """Memory holds h, whose child d the disk holds, and a leaf x (lru: h oldest); the disk's one
    chunk of room holds d, pinned by a reader, so no demotion can succeed. A put of y must still get
    room: h stays (dropping it would orphan d) and the next candidate, x, is dropped for it (a failed
    demotion drops a leaf). Before, room-making ended at h, the first victim that could not leave,
    and the put stored nothing although x could go (an optimality fuzz found puts of 66 chunks
    storing 1 into a memory tier over a disk full of chains' heads)."""
    store = _store(tmp_path, mem_chunks=2, disk_chunks=1)
    try:
        ns = new_namespace()
        assert _put(store, ns, ["h"]) == [True]
        assert _put(store, ns, ["d"], parent="h") == [True]
        assert _put(store, ns, ["x"]) == [True]  # evicts the leaf d: demoted to the disk
        assert [_mask(store, ns, k) for k in ("h", "d", "x")] == [1, 2, 1]
        with store.lock:
            d = store.tree.lookup(ns.digest, "d")
            store.tree.pin([d], "reader", 60.0)
        assert _put(store, ns, ["y"]) == [True]
        assert [_mask(store, ns, k) for k in ("h", "d", "x", "y")] == [1, 2, None, 1]
        with store.lock:
            store.tree.unpin([d], "reader")
            assert store.tree.pinned_count() == 0  # room-making released the pin it kept h with
        _assert_reads_back(store, ns, ["h", "d"])
    finally:
        store.close()


def test_a_kept_victim_is_offered_again_once_chunks_left_the_tier(tmp_path) -> None:
    """Memory (3 chunks) holds h, whose child c only the disk (1 chunk, full) holds, c's child d,
    and a leaf w (lru: h, w, d). A put of 3 chunks: h's demotion fails (the disk's only chunk, c,
    has d below it) and h stays, kept (dropping it would orphan c and d); w and d, leaves whose
    demotions fail, are dropped. c is now a leaf the disk can drop, so h can be demoted: the put
    stores all 3. Before, each victim was tried once per room-making: h was never offered again
    and the put stored 2 of 3 (found by an optimality fuzz: a put into s3fifo memory over a cost
    disk stored 2 chunks of 44 while memory kept such a chunk)."""
    store = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=3 * CHUNK_BYTES, name="mem"),
               TierConfig(url=f"file://{tmp_path / 'disk'}", name="disk",
                          capacity_bytes=1 * (CHUNK_BYTES + FRAME_SLACK))],
        policy="lru", write_policy="write_back", metrics=False, probe_tiers=False,
        promote_on_hit=False))
    try:
        ns = new_namespace()
        assert _put(store, ns, ["h"]) == [True]
        assert _put(store, ns, ["c"], parent="h") == [True]
        assert _put(store, ns, ["x"]) == [True]
        assert _put(store, ns, ["w"]) == [True]  # memory full: the leaf c goes to the disk
        assert _put(store, ns, ["d"], parent="c") == [True]  # h kept, x dropped
        assert [_mask(store, ns, k) for k in ("h", "c", "x", "w", "d")] == [1, 2, None, 1, 1]
        assert _put(store, ns, ["y1", "y2", "y3"]) == [True, True, True]
        assert [_mask(store, ns, k) for k in ("h", "c", "w", "d")] == [2, None, None, None]
        with store.lock:
            assert store.tree.pinned_count() == 0  # room-making released the pins it kept h with
        bufs = buffers(4)
        keys = ["h", "y1", "y2", "y3"]
        assert store.get(ns, keys[:1], bufs[:1]) == 1
        assert store.get(ns, keys[1:], bufs[1:]) == 3
        assert_exact(keys, bufs, 4)
        store.flush()
        store.check_integrity()
    finally:
        store.close()
