"""check_integrity() must catch corruption, not only agree with itself: each test builds a small
valid state through the public API, breaks one invariant in the internal fields, and expects the
check to raise. (Tests everywhere call check_integrity after their operations; a check that misses
a kind of corruption makes all of them weaker than they look.)"""

from __future__ import annotations

import pytest
import torch

import radixkv.sims.opt  # noqa: F401  (registers "opt")
from radixkv.policy_heap import _ORDERED, _OUT, _PARKED
from radixkv.tiers.disk import DiskTier, DiskTierConfig
from radixkv.tiers.memory import MemoryTier, MemoryTierConfig
from radixkv.tiers.redis_accounting import ByteLedger
from radixkv.tree import RadixTree

HEAP_POLICIES = ["lfu", "cost", "agedref", "oddsref", "opt"]


def _tree(policy: str) -> RadixTree:
    """Two tiers, a branching chain, a freed slot (for a dead node id) and a pinned prefix."""
    t = RadixTree(tiers=("mem", "disk"), policy=policy)
    keys = [f"a{i}" for i in range(6)]
    t.insert("ns", keys, "mem", 16, 100)
    t.insert("ns", ["a0", "a1", "b2", "b3"], "mem", 16, 100)
    t.insert("ns", ["c0", "c1", "c2"], "mem", 16, 100)
    t.set_resident([t.lookup("ns", k) for k in keys], "disk")
    t.match("ns", keys[:4])
    if policy == "opt":
        for ti in range(2):
            resident = [n for n in range(len(t._key)) if t._key[n] is not None and t._mask[n] >> ti & 1]
            t._policies[ti].set_next_use(resident, [5 + n for n in resident])  # type: ignore[attr-defined]
    t.clear(namespace="ns", subtree_key="c1")  # frees two slots
    t.pin([t.lookup("ns", "a0")], "req")  # type: ignore[list-item]
    t.check_integrity()
    assert t._free
    return t


def _mem_leaf(t: RadixTree) -> int:
    """A chunk only the first tier holds, with no child there (a tier leaf)."""
    return next(n for n in range(len(t._key)) if t._mask[n] == 1 and not t._tchild[0][n])


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_heap_policy_slot_of_a_dead_node_instead_of_a_live_one(policy):
    t = _tree(policy)
    pol, dead, leaf = t._policies[0], t._free[0], _mem_leaf(t)
    order = pol._order  # type: ignore[attr-defined]
    prio = order.prio_of(leaf)
    pol._st[leaf] = _OUT  # type: ignore[attr-defined]
    order.remove(leaf)
    pol._st[dead] = _ORDERED  # type: ignore[attr-defined]
    order.push(dead, prio, t._depth[dead])
    if policy == "oddsref":
        pol._cls[leaf] = -1  # type: ignore[attr-defined]  # no longer a fresh chunk either
    with pytest.raises(AssertionError, match="not in the tier"):
        t.check_integrity()


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_heap_policy_parked_leaf(policy):
    t = _tree(policy)
    pol, leaf = t._policies[0], _mem_leaf(t)
    pol._st[leaf] = _PARKED  # type: ignore[attr-defined]
    pol._order.remove(leaf)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="leaves parked"):
        t.check_integrity()


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_heap_policy_ordered_leaf_missing_from_the_heap(policy):
    t = _tree(policy)
    t._policies[0]._order.remove(_mem_leaf(t))  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="missing from the heap"):
        t.check_integrity()


@pytest.mark.parametrize("policy", HEAP_POLICIES)
def test_heap_policy_priority_changed_without_reordering(policy):
    # A priority written behind the heap's back (not through push): the heap order no longer holds.
    t = _tree(policy)
    for _ in range(3):
        t.insert("ns", [f"z{len(t._key)}"], "mem", 16, 100)  # more leaves: a heap with levels
    order = t._policies[0]._order  # type: ignore[attr-defined]
    nodes = order.nodes()
    assert len(nodes) >= 3
    top, worst = order.top(), max(order.prio_of(n) for n in nodes) + 1.0
    order._prio[top] = order._hprio[0] = worst  # the node's key and its slot's copy agree
    with pytest.raises(AssertionError, match="below its parent"):
        t.check_integrity()


def test_opt_next_use_changed_without_reordering():
    # In range, but not what the leaf is ordered by: the heap's order is of another future.
    t = _tree("opt")
    pol, leaf = t._policies[0], _mem_leaf(t)
    pol._next[leaf] = pol._next[leaf] + 1  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="ordered by another next use"):
        t.check_integrity()


@pytest.mark.parametrize("column", ["tokens", "size"])
def test_policies_view_of_a_grown_column_is_stale(column):
    # The tree replaces a column when it grows and points tree._views at the new one; had it not, the
    # policies would read the old copy. No check read tokens or sizes through the view (lfu's reads
    # neither; a stale depth view was caught only by the policy's slot count).
    t = _tree("lfu")
    old = getattr(t._views, column)
    t.insert("ns", [f"d{i}" for i in range(len(t._free) + 1)], "mem", 16, 100)  # past the free slots
    setattr(t._views, column, old)
    with pytest.raises(AssertionError, match=f"view of {column} is stale"):
        t.check_integrity()


def _splice(links, fifo, leaf: int, dead: int) -> None:
    # Put node ``dead`` in ``leaf``'s place in ``fifo`` (a LinkedList through ``links``), every link
    # and end consistent: only a check that the listed nodes are the tier's can tell.
    nw, od = links.newer[leaf], links.older[leaf]
    links.newer[dead], links.older[dead] = nw, od
    links.newer[leaf] = links.older[leaf] = -2
    if nw >= 0:
        links.older[nw] = dead
    else:
        fifo.newest = dead
    if od >= 0:
        links.newer[od] = dead
    else:
        fifo.oldest = dead


def test_s3fifo_queue_entry_of_a_dead_node_instead_of_a_live_one():
    t = _tree("s3fifo")
    pol, dead, leaf = t._policies[0], t._free[0], _mem_leaf(t)
    links = pol._links  # type: ignore[attr-defined]
    fifo = pol._main if pol._queue[leaf] == 2 else pol._small  # type: ignore[attr-defined]  # 2: _MAIN
    _splice(links, fifo, leaf, dead)
    pol._queue[dead], pol._queue[leaf] = pol._queue[leaf], 0  # type: ignore[attr-defined]
    pol._freq[dead], pol._freq[leaf] = pol._freq[leaf], -1  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="not in the tier"):
        t.check_integrity()


def test_s3fifo_parked_leaf():
    t = _tree("s3fifo")
    pol, leaf = t._policies[0], _mem_leaf(t)
    pol._unlink(leaf)  # type: ignore[attr-defined]
    pol._queue[leaf] = 3  # type: ignore[attr-defined]  # _PARKED_SMALL
    pol._n_parked += 1  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="leaves parked"):
        t.check_integrity()


@pytest.mark.parametrize("fault", ["older", "mark", "count", "end"])
def test_s3fifo_broken_fifo(fault):
    t = _tree("s3fifo")
    pol = t._policies[0]
    queue = pol._fifo(False) or pol._fifo(True)  # type: ignore[attr-defined]
    assert len(queue) >= 3
    a, c = queue[0], queue[2]
    fifo = pol._small if pol._queue[a] == 1 else pol._main  # type: ignore[attr-defined]  # 1: _SMALL
    if fault == "older":
        pol._links.older[c] = a  # type: ignore[attr-defined]  # skips the node between them
        match = "older link"
    elif fault == "mark":
        pol._queue[c] = 2 if pol._queue[c] == 1 else 1  # type: ignore[attr-defined]
        match = "marked as another queue"
    elif fault == "count":
        fifo.count += 1
        match = "counted"
    else:
        fifo.newest = a
        match = "newest end"
    with pytest.raises(AssertionError, match=match):
        t.check_integrity()


def test_sieve_fifo_slot_of_a_dead_node_instead_of_a_live_one():
    t = _tree("sieve")
    pol, dead, leaf = t._policies[0], t._free[0], _mem_leaf(t)
    _splice(pol._links, pol._fifo, leaf, dead)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="not in the tier"):
        t.check_integrity()


def test_sieve_broken_older_link():
    t = _tree("sieve")
    pol = t._policies[0]
    links, a = pol._links, pol._fifo.oldest  # type: ignore[attr-defined]
    c = links.newer[links.newer[a]]
    links.older[c] = a  # skips the node between them
    with pytest.raises(AssertionError, match="older link"):
        t.check_integrity()


def test_sieve_head_not_the_newest():
    t = _tree("sieve")
    fifo = t._policies[0]._fifo  # type: ignore[attr-defined]
    fifo.newest = fifo.oldest
    with pytest.raises(AssertionError, match="newest end"):
        t.check_integrity()


def test_sieve_hand_outside_the_fifo():
    t = _tree("sieve")
    t._policies[0]._hand = t._free[0]  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="hand"):
        t.check_integrity()


def test_opt_next_use_out_of_range():
    t = _tree("opt")
    t._policies[0]._next[_mem_leaf(t)] = -5  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="next uses out of range"):
        t.check_integrity()


def _memory_tier() -> MemoryTier:
    tier = MemoryTier(MemoryTierConfig(capacity_bytes=1 << 20, unit_bytes=1 << 16, slab_target_bytes=1 << 18,
                                       prefault=False, huge_pages=False, pin=False))
    tier.put_many("ns", [f"k{i}" for i in range(6)], [torch.full((4096,), i, dtype=torch.uint8) for i in range(6)])
    tier.delete_many("ns", ["k1"])
    tier.check_integrity()
    return tier


def test_memory_tier_two_keys_on_one_slot():
    tier = _memory_tier()
    try:
        # k2's slot leaks (still used, held by no one) and k2 now reads and overwrites k3's bytes:
        # every count still agrees.
        tier._index["ns"]["k2"] = tier._index["ns"]["k3"]
        with pytest.raises(RuntimeError, match="held twice|slots used"):
            tier.check_integrity()
    finally:
        tier.close()


def test_disk_spare_file_listed_twice(tmp_path):
    tier = DiskTier(DiskTierConfig(root=str(tmp_path / "d"), capacity_bytes=1 << 20, io_threads=1))
    try:
        tier.put_many("ns", ["a", "b", "c"], [torch.full((4096,), i, dtype=torch.uint8) for i in range(3)])
        tier.delete_many("ns", ["a"])
        tier.check_integrity()
        spares = tier._spares
        assert len(spares) == 1
        path, size = spares._files[0]
        spares.add(path, size)  # two puts would now overwrite one file
        with pytest.raises(RuntimeError, match="more than once"):
            tier.check_integrity()
    finally:
        tier.close()


def _ledger(ttl_s: float | None) -> ByteLedger:
    ledger = ByteLedger(1 << 20, ttl_s)
    granted = ledger.reserve("ns", ["a", "b"], [100, 100])
    ledger.settle("ns", ["a", "b"], [100, 100], granted, [True, True])
    ledger.check_integrity()
    return ledger


def test_ledger_reservation_without_a_put():
    ledger = _ledger(None)
    ledger._reserved_bytes += 100  # a put that never settled its reservation
    with pytest.raises(AssertionError, match="puts in flight"):
        ledger.check_integrity()


def test_ledger_entry_whose_expiry_is_not_queued():
    ledger = _ledger(3600.0)
    ledger._expiry.clear()  # the entries would count against the capacity forever
    with pytest.raises(AssertionError, match="expiry is not queued"):
        ledger.check_integrity()


@pytest.mark.parametrize(("column", "value", "match"), [("_tokens", 0, "0 tokens"), ("_size", -1, "size -1")])
def test_tree_node_without_tokens_or_with_a_negative_size(column, value, match):
    # insert refuses both; the check did not look, so a corrupted column passed (tier totals agree
    # with a negative size once they are adjusted with it)
    t = _tree("lru")
    n = _mem_leaf(t)
    if column == "_size":
        t._tier_bytes[0] += value - t._size[n]  # type: ignore[attr-defined]
    getattr(t, column)[n] = value
    with pytest.raises(AssertionError, match=match):
        t.check_integrity()


def test_lru_parent_left_due_after_an_eviction_run():
    # A parent the last eviction made a leaf is held aside (due at the old end) only until the run's
    # next step; one still due after the run would never be evicted.
    t = _tree("lru")
    pol = t._policies[0]
    pol._due = _mem_leaf(t)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="still due"):
        t.check_integrity()


@pytest.mark.parametrize("corruption", ["lost_leaf", "dead_node_ordered", "broken_older_link", "miscount"])
def test_lru_order_links_are_checked(corruption):
    # LRU's order is a doubly linked list in vec columns (it was an OrderedDict): a leaf dropped from
    # it, a dead node spliced in, a one-sided link or a wrong count must each be caught
    t = _tree("lru")
    pol, leaf, dead = t._policies[0], _mem_leaf(t), t._free[0]
    match = {"lost_leaf": "neither ordered nor set aside", "dead_node_ordered": "not resident in the tier",
             "broken_older_link": "older link", "miscount": "counted"}[corruption]
    order = pol._order  # type: ignore[attr-defined]
    if corruption == "lost_leaf":
        order.unlink(leaf)
    elif corruption == "dead_node_ordered":
        order.append_newest(dead)
    elif corruption == "broken_older_link":
        pol._links.older[order.newest] = -1  # type: ignore[attr-defined]
    else:
        order.count += 1
    with pytest.raises(AssertionError, match=match):
        t.check_integrity()
