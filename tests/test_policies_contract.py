"""One contract suite, run against every registered eviction policy.

Whatever its order, a policy behind the tree must: keep the tree's invariants, never cause an orphan
or evict a pinned chunk, bring a tier back within capacity whenever unpinned leaves allow, and track
exactly the nodes resident in its tier.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixkv.sims.opt  # noqa: F401  (registers "opt": every policy, offline ones too, is checked below)
from radixkv.errors import ConfigError
from radixkv.policies import POLICIES, make_policy
from radixkv.tree import RadixTree

NS = "ns"
# Policies that need information a live cache does not have (the future) are offline-only.
ONLINE = sorted(name for name, cls in POLICIES.items() if not getattr(cls, "offline", False))


def paths_from(reqs: list[list[int]]) -> list[list[str]]:
    out = []
    for r in reqs:
        prefix, path = "", []
        for b in r:
            prefix = f"{prefix}.{b}"
            path.append(prefix)
        out.append(path)
    return out


def replay(policy: str, capacity: int, paths: list[list[str]], pin_every: int = 0) -> list[int]:
    tree = RadixTree(("mem",), policy=policy)
    hits = []
    for i, keys in enumerate(paths):
        m = tree.match(NS, keys)
        hits.append(m.hit_chunks)
        r = tree.insert(NS, keys, "mem", 16, 1)
        pinned = list(r.node_ids) if pin_every and i % pin_every == 0 else []
        if pinned:
            tree.pin(pinned, owner=f"r{i}")
        over = tree.tier_chunks("mem") - capacity
        if over > 0:
            d = tree.evict("mem", over)
            assert d.orphaned_node_ids == ()
            assert not set(pinned) & set(d.removed_node_ids), "evicted a pinned chunk"
            if tree.tier_chunks("mem") > capacity:
                # Only pins may keep the tier over capacity.
                assert tree.pinned_count() > 0
        if pinned:
            tree.unpin(pinned, owner=f"r{i}")
        tree.check_integrity()
    return hits


@pytest.mark.parametrize("policy", ONLINE)
def test_registry_builds_each_policy(policy):
    p = make_policy(policy)
    assert p.name == policy and len(p) == 0


def test_unknown_policy_lists_supported():
    with pytest.raises(ConfigError, match="supported policies: .*lru"):
        make_policy("fifo-ish")


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize("seed", range(3))
def test_contract_random_trace(policy, seed):
    rng = random.Random(seed)
    reqs = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(150)]
    replay(policy, capacity=rng.choice([2, 5, 12]), paths=paths_from(reqs), pin_every=7)


@pytest.mark.parametrize("policy", ONLINE)
def test_contract_capacity_holds_without_pins(policy):
    rng = random.Random(42)
    reqs = [[rng.randrange(4) for _ in range(rng.randint(1, 8))] for _ in range(200)]
    tree = RadixTree(("mem",), policy=policy)
    for keys in paths_from(reqs):
        tree.match(NS, keys)
        tree.insert(NS, keys, "mem", 16, 1)
        over = tree.tier_chunks("mem") - 10
        if over > 0:
            tree.evict("mem", over)
        assert tree.tier_chunks("mem") <= 10
    tree.check_integrity()


@pytest.mark.parametrize("policy", ONLINE)
def test_contract_infinite_capacity_hits_everything_seen(policy):
    paths = paths_from([[0, 1, 2], [0, 1, 2, 3], [0, 1], [0, 1, 2, 3]])
    assert replay(policy, 10**6, paths) == [0, 3, 2, 4]


@pytest.mark.parametrize("policy", ONLINE)
def test_contract_multi_tier(policy):
    """Policies of several tiers under one tree: residency changes keep every policy consistent."""
    tree = RadixTree(("mem", "disk"), policy=policy)
    rng = random.Random(1)
    for keys in paths_from([[rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(100)]):
        r = tree.insert(NS, keys, "mem", 16, 1)
        tree.set_resident(r.node_ids[: len(r.node_ids) // 2], "disk")
        for victim in tree.evict_candidates("mem", max(0, tree.tier_chunks("mem") - 6)):
            # Demote (like the store does) then drop from mem.
            tree.set_resident([victim], "disk")
            tree.clear_resident([victim], "mem")
        over = tree.tier_chunks("disk") - 15
        if over > 0:
            tree.evict("disk", over)
        tree.check_integrity()


@pytest.mark.parametrize("policy", ONLINE)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=30),
    capacity=st.integers(1, 8),
)
def test_contract_property(policy, reqs, capacity):
    replay(policy, capacity, paths_from(reqs), pin_every=5)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_tree_and_its_policies_form_no_reference_cycle(policy):
    # A policy that kept its tree (the tree itself, or a bound method of it, as oddsref did for
    # the live-children count) made every tree a reference cycle, freed only by the cycle collector:
    # a closed store's tree (10^5-10^6 nodes) stayed until then, and forever where an engine turns
    # the collector off. Policies hold the tree's columns (tree._views) instead.
    import sys

    tree = RadixTree(policy=policy)
    tree.insert("ns", ["a", "b", "c"], "mem", 16, 16)
    tree.insert("ns", ["d"], "mem", 16, 16, parent_key="a")
    tree.evict("mem", 2)
    assert sys.getrefcount(tree) == 2  # this name and the call's argument: nothing else holds it


def test_a_type_error_inside_a_policy_constructor_is_not_called_bad_options():
    # make_policy turned any TypeError of the constructor into "bad options", hiding a bug in the
    # policy's own code behind a message about the caller's options.
    from radixkv.policies import register_policy

    class Buggy(POLICIES["lru"]):
        def __init__(self, depth: int = 1) -> None:
            super().__init__()
            self.x = len(depth)  # a bug: TypeError

    register_policy("buggy-ctor-test")(Buggy)
    try:
        with pytest.raises(TypeError, match="has no len"):
            make_policy("buggy-ctor-test", depth=2)
        with pytest.raises(ConfigError, match="bad options"):
            POLICIES["buggy-ctor-test"] = type("Req", (POLICIES["lru"],), {"__init__": lambda self, need: None})
            make_policy("buggy-ctor-test")  # a required option missing: the caller's mistake
    finally:
        POLICIES.pop("buggy-ctor-test", None)
