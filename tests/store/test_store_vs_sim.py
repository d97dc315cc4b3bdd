"""The runtime store against the simulator: one request stream replayed by ``sims.replay.replay`` and
by a HierarchicalStore driven as the engine adapters drive it (lookup the chain, get the hit, put the
rest under the last hit key). Where docs/simulator.md ("Simulator and runtime") says they agree
exactly, they must, request by request; where it names a difference, the store must still follow its
own documented order (the tree's policy order, evicting exactly what a write needs)."""

from __future__ import annotations

import pytest
import torch

from radixkv.config import StoreConfig, TierConfig
from radixkv.keys import Namespace
from radixkv.policies import POLICIES
from radixkv.sims import replay as replay_mod
from radixkv.sims.replay import TierCapacity, replay
from radixkv.sims.traces import Request, Trace
from radixkv.sims.workloads import WorkloadConfig, generate
from radixkv.store import HierarchicalStore
from radixkv.tree import RadixTree

ONLINE = sorted(n for n, c in POLICIES.items() if not getattr(c, "offline", False))
CHUNK_BYTES = 64
NS = Namespace(model="sim-vs-store", dtype="bfloat16", layout="page_first", chunk_tokens=256)


def _full_blocks(trace: Trace) -> Trace:
    """The trace without partial last blocks: the runtime stores only whole chunks."""
    bt = trace.block_tokens
    out = Trace(trace.name, bt)
    for r in trace.requests:
        n = r.input_tokens // bt
        out.requests.append(Request(r.arrival_s, n * bt, r.output_tokens, list(r.block_keys[:n])))
    return out


def _residency(tree: RadixTree, ns: str) -> dict[str, int]:
    return {k: tree.node_tier_mask(n) for k, n in tree.items(ns)}


def _sim(monkeypatch: pytest.MonkeyPatch, trace: Trace, policy: str, caps: list[int],
         write_policy: str = "write_back", lower_policy: str | None = None):
    """Per-request hits, per-tier hits and residency (key -> tier mask) after each request, from the
    simulator (the lower tiers run ``lower_policy`` if given)."""
    after: list[dict[str, int]] = []

    class Recording:
        """The replay's tree, recording the residency where the replay checks integrity. A proxy, not
        a subclass: the compiled RadixTree cannot be subclassed from Python."""

        def __init__(self, *args, **kwargs) -> None:
            self._tree = RadixTree(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self._tree, name)

        def check_integrity(self) -> None:  # replay(check_every=1) calls it after each request
            self._tree.check_integrity()
            after.append(_residency(self._tree, "sim"))

    monkeypatch.setattr(replay_mod, "RadixTree", Recording)
    names = ["mem", "disk", "remote"][: len(caps)]
    r = replay(trace, policy, [TierCapacity(n, c, policy=lower_policy if i else None)
                               for i, (n, c) in enumerate(zip(names, caps))],
               check_every=1, write_policy=write_policy)
    return ([int(h) for h in r.hit_blocks], [list(map(int, row)) for row in r.tier_hit_blocks],
            after[: len(trace.requests)])


def _store(tmp_path, trace: Trace, policy: str, caps: list[int], write_policy: str = "write_back",
           lower_policy: str | None = None, remote_url: str | None = None):
    """The same from a store driven as an adapter drives it (background copies drained after the
    get and after the put, so their order is the one a replay can have). A third tier is
    ``remote_url`` (Redis), or a second disk directory."""
    tiers = [TierConfig(url="mem://", capacity_bytes=caps[0] * CHUNK_BYTES, name="mem")]
    for name, url, cap in zip(["disk", "remote"], [f"file://{tmp_path / 'disk'}",
                                                   remote_url or f"file://{tmp_path / 'disk2'}"], caps[1:]):
        # a framed tier (disk, Redis) charges header + identity per chunk
        tiers.append(TierConfig(url=url, name=name, capacity_bytes=cap * (CHUNK_BYTES + 132),
                                **({"policy": lower_policy} if lower_policy else {})))
    store = HierarchicalStore(StoreConfig(tiers=tiers, policy=policy, write_policy=write_policy,
                                          metrics=False, probe_tiers=False))
    payload = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    hits: list[int] = []
    tier_hits: list[list[int]] = []
    after: list[dict[str, int]] = []
    try:
        for t in range(len(caps)):
            assert store._stack.charge(t, CHUNK_BYTES) == CHUNK_BYTES + (132 if t else 0)
        for req in trace.requests:
            keys = req.block_keys
            n = store.lookup(NS, keys) if keys else 0
            row = [0] * len(caps)
            if n:
                with store.lock:  # each hit chunk is read from the fastest tier holding it
                    for mask in store.tree.match(NS.digest, keys[:n], touch=False).tier_masks:
                        row[(mask & -mask).bit_length() - 1] += 1
                assert store.get(NS, keys[:n], [torch.empty(CHUNK_BYTES, dtype=torch.uint8)
                                                for _ in range(n)]) == n
                store.flush()
            if n < len(keys):
                # A request with more new chunks than the tier holds stores the leading run that
                # fits: what the simulator keeps too (it evicts a tie deepest first).
                store.put(NS, keys[n:], [payload] * (len(keys) - n), parent_key=keys[n - 1] if n else None)
                store.flush()
            hits.append(n)
            tier_hits.append(row)
            with store.lock:
                after.append(_residency(store.tree, NS.digest))
    finally:
        store.close()
    return hits, tier_hits, after


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.fixture(scope="module")
def mix_trace() -> Trace:
    return _full_blocks(generate("mix", WorkloadConfig(requests=400, seed=0)))


def test_a_hit_served_from_a_lower_tier_keeps_its_prefix_in_the_top_tier(monkeypatch, tmp_path) -> None:
    """A chain whose head is in memory and whose tail was demoted to disk is hit again: the hit must
    refresh memory's copy of the head, so promoting the tail evicts another chain, not the head of
    the chain being promoted (before: the get's touch reached only the disk tier, which held the
    deepest hit chunk; the promotion then demoted the head, and the next hit read it from disk,
    while the simulator kept the whole chain in memory)."""
    a = [f"a{i}" for i in range(4)]  # two chains; keys name their whole prefix, as real keys do
    b = ["b0", "b0b1"]
    trace = Trace("by-hand", 256, [Request(float(i), len(k) * 256, 1, k) for i, k in enumerate([a, b, a])])
    caps = [4, 16]
    sim_hits, _, sim_after = _sim(monkeypatch, trace, "lru", caps)
    store_hits, _, store_after = _store(tmp_path, trace, "lru", caps)
    assert sim_hits == store_hits == [0, 0, 4]
    mem_only_a = {k: store_after[-1][k] & 1 for k in a}
    assert mem_only_a == dict.fromkeys(a, 1), f"chain a's chunks in memory after its hit: {mem_only_a}"
    assert store_after == sim_after


@pytest.mark.parametrize("capacity_fraction", [0.02, 0.1])
def test_one_memory_tier_matches_the_simulator_exactly_under_lru(monkeypatch, tmp_path, mix_trace,
                                                                 capacity_fraction) -> None:
    """A memory tier whose capacity is a whole number of equal chunks evicts exactly what the
    simulator evicts under lru: same hits and same residency after every request."""
    caps = [int(capacity_fraction * mix_trace.unique_blocks)]
    sim_hits, _, sim_after = _sim(monkeypatch, mix_trace, "lru", caps)
    store_hits, _, store_after = _store(tmp_path, mix_trace, "lru", caps)
    assert _first_difference(sim_hits, store_hits) is None
    assert _first_difference(sim_after, store_after) is None
    assert sum(store_hits) > 0 and any(len(s) == caps[0] for s in store_after)  # it did evict


@pytest.mark.parametrize("policy", ONLINE)
def test_every_policy_evicts_in_the_trees_order_for_the_adapters_calls(tmp_path, mix_trace, policy) -> None:
    """Per request, the store touches the hit (get), makes room for the missing chunks in exact
    policy order with the chunk they hang from pinned, then inserts them (put): the tree driven in
    that order by hand must end every request with the store's residency. This is the order that
    differs from the simulator's insert-then-evict (docs/simulator.md); it also catches a store that
    evicts more than a write needs."""
    cap = int(0.02 * mix_trace.unique_blocks)
    tree = RadixTree(tiers=["mem"], policy=policy)
    want_hits: list[int] = []
    want_after: list[dict[str, int]] = []
    for req in mix_trace.requests:
        keys = req.block_keys
        n = tree.match("x", keys, touch=False).hit_chunks
        if n:
            tree.match("x", keys[:n], touch=True)
        if n < len(keys):
            parent = tree.lookup("x", keys[n - 1]) if n else None
            if parent is not None:
                tree.pin([parent], "put", 1e9)
            while tree.tier_chunks("mem") + len(keys) - n > cap:
                victims = tree.evict_candidates("mem", 1, drop=True)
                if not victims:
                    break  # only the pinned parent is left
                tree.clear_resident(victims, "mem")
            if parent is not None:
                tree.unpin([parent], "put")
            fit = cap - tree.tier_chunks("mem")  # the put stores the leading run that fits
            tree.insert("x", keys[n:n + fit], "mem", 256, CHUNK_BYTES, parent_key=keys[n - 1] if n else None)
        want_hits.append(n)
        want_after.append(_residency(tree, "x"))
    store_hits, _, store_after = _store(tmp_path, mix_trace, policy, [cap])
    assert _first_difference(want_hits, store_hits) is None
    assert _first_difference(want_after, store_after) is None


def _check_same(sim, store) -> None:
    """Hits, hits per tier and residency agree after every request (first difference named)."""
    for what, a, b in zip(["hits", "hits per tier", "residency"], sim, store):
        i = _first_difference(a, b)
        assert i is None, f"{what} differ first at request {i}: simulator {a[i]!r:.200}, store {b[i]!r:.200}"


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("fractions", [(0.1, 0.1), (0.1, 0.3)], ids=["disk=mem", "disk=3mem"])
def test_memory_and_disk_match_the_simulator_exactly_under_lru(monkeypatch, tmp_path, mix_trace, write_policy,
                                                               fractions) -> None:
    """Memory over disk under lru, with either write policy: the simulator told the store's
    write_policy holds, serves and moves what the store does, request by request (hits, hits per
    tier, residency). Before, the simulator modelled write-back only (with the store's default,
    write-through, the disk holds a copy of what memory holds: mix, 1,000 requests, memory = disk =
    5 %, the simulator overstated hits by 27 %), and under write-back its disk ranked blocks
    otherwise: it made room after all of a request's demotions rather than before each one, and it
    never refreshed a lower tier's copy of a partly hit path the store's get touches."""
    caps = [int(f * mix_trace.unique_blocks) for f in fractions]
    # (a request longer than memory is a documented difference: docs/simulator.md)
    assert max(len(r.block_keys) for r in mix_trace.requests) <= caps[0]
    sim = _sim(monkeypatch, mix_trace, "lru", caps, write_policy)
    store = _store(tmp_path, mix_trace, "lru", caps, write_policy)
    _check_same(sim, store)
    assert sum(row[1] for row in store[1]) > 0 or (write_policy == "write_through" and caps[1] == caps[0])


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_memory_disk_and_redis_match_the_simulator_exactly_under_lru(monkeypatch, tmp_path, redis_server, mix_trace,
                                                                     write_policy) -> None:
    """Three tiers (memory, disk, Redis) under lru: the same, request by request. The store makes
    room in each tier before each chunk arrives (a demotion may cascade down), pins the hit chunks
    it promotes while memory makes room for them (so the tiers below cannot drop their copies
    meanwhile), and its get touches each lower tier's copy of the hit path; the simulator now does
    the same (before: Redis dropped promoted chunks' copies the store keeps, and served a different
    share of the hits)."""
    caps = [int(f * mix_trace.unique_blocks) for f in (0.1, 0.1, 0.2)]
    sim = _sim(monkeypatch, mix_trace, "lru", caps, write_policy)
    store = _store(tmp_path, mix_trace, "lru", caps, write_policy, remote_url=redis_server.url)
    _check_same(sim, store)
    assert sum(row[2] for row in store[1]) > 0  # Redis served hits


@pytest.mark.parametrize("lower_policy", ["sieve", "s3fifo"])
def test_a_lower_tiers_policy_hears_what_the_store_tells_it(monkeypatch, tmp_path, mix_trace, lower_policy) -> None:
    """lru memory over a disk running another policy: the disk's policy hears the same touches, at
    times it can tell from its inserts, as in the store (before: the simulator never touched the
    disk's copy of a partly hit path, and S3-FIFO takes a touch at the time of its last insert for
    that insert's own, so the two disks kept different chunks)."""
    caps = [int(f * mix_trace.unique_blocks) for f in (0.1, 0.2)]
    sim = _sim(monkeypatch, mix_trace, "lru", caps, "write_through", lower_policy)
    store = _store(tmp_path, mix_trace, "lru", caps, "write_through", lower_policy)
    _check_same(sim, store)


@pytest.mark.parametrize("caps", [[3, 1], [3, 1, 1]], ids=["mem+disk", "mem+disk+disk"])
def test_a_victim_the_full_tier_below_cannot_take_leaves_as_in_the_store(monkeypatch, tmp_path, caps) -> None:
    """A hit promoted from a full one-chunk disk is pinned there while memory makes room for it, so
    memory's victim cannot be copied down: the store's demotion fails and drops the victim (a leaf),
    and no tier ever holds more than its capacity. Before, the simulator copied the victim down
    anyway: the disk held 2 chunks of 1 (the next request would have hit k3 there)."""
    reqs = [["k0"], ["k1", "k1k2", "k1k2k3"], ["k0"]]  # keys name their whole prefix
    trace = Trace("by-hand", 256, [Request(float(i), len(k) * 256, 1, k) for i, k in enumerate(reqs)])
    sim = _sim(monkeypatch, trace, "lru", caps)
    store = _store(tmp_path, trace, "lru", caps)
    _check_same(sim, store)
    assert sim[2][-1] == {"k0": 0b11, "k1": 1, "k1k2": 1}  # k3 dropped: memory 3 of 3, disk 1 of 1


def test_a_victim_keeps_its_copy_further_down_while_the_tiers_below_make_room_for_it(monkeypatch, tmp_path) -> None:
    """Memory demotes b5, which the third tier also holds, to a full disk; the disk's victim (b11)
    goes to the full third tier, whose least recently used chunk is b5's own copy. The store pins a
    chunk it demotes, so the third tier drops the next one (a0) and b5 ends on disk and in the third
    tier. Before, the simulator left the victim unpinned: the cascade dropped b5's third-tier copy
    (b5 on disk only, a0 kept), and the tiers differed from the last request on."""
    a, b, c = ["a0"], [f"b{i}" for i in range(1, 6)], [f"c{i}" for i in range(6, 10)]
    reqs = [a, b, c, a, c + ["c10"], b + ["b11"], c]
    trace = Trace("by-hand", 256, [Request(float(i), len(k) * 256, 1, k) for i, k in enumerate(reqs)])
    caps = [8, 3, 5]
    sim = _sim(monkeypatch, trace, "lru", caps)
    store = _store(tmp_path, trace, "lru", caps)
    _check_same(sim, store)
    assert sim[2][-1]["b5"] == 0b110 and "a0" not in sim[2][-1]
