"""Behaviour of each eviction policy beyond the shared contract suite, driven through the real tree."""

from __future__ import annotations

import pytest

from radixkv.errors import ConfigError
from radixkv.policies import make_policy
from radixkv.tree import RadixTree

NS = "ns"


def use(tree: RadixTree, *labels: str, tokens: int = 16) -> None:
    keys, prefix = [], ""
    for lab in labels:
        prefix = f"{prefix}/{lab}"
        keys.append(prefix)
    tree.insert(NS, keys, "mem", tokens, tokens)


def resident(tree: RadixTree) -> set[str]:
    return {k.rsplit("/", 1)[-1] for k in tree._index.get(NS, {})}


def evict_to(tree: RadixTree, n: int) -> None:
    over = tree.tier_chunks("mem") - n
    if over > 0:
        tree.evict("mem", over)
    tree.check_integrity()


@pytest.mark.parametrize("policy", ["lfu", "agedref", "cost"])
def test_frequency_policies_keep_the_often_used_chunk(policy):
    tree = RadixTree(("mem",), policy=policy)
    for _ in range(4):
        use(tree, "hot")
    use(tree, "cold1")
    use(tree, "cold2")
    evict_to(tree, 2)
    assert "hot" in resident(tree) and "cold1" not in resident(tree)


def test_lru_would_drop_the_often_used_chunk():
    tree = RadixTree(("mem",), policy="lru")
    for _ in range(4):
        use(tree, "hot")
    use(tree, "cold1")
    use(tree, "cold2")
    evict_to(tree, 2)
    assert resident(tree) == {"cold1", "cold2"}


def test_lfu_ages_old_counts_away():
    tree = RadixTree(("mem",), policy="lfu")
    for _ in range(3):
        use(tree, "old")
    for i in range(12):  # a stream of new chunks, each used twice: L rises past old's count
        use(tree, f"n{i}")
        use(tree, f"n{i}")
        evict_to(tree, 3)
    assert "old" not in resident(tree)


def test_cost_prefers_keeping_deep_chunks():
    tree = RadixTree(("mem",), policy="cost", policy_options={"attention_tokens": 16})
    use(tree, "a", "b", "c")  # deep chain: its leaf c costs 3x a depth-1 chunk to recompute
    use(tree, "x")
    evict_to(tree, 3)
    assert resident(tree) == {"a", "b", "c"}


def test_s3fifo_one_hit_chunks_leave_first_and_ghost_readmits_to_main():
    tree = RadixTree(("mem",), policy="s3fifo")
    use(tree, "keep")
    use(tree, "keep")  # touched while in the small queue -> promoted to main on the next pass
    for i in range(6):
        use(tree, f"once{i}")
        evict_to(tree, 3)
    assert "keep" in resident(tree)
    pol = tree.policy("mem")
    assert len(pol._ghost) > 0  # one-hit chunks went to the ghost FIFO
    ghost_key = pol._ghost.names()[0]  # the chunk's key (its namespace is the tree's only one)
    use(tree, ghost_key.lstrip("/"))
    main = pol._fifo(True)  # the main FIFO, oldest first
    assert main and tree.lookup(NS, ghost_key) in main


def test_sieve_visited_chunk_survives_a_sweep():
    tree = RadixTree(("mem",), policy="sieve")
    use(tree, "a")
    use(tree, "b")
    use(tree, "c")
    use(tree, "a")  # visited
    use(tree, "d")
    evict_to(tree, 3)
    assert resident(tree) == {"a", "c", "d"}


def test_agedref_half_life_adapts_to_reuse_gaps():
    tree = RadixTree(("mem",), policy="agedref")
    pol = tree.policy("mem")
    h0 = pol.half_life
    for i in range(400):  # every request extends a prefix used 40 requests ago: gaps of 40
        use(tree, f"p{i % 40}", f"q{i}")
        evict_to(tree, 100)
    assert pol.half_life < h0 and 20 < pol.half_life < 80



@pytest.mark.parametrize(("chains", "share", "scaled"), [(10, 0.05, True), (10, 0.0, False), (300, 0.05, False)])
def test_long_gap_guard_scales_the_bonus_down_only_where_lru_catches_the_reuses(chains, share, scaled):
    # Requests extend `chains` chains round robin by one chunk each (a conversation's next turn), and
    # a chain ends after 5 turns (the next one starts fresh): a request's deepest hit was used
    # `chains` requests ago. With 100 resident chunks and about one inserted per request, the
    # turnover is about 100 requests: every gap of 10 is shorter (LRU hits them all), and the guard
    # takes the bonus away; every gap of 300 is longer, and the bonus stays, as it does with the
    # guard off.
    tree = RadixTree(("mem",), policy="agedref", policy_options={"long_gap_share": share})
    pol = tree.policy("mem")
    assert pol.bonus_weight == 0.5
    for i in range(3000):  # the guard moves slowly (0.003 per observed gap)
        k, turn, gen = i % chains, i // chains % 5, i // (5 * chains)
        use(tree, f"p{k}.{gen}", *[f"{k}.{gen}.{j}" for j in range(turn + 1)])
        evict_to(tree, 100)
    assert pol.half_life == pytest.approx(chains, rel=0.1)  # the gaps were observed
    if scaled:
        assert pol.bonus_weight < 0.05
    else:
        assert pol.bonus_weight == 0.5


def test_oddsref_turns_the_long_gap_guard_on():
    assert make_policy("oddsref").bonus_weight == make_policy("agedref").bonus_weight == 0.5
    assert make_policy("oddsref")._long_gap_share == 0.05 and make_policy("agedref")._long_gap_share == 0.0


@pytest.mark.parametrize(("count_weight", "hot_kept"), [(1.0, True), (0.5, False)])
def test_agedref_count_weight_scales_the_bonus_of_references(count_weight, hot_kept):
    # H stays at its initial 100 requests (no gap is observed). "hot" is used at clock 1-4: its aged
    # count is ~4, a bonus of H * log2(4) = 200 requests with full weight, 100 with half. The 10
    # newest of 150 single-use chunks were used at clock 145-154: past 104, not past 204.
    tree = RadixTree(("mem",), policy="agedref", policy_options={"count_weight": count_weight})
    for _ in range(4):
        use(tree, "hot")
    for i in range(150):
        use(tree, f"c{i}")
    evict_to(tree, 10)
    assert tree.policy("mem").half_life == 100.0
    assert ("hot" in resident(tree)) is hot_kept
    assert {f"c{i}" for i in range(141 if hot_kept else 140, 150)} <= resident(tree)

@pytest.mark.parametrize(
    ("name", "options"),
    [("cost", {"attention_tokens": 0}), ("s3fifo", {"small_fraction": 1.5}), ("agedref", {"gap_quantile": 2}),
     ("agedref", {"count_weight": 0}), ("agedref", {"gap_step": 0}), ("agedref", {"gap_step": 0.5}),
     ("lru", {"bogus": 1}), ("agedref", {"gap_quantile": "0.7"}), ("oddsref", {"gap_step": "abc"}),
     ("s3fifo", {"small_fraction": True}), ("agedref", {"long_gap_share": -0.1}),
     ("oddsref", {"long_gap_share": 1.5})],
)
def test_bad_policy_options(name, options):
    with pytest.raises(ConfigError, match=next(iter(options))):  # the message names the option
        make_policy(name, **options)


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_restored_chunk_folded_twice_never_hits_a_math_domain_error(policy):
    # Found by fuzzing: folding a never-touched child (-inf) re-rounds a restored parent's score to
    # one ulp above its base, and the "references since it came back" became log2(0).
    tr = RadixTree(("mem", "disk"), policy=policy,
                   policy_options={"mem": {"initial_half_life": 117.92854062256833}, "disk": {}})
    tr.insert("ns", ["g", "p"], "mem", 16, 1)
    tr.clear_resident([tr.lookup("ns", "p")], "mem")  # p goes to the ghost history
    tr.insert("ns", ["p"], "disk", 16, 1, parent_key="g")
    tr.insert("ns", ["c"], "disk", 16, 1, parent_key="p")
    tr.set_resident([tr.lookup("ns", "p")], "mem")  # restored from the ghost history
    tr.set_resident([tr.lookup("ns", "c")], "mem")
    tr.clear_resident([tr.lookup("ns", "c")], "mem")
    tr.clear_resident([tr.lookup("ns", "p")], "mem")
    tr.check_integrity()


@pytest.mark.parametrize("first", ["a", "b"])
def test_s3fifo_ghost_tells_namespaces_apart(first):
    # Ghost entries of the history's first namespace are named by key alone, others by (namespace,
    # key): the same key evicted from one namespace must not readmit the other's chunk to main.
    from radixkv.policy_fifo import _MAIN, _SMALL

    other = "b" if first == "a" else "a"
    t = RadixTree(("mem",), policy="s3fifo")
    pol = t.policy("mem")
    t.insert(first, ["seed"], "mem", 16, 1)  # the first namespace the policy sees
    t.insert(other, ["k"], "mem", 16, 1)
    t.evict("mem", 2)  # both one-hit chunks of the small queue: ghosts
    assert len(pol._ghost) == 2
    n = t.insert(first, ["k"], "mem", 16, 1).node_ids[0]
    assert pol._queue[n] == _SMALL  # "k" of the other namespace is the ghost, not this one
    m = t.insert(other, ["k"], "mem", 16, 1).node_ids[0]
    assert pol._queue[m] == _MAIN
    t.check_integrity()


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_aged_ghost_tells_namespaces_apart(policy, first):
    import math

    other = "b" if first == "a" else "a"
    t = RadixTree(("mem",), policy=policy)
    pol = t.policy("mem")
    t.insert(first, ["seed"], "mem", 16, 1)
    for _ in range(3):
        t.match(other, ["k"]) if t.lookup(other, "k") is not None else t.insert(other, ["k"], "mem", 16, 1)
    t.evict("mem", 2)
    n = t.insert(first, ["k"], "mem", 16, 1).node_ids[0]
    assert math.isnan(pol._restored[n])  # not the other namespace's history
    m = t.insert(other, ["k"], "mem", 16, 1).node_ids[0]
    assert not math.isnan(pol._restored[m])
    t.check_integrity()
