"""One contract suite for every tier (radixkv.tiers.base.Tier): memory, disk, Redis, Redis Cluster.

Each test gets a fresh tier (Redis: a fresh namespace on the shared test server) and ends with
``check_integrity()``. Payloads are derived from their key and a salt, so every hit is checked
byte for byte: a tier may miss but must never return wrong bytes.
"""

from __future__ import annotations

import random
import threading
import uuid

import pytest
import torch

from radixkv.errors import InputError
from radixkv.keys import Namespace
from radixkv.tiers.base import Tier, TierStats
from radixkv.tiers.registry import make_tier

CHUNK_BYTES = 4096
CAPACITY_BYTES = 4 << 20


def payload_for(key: str, salt: str = "", nbytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Deterministic bytes for (key, salt): different keys/salts give different bytes."""
    g = torch.Generator().manual_seed(int.from_bytes((salt + "|" + key).encode(), "little") % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def buffers(n: int, nbytes: int = CHUNK_BYTES) -> list[torch.Tensor]:
    return [torch.full((nbytes,), 0xAB, dtype=torch.uint8) for _ in range(n)]


def keys_for(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def _redis_tier(request: pytest.FixtureRequest, fixture: str, name: str) -> Tier:
    pytest.importorskip("radixkv.tiers.redis", reason="radixkv.tiers.redis is not importable")
    try:
        url = request.getfixturevalue(fixture)
    except pytest.FixtureLookupError:
        pytest.skip(f"fixture {fixture} (tests/_redis_servers.py) is not available")
    return make_tier(url, capacity_bytes=CAPACITY_BYTES, name=name)


@pytest.fixture(params=["memory", "disk", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis_cluster", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path) -> Tier:
    kind = request.param
    if kind == "memory":
        t = make_tier("mem://", capacity_bytes=CAPACITY_BYTES, unit_bytes=64 << 10, slab_target_bytes=256 << 10)
    elif kind == "disk":
        t = make_tier(f"file://{tmp_path}/tier", capacity_bytes=CAPACITY_BYTES, io_threads=4)
    elif kind == "redis":
        t = _redis_tier(request, "redis_url", "redis")
    else:
        t = _redis_tier(request, "redis_cluster_url", "redis-cluster")
    yield t
    if getattr(request.node, "_tier_closed", False):
        return
    try:
        t.check_integrity()
    finally:
        t.clear()
        t.close()


@pytest.fixture
def ns() -> str:
    """A fresh namespace per test (the Redis servers are shared by the whole session)."""
    return Namespace(model="contract", dtype="uint8", layout="flat", chunk_tokens=16,
                     extra=uuid.uuid4().hex).digest


class TestRoundTrip:
    def test_is_a_tier(self, tier):
        """Every tier satisfies the runtime-checkable protocol and has a name and capacity."""
        assert isinstance(tier, Tier)
        assert tier.name and isinstance(tier.capacity_bytes, int)

    def test_put_then_get_is_bit_exact(self, tier, ns):
        """Stored payloads come back byte for byte into caller buffers."""
        keys = keys_for("rt", 5)
        payloads = [payload_for(k) for k in keys]
        assert tier.put_many(ns, keys, payloads) == [True] * 5
        outs = buffers(5)
        assert tier.get_many(ns, keys, outs) == [True] * 5
        for p, o in zip(payloads, outs):
            assert torch.equal(p, o)
        st = tier.stats()
        assert isinstance(st, TierStats)
        assert st.hits >= 5 and st.bytes_out >= 5 * CHUNK_BYTES and st.puts >= 5
        assert all(isinstance(v, int) for v in st.as_dict().values())

    def test_missing_keys_miss(self, tier, ns):
        """Absent keys are misses (False), mixed with hits in one batch."""
        tier.put_many(ns, ["have"], [payload_for("have")])
        outs = buffers(3)
        assert tier.get_many(ns, ["nope0", "have", "nope1"], outs) == [False, True, False]
        assert torch.equal(outs[1], payload_for("have"))
        assert tier.stats().misses >= 2

    def test_put_existing_key_is_true_and_keeps_bytes(self, tier, ns):
        """Re-putting a present key succeeds and the chunk still reads back intact."""
        p = payload_for("k")
        assert tier.put_many(ns, ["k"], [p]) == [True]
        assert tier.put_many(ns, ["k"], [p]) == [True]
        out = buffers(1)
        assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], p)

    def test_large_batch(self, tier, ns):
        """A batch larger than the I/O pool round-trips in order."""
        keys = keys_for("big", 40)
        payloads = [payload_for(k) for k in keys]
        assert tier.put_many(ns, keys, payloads) == [True] * 40
        outs = buffers(40)
        assert tier.get_many(ns, keys, outs) == [True] * 40
        assert all(torch.equal(p, o) for p, o in zip(payloads, outs))

    def test_empty_batches(self, tier, ns):
        """Empty batches are no-ops."""
        assert tier.put_many(ns, [], []) == []
        assert tier.get_many(ns, [], []) == []
        assert tier.contains_many(ns, []) == 0
        assert tier.delete_many(ns, []) == 0


def cut(t: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
    """``t`` cut into views of ``sizes`` bytes (the rest last): a chunk in parts."""
    out, at = [], 0
    for n in sizes:
        out.append(t[at : at + n])
        at += n
    out.append(t[at:])
    return tuple(out)


class TestParts:
    """A chunk may be passed as a tuple of parts (its bytes scattered in the caller's memory): it is
    the parts' concatenation, whichever way it is cut on the way in or out."""

    def test_parts_in_whole_out(self, tier, ns):
        keys = keys_for("pw", 4)
        payloads = [payload_for(k) for k in keys]
        assert tier.put_many(ns, keys, [cut(p, 1000, 96) for p in payloads]) == [True] * 4
        outs = buffers(4)
        assert tier.get_many(ns, keys, outs) == [True] * 4
        assert all(torch.equal(p, o) for p, o in zip(payloads, outs))
        assert tier.stats().bytes_out >= 4 * CHUNK_BYTES

    def test_whole_in_parts_out_cut_another_way(self, tier, ns):
        keys = keys_for("wp", 3)
        payloads = [payload_for(k) for k in keys]
        assert tier.put_many(ns, keys, payloads) == [True] * 3
        outs = buffers(3)
        # separate, scattered destination buffers, one of them a 1-byte part
        parts = [(o[2048:], o[:1], o[1:2048]) for o in outs]
        assert tier.get_many(ns, keys, parts) == [True] * 3
        for p, o in zip(payloads, outs):
            assert torch.equal(torch.cat([o[2048:], o[:2048]]), p)

    def test_parts_round_trip_and_misses_leave_parts_alone(self, tier, ns):
        p = payload_for("pp")
        assert tier.put_many(ns, ["pp"], [list(cut(p, 17, 4000))]) == [True]  # a list works too
        a, b = buffers(2)
        assert tier.get_many(ns, ["pp", "absent"], [cut(a, 3000), cut(b, 5)]) == [True, False]
        assert torch.equal(a, p)

    def test_parts_sizes_count_as_one_chunk(self, tier, ns):
        """The namespace's chunk size is the parts' total: other totals are refused or miss."""
        tier.put_many(ns, ["k"], [payload_for("k")])
        short = buffers(1)[0][: CHUNK_BYTES - 8]
        try:
            hit = tier.get_many(ns, ["k"], [cut(short, 100)])
        except InputError:
            hit = [False]
        assert hit == [False]

    @pytest.mark.parametrize("alias", ["parts", "buffers"])
    def test_buffers_sharing_bytes_are_refused_and_the_chunk_survives(self, tier, ns, alias):
        # Found by a review: the disk tier read both parts, failed the checksum and deleted the good
        # file; Redis reported a hit for bytes the buffer could not hold.
        keys = ["x", "y"]
        assert tier.put_many(ns, keys, [payload_for(k) for k in keys]) == [True, True]
        half = torch.zeros(CHUNK_BYTES // 2, dtype=torch.uint8)
        whole = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
        if alias == "parts":
            bad, ks = [(half, half)], ["x"]
        else:
            bad, ks = [whole, whole], keys  # one buffer passed for two chunks
        with pytest.raises(InputError, match="share bytes|overlap"):
            tier.get_many(ns, ks, bad)
        outs = buffers(2)
        assert tier.get_many(ns, keys, outs) == [True, True]  # nothing was judged corrupt
        assert all(torch.equal(o, payload_for(k)) for o, k in zip(outs, keys))

    @pytest.mark.parametrize(
        "bad",
        [(), (torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.float32)),
         (torch.zeros(8, dtype=torch.uint8), "x")],
        ids=["empty", "float-part", "str-part"],
    )
    def test_bad_parts_raise_input_error(self, tier, ns, bad):
        with pytest.raises(InputError, match=r"payloads\[0\]"):
            tier.put_many(ns, ["k"], [bad])
        assert tier.contains_many(ns, ["k"]) == 0


class TestContainsDeleteClear:
    def test_contains_is_leading_run(self, tier, ns):
        """contains_many counts only the leading run of present keys."""
        keys = keys_for("c", 5)
        tier.put_many(ns, [keys[0], keys[1], keys[3]], [payload_for(k) for k in (keys[0], keys[1], keys[3])])
        assert tier.contains_many(ns, keys) == 2
        assert tier.contains_many(ns, keys[3:]) == 1
        assert tier.contains_many(ns, keys[2:]) == 0

    def test_delete_counts_present_and_removes(self, tier, ns):
        """delete_many returns how many were present; deleted keys miss afterwards."""
        keys = keys_for("d", 4)
        tier.put_many(ns, keys, [payload_for(k) for k in keys])
        assert tier.delete_many(ns, keys[:2] + ["absent"]) == 2
        assert tier.contains_many(ns, keys) == 0
        assert tier.contains_many(ns, keys[2:]) == 2
        assert tier.get_many(ns, keys[:2], buffers(2)) == [False, False]
        assert tier.delete_many(ns, keys[:2]) == 0

    def test_namespaces_are_isolated(self, tier, ns):
        """One key under two namespaces holds two payloads; clear(ns) touches only its namespace."""
        other = Namespace(model="contract", dtype="uint8", layout="flat", chunk_tokens=16,
                          extra=uuid.uuid4().hex).digest
        tier.put_many(ns, ["same"], [payload_for("same", "A")])
        tier.put_many(other, ["same"], [payload_for("same", "B")])
        outs = buffers(2)
        assert tier.get_many(ns, ["same"], outs[:1]) == [True]
        assert tier.get_many(other, ["same"], outs[1:]) == [True]
        assert torch.equal(outs[0], payload_for("same", "A"))
        assert torch.equal(outs[1], payload_for("same", "B"))
        tier.clear(ns)
        assert tier.contains_many(ns, ["same"]) == 0
        assert tier.contains_many(other, ["same"]) == 1
        tier.clear(other)

    def test_usage_tracks_puts_and_deletes(self, tier, ns):
        """usage_bytes grows by at least the payload bytes and returns after delete."""
        before = tier.usage_bytes()
        keys = keys_for("u", 3)
        tier.put_many(ns, keys, [payload_for(k) for k in keys])
        grown = tier.usage_bytes()
        assert grown - before >= 3 * CHUNK_BYTES
        tier.delete_many(ns, keys)
        assert tier.usage_bytes() == before


class TestBadInput:
    @pytest.mark.parametrize(
        "bad",
        [
            torch.zeros(CHUNK_BYTES, dtype=torch.float32),
            torch.zeros(2 * CHUNK_BYTES, dtype=torch.uint8)[::2],
            "not a tensor",
        ],
        ids=["float32", "non-contiguous", "str"],
    )
    def test_bad_payload_raises_input_error(self, tier, ns, bad):
        """A payload that is not a contiguous uint8 CPU tensor is a caller error."""
        with pytest.raises(InputError):
            tier.put_many(ns, ["k"], [bad])
        assert tier.contains_many(ns, ["k"]) == 0

    @pytest.mark.parametrize("bad", ["model/v1 \u00e9", "a:b", "a*b", "", "x" * 129, None], ids=repr)
    def test_a_namespace_no_tier_can_store_is_refused_by_every_tier(self, tier, ns, bad):
        """Found by an audit: the memory tier took any non-empty str as a namespace, so a chunk held
        in memory failed only later, when an eviction demoted it to a tier that refuses the name.
        Every call that names a namespace checks it first, in every tier."""
        tier.put_many(ns, ["k"], [payload_for("k")])
        calls = [lambda: tier.put_many(bad, ["k"], [payload_for("k")]),
                 lambda: tier.get_many(bad, ["k"], buffers(1)),
                 lambda: tier.contains_many(bad, ["k"]),
                 lambda: tier.delete_many(bad, ["k"])]
        for call in calls:
            with pytest.raises(InputError, match="namespace"):
                call()
        assert tier.contains_many(ns, ["k"]) == 1

    def test_length_mismatch_raises(self, tier, ns):
        """keys and payloads/buffers must pair up."""
        with pytest.raises(InputError, match="payload"):
            tier.put_many(ns, ["a", "b"], [payload_for("a")])
        with pytest.raises(InputError, match="buffer"):
            tier.get_many(ns, ["a", "b"], buffers(1))

    def test_wrong_buffer_size_never_returns_wrong_bytes(self, tier, ns):
        """A buffer of another size than the stored chunk is an error or a miss, never a hit."""
        tier.put_many(ns, ["k"], [payload_for("k")])
        out = torch.zeros(CHUNK_BYTES // 2, dtype=torch.uint8)
        try:
            hit = tier.get_many(ns, ["k"], [out])
        except InputError:
            return
        assert hit == [False]


class TestCapacityAndConcurrency:
    def test_capacity_never_exceeded(self, tier, ns):
        """Putting twice the capacity keeps usage within it; every hit is still exact."""
        chunk = 64 << 10
        keys = keys_for("cap", 2 * CAPACITY_BYTES // chunk)
        for i in range(0, len(keys), 8):
            batch = keys[i : i + 8]
            tier.put_many(ns, batch, [payload_for(k, nbytes=chunk) for k in batch])
            assert tier.usage_bytes() <= tier.capacity_bytes or tier.capacity_bytes == 0
        outs = buffers(len(keys), chunk)
        hits = tier.get_many(ns, keys, outs)
        for k, h, o in zip(keys, hits, outs):
            if h:
                assert torch.equal(o, payload_for(k, nbytes=chunk)), k

    def test_matches_dict_reference(self, tier, ns):
        """A seeded random op sequence agrees step by step with a dict (capacity is ample)."""
        rng = random.Random(1234)
        model: set[str] = set()
        universe = keys_for("m", 24)
        for step in range(150):
            op = rng.choice(["put", "put", "get", "delete", "contains"])
            batch = rng.sample(universe, rng.randint(1, 5))
            if op == "put":
                assert tier.put_many(ns, batch, [payload_for(k) for k in batch]) == [True] * len(batch)
                model.update(batch)
            elif op == "get":
                outs = buffers(len(batch))
                assert tier.get_many(ns, batch, outs) == [k in model for k in batch], step
                for k, o in zip(batch, outs):
                    if k in model:
                        assert torch.equal(o, payload_for(k)), (step, k)
            elif op == "delete":
                assert tier.delete_many(ns, batch) == len(model & set(batch)), step
                model -= set(batch)
            else:
                expect = 0
                while expect < len(batch) and batch[expect] in model:
                    expect += 1
                assert tier.contains_many(ns, batch) == expect, step
        tier.check_integrity()

    def test_eight_threads_put_get_delete(self, tier, ns):
        """8 threads racing put/get/delete on 16 keys: no exception, every hit exact, invariants hold."""
        universe = keys_for("t", 16)
        expected = {k: payload_for(k) for k in universe}
        errors: list[BaseException] = []
        wrong: list[str] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    batch = rng.sample(universe, rng.randint(1, 4))
                    op = rng.random()
                    if op < 0.4:
                        tier.put_many(ns, batch, [expected[k] for k in batch])
                    elif op < 0.8:
                        outs = buffers(len(batch))
                        for k, h, o in zip(batch, tier.get_many(ns, batch, outs), outs):
                            if h and not torch.equal(o, expected[k]):
                                wrong.append(k)
                    elif op < 0.9:
                        tier.delete_many(ns, batch)
                    else:
                        tier.contains_many(ns, batch)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert not wrong, wrong
        tier.check_integrity()
        assert tier.usage_bytes() <= tier.capacity_bytes or tier.capacity_bytes == 0

    def test_close_is_idempotent(self, tier, request):
        """close() twice is fine."""
        tier.check_integrity()
        tier.clear()
        request.node._tier_closed = True
        tier.close()
        tier.close()

    def test_a_closed_tier_refuses_deletes_and_clears(self, tier, ns, request):
        """Like puts and gets: a late caller (a store's read overtaken by close()) must not remove
        the chunks a persistent tier keeps for the next process."""
        tier.check_integrity()
        tier.clear()
        request.node._tier_closed = True
        tier.close()
        for call in (lambda: tier.delete_many(ns, ["k"]), lambda: tier.clear(ns), tier.clear):
            with pytest.raises(RuntimeError, match="closed"):
                call()
