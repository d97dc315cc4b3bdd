"""The host radix tree: matching, insertion, residency, pins, orphans, bad input.

Every test ends with ``check_integrity()``; a brute-force reference model checks LRU exactly and
hypothesis drives random operation sequences against it.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from radixkv.errors import ConfigError, InputError, PinError
from radixkv.keys import sglang_page_keys
from radixkv.tree import RadixTree

NS = "ns0"


def chain(prefix: str, n: int, start: int = 0) -> list[str]:
    """Synthetic chain keys: equal (prefix, i) means equal prefixes, like real chained hashes."""
    return [f"{prefix}/{i}" for i in range(start, start + n)]


def branch(base: list[str], at: int, name: str, n: int) -> list[str]:
    return base[:at] + [f"{base[at - 1] if at else ''}>{name}/{i}" for i in range(n)]


@pytest.fixture
def tree() -> RadixTree:
    t = RadixTree(("mem", "disk", "redis"))
    yield t
    t.check_integrity()


class TestMatchInsert:
    def test_empty_tree_and_empty_keys(self, tree):
        assert tree.match(NS, chain("a", 3)).hit_chunks == 0
        assert tree.match(NS, []).hit_chunks == 0
        assert tree.insert(NS, [], "mem", 16, 10).inserted_chunks == 0

    def test_insert_then_match_longest_prefix(self, tree):
        keys = chain("a", 10)
        r = tree.insert(NS, keys[:6], "mem", 16, 100)
        assert len(r.new_node_ids) == 6
        for n in range(11):
            m = tree.match(NS, keys[:n])
            assert m.hit_chunks == min(n, 6)
            assert m.node_ids == list(r.node_ids[: min(n, 6)])
        assert tree.node_depth(r.node_ids[3]) == 4
        assert tree.node_parent(r.node_ids[0]) is None
        assert tree.node_parent(r.node_ids[1]) == r.node_ids[0]

    def test_tokens_through_key_scheme(self, tree):
        tokens = list(range(1000))
        keys = sglang_page_keys(tokens, 64)
        tree.insert(NS, keys, "mem", 64, 1 << 20)
        other = sglang_page_keys(tokens[:500] + [7] * 500, 64)
        assert tree.match(NS, other).hit_chunks == 500 // 64

    def test_duplicate_insert_is_noop(self, tree):
        keys = chain("a", 4)
        r1 = tree.insert(NS, keys, "mem", 16, 10)
        r2 = tree.insert(NS, keys, "mem", 16, 10)
        assert r2.node_ids == r1.node_ids and r2.new_node_ids == ()
        assert tree.tier_chunks("mem") == 4 and tree.tier_bytes("mem") == 40

    def test_branching(self, tree):
        base = chain("a", 6)
        tree.insert(NS, base, "mem", 16, 10)
        other = branch(base, 3, "b", 4)
        r = tree.insert(NS, other, "mem", 16, 10)
        assert len(r.new_node_ids) == 4
        assert tree.match(NS, other).hit_chunks == 7
        assert tree.node_children_alive(r.node_ids[2]) == 2

    def test_parent_key_continuation(self, tree):
        keys = chain("a", 6)
        tree.insert(NS, keys[:3], "mem", 16, 10)
        r = tree.insert(NS, keys[3:], "disk", 16, 10, parent_key=keys[2])
        assert tree.node_depth(r.node_ids[0]) == 4
        assert tree.match(NS, keys).hit_chunks == 6
        m = tree.match(NS, keys)
        assert m.hit_chunks_in("mem") == 3 and m.tier_of(4) == "disk"

    def test_mid_chain_run_without_parent_key(self, tree):
        keys = chain("a", 5)
        full = tree.insert(NS, keys, "mem", 16, 10)
        again = tree.insert(NS, keys[2:] + ["a/x"], "mem", 16, 10)
        assert again.node_ids[:3] == full.node_ids[2:] and len(again.new_node_ids) == 1
        assert tree.node_parent(again.new_node_ids[0]) == full.node_ids[-1]

    def test_unknown_parent_key_inserts_nothing(self, tree):
        r = tree.insert(NS, chain("a", 3, 5), "mem", 16, 10, parent_key="missing")
        assert r.inserted_chunks == 0 and len(tree) == 0

    def test_match_with_mid_chain_start(self, tree):
        keys = chain("a", 8)
        tree.insert(NS, keys, "mem", 16, 10)
        assert tree.match(NS, keys[3:] + ["zz"]).hit_chunks == 5

    def test_namespaces_are_isolated(self, tree):
        keys = chain("a", 4)
        tree.insert("nsA", keys, "mem", 16, 10)
        assert tree.match("nsB", keys).hit_chunks == 0
        tree.insert("nsB", keys, "mem", 16, 10)
        assert tree.lookup("nsA", keys[0]) != tree.lookup("nsB", keys[0])

    def test_non_chain_keys_are_detected(self, tree):
        keys = chain("a", 5)
        tree.insert(NS, keys, "mem", 16, 10)
        # Holes in the caller's chain: binary search alone would be fooled; the depth and last-link
        # checks catch these, verify=True catches any.
        assert tree.match(NS, [keys[0], "x", keys[2]]).hit_chunks == 1
        assert tree.match(NS, [keys[0], keys[1], keys[3]]).hit_chunks == 2
        assert tree.match(NS, [keys[0], "x", keys[2], keys[3]], verify=True).hit_chunks == 1
        with pytest.raises(InputError, match="not one chain"):
            tree.insert(NS, ["b0", keys[4]], "mem", 16, 10)
        with pytest.raises(InputError, match="not one chain"):
            tree.insert(NS, ["c0", "c1", "c0"], "mem", 16, 10)
        with pytest.raises(InputError, match="another parent"):
            tree.insert(NS, keys[2:], "mem", 16, 10, parent_key=keys[0])
        with pytest.raises(InputError, match="not one str"):  # would be read as three 1-char keys
            tree.insert(NS, "xyz", "mem", 16, 10)
        with pytest.raises(InputError, match="n_chunks=1.5"):
            tree.evict("mem", 1.5)
        ids = [tree.lookup(NS, keys[0])] * 2
        tree.pin(ids, "o")
        tree.unpin(ids, "o")  # a node listed twice is released once (was a bare KeyError)
        assert not tree.is_pinned(ids[0])
        tree.check_integrity()

    def test_refused_insert_leaves_the_tree_unchanged(self, tree):
        keys = chain("a", 6)
        tree.insert(NS, chain("z", 4), "mem", 16, 10)
        tree.insert(NS, keys, "mem", 16, 10)
        assert len(tree.evict("mem", 3).removed_node_ids) == 3  # z's: free slots the refused insert reuses
        before = sorted(tree.items(NS))
        for bad in (["b0", "b1", keys[4]], ["c0", "c1", "c0"], ["d0", 7], ["e0", ""]):
            with pytest.raises(InputError):
                tree.insert(NS, bad, "mem", 16, 10)
            tree.check_integrity()
            assert sorted(tree.items(NS)) == before
        assert tree.match(NS, keys).hit_chunks == 6
        # The slots survive for the next valid insert.
        assert tree.insert(NS, chain("f", 5), "mem", 16, 10).inserted_chunks == 5
        tree.check_integrity()

    @pytest.mark.parametrize(
        "kwargs, err, match",
        [
            (dict(tier="ssd"), InputError, "unknown tier 'ssd'"),
            (dict(chunk_tokens=0), InputError, "chunk_tokens"),
            (dict(size_bytes=-1), InputError, "size_bytes"),
            # the columns are 64-bit: a value past the bound is refused, not wrapped or an OverflowError
            (dict(size_bytes=1 << 48), InputError, r"size_bytes=281474976710656 must be .* below 2\*\*48"),
            (dict(size_bytes=1 << 64), InputError, "size_bytes"),
            (dict(chunk_tokens=1 << 70), InputError, r"chunk_tokens=.* below 2\*\*48"),
        ],
    )
    def test_bad_insert_arguments(self, tree, kwargs, err, match):
        args = dict(namespace=NS, keys=chain("a", 2), tier="mem", chunk_tokens=16, size_bytes=1)
        args.update(kwargs)
        with pytest.raises(err, match=match):
            tree.insert(**args)
        assert len(tree) == 0

    def test_bad_key_type(self, tree):
        with pytest.raises(InputError, match="non-empty str"):
            tree.insert(NS, ["a", 3], "mem", 16, 1)  # type: ignore[list-item]

    def test_bad_construction(self):
        with pytest.raises(ConfigError, match="distinct"):
            RadixTree(("mem", "mem"))
        with pytest.raises(ConfigError, match="unknown eviction policy 'nope'.*lru"):
            RadixTree(("mem",), policy="nope")
        with pytest.raises(ConfigError, match=r"policy names tiers \['dsk'\].*\['mem', 'disk'\]"):
            RadixTree(("mem", "disk"), policy={"mem": "lru", "dsk": "cost"})


def _evict_all_one_by_one(t: RadixTree) -> list[int]:
    """Node ids in the order tier "mem" evicts them, one at a time, checking integrity after each."""
    order: list[int] = []
    while len(t):
        gone = t.evict("mem", 1).removed_node_ids
        assert gone
        order += gone
        t.check_integrity()
    return order


def test_keys_that_only_look_like_one_chain_are_an_input_error():
    """Found by a graft fuzz: a list whose depth span and last link agree with one chain (so the
    fast match takes every key as hit) while a key in between is absent. Never a real hash chain,
    but node_ids (and an insert into another tier, which reads them) raised a bare KeyError."""
    tree = RadixTree(("mem", "disk"))
    tree.insert(NS, ["kc", "kca", "kcab", "kcabb", "kcabbb"], "disk", 16, 1)
    keys = ["kc", "ka", "kac", "kcabb", "kcabbb"]
    with pytest.raises(InputError, match="key 'ka' is not in the tree although the keys around it are"):
        tree.match(NS, keys, touch=False).node_ids
    with pytest.raises(InputError, match="keys are not one chain"):
        tree.insert(NS, keys, "mem", 16, 1)
    assert tree.match(NS, keys, verify=True).hit_chunks == 1
    tree.check_integrity()


class TestResidency:
    def test_residency_and_accounting(self, tree):
        r = tree.insert(NS, chain("a", 4), "mem", 16, 10)
        tree.set_resident(r.node_ids, "disk")
        assert tree.tier_bytes("disk") == 40
        assert tree.node_tiers(r.node_ids[0]) == ["mem", "disk"]
        d = tree.clear_resident(r.node_ids, "mem")
        assert d.dropped_chunks == 0 and len(tree) == 4
        assert tree.match(NS, chain("a", 4)).tier_of(0) == "disk"

    def test_dropping_last_tier_removes_node_and_orphans_descendants(self, tree):
        r = tree.insert(NS, chain("a", 5), "mem", 16, 10)
        tree.set_resident(r.node_ids[3:], "disk")  # deep chunks survive in disk...
        d = tree.clear_resident([r.node_ids[1]], "mem")  # ...but their prefix is lost
        assert d.removed_node_ids == (r.node_ids[1],)
        assert set(d.orphaned_node_ids) == set(r.node_ids[2:])
        assert tree.stats.orphan_drops == 3
        assert tree.match(NS, chain("a", 5)).hit_chunks == 1
        assert tree.tier_bytes("disk") == 0

    def test_clear_all_namespace_subtree_tier(self, tree):
        a = tree.insert("nsA", chain("a", 4), "mem", 16, 10)
        tree.insert("nsB", chain("b", 4), "mem", 16, 10)
        tree.set_resident(a.node_ids, "disk")
        tree.clear(namespace="nsA", tier="mem")
        assert tree.tier_chunks("mem") == 4 and tree.match("nsA", chain("a", 4)).hit_chunks == 4
        tree.clear(namespace="nsA", subtree_key=chain("a", 4)[2])
        assert tree.match("nsA", chain("a", 4)).hit_chunks == 2
        assert tree.descendants([tree.lookup("nsB", chain("b", 4)[1])]) == [
            tree.lookup("nsB", k) for k in chain("b", 4)[2:]
        ]
        assert sorted(k for k, _ in tree.items("nsB")) == chain("b", 4)
        d = tree.clear()
        assert len(tree) == 0 and d.orphaned_node_ids == ()
        with pytest.raises(InputError, match="needs the namespace"):
            tree.clear(subtree_key="x")


class TestPins:
    def test_pinned_nodes_are_not_candidates(self, tree):
        r = tree.insert(NS, chain("a", 3), "mem", 16, 10)
        tree.pin([r.node_ids[2]], owner="req1")
        assert tree.evict_candidates("mem", 10, drop=True) == []
        tree.unpin([r.node_ids[2]], owner="req1")
        assert tree.evict_candidates("mem", 10, drop=True) == [r.node_ids[2]]

    def test_lease_expires(self):
        now = [0.0]
        t = RadixTree(("mem",), clock=lambda: now[0])
        r = t.insert(NS, chain("a", 2), "mem", 16, 10)
        t.pin(r.node_ids, owner="crashed", lease_s=5)
        assert t.evict_candidates("mem", 1, drop=True) == []
        now[0] = 6.0
        assert t.evict_candidates("mem", 1, drop=True) == [r.node_ids[1]]
        t.unpin(r.node_ids, owner="crashed")  # a late unpin of an expired lease is a no-op
        t.check_integrity()

    def test_unpin_errors(self, tree):
        r = tree.insert(NS, chain("a", 2), "mem", 16, 10)
        with pytest.raises(PinError, match="not pinned by owner 'x'"):
            tree.unpin(r.node_ids, owner="x")
        tree.pin(r.node_ids, owner="a")
        with pytest.raises(PinError):
            tree.unpin(r.node_ids, owner="b")
        with pytest.raises(PinError, match="non-empty"):
            tree.pin(r.node_ids, owner="")
        with pytest.raises(PinError, match="lease_s"):
            tree.pin(r.node_ids, owner="a", lease_s=0)
        tree.unpin(r.node_ids, owner="a")
        assert not tree.is_pinned(r.node_ids[0])


class TestEviction:
    def test_leaf_first_never_orphans(self, tree):
        tree.insert(NS, chain("a", 5), "mem", 16, 10)
        tree.insert(NS, branch(chain("a", 5), 2, "b", 3), "mem", 16, 10)
        d = tree.evict("mem", 100)
        assert d.orphaned_node_ids == () and len(tree) == 0

    def test_multi_tier_candidates(self, tree):
        r = tree.insert(NS, chain("a", 3), "mem", 16, 10)
        tree.set_resident(r.node_ids[:2], "disk")
        tree.clear_resident([r.node_ids[2]], "mem")
        # a/1 has no child in mem any more: evictable from mem (disk holds it) even though its
        # child is alive (in no tier but... removed) -- and droppable without orphaning.
        assert tree.evict_candidates("mem", 5) == [r.node_ids[1]]


# ---------------------------------------------------------------------------- reference model


class ReferenceLRU:
    """Brute force: cached blocks with (last request, depth); evict min (last, -depth) among leaves."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.last: dict[str, int] = {}
        self.parent: dict[str, str | None] = {}

    def request(self, t: int, keys: list[str]) -> int:
        hit = 0
        for k in keys:
            if k not in self.last:
                break
            hit += 1
        for i, k in enumerate(keys):
            self.last[k] = t
            self.parent[k] = keys[i - 1] if i else None
        while len(self.last) > self.capacity:
            parents = {self.parent[k] for k in self.last}
            leaves = [k for k in self.last if k not in parents]
            victim = min(leaves, key=lambda k: (self.last[k], -self.depth(k)))
            del self.last[victim]
        return hit

    def depth(self, k: str) -> int:
        d = 0
        while k is not None:
            d, k = d + 1, self.parent[k]
        return d


def replay_tree(tree: RadixTree, capacity: int, requests: list[list[str]]) -> list[int]:
    hits = []
    for keys in requests:
        hits.append(tree.match(NS, keys).hit_chunks)
        tree.insert(NS, keys, "mem", 16, 1)
        over = tree.tier_chunks("mem") - capacity
        if over > 0:
            tree.evict("mem", over)
        tree.check_integrity()
    return hits


def random_requests(rng: random.Random, n: int, fanout: int, max_len: int) -> list[list[str]]:
    reqs = []
    for _ in range(n):
        length = rng.randint(1, max_len)
        path, prefix = [], ""
        for _ in range(length):
            prefix = f"{prefix}.{rng.randrange(fanout)}"
            path.append(prefix)
        reqs.append(path)
    return reqs


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("capacity", [1, 3, 8, 20])
def test_lru_equals_reference(seed, capacity):
    rng = random.Random(seed)
    reqs = random_requests(rng, 120, fanout=3, max_len=6)
    ref = ReferenceLRU(capacity)
    expected = [ref.request(t, keys) for t, keys in enumerate(reqs)]
    assert replay_tree(RadixTree(("mem",), "lru"), capacity, reqs) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=40),
    capacity=st.integers(1, 10),
)
def test_lru_property(reqs, capacity):
    paths = []
    for r in reqs:
        prefix, path = "", []
        for b in r:
            prefix = f"{prefix}.{b}"
            path.append(prefix)
        paths.append(path)
    ref = ReferenceLRU(capacity)
    expected = [ref.request(t, p) for t, p in enumerate(paths)]
    assert replay_tree(RadixTree(("mem",), "lru"), capacity, paths) == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert_tail", "insert_under", "match", "pin", "unpin", "evict",
                             "clear_tier", "set_tier"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=4),
            st.sampled_from(["mem", "disk"]),
        ),
        max_size=60,
    )
)
@example(ops=[("insert_tail", [0, 1, 2], "disk"), ("insert", [0], "mem"), ("match", [0, 1, 2], "mem"),
              ("insert_under", [0, 1, 2], "mem"), ("match", [0, 1, 2], "mem"), ("evict", [0], "mem")])
def test_random_operations_keep_invariants(ops):
    """Random insert/match/pin/evict/residency sequences against a dict model of what is cached.
    ``insert_tail`` puts a path without its first chunk at the namespace root and ``insert_under``
    puts it under its first chunk: chains arriving child first (split), joined by later inserts."""
    tree = RadixTree(("mem", "disk"))
    pinned: dict[int, int] = {}
    for op, path, tier in ops:
        keys, prefix = [], ""
        for b in path:
            prefix = f"{prefix}.{b}"
            keys.append(prefix)
        if op == "insert":
            tree.insert(NS, keys, tier, 16, 5)
        elif op == "insert_tail" and len(keys) > 1:
            tree.insert(NS, keys[1:], tier, 16, 5)
        elif op == "insert_under" and len(keys) > 1:
            tree.insert(NS, keys[1:], tier, 16, 5, parent_key=keys[0])
        elif op == "match":
            m = tree.match(NS, keys)
            # Model: a prefix is hit iff every key of it is alive and hangs from the key before it
            # (a run split from its prefix is not reached until it is grafted).
            expect, up = 0, None
            for k in keys:
                n = tree.lookup(NS, k)
                if n is None or tree.node_parent(n) != up:
                    break
                expect, up = expect + 1, n
            assert m.hit_chunks == expect
            # the binary search (depth span, last link) agrees with a checked walk after grafts
            assert tree.match(NS, keys, touch=False, verify=True).hit_chunks == expect
        elif op == "pin":
            m = tree.match(NS, keys)
            if m.hit_chunks:
                tree.pin(m.node_ids, owner="o")
                for n in m.node_ids:
                    pinned[n] = 1
        elif op == "unpin" and pinned:
            alive = [n for n in pinned if tree._key[n] is not None]
            if alive:
                tree.unpin(alive, owner="o")
            pinned.clear()
        elif op == "evict":
            before = {n for n in pinned if tree._key[n] is not None}
            tree.evict(tier, 2)
            assert all(tree._key[n] is not None for n in before), "a pinned chunk was evicted"
        elif op == "clear_tier":
            m = tree.match(NS, keys)
            if m.hit_chunks:
                tree.clear_resident(m.node_ids[-1:], tier)
                pinned = {n: 1 for n in pinned if tree._key[n] is not None}
        elif op == "set_tier":
            m = tree.match(NS, keys)
            tree.set_resident(m.node_ids, tier)
        tree.check_integrity()


def test_an_insert_refused_for_a_contradicting_chain_changes_nothing():
    # Found by a fuzz: the matched prefix gained the tier's residency before the refusal.
    t = RadixTree(("mem", "disk"))
    t.insert("ns", ["a", "b"], "disk", 16, 100)
    t.insert("ns", ["w", "x"], "disk", 16, 100)
    with pytest.raises(InputError, match="not one chain"):
        t.insert("ns", ["a", "x"], "mem", 16, 100)  # x already hangs under w (at the root: a graft)
    assert t.node_tiers(t.lookup("ns", "a")) == ["disk"] and t.tier_bytes("mem") == 0
    t.check_integrity()


def test_an_insert_repeating_a_matched_key_into_another_tier_is_refused():
    """Found by the compiled-vs-source fuzz (both builds alike): with one key repeated, a list whose
    depth span and last link agree with a chain passes the fast match as wholly present; the insert
    into a tier those chunks lacked gave the repeated node the tier twice (its parent's per-tier child
    count and the tier's chunk and byte totals counted twice), so check_integrity failed."""
    t = RadixTree(("mem", "disk"))
    t.insert("ns", ["w", "x", "b", "c"], "disk", 16, 100)  # b at depth 3, c at depth 4
    t.insert("ns", ["a"], "disk", 16, 100)  # a at depth 1: a..c spans 3 links, as 4 keys would
    with pytest.raises(InputError, match="not one chain: a key repeats"):
        t.insert("ns", ["a", "b", "b", "c"], "mem", 16, 100)
    assert t.tier_chunks("mem") == 0 and t.tier_bytes("mem") == 0
    t.check_integrity()


def test_ids_listed_twice_count_once():
    t = RadixTree(("mem", "disk"))
    (a,) = t.insert("ns", ["a"], "mem", 16, 100).node_ids
    t.set_resident([a, a], "disk")
    assert t.tier_bytes("disk") == 100 and t.tier_chunks("disk") == 1
    t.clear_resident([a, a], "mem")
    assert t.tier_bytes("mem") == 0 and t.tier_chunks("mem") == 0
    t.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "sieve", "s3fifo", "lfu", "cost", "agedref", "oddsref"])
def test_evict_candidates_are_distinct(policy):
    t = RadixTree(("mem",), policy)
    t.insert("ns", ["a"], "mem", 16, 100)
    t.insert("ns", ["b"], "mem", 16, 100)
    out = t.evict_candidates("mem", 5)
    assert sorted(out) == sorted(set(out)) and len(out) == 2


def test_nodes_fields_batch_matches_node_fields_and_refuses_dead_ids():
    t = RadixTree(("mem",))
    ids = t.insert("ns", ["a", "b"], "mem", 16, 100).node_ids
    assert t.nodes_fields(ids) == [(n, *t.node_fields(n)) for n in ids]
    t.clear_resident(ids[1:], "mem")  # the leaf leaves its last tier: removed
    for dead in (ids[1], -1, 10_000):
        with pytest.raises(InputError, match="not in the tree"):
            t.nodes_fields([ids[0], dead])


@pytest.mark.parametrize("policy", ["lfu", "cost", "agedref", "oddsref"])
def test_evict_empties_the_tier_after_many_touches(policy):
    # Many touches of one chunk, then an eviction of every chunk. With the lazily invalidated heap
    # of earlier builds the touches piled up stale entries and the eviction compacted the heap while
    # its candidates() run was reading it, so the run missed the parent that became a leaf
    # (evict(3) removed 2). The run must see it.
    t = RadixTree(("mem",), policy=policy)
    t.insert("ns", ["a", "b"], "mem", 16, 100)
    t.insert("ns", ["x"], "mem", 16, 100)
    for _ in range(1100):
        t.match("ns", ["x"])
    r = t.evict("mem", 3)
    assert len(r.removed_node_ids) == 3 and t.items("ns") == []
    t.check_integrity()


def test_an_insert_refused_for_a_bad_key_changes_no_residency():
    # The matched prefix lacks the tier: its residency must not be added before the rest of the
    # chain is refused (it was: "a" claimed the disk tier, whose bytes grew, after an InputError).
    t = RadixTree(("mem", "disk"))
    a = t.insert("ns", ["a"], "mem", 16, 10).new_node_ids[0]
    with pytest.raises(InputError, match="non-empty str"):
        t.insert("ns", ["a", ""], "disk", 16, 10)
    assert t.node_tiers(a) == ["mem"] and t.tier_bytes("disk") == 0
    t.check_integrity()


def test_clearing_a_namespace_over_several_tiers_orphans_nothing():
    # "a" only in mem, its child only in disk: clearing everything removes both, and neither is an
    # orphan (tier by tier, "a" left first and its child was dropped and counted as orphaned).
    t = RadixTree(("mem", "disk"))
    t.insert("ns", ["a"], "mem", 16, 1)
    t.insert("ns", ["a/b"], "disk", 16, 1, parent_key="a")
    r = t.clear(namespace="ns")
    assert len(r.removed_node_ids) == 2 and r.orphaned_node_ids == ()
    assert t.stats.orphan_drops == 0 and len(t) == 0
    t.check_integrity()


def test_bad_arguments_the_checks_missed_are_refused():
    t = RadixTree(("mem",))
    with pytest.raises(InputError, match="chunk_tokens"):
        t.insert("ns", ["q"], "mem", True, 1)  # a bool is an int to isinstance, not a token count
    with pytest.raises(InputError, match="size_bytes"):
        t.insert("ns", ["q"], "mem", 16, False)
    with pytest.raises(InputError, match="not one str"):
        t.match("ns", "abc")  # would be the keys "a", "b", "c"
    with pytest.raises(InputError, match="unknown tier"):
        t.clear(tier="bogus")  # even with nothing to drop
    assert len(t) == 0
    t.check_integrity()


@pytest.mark.parametrize("how", ["clear_resident", "clear_subtree", "descendants"])
def test_a_subtree_is_walked_without_reading_the_rest_of_the_tree(tree, how):
    """Dropping a chunk with descendants (a failed read, a delete, a clear of one subtree: under the
    store's lock) walks that subtree only. It scanned every node of the tree: with 10^5 chunks each
    such drop took ~60 ms. Every node outside the subtree gets a parent id no tree has, so reading
    one raises; the subtree's own columns, its parent's and its siblings' links are left intact."""
    for i in range(50):  # the rest of the tree: other chains, siblings, other namespaces
        tree.insert(NS if i % 2 else "ns1", chain(f"other{i}", 20), "mem", 16, 100)
    base = chain("a", 5)
    tree.insert(NS, base, "mem", 16, 100)
    b, c, d = (branch(base, at, name, k)[at:] for at, name, k in ((3, "b", 4), (4, "c", 3), (5, "d", 2)))
    tree.insert(NS, b, "disk", 16, 100, parent_key=base[2])  # a sibling of base[3]
    tree.insert(NS, c, "mem", 16, 100, parent_key=base[3])  # base[3]'s subtree: base[4], c/*, d/*
    tree.insert(NS, d, "redis", 16, 100, parent_key=base[4])
    root = tree.lookup(NS, base[3])
    sub = {root, *tree.descendants([root])}
    assert len(sub) == 1 + 1 + 3 + 2
    saved = list(tree._parent)
    for n in range(len(saved)):
        if n not in sub and tree._key[n] is not None:
            tree._parent[n] = 10**9  # a trap: any read of it walks off the columns
    try:
        _drop_subtree(tree, how, root, sub, base)
    finally:
        for n in range(len(saved)):
            if tree._parent[n] == 10**9:
                tree._parent[n] = saved[n]


def _drop_subtree(tree: RadixTree, how: str, root: int, sub: set[int], base: list[str]) -> None:
    if how == "clear_resident":  # only mem holds base[3]: its descendants are orphaned
        r = tree.clear_resident([root], "mem")
        assert len(r.removed_node_ids) == 1 and len(r.orphaned_node_ids) == len(sub) - 1
    elif how == "clear_subtree":
        r = tree.clear(namespace=NS, subtree_key=base[3])
        assert len(r.removed_node_ids) == len(sub) and not r.orphaned_node_ids
    else:
        assert set(tree.descendants([root])) == sub - {root}


# ------------------------------------------------------------------ split chains joined (grafts)

GRAFT_POLICIES = ["lru", "lfu", "cost", "agedref", "oddsref", "s3fifo", "sieve"]


@pytest.mark.parametrize("policy", GRAFT_POLICIES)
def test_a_run_at_the_namespace_root_is_grafted_when_its_chain_reaches_it(policy):
    """A chain's later chunks put first hang at the namespace root; the insert that reaches their
    first key grafts the run (and its subtree) under the chain: one chain, depths and per-tier child
    counts updated, the policies' depth-keyed state re-derived (check_integrity after each step)."""
    t = RadixTree(("mem", "disk"), policy=policy)
    t.insert(NS, ["c", "d", "e"], "disk", 16, 100)
    t.check_integrity()
    t.insert(NS, ["c", "d"], "mem", 16, 100)  # the run's first two chunks in both tiers
    t.insert(NS, ["f"], "mem", 16, 100, parent_key="c")  # a branch of the run
    t.pin([t.lookup(NS, "d")], "o")
    t.check_integrity()
    r = t.insert(NS, ["a", "b", "c", "d"], "mem", 16, 100)
    t.check_integrity()
    a, b, c, d, e, f = (t.lookup(NS, k) for k in "abcdef")
    assert r.node_ids == (a, b, c, d) and r.new_node_ids == (a, b) and r.present_chunks == 0
    assert t.node_parent(c) == b and t.node_parent(a) is None
    assert [t.node_depth(n) for n in (a, b, c, d, e, f)] == [1, 2, 3, 4, 5, 4]
    assert t._tchild[0][b] == 1 and t._tchild[1][b] == 1 and t.node_children_alive(b) == 1
    assert t.descendants([a]) == [b, c, d, f, e]
    for keys, hit in ((list("abcde"), 5), (list("abcf"), 4), (list("abcdx"), 4), (list("cde"), 3)):
        assert t.match(NS, keys).hit_chunks == hit
        assert t.match(NS, keys, verify=True).hit_chunks == hit
    # Memory pressure: the parent run (a, b: memory only) is never dropped while the run below it
    # stays, and the pinned chunk stays.
    for _ in range(8):
        gone = t.evict("mem", 1).removed_node_ids
        t.check_integrity()
        assert t.lookup(NS, "d") == d and (t.lookup(NS, "b") is None) <= (t.lookup(NS, "c") is None)
        if not gone and not t.evict_candidates("mem", 1, drop=True):
            break
    assert t.lookup(NS, "a") == a and t.node_tiers(c) == ["mem", "disk"]
    t.unpin([d], "o")
    t.clear_resident([c, d, e], "disk")  # c leaves every tier: d, e orphaned, never served
    t.evict("mem", 10)
    t.check_integrity()
    assert len(t) == 0


@pytest.mark.parametrize("policy", GRAFT_POLICIES)
def test_a_graft_evicts_the_child_run_before_the_parent_run(policy):
    """One tier: after the graft the runs are one branch, so eviction is leaf-first across the old
    split (the parent run's last chunk is no leaf while the child run stays)."""
    t = RadixTree(("mem",), policy=policy)
    t.insert(NS, ["c", "d"], "mem", 16, 100)
    t.insert(NS, ["a", "b"], "mem", 16, 100)
    t.insert(NS, ["a", "b", "c"], "mem", 16, 100)  # reaches c: grafted
    t.check_integrity()
    want = [t.lookup(NS, k) for k in "dcba"]
    assert _evict_all_one_by_one(t) == want


def test_a_graft_by_parent_key_and_the_contradictions_it_still_refuses():
    t = RadixTree(("mem", "disk"), policy="cost")
    t.insert(NS, ["c", "d"], "disk", 16, 100)
    t.insert(NS, ["a", "b"], "mem", 16, 100)
    t.insert(NS, ["w", "x"], "mem", 16, 100)
    before = sorted(t.items(NS))
    bad = [
        (["y", "x"], None),  # x hangs under w, not at the root
        (["y", "c", "y"], "b"),  # a repeat
        (["y", "c"], "d"),  # c is the root of the chain it would hang under (a cycle)
        (["c"], "d"),
    ]
    for keys, parent_key in bad:
        with pytest.raises(InputError, match="not one chain|another parent"):
            t.insert(NS, keys, "mem", 16, 100, parent_key=parent_key)
        t.check_integrity()
        assert sorted(t.items(NS)) == before and t.tier_chunks("mem") == 4
    r = t.insert(NS, ["c", "d"], "mem", 16, 100, parent_key="b")  # grafted, and gains the tier
    t.check_integrity()
    c, d = t.lookup(NS, "c"), t.lookup(NS, "d")
    assert r.node_ids == (c, d) and r.new_node_ids == () and t.node_parent(c) == t.lookup(NS, "b")
    assert t.node_tiers(d) == ["mem", "disk"] and t.node_depth(d) == 4
    assert t.match(NS, ["a", "b", "c", "d"]).hit_chunks == 4
    # Chains meeting two runs in one insert; the second run lies past new chunks.
    t.insert(NS, ["p"], "mem", 16, 100)
    t.insert(NS, ["s", "u"], "mem", 16, 100)
    t.insert(NS, ["a", "b", "c", "d", "p", "q", "s", "u", "v"], "mem", 16, 100)
    t.check_integrity()
    assert t.match(NS, list("abcdpqsuv")).hit_chunks == 9
    assert t.node_depth(t.lookup(NS, "v")) == 9


# ------------------------------------------------------------------ runs awaiting their parent key


@pytest.mark.parametrize("policy", GRAFT_POLICIES)
def test_a_run_awaiting_its_parent_at_the_root_is_grafted_when_the_parent_arrives_alone(policy):
    """SGLang's write_back order: a child node's pages first (their parent key absent: stored at the
    root, awaiting it), then the parent node's pages alone (their own keys only; no insert reaches
    the child run). Creating the awaited key grafts the run: one chain, leaf-first eviction across
    the old split (the parent's last chunk is no leaf while the child run stays)."""
    t = RadixTree(("mem",), policy=policy)
    r = t.insert(NS, ["c", "d"], "mem", 16, 100, parent_key="b", root_if_missing=True)
    c, d = t.lookup(NS, "c"), t.lookup(NS, "d")
    assert r.node_ids == (c, d) and t.node_parent(c) is None
    t.check_integrity()
    assert t.insert(NS, ["x"], "mem", 16, 100, parent_key="b").node_ids == ()  # no root_if_missing
    t.insert(NS, ["a", "b"], "mem", 16, 100)  # the parent run alone: newer than the child run
    t.check_integrity()
    a, b = t.lookup(NS, "a"), t.lookup(NS, "b")
    assert t.node_parent(c) == b and [t.node_depth(n) for n in (a, b, c, d)] == [1, 2, 3, 4]
    assert t.match(NS, list("abcd")).hit_chunks == 4
    assert t.match(NS, list("abcd"), verify=True).hit_chunks == 4
    assert not t._awaiting and not t._awaits
    assert _evict_all_one_by_one(t) == [d, c, b, a]


def test_a_run_awaiting_its_parent_is_grafted_mid_chain_and_by_any_insert_path():
    """The awaited key may be created mid-run (the graft makes a branch), by an insert that also
    grafts another split run, or under parent_key; several runs may await one key."""
    t = RadixTree(("mem", "disk"), policy="lru")
    t.insert(NS, ["c1"], "disk", 16, 100, parent_key="b", root_if_missing=True)
    t.insert(NS, ["c2", "c3"], "mem", 16, 100, parent_key="b", root_if_missing=True)
    t.insert(NS, ["q"], "mem", 16, 100, parent_key="p", root_if_missing=True)
    t.insert(NS, ["z"], "mem", 16, 100)  # a split run some insert reaches (no wait)
    t.check_integrity()
    assert len(t._awaits) == 3
    t.insert(NS, ["a", "b", "x", "z"], "mem", 16, 100)  # creates b mid-run, reaches z: a graft
    t.check_integrity()
    b = t.lookup(NS, "b")
    assert {t.node_parent(t.lookup(NS, k)) for k in ("c1", "c2", "x")} == {b}
    assert t.node_depth(t.lookup(NS, "c3")) == 4 and t.node_children_alive(b) == 3
    assert list(t._awaits.values()) == [(NS, "q", "p")]
    t.insert(NS, ["p"], "disk", 16, 100, parent_key="a")  # created under parent_key
    t.check_integrity()
    assert t.node_parent(t.lookup(NS, "q")) == t.lookup(NS, "p") and not t._awaits


def test_a_wait_ends_when_the_run_leaves_the_tree_or_its_parent_is_its_own_chunk():
    """A run's wait ends when its first chunk leaves the tree (evicted, cleared, orphan root
    removed), before the parent arrives; the slot's next chunk is never grafted in its place. No
    wait is kept for a run whose parent key is among its own keys, or that hangs under a parent."""
    t = RadixTree(("mem", "disk"), policy="lru")
    t.insert(NS, ["c", "d"], "mem", 16, 100, parent_key="b", root_if_missing=True)
    t.insert(NS, ["e"], "disk", 16, 100, parent_key="b2", root_if_missing=True)
    t.insert(NS, ["g"], "mem", 16, 100, parent_key="b3", root_if_missing=True)
    assert len(t._awaits) == 3
    assert t.evict("mem", 2).removed_node_ids  # d then c (lru): c's wait ends
    t.check_integrity()
    assert t.lookup(NS, "c") is None and "b" not in t._awaiting.get(NS, {})
    t.clear(NS, "disk")  # e leaves: its wait ends
    t.check_integrity()
    assert list(t._awaits.values()) == [(NS, "g", "b3")]
    t.clear_resident([t.lookup(NS, "g")], "mem")
    t.check_integrity()
    assert not t._awaits and not t._awaiting
    t.insert(NS, ["y"], "mem", 16, 100)  # may take a freed slot: not grafted by any key below
    t.insert(NS, ["a", "b", "b2", "b3"], "mem", 16, 100)
    t.check_integrity()
    assert t.node_parent(t.lookup(NS, "y")) is None and t.lookup(NS, "c") is None
    # No wait: the parent key is one of the run's keys, or the run continues where its first key is
    t.insert(NS, ["u", "v"], "mem", 16, 100, parent_key="v", root_if_missing=True)
    t.insert(NS, ["b", "w"], "mem", 16, 100, parent_key="missing", root_if_missing=True)
    t.check_integrity()
    assert not t._awaits and t.node_parent(t.lookup(NS, "w")) == t.lookup(NS, "b")


def test_a_run_awaiting_its_parent_is_not_grafted_under_its_own_chain():
    """The awaited key created below the waiting run itself (keys that are not a hash chain) ends
    the wait without a graft (a cycle)."""
    t = RadixTree(("mem",), policy="lru")
    t.insert(NS, ["c", "d"], "mem", 16, 100, parent_key="b", root_if_missing=True)
    t.insert(NS, ["e", "b"], "mem", 16, 100, parent_key="d")  # b created below c
    t.check_integrity()
    assert t.node_parent(t.lookup(NS, "c")) is None and not t._awaits
    assert t.node_depth(t.lookup(NS, "b")) == 4


def test_the_runs_awaiting_a_parent_are_bounded_the_oldest_forgotten_first():
    with pytest.raises(ConfigError, match="max_awaiting_runs"):
        RadixTree(("mem",), max_awaiting_runs=-1)
    t = RadixTree(("mem",), policy="lru", max_awaiting_runs=3)
    for i in range(10):
        t.insert(NS, [f"c{i}"], "mem", 16, 100, parent_key=f"p{i}", root_if_missing=True)
        t.check_integrity()
        assert len(t._awaits) == min(i + 1, 3)
    for i in range(10):
        t.insert(NS, [f"p{i}"], "mem", 16, 100)
    t.check_integrity()
    grafted = [i for i in range(10) if t.node_parent(t.lookup(NS, f"c{i}")) is not None]
    assert grafted == [7, 8, 9] and not t._awaits
    zero = RadixTree(("mem",), max_awaiting_runs=0)
    zero.insert(NS, ["c"], "mem", 16, 100, parent_key="b", root_if_missing=True)
    zero.check_integrity()
    assert not zero._awaits and zero.lookup(NS, "c") is not None



_HEARD: list[tuple[int, str, int]] = []  # (policy's tier index, node key, time) of each access


def _recording_tree(tiers: list[str]) -> RadixTree:
    """A tree whose tiers run lru, recording each access in _HEARD (a Python subclass of the
    compiled policy, registered only while the tree is made)."""
    from radixkv.policies import POLICIES, register_policy

    base = POLICIES["lru"]

    def bind(self, tree, tier_index, _b=base):
        self.tier_index, self.tree = tier_index, tree
        _b.bind(self, tree, tier_index)

    def on_access(self, n, now, _b=base):
        _HEARD.append((self.tier_index, self.tree.node_key(n), now))
        _b.on_access(self, n, now)

    register_policy("lru-heard")(type("LRUHeard", (base,), {"bind": bind, "on_access": on_access}))
    try:
        return RadixTree(tiers=tiers, policy="lru-heard")
    finally:
        del POLICIES["lru-heard"]


def test_a_touch_for_some_tiers_tells_only_them_and_keeps_the_clock():
    """touch(ids, tiers=...) tells the named tiers what match(touch=True) would (each tier holding
    the node; a tier faster than all of them its deepest node on the path), at the next clock tick
    without taking it: the other tiers hear nothing, and the next event takes that tick."""
    t = _recording_tree(["mem", "disk", "remote"])
    t.insert("n", ["a", "ab", "abc"], "mem", 4, 4)
    ids = t.match("n", ["a", "ab", "abc"], touch=False).node_ids
    t.set_resident(ids, "disk")
    t.set_resident(ids[2:], "remote")
    t.clear_resident(ids[2:], "mem")  # abc: disk and remote; a, ab: mem and disk
    _HEARD.clear()
    t.touch([ids[2]], tiers=["disk", "remote"])
    (_, _, now), _ = _HEARD
    assert sorted(_HEARD) == [(1, "abc", now), (2, "abc", now)]
    _HEARD.clear()
    t.clear_resident(ids[2:], "disk")  # abc: remote only; the disk's deepest node on the path is ab
    t.touch([ids[2]], tiers=["disk"])
    assert _HEARD == [(1, "ab", now)]  # the same tick: neither touch took it (nor did the clear)
    _HEARD.clear()
    t.match("n", ["a", "ab", "abc"])  # the full touch: every tier, at the tick the touches used
    assert sorted(_HEARD) == [(0, "ab", now), (1, "ab", now), (2, "abc", now)]


@pytest.mark.parametrize("how", ["evict-lru", "evict-lfu", "evict-s3fifo", "evict-sieve", "evict-agedref", "clear",
                                 "clear_resident", "refused"])
def test_a_namespace_whose_last_chunk_left_leaves_no_index_behind(how):
    """A namespace's key index leaves the tree with its last chunk. A dict keeps its table at its
    peak size as keys leave: an engine serving a namespace per weight version kept, per version
    whose chunks were evicted or cleared, an empty index as large as its peak (3.8 MB for 10^5
    chunks), for the life of the process. A refused first insert of a namespace (a missing parent
    key, a bad key) leaves none either."""
    tree = RadixTree(("mem", "disk"), policy=how[6:] if how.startswith("evict") else "lru")
    keys = chain("old", 300)
    tree.insert("v1", keys, "mem", 16, 1024)
    tree.insert("v2", chain("new", 2), "mem", 16, 1024)
    if how.startswith("evict"):  # each policy's eviction loop (the fused ones included)
        assert len(tree.evict("mem", 1000).removed_node_ids) == 302
        assert "v2" not in tree._index
    elif how == "clear":
        tree.clear(namespace="v1")
    elif how == "clear_resident":
        tree.clear_resident([tree.lookup("v1", keys[0])], "mem")  # the rest: orphans
    else:
        tree.clear(namespace="v1")
        assert tree.insert("v1", ["a"], "mem", 16, 1024, parent_key="gone").new_node_ids == ()
        with pytest.raises(InputError):
            tree.insert("v1", ["a", ""], "mem", 16, 1024)
        with pytest.raises(InputError):
            tree.insert("v1", ["a", "a"], "mem", 16, 1024)
    assert "v1" not in tree._index, f"{how}: namespace v1 left an empty index of {len(tree._index.get('v1', ()))} keys"
    assert "v1" not in tree.namespaces()
    tree.insert("v1", keys[:2], "mem", 16, 1024)  # the namespace comes back as new
    assert tree.match("v1", keys).hit_chunks == 2
    tree.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "sieve", "lfu", "cost", "agedref", "oddsref"])
def test_a_python_subclass_of_a_builtin_policy_hears_each_eviction_through_its_hooks(policy):
    """The tree drives a built-in policy's exact class through direct calls (its candidates() steps
    and a private per-eviction hook); a Python subclass takes the generic path, on which each evicted
    chunk reaches ``on_remove`` and a parent it leaves a leaf reaches ``on_leaf``. A public
    ``on_evict`` inherited from the base replaces both there too: lfu, agedref and oddsref gained one
    with their indexed heap (cost had one), and a subclass overriding on_remove or on_leaf no longer
    heard evictions (one whose on_leaf kept interior chunks out of the order had them evicted);
    lru's and s3fifo's public on_evict did the same before."""
    from radixkv.policies import POLICIES, register_policy

    base = POLICIES[policy]
    removed: list[int] = []
    leaves: list[int] = []

    def on_remove(self, node_ids, _b=base):
        removed.extend(node_ids)
        _b.on_remove(self, node_ids)

    def on_leaf(self, node_id, _b=base):
        leaves.append(node_id)
        _b.on_leaf(self, node_id)

    register_policy(f"{policy}-heard")(type("Heard", (base,), {"on_remove": on_remove, "on_leaf": on_leaf}))
    try:
        tree = RadixTree(("mem",), policy=f"{policy}-heard")
    finally:
        del POLICIES[f"{policy}-heard"]
    a, ab, abc = tree.insert(NS, ["a", "ab", "abc"], "mem", 16, 1).node_ids
    assert tree.evict("mem", 3).removed_node_ids == (abc, ab, a)
    assert (removed, leaves) == ([abc, ab, a], [ab, a])
    tree.check_integrity()


@pytest.mark.parametrize("policy", ["agedref", "oddsref"])
def test_a_clear_leaves_the_ghost_history_within_its_bound(policy):
    """agedref/oddsref remember evicted (and cleared) chunks, up to ghost_factor x resident. Each
    removal trims at most one entry while adding its own, so a clear of many chunks left the whole
    tier's history behind (20k chunks cleared: ~19k entries, ~450 B each, kept until the tier held
    as many chunks again); a clear trims it to the bound of what stays."""
    tree = RadixTree(("mem",), policy=policy)
    for c in range(200):  # an insert touches its chunks: each cleared one enters the history
        tree.insert("v1", chain(f"c{c}-", 10), "mem", 16, 1024)
    tree.insert("v2", chain("keep", 3), "mem", 16, 1024)
    pol = tree.policy("mem")
    tree.clear(namespace="v1")
    bound = pol._ghost_factor * len(pol) + 64
    ghosts = [pol._ghost]
    assert [len(g) for g in ghosts] == [bound] * len(ghosts), f"bound {bound} with {len(pol)} resident"
    tree.clear()
    assert [len(g) for g in ghosts] == [64] * len(ghosts)
    tree.check_integrity()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "sieve", "lfu", "cost", "agedref", "oddsref"])
def test_the_native_eviction_loop_evicts_what_the_generic_path_does(policy, seed):
    """``RadixTree.evict`` drives a built-in policy's exact class through its private eviction steps
    (lru holds a parent its eviction made a leaf instead of ordering it and taking it back out); a
    Python subclass that overrides nothing takes the generic path (candidates(), on_remove, on_leaf).
    Both must evict the same chunks in the same order, with pins, branches and partial chunks (the
    two trees stay identical, node ids included, as long as they do)."""
    from radixkv.policies import POLICIES, register_policy

    register_policy(f"{policy}-generic")(type("Generic", (POLICIES[policy],), {}))
    try:
        trees = [RadixTree(("mem",), policy=policy), RadixTree(("mem",), policy=f"{policy}-generic")]
    finally:
        del POLICIES[f"{policy}-generic"]
    rng = random.Random(seed)
    bases = [chain(f"s{i}", 6) for i in range(4)]
    for step in range(300):
        op = rng.random()
        keys = branch(rng.choice(bases), rng.randint(1, 6), f"b{rng.randint(0, 30)}", rng.randint(0, 4))
        tokens = 16 if rng.random() < 0.8 else 5  # now and then a partial chunk
        n_evict = rng.randint(1, 8)
        # every few chunks pinned while a few are evicted around them
        pinned = [n for _, n in sorted(trees[0].items(NS))][:: rng.randint(3, 7)]
        removed = []
        for t in trees:
            if op < 0.6:
                t.insert(NS, keys, "mem", tokens, tokens)
            elif op < 0.8:
                t.match(NS, keys)
            if op >= 0.8:
                t.pin(pinned, "test")
                removed.append(t.evict("mem", n_evict).removed_node_ids)
                t.unpin(pinned, "test")
            elif len(t) > 40:
                removed.append(t.evict("mem", len(t) - 40).removed_node_ids)
        assert removed == [] or removed[0] == removed[1], f"step {step}: the two paths evicted differently"
    for t in trees:
        t.check_integrity()
    assert sorted(trees[0].items(NS)) == sorted(trees[1].items(NS))


def test_a_policy_of_its_own_hears_every_hook_as_a_built_in_does():
    """A policy that implements the protocol itself (no built-in base class) is called through the
    protocol; the built-in ones (and their subclasses) through direct calls. Both must hear the
    same inserts and accesses: here a plain Python FIFO beside lru on a second tier."""
    from radixkv.policies import POLICIES, register_policy

    heard: list[tuple[str, object]] = []

    class Fifo:
        name = "fifo-own"

        def bind(self, tree, tier_index):
            self.tree, self.bit, self.order = tree, 1 << tier_index, []

        def on_insert(self, node_ids, now):
            heard.append(("insert", list(node_ids)))
            self.order += [n for n in node_ids if n not in self.order]

        def on_access(self, node_id, now):
            heard.append(("access", node_id))

        def on_leaf(self, node_id):
            pass

        def on_remove(self, node_ids):
            self.order = [n for n in self.order if n not in set(node_ids)]

        def candidates(self):
            yield from list(self.order)

        def check_integrity(self):
            assert sorted(self.order) == sorted(n for _, n in self.tree.items(NS)
                                                if self.tree.node_tier_mask(n) & self.bit)

        def __len__(self):
            return len(self.order)

    register_policy("fifo-own")(Fifo)
    try:
        t = RadixTree(("mem", "disk"), policy={"mem": "fifo-own", "disk": "lru"})
    finally:
        del POLICIES["fifo-own"]
    a, b, c = t.insert(NS, chain("k", 3), "mem", 16, 1).node_ids
    t.insert(NS, chain("k", 2), "disk", 16, 1)
    t.match(NS, chain("k", 3))
    # the inserts' touches (of b: the disk insert's, heard by every tier holding b) and the match's
    assert heard == [("insert", [a, b, c]), ("access", c), ("access", b), ("access", c)]
    assert t.evict("mem", 1).removed_node_ids == (c,)  # a and b come first, but have children
    t.check_integrity()
    assert t.evict("mem", 2).removed_node_ids == ()  # a and b leave mem; disk holds them
    assert t.node_tiers(a) == t.node_tiers(b) == ["disk"]
    t.check_integrity()
