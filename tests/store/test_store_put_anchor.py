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
        keys = ["p", "c1", "c2"]
        bufs = buffers(3)
        assert store.get(ns, keys, bufs) == 3
        assert_exact(keys, bufs, 3)
        store.flush()
        store.check_integrity()
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
        bufs = buffers(2)
        assert store.get(ns, ["p", "c"], bufs) == 2
        assert_exact(["p", "c"], bufs, 2)
        store.flush()
        store.check_integrity()
    finally:
        store.close()
