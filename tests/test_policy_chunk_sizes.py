"""agedref and oddsref over namespaces of different chunk sizes in one tier (a store's pools, an
engine's KV-cache groups): a chunk is partial (a prompt's ragged end, ordered first and never
remembered) only below its own namespace's chunk size. Found by an audit: one tier-wide largest chunk
made every chunk of the smaller namespace "partial", evicted first however hot, and its touches
stopped the policy's clock."""

from __future__ import annotations

import pytest

from radixkv.tree import RadixTree


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_a_hot_chunk_of_a_smaller_chunk_namespace_outlives_a_cold_one(policy):
    t = RadixTree(("mem",), policy=policy)
    cold = t.insert("A", ["a-cold"], "mem", 64, 1).node_ids[0]
    hot = t.insert("B", ["b-hot"], "mem", 16, 1).node_ids[0]
    for _ in range(50):
        t.match("B", ["b-hot"])
    assert t.evict_candidates("mem", 2) == [cold, hot]
    t.check_integrity()


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_touches_of_a_smaller_chunk_namespace_advance_the_clock(policy):
    t = RadixTree(("mem",), policy=policy)
    t.insert("A", ["a"], "mem", 64, 1)
    old = t.insert("B", ["b-old"], "mem", 16, 1).node_ids[0]
    for _ in range(3):
        t.match("B", ["b-old"])
    for i in range(200):
        t.insert("B", [f"b{i}"], "mem", 16, 1)
        t.match("B", [f"b{i}"])
    # Recency counts among B's chunks: b-old, used 4 times but last 200 requests ago, goes before
    # most newer ones (it was kept longest of all: with the clock stopped, its count ruled forever).
    order = t.evict_candidates("mem", 202)
    assert order.index(old) < 100, order.index(old)
    t.check_integrity()


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_a_partial_chunk_is_still_one_below_its_own_namespaces_size(policy):
    t = RadixTree(("mem",), policy=policy)
    t.insert("A", ["a0", "a1"], "mem", 64, 1)
    b_full = t.insert("B", ["b0"], "mem", 16, 1).node_ids[0]
    b_tail = t.insert("B", ["b1"], "mem", 5, 1, parent_key="b0").node_ids[0]
    for _ in range(5):
        t.match("B", ["b0", "b1"])
    # the hot 5-token tail of B is partial (below B's 16): ordered first; B's full chunk is not
    order = t.evict_candidates("mem", 1)
    assert order == [b_tail]
    assert b_full not in t.evict_candidates("mem", 1)
    t.check_integrity()


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_the_namespace_sizes_remembered_are_bounded(policy):
    """Found by the review: one entry per namespace ever seen (a namespace per tenant salt or LoRA
    adapter), never pruned."""
    from radixkv.policy_heap import _NS_FULL_MAX

    t = RadixTree(("mem",), policy=policy)
    for i in range(_NS_FULL_MAX + 50):
        t.insert(f"ns{i}", [f"k{i}"], "mem", 16, 1)
        t.evict("mem", 1)
    assert len(t.policy("mem")._ns_full) == _NS_FULL_MAX
    t.check_integrity()
