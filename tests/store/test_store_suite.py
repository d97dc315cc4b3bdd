"""One suite for the hierarchical store over every tier stack (mem, mem->disk, mem->redis,
mem->disk->redis): round trips, prefix semantics, eviction with demotion, write policies, promotion,
prefetch, concurrency and shutdown. Every hit is checked byte for byte; every test ends with
``check_integrity()`` and a capacity check."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from radixkv.errors import InputError
from radixkv.store import HierarchicalStore
from store_helpers import (
    CAP_CHUNKS,
    CHUNK_BYTES,
    assert_exact,
    assert_within_capacity,
    buffers,
    chain,
    new_namespace,
    payload_for,
)


def put_chain(
    store: HierarchicalStore, ns, keys: list[str], parent_key: str | None = None
) -> list[bool]:
    ok = store.put(ns, keys, [payload_for(k) for k in keys], parent_key=parent_key)
    assert_within_capacity(store)
    return ok


def residency(store: HierarchicalStore, ns, keys: list[str]) -> list[list[str]]:
    with store.lock:
        out = []
        for k in keys:
            n = store.tree.lookup(ns.digest, k)
            out.append([] if n is None else store.tree.node_tiers(n))
        return out


class TestRoundTrip:
    def test_put_lookup_get_exact(self, make_store, stack):
        """A stored chain reads back byte for byte; a longer query stops where the chain ends."""
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(1, 6)
        assert put_chain(store, ns, keys) == [True] * 6
        assert store.lookup(ns, keys) == 6
        _, longer = chain(1, 9)
        assert longer[:6] == keys
        bufs = buffers(9)
        assert store.get(ns, longer, bufs) == 6
        assert_exact(longer, bufs, 6)
        assert torch.all(bufs[6] == 0xAB)  # untouched past the run
        store.flush()
        store.check_integrity()

    def test_continuation_and_branches(self, make_store, stack):
        """A chain continued with parent_key and a branch sharing its prefix both read back."""
        store = make_store(stack)
        ns = new_namespace()
        tokens, keys = chain(2, 3)
        _, branch = chain(3, 2, prefix=tokens)
        assert branch[:3] == keys
        assert put_chain(store, ns, keys[:2]) == [True, True]
        assert put_chain(store, ns, keys[2:], parent_key=keys[1]) == [True]
        assert put_chain(store, ns, branch[3:], parent_key=keys[2]) == [True, True]
        bufs = buffers(5)
        assert store.get(ns, branch, bufs) == 5
        assert_exact(branch, bufs, 5)
        store.flush()
        store.check_integrity()

    def test_put_under_missing_parent_stores_nothing(self, make_store, stack):
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(4, 4)
        assert put_chain(store, ns, keys[2:], parent_key=keys[1]) == [False, False]
        assert store.lookup(ns, keys[2:]) == 0
        store.flush()
        store.check_integrity()


def in_parts(t: torch.Tensor, cut: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    return (t[:cut], t[cut:])


class TestChunksInParts:
    def test_parts_through_every_stack(self, make_store, stack):
        """Chunks put in parts (views of separate buffers) read back from every tier of the stack,
        into parts cut another way or into whole buffers, byte for byte."""
        store = make_store(stack, write_policy="write_through")
        ns = new_namespace()
        _, keys = chain(41, 5)
        whole = [payload_for(k) for k in keys]
        # each chunk's two halves live in separate tensors, as an SGLang page's K and V blocks do
        parts = [(w[: CHUNK_BYTES // 2].clone(), w[CHUNK_BYTES // 2 :].clone()) for w in whole]
        assert store.put(ns, keys, parts) == [True] * 5
        store.flush()
        for tier in store.tiers:
            outs = buffers(5)
            assert tier.get_many(ns.digest, keys, [in_parts(o, 77) for o in outs]) == [True] * 5
            assert_exact(keys, outs, 5)
        outs = buffers(5)
        assert store.get(ns, keys, [in_parts(o) for o in outs]) == 5
        assert_exact(keys, outs, 5)
        with pytest.raises(InputError, match=r"buffers\[0\]"):
            store.get(ns, keys, [(outs[0][:10],)] + outs[1:])  # parts must add up to the chunk size
        store.check_integrity()

    def test_aliased_buffers_are_refused(self, make_store, stack):
        """Buffers sharing bytes (within a chunk's parts or across chunks) are an InputError before
        any tier reads into them: a tier verifying checksums would otherwise drop good chunks."""
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(43, 2)
        put_chain(store, ns, keys)
        store.flush()
        half = torch.zeros(CHUNK_BYTES // 2, dtype=torch.uint8)
        whole = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
        for bad in ([(half, half), whole], [whole, whole]):
            with pytest.raises(InputError, match="share bytes"):
                store.get(ns, keys, bad)
        outs = buffers(2)
        assert store.get(ns, keys, outs) == 2
        assert_exact(keys, outs, 2)
        store.check_integrity()

    def test_a_prefetch_into_overlapping_buffers_is_refused_at_the_call(self, make_store):
        """Found by an audit: get refused overlapping buffers at once, prefetch only on its worker
        thread, where a caller that polled done() or dropped the handle never saw the error."""
        store = make_store("mem-disk")
        ns = new_namespace()
        _, keys = chain(41, 2)
        put_chain(store, ns, keys)
        store.flush()  # (the put's write-through copies pin its chunks until they end)
        whole = torch.zeros(2 * CHUNK_BYTES, dtype=torch.uint8)
        overlapping = [whole[:CHUNK_BYTES], whole[CHUNK_BYTES // 2 : CHUNK_BYTES // 2 + CHUNK_BYTES]]
        with pytest.raises(InputError, match="overlap|share|alias"):
            store.prefetch(ns, keys, overlapping)
        assert store.stats()["tree"]["pinned_chunks"] == 0
        store.check_integrity()

    def test_aliased_buffers_across_tiers_are_refused(self, make_store):
        """Each tier checks the buffers of its own call; a read spanning tiers checks them all
        before its second call, so one tier cannot overwrite what another delivered."""
        store = make_store("mem-disk", write_policy="write_back", chunks={"mem": 1}, promote_on_hit=False)
        ns = new_namespace()
        _, keys = chain(44, 2)
        put_chain(store, ns, keys[:1])
        put_chain(store, ns, keys[1:], parent_key=keys[0])  # evicts (demotes) the first chunk
        assert residency(store, ns, keys) == [["disk"], ["mem"]]
        whole = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
        with pytest.raises(InputError, match="share bytes"):
            store.get(ns, keys, [whole, whole])
        outs = buffers(2)
        assert store.get(ns, keys, outs) == 2
        assert_exact(keys, outs, 2)
        store.check_integrity()

    def test_demotion_and_promotion_of_chunks_put_in_parts(self, make_store):
        store = make_store("mem-disk", write_policy="write_back", promote_on_hit=True)
        ns = new_namespace()
        _, first = chain(42, 2)
        assert store.put(ns, first, [in_parts(payload_for(k)) for k in first]) == [True] * 2
        for i in range(2):
            put_chain(store, ns, chain(500 + i, 4)[1])
        assert residency(store, ns, first) == [["disk"]] * 2  # demoted byte for byte
        outs = buffers(2)
        assert store.get(ns, first, [in_parts(o, 3) for o in outs]) == 2  # read into parts
        assert_exact(first, outs, 2)
        store.flush()
        assert all("mem" in r for r in residency(store, ns, first))  # promoted from the parts
        outs = buffers(2)
        assert store.tiers[0].get_many(ns.digest, first, outs) == [True] * 2
        assert_exact(first, outs, 2)
        store.check_integrity()


class TestPrefixSemantics:
    def test_missing_middle_chunk_stops_the_run(self, make_store, stack):
        """A chunk lost from every tier behind the store's back ends the run there; its
        descendants are dropped as orphans and their bytes deleted from every tier, except Redis,
        which other processes write: there they are only forgotten (its byte ledger stops counting
        them; a delete by name could remove a value another process wrote since)."""
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(5, 6)
        put_chain(store, ns, keys)
        store.flush()
        for tier in store.tiers:
            tier.delete_many(ns.digest, [keys[3]])
        used = [tier.usage_bytes() for tier in store.tiers]
        bufs = buffers(6)
        assert store.get(ns, keys, bufs) == 3
        assert_exact(keys, bufs, 3)
        assert store.lookup(ns, keys) == 3
        assert store.stats()["tree"]["orphan_drops"] == 2
        for tier, before in zip(store.tiers, used):
            if tier.shared:  # Redis: the 5 chunks left, less the 2 orphans
                assert tier.contains_many(ns.digest, keys[4:6]) == 2
                assert tier.usage_bytes() == before // 5 * 3, f"{tier.name} still counts the orphans"
            else:
                assert tier.contains_many(ns.digest, keys[4:5]) == 0, (
                    f"orphan bytes left in {tier.name}"
                )
        store.check_integrity()

    def test_delete_removes_descendants(self, make_store, stack):
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(6, 5)
        put_chain(store, ns, keys)
        store.flush()
        assert store.delete(ns, [keys[2]]) == 1
        assert store.lookup(ns, keys) == 2
        store.check_integrity()


class TestEviction:
    def test_overflow_keeps_contents_exact_and_within_capacity(self, make_store, stack):
        """Writing 3x the top tier's capacity: every chunk the store still reports reads back
        exactly; with lower tiers, demotion keeps everything the stack can hold."""
        store = make_store(stack)
        ns = new_namespace()
        chains = [chain(100 + i, 4)[1] for i in range(6)]  # 24 chunks vs a top tier of 8
        for keys in chains:
            assert put_chain(store, ns, keys) == [True] * 4
        store.flush()
        total = 0
        for keys in chains:
            bufs = buffers(4)
            n = store.get(ns, keys, bufs)
            assert_exact(keys, bufs, n)
            assert_within_capacity(store)
            total += n
        st = store.stats()["store"]
        top = store.tiers[0].name
        if len(store.tiers) == 1:
            assert total == 8 and st[f"{top}.evicted_drop"] == 16
        else:
            # write_through keeps every chunk in the last tier too, so the last tier bounds the union
            assert total == min(24, CAP_CHUNKS[store.tiers[-1].name]), "demotion lost chunks"
            assert st.get(f"{top}.evicted_demote", 0) + st.get(f"{top}.evicted_release", 0) >= 16
        store.flush()
        store.check_integrity()

    def test_write_back_demotes_byte_for_byte(self, make_store):
        """write_back: chunks reach the next tier only when evicted, and arrive intact."""
        store = make_store("mem-disk", write_policy="write_back", promote_on_hit=False)
        ns = new_namespace()
        _, first = chain(7, 4)
        put_chain(store, ns, first)
        assert residency(store, ns, first) == [["mem"]] * 4
        assert store.tiers[1].contains_many(ns.digest, first) == 0
        for i in range(4):
            put_chain(store, ns, chain(200 + i, 4)[1])  # 16 more chunks: the first chain is evicted
        assert residency(store, ns, first) == [["disk"]] * 4
        bufs = buffers(4)
        assert store.tiers[1].get_many(ns.digest, first, bufs) == [True] * 4
        assert_exact(first, bufs, 4)
        assert store.stats()["store"]["mem.evicted_demote"] >= 4
        store.check_integrity()

    def test_write_through_copies_everything_down(self, make_store):
        store = make_store("mem-disk-redis", write_policy="write_through")
        ns = new_namespace()
        _, keys = chain(8, 5)
        put_chain(store, ns, keys)
        store.flush()
        assert residency(store, ns, keys) == [["mem", "disk", "redis"]] * 5
        for tier in store.tiers:
            bufs = buffers(5)
            assert tier.get_many(ns.digest, keys, bufs) == [True] * 5
            assert_exact(keys, bufs, 5)
        store.check_integrity()

    @pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
    def test_a_chain_longer_than_the_top_tier_is_stored_whole(self, make_store, stack, write_policy):
        """Found by an audit: a put reserved the whole chain in the top tier at once and pinned the
        chain's own chunks held there, so a chain longer than the top tier (SGLang backs up 128
        pages per batch) stored only its first top-tier-full, on every retry, however much room the
        tiers below had. It now goes in runs; a single tier still stores the leading run it holds."""
        store = make_store(stack, write_policy=write_policy)
        ns = new_namespace()
        _, keys = chain(77, 14)  # the top tier holds 8; every lower tier at least 16
        for attempt in range(2):  # the second put (a retry, a backup again) keeps it all
            ok = put_chain(store, ns, keys)
            store.flush()
            stored = 8 if len(store.tiers) == 1 else 14
            assert ok == [True] * stored + [False] * (14 - stored), attempt
            assert store.lookup(ns, keys) == stored
            bufs = buffers(14)
            assert store.get(ns, keys, bufs) == stored
            assert_exact(keys, bufs, stored)
            assert_within_capacity(store)
            store.flush()
            store.check_integrity()

    def test_last_tier_drops_leaf_first(self, make_store):
        """From the last tier, eviction drops leaves first: a chain shortens from its end."""
        store = make_store("mem", chunks={"mem": 4})
        ns = new_namespace()
        _, a = chain(9, 3)
        put_chain(store, ns, a)
        _, b = chain(10, 2)
        put_chain(store, ns, b)  # needs one slot: the leaf of a goes
        assert store.lookup(ns, a) == 2
        assert store.lookup(ns, b) == 2
        store.check_integrity()


class TestPromotion:
    def test_hit_in_lower_tier_promotes_to_top(self, make_store):
        store = make_store("mem-disk", write_policy="write_back", promote_on_hit=True)
        ns = new_namespace()
        _, first = chain(11, 2)
        put_chain(store, ns, first)
        for i in range(2):
            put_chain(store, ns, chain(300 + i, 4)[1])
        assert residency(store, ns, first) == [["disk"]] * 2
        bufs = buffers(2)
        assert store.get(ns, first, bufs) == 2
        assert_exact(first, bufs, 2)
        store.flush()
        assert all("mem" in r for r in residency(store, ns, first))
        st = store.stats()["store"]
        assert st["disk.hit_chunks"] == 2 and st["mem.promotions"] == 2
        assert_within_capacity(store)
        store.check_integrity()

    def test_promote_after_hits_threshold(self, make_store):
        store = make_store("mem-disk", write_policy="write_back", promote_after_hits=2)
        ns = new_namespace()
        _, first = chain(12, 1)
        put_chain(store, ns, first)
        for i in range(2):
            put_chain(store, ns, chain(400 + i, 4)[1])
        store.get(ns, first, buffers(1))
        store.flush()
        assert residency(store, ns, first) == [["disk"]]
        store.get(ns, first, buffers(1))
        store.flush()
        assert "mem" in residency(store, ns, first)[0]
        store.check_integrity()


class TestPrefetch:
    def test_wait_returns_run_and_bytes(self, make_store, stack):
        store = make_store(stack)
        ns = new_namespace()
        _, keys = chain(13, 5)
        put_chain(store, ns, keys)
        bufs = buffers(7)
        _, longer = chain(13, 7)
        h = store.prefetch(ns, longer, bufs)
        assert h.wait(timeout_s=10) == 5
        assert h.done()
        assert_exact(longer, bufs, 5)
        store.flush()
        store.check_integrity()

    def test_cancel_before_start_releases_pins(self, make_store):
        """A cancelled prefetch never reads, returns 0, and leaves no pin behind."""
        store = make_store("mem-disk", prefetch_threads=1)
        ns = new_namespace()
        _, keys = chain(14, 3)
        put_chain(store, ns, keys)
        gate = threading.Event()
        blocker = store._reader.submit(lambda job: gate.wait(10), False)  # occupy the only reader
        bufs = buffers(3)
        h = store.prefetch(ns, keys, bufs)
        assert store.stats()["tree"]["pinned_chunks"] >= 3
        assert h.cancel() is True
        assert h.wait(timeout_s=1) == 0
        gate.set()
        blocker.wait(10)
        store.flush()
        assert store.stats()["tree"]["pinned_chunks"] == 0
        assert all(torch.all(b == 0xAB) for b in bufs)
        store.check_integrity()

    def test_pinned_chunks_survive_eviction_pressure(self, make_store):
        """Chunks pinned by a pending prefetch are not evicted by writers that need room."""
        store = make_store("mem", prefetch_threads=1)
        ns = new_namespace()
        _, keys = chain(15, 4)
        put_chain(store, ns, keys)
        gate = threading.Event()
        blocker = store._reader.submit(lambda job: gate.wait(10), False)
        bufs = buffers(4)
        h = store.prefetch(ns, keys, bufs)
        others = [chain(500 + i, 4)[1] for i in range(3)]
        for o in others:
            put_chain(store, ns, o)
        assert store.lookup(ns, keys) == 4
        gate.set()
        blocker.wait(10)
        assert h.wait(timeout_s=10) == 4
        assert_exact(keys, bufs, 4)
        store.check_integrity()


class TestConcurrency:
    @pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
    def test_eight_threads_put_get_delete(self, make_store, stack, write_policy):
        """8 threads put, get and delete over shared chains; every hit is exact, capacity holds,
        and the store is consistent afterwards."""
        store = make_store(stack, write_policy=write_policy)
        ns = new_namespace()
        chains = [chain(600 + i, 6)[1] for i in range(10)]
        errors: list[BaseException] = []
        stop_at = time.monotonic() + 1.0

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop_at:
                    keys = rng.choice(chains)
                    op = rng.random()
                    if op < 0.45:
                        cut = rng.randrange(1, 6)
                        ok = store.put(ns, keys[:cut], [payload_for(k) for k in keys[:cut]])
                        assert ok == sorted(ok, reverse=True), f"put result not a leading run: {ok}"
                    elif op < 0.9:
                        bufs = buffers(6)
                        n = store.get(ns, keys, bufs)
                        assert_exact(keys, bufs, n)
                    else:
                        store.delete(ns, [keys[rng.randrange(6)]])
                    assert_within_capacity(store)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors[0]
        store.flush()
        store.check_integrity()
        assert store.stats()["tree"]["pinned_chunks"] == 0


class TestShutdown:
    def test_close_flushes_pending_write_through(self, make_store, tmp_path):
        """close() runs queued write-through copies before closing: the disk tier got every chunk."""
        before = set(threading.enumerate())
        store = make_store("mem-disk", write_policy="write_through", chunks={"mem": 64, "disk": 64})
        ns = new_namespace()
        chains = [chain(700 + i, 4)[1] for i in range(8)]
        for keys in chains:
            put_chain(store, ns, keys)
        disk = store.tiers[1]
        store.close()
        assert store.stats()["store"].get("disk.put_chunks", 0) == 32
        assert store._writer.threads_alive() == 0 and store._reader.threads_alive() == 0
        leaked = [t.name for t in threading.enumerate() if t not in before]
        assert not leaked, leaked
        with pytest.raises(RuntimeError):
            store.put(ns, chains[0], [payload_for(k) for k in chains[0]])
        assert disk.stats().puts == 32

    def test_close_without_flush_cancels_and_joins(self, make_store):
        before = set(threading.enumerate())
        store = make_store(
            "mem-disk", write_policy="write_through", io_threads=1, chunks={"mem": 64, "disk": 64}
        )
        ns = new_namespace()
        for i in range(8):
            put_chain(store, ns, chain(800 + i, 4)[1])
        store.close(flush=False)
        store.close()  # idempotent
        leaked = [t.name for t in threading.enumerate() if t not in before]
        assert not leaked, leaked

    def test_many_stores_do_not_leak_threads(self, make_store, stack):
        before = set(threading.enumerate())
        for _ in range(3):
            store = make_store(stack)
            ns = new_namespace()
            put_chain(store, ns, chain(900, 3)[1])
            store.close()
        assert [t.name for t in threading.enumerate() if t not in before] == []


def test_chunk_bytes_constant() -> None:
    assert payload_for("a").numel() == CHUNK_BYTES


class TestDifferential:
    def test_random_ops_match_reference_model(self, make_store, stack):
        """Seeded random puts (branching chains), deletes and lookups against a brute-force model of
        prefix-closed presence, with capacities large enough that nothing is evicted."""
        store = make_store(stack, chunks={"mem": 256, "disk": 256, "redis": 256})
        ns = new_namespace()
        rng = random.Random(7)
        parent_of: dict[str, str | None] = {}
        present: set[str] = set()
        roots = [chain(1000 + i, 6) for i in range(4)]
        for step in range(150):
            tokens, keys = rng.choice(roots)
            if rng.random() < 0.3:  # branch: continue a random prefix with new tokens
                cut = rng.randrange(0, 6)
                tokens, keys = chain(5000 + step, 2, prefix=tokens[: cut * 16])
            op = rng.random()
            if op < 0.5:
                start = rng.randrange(len(keys))
                parent = keys[start - 1] if start else None
                ok = store.put(
                    ns, keys[start:], [payload_for(k) for k in keys[start:]], parent_key=parent
                )
                expect = parent is None or parent in present
                assert ok == [expect] * (len(keys) - start), (step, ok)
                if expect:
                    for i in range(start, len(keys)):
                        parent_of[keys[i]] = keys[i - 1] if i else None
                        present.add(keys[i])
            elif op < 0.65:
                k = rng.choice(keys)
                assert store.delete(ns, [k]) == (k in present)
                gone = {k}
                changed = True
                while changed:  # the model: every descendant of a deleted chunk goes too
                    new = {x for x in present if parent_of.get(x) in gone} - gone
                    gone |= new
                    changed = bool(new)
                present -= gone
            else:
                want = 0
                while want < len(keys) and keys[want] in present:
                    want += 1
                assert store.lookup(ns, keys) == want, step
                bufs = buffers(len(keys))
                assert store.get(ns, keys, bufs) == want
                assert_exact(keys, bufs, want)
        store.flush()
        store.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost", "s3fifo", "sieve", "agedref", "oddsref"])
def test_every_policy_evicts_consistently(make_store, policy):
    """Each registered policy drives eviction and demotion through the store: contents stay exact,
    capacities hold, and the tree, policies and tiers agree afterwards."""
    from radixkv.policies import POLICIES

    if policy not in POLICIES:
        pytest.skip(f"policy {policy!r} is not registered")
    store = make_store("mem-disk", policy=policy, write_policy="write_back")
    ns = new_namespace()
    chains = [chain(1200 + i, 4)[1] for i in range(6)]
    rng = random.Random(3)
    for step in range(30):
        keys = rng.choice(chains)
        if step % 3:
            put_chain(store, ns, keys)
        else:
            bufs = buffers(4)
            assert_exact(keys, bufs, store.get(ns, keys, bufs))
    store.flush()
    store.check_integrity()
