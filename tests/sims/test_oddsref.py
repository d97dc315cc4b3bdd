"""oddsref: agedref plus a learned bypass of fresh chunks whose request class rarely returns."""

from __future__ import annotations

import pytest

from radixkv.errors import ConfigError
from radixkv.policies import POLICIES, make_policy
from radixkv.sims.replay import TierCapacity, replay
from radixkv.sims.workloads import WorkloadConfig, generate
from radixkv.tree import RadixTree

NS = "ns"


def use(tree: RadixTree, *labels: str) -> None:
    keys, prefix = [], ""
    for lab in labels:
        prefix = f"{prefix}/{lab}"
        keys.append(prefix)
    tree.insert(NS, keys, "mem", 16, 16)


def evict_to(tree: RadixTree, n: int) -> None:
    over = tree.tier_chunks("mem") - n
    if over > 0:
        tree.evict("mem", over)
    tree.check_integrity()


def resident(tree: RadixTree) -> set[str]:
    return set(tree._index.get(NS, {}))


def train(policy: str) -> RadixTree:
    """Two request classes under one shared prefix "s": requests adding three new chunks are never
    seen again; requests adding one new chunk are always continued by the next request."""
    tree = RadixTree(("mem",), policy=policy)
    for i in range(60):
        use(tree, "s", f"one{i}", f"one{i}b", f"one{i}c")
        use(tree, "s", f"two{i}")
        use(tree, "s", f"two{i}", f"two{i}x")  # continues the one-chunk request: reuses two{i}
        evict_to(tree, 40)
    return tree


def test_registered_without_an_import_in_policies():
    assert POLICIES["oddsref"].name == "oddsref"


def test_learns_which_request_class_returns():
    tree = train("oddsref")
    pol = tree.policy("mem")
    use(tree, "s", "probe1")
    use(tree, "s", "probe3", "b", "c")
    one, three = pol.class_of(tree.lookup(NS, "/s/probe1")), pol.class_of(tree.lookup(NS, "/s/probe3/b/c"))  # type: ignore[attr-defined]
    assert one[0] == three[0] >= 5  # the same shared prefix, with dozens of continuations
    odds = pol.class_odds()  # type: ignore[attr-defined]
    assert odds[three] < 0.05 and odds[one] > 0.8
    assert pol.class_penalty(one) == 0.0 and pol.class_penalty(three) < -2.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("policy", "fresh_first"), [("oddsref", False), ("agedref", True), ("lru", True)]
)
def test_fresh_chunks_of_a_returning_class_outlive_newer_one_offs(policy, fresh_first):
    tree = train(policy)
    use(tree, "s", "fresh")  # one new chunk: the class that returns
    for j in range(4):  # then newer one-offs of the class that never returns
        use(tree, "s", f"late{j}", f"late{j}b", f"late{j}c")
    fresh, late = tree.lookup(NS, "/s/fresh"), tree.lookup(NS, "/s/late3/late3b/late3c")
    # the policy's whole order; nothing is evicted
    order = tree.evict_candidates("mem", tree.tier_chunks("mem"))
    assert (order.index(fresh) < order.index(late)) is fresh_first
    tree.check_integrity()


def test_a_chunk_evicted_fresh_carries_its_class_through_the_ghost_history():
    # The class rides in the chunk's one ghost entry (agedref's, beside its score): a return credits
    # it once; a chunk evicted after a reuse carries none.
    tree = RadixTree(("mem",), policy="oddsref")
    pol = tree.policy("mem")
    use(tree, "s", "a")
    c = pol.class_of(tree.lookup(NS, "/s/a"))  # type: ignore[attr-defined]
    assert c is not None and pol.class_odds() == {c: 1 / 4}  # type: ignore[attr-defined]  # (0 + 1) / (2 + 2)
    tree.evict("mem", 1)  # /s/a, fresh
    assert pol._ghost_tags() == [0]  # type: ignore[attr-defined]  # class number 0
    use(tree, "s", "a")  # back: /s/a from the ghost history, /s a hit
    assert pol.class_of(tree.lookup(NS, "/s/a")) is None  # type: ignore[attr-defined]  # reused, not fresh
    assert pol.class_odds() == {c: 3 / 4}  # type: ignore[attr-defined]  # both credited, once each
    assert len(pol._ghost) == 0  # type: ignore[attr-defined]
    tree.evict("mem", 1)
    assert pol._ghost_tags() == [-1]  # type: ignore[attr-defined]
    use(tree, "s", "a")
    assert pol.class_odds() == {c: 3 / 4}  # type: ignore[attr-defined]
    tree.check_integrity()


def test_reused_chunks_are_ordered_like_agedref():
    # odds_weight=0 switches the rule off: oddsref then orders chunks exactly as agedref does.
    trace = generate("chat", WorkloadConfig(requests=300, seed=3))
    for cap in (30, 120):
        a = replay(trace, "agedref", [TierCapacity("mem", cap)])
        o = replay(trace, "oddsref", [TierCapacity("mem", cap)],
                   policy_options={"odds_weight": 0.0}, check_every=25)
        assert list(a.hit_blocks) == list(o.hit_blocks)


def test_integrity_with_partial_tails_and_two_tiers():
    trace = generate("mix", WorkloadConfig(requests=400, seed=5))
    tiers = [TierCapacity("mem", 60), TierCapacity("disk", 400)]
    r = replay(trace, "oddsref", tiers, check_every=10)
    assert 0 < r.block_hits <= trace.infinite_hit_blocks()
    assert r.demotions > 0


@pytest.mark.parametrize("options", [{"odds_weight": -1}, {"class_decay": 0}, {"class_decay": 1.5},
                                     {"gap_quantile": 2}, {"bogus": 1}])
def test_bad_options(options):
    with pytest.raises(ConfigError):
        make_policy("oddsref", **options)
