"""Memory-tier specifics: slab slots per namespace size, capacity bound, leases and deferred free."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from radixkv.errors import CapacityError, ConfigError, InputError
from radixkv.tiers.memory import MemoryTier, MemoryTierConfig
from radixkv.tiers.registry import make_tier

KiB = 1 << 10


def pl(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.fixture
def small() -> MemoryTier:
    """64 KiB buffer in 8 KiB units; slabs prefer 32 KiB."""
    t = MemoryTier(capacity_bytes=64 * KiB, unit_bytes=8 * KiB, slab_target_bytes=32 * KiB)
    yield t
    t.check_integrity()
    t.close()


class TestSizes:
    def test_namespace_slot_size_is_fixed_by_first_put(self, small):
        """A later payload of another size names both sizes."""
        small.put_many("ns", ["a"], [pl(1, 4 * KiB)])
        with pytest.raises(InputError, match=r"6144 bytes.*4096-byte"):
            small.put_many("ns", ["b"], [pl(2, 6 * KiB)])
        assert small.contains_many("ns", ["b"]) == 0
        # another namespace may use another size
        assert small.put_many("other", ["b"], [pl(2, 6 * KiB)]) == [True]

    def test_mixed_sizes_in_first_batch_rejected(self, small):
        """The first batch fixes the size too: mixed sizes in it are refused, nothing stored."""
        with pytest.raises(InputError, match="4096"):
            small.put_many("ns", ["a", "b"], [pl(1, 4 * KiB), pl(2, 2 * KiB)])
        assert small.contains_many("ns", ["a"]) == 0
        small.clear()

    def test_wrong_buffer_size_on_get(self, small):
        """get_many names both sizes when the buffer does not match the namespace's chunks."""
        small.put_many("ns", ["a"], [pl(1, 4 * KiB)])
        with pytest.raises(InputError, match=r"2048 bytes.*4096"):
            small.get_many("ns", ["a"], [torch.empty(2 * KiB, dtype=torch.uint8)])

    def test_bad_buffer_leaves_no_reader_behind(self, small):
        """An InputError on the 2nd buffer must not leave the 1st chunk's slot leased."""
        small.put_many("ns", ["a"], [pl(1, 4 * KiB)])
        with pytest.raises(InputError):
            small.get_many("ns", ["a", "b"], [torch.empty(4 * KiB, dtype=torch.uint8),
                                              torch.empty(2 * KiB, dtype=torch.uint8)])
        small.delete_many("ns", ["a"])
        assert small.stats().extra["leased_dead_slots"] == 0
        assert small.usage_bytes() == 0

    def test_clear_namespace_resets_its_size(self, small):
        """After clear(ns) the namespace may take a new size."""
        small.put_many("ns", ["a"], [pl(1, 4 * KiB)])
        small.clear("ns")
        assert small.put_many("ns", ["a"], [pl(1, 2 * KiB)]) == [True]

    def test_clear_of_a_namespace_does_not_scan_the_others(self, small):
        """clear(ns) visits that namespace's chunks only: it scanned the whole index, under the
        tier's lock (every get and put of every namespace waits), per namespace cleared (an engine
        clears each weight version's, SGLang's clear() every retired one)."""
        small.put_many("keep", [f"k{i}" for i in range(8)], [pl(1, KiB)] * 8)
        small.put_many("ns", ["a", "b"], [pl(1, KiB)] * 2)

        class NoScan(dict):
            def __iter__(self):
                raise AssertionError("clear(ns) iterated the whole index")

            keys = values = items = __iter__

        small._index = NoScan(small._index)
        small.clear("ns")
        small.clear("never-held")
        small._index = dict(dict.items(small._index))
        assert small.contains_many("ns", ["a"]) == 0 and small.contains_many("keep", ["k0", "k7"]) == 2
        assert small.stats().extra["chunks"] == 8
        small.check_integrity()

    def test_capacity_smaller_than_one_chunk(self):
        """A chunk larger than the whole buffer is a CapacityError with the numbers."""
        t = MemoryTier(capacity_bytes=16 * KiB)
        with pytest.raises(CapacityError, match=r"20480-byte chunk.*16384"):
            t.put_many("ns", ["a"], [pl(1, 20 * KiB)])
        t.check_integrity()

    @pytest.mark.parametrize("bad", [None, 5, "", "a/b", "model/v1 \u00e9", "a.b", "a:b", "x" * 129], ids=repr)
    @pytest.mark.parametrize("op", ["put_many", "get_many", "lease", "get_views", "contains_many",
                                    "delete_many", "clear"])
    def test_every_call_refuses_a_namespace_the_disk_tier_cannot_store(self, small, op, bad):
        """Found by an audit: the memory tier took any non-empty str as a namespace ("model/v1 é"),
        which the disk tier refuses, so a chunk it held failed only later, when an eviction demoted
        it. Namespaces are checked like keys (radixkv.keys.KEY_RE), before anything is stored."""
        if op == "clear" and bad is None:
            pytest.skip("clear(None) clears every namespace")
        small.put_many("ns", ["a"], [pl(1, KiB)])
        args = {"put_many": (["k"], [pl(1, KiB)]), "get_many": (["k"], [torch.empty(KiB, dtype=torch.uint8)]),
                "clear": ()}.get(op, (["k"],))
        if op == "clear":  # clear only drops what is held: an unknown namespace holds nothing
            getattr(small, op)(bad)
        else:
            with pytest.raises(InputError, match=r"namespace=.* must be 1-128 chars"):
                getattr(small, op)(bad, *args)
        assert small.contains_many("ns", ["a"]) == 1 and small.stats().puts == 1

    @pytest.mark.parametrize("capacity_mib, chunk_mib, fits", [(3, 3, 1), (7, 7, 1), (5, 1, 5), (10, 3, 3)])
    def test_the_whole_capacity_holds_chunks(self, capacity_mib, chunk_mib, fits):
        """Found by an audit: the part of the capacity past the last whole 2 MiB unit was never used
        (a 3 MiB tier refused a 3 MiB chunk with a CapacityError, a 5 MiB tier held four 1 MiB
        chunks), and a slab was at most a quarter of the tier, so a 10 MiB tier held two 3 MiB chunks
        (one per 4 MiB slab). The last unit is shorter; a slab may take two slots past the quarter."""
        MiB = 1 << 20
        t = MemoryTier(capacity_bytes=capacity_mib * MiB, prefault=False)
        try:
            keys = [f"k{i}" for i in range(fits + 1)]
            data = [pl(i, chunk_mib * MiB) for i in range(fits + 1)]
            assert t.put_many("ns", keys, data) == [True] * fits + [False]
            assert t.usage_bytes() == fits * chunk_mib * MiB <= t.capacity_bytes
            assert t.stats().extra["slab_bytes"] <= t.capacity_bytes
            outs = [torch.zeros(chunk_mib * MiB, dtype=torch.uint8) for _ in range(fits)]
            assert t.get_many("ns", keys[:fits], outs) == [True] * fits
            assert all(torch.equal(o, d) for o, d in zip(outs, data))
            t.check_integrity()
            assert t.delete_many("ns", keys) == fits  # the units return: another size uses them all
            assert t.put_many("other", ["big"], [pl(9, capacity_mib * MiB)]) == [True]
            t.check_integrity()
        finally:
            t.close()

    def test_a_chunk_as_large_as_the_tier_fits_and_one_byte_more_does_not(self):
        t = MemoryTier(capacity_bytes=3 * KiB + 5, unit_bytes=KiB, prefault=False)
        with pytest.raises(CapacityError,
                           match=r"3078-byte chunk .* capacity 3077 bytes; raise capacity_bytes to at least 3078"):
            t.put_many("ns", ["a"], [pl(1, 3 * KiB + 6)])
        assert t.put_many("ns", ["a"], [pl(1, 3 * KiB + 5)]) == [True]
        assert t.usage_bytes() == t.capacity_bytes
        t.check_integrity()

    def test_a_store_puts_a_chunk_as_large_as_its_memory_tier(self):
        """The store checks a tier's capacity against one chunk (radixkv/store_checks.py); the tier
        then stores it, instead of raising CapacityError from inside the store's put."""
        from radixkv.config import StoreConfig, TierConfig
        from radixkv.keys import Namespace
        from radixkv.store import HierarchicalStore

        MiB = 1 << 20
        st = HierarchicalStore(StoreConfig(tiers=[TierConfig(url="mem://?prefault=0", capacity_bytes=7 * MiB)]))
        try:
            ns = Namespace(model="m", dtype="float16", layout="x", chunk_tokens=16)
            assert st.put(ns, ["ab" * 32], [pl(1, 7 * MiB)]) == [True]
        finally:
            st.close()

    def test_empty_payload_rejected(self, small):
        with pytest.raises(InputError, match="empty"):
            small.put_many("ns", ["a"], [torch.empty(0, dtype=torch.uint8)])

    @pytest.mark.parametrize("bad", [None, 5, "", ("x",), b"k", "a/b", "a b", "\u00e9", "k\n", "x" * 129],
                             ids=repr)
    @pytest.mark.parametrize("op", ["put_many", "get_many", "lease", "get_views", "contains_many",
                                    "delete_many"])
    def test_every_call_refuses_a_key_the_other_tiers_cannot_store(self, small, op, bad):
        """Keys are checked like the disk tier checks them (radixkv.keys.KEY_RE), in any position of a
        batch, before anything is stored: the error names the key."""
        small.put_many("ns", ["a"], [pl(1, KiB)])
        keys = ["a", bad, "b"]
        args = {"put_many": ([pl(1, KiB)] * 3,), "get_many": ([torch.empty(KiB, dtype=torch.uint8)
                                                               for _ in keys],)}.get(op, ())
        with pytest.raises(InputError, match=r"key .* must be 1-128 chars"):
            getattr(small, op)("ns", keys, *args)
        assert small.contains_many("ns", ["a"]) == 1 and small.contains_many("ns", ["b"]) == 0
        assert small.stats().puts == 1

    def test_keys_that_the_other_tiers_store_are_taken(self, small):
        keys = ["0" * 64, "a-b_C9", "x" * 128, "k"]
        assert small.put_many("ns", tuple(keys), [pl(i, KiB) for i in range(4)]) == [True] * 4
        assert small.contains_many("ns", keys) == 4
        assert small.contains_many("ns", []) == 0
        with pytest.raises(InputError, match="sequence of str keys"):
            small.contains_many("ns", None)

    @pytest.mark.parametrize("bad", [0, -1, 1.5, True])
    def test_bad_capacity(self, bad):
        with pytest.raises(ConfigError, match="capacity_bytes"):
            MemoryTierConfig(capacity_bytes=bad)

    @pytest.mark.parametrize("option", ["pin", "prefault", "huge_pages"])
    @pytest.mark.parametrize("bad", ["false", "true", 0, 1, ""], ids=repr)
    def test_a_switch_that_is_not_a_bool_is_a_config_error(self, option, bad):
        """Found by an audit: huge_pages="false" (a true str) turned huge pages on, and pin="false"
        failed with "pin=True needs CUDA". Switches are True or False (pin also None); the URL form
        parses strings (mem://?pin=false)."""
        with pytest.raises(ConfigError, match=rf"MemoryTierConfig\.{option}={bad!r} must be True"):
            MemoryTierConfig(capacity_bytes=KiB, **{option: bad})

    def test_a_capacity_the_host_cannot_allocate_is_a_config_error(self):
        """Found by an audit: torch's RuntimeError ("can't allocate memory") came out of make_tier
        (mem://?capacity=100TiB). 300,000 TiB exceeds even a 57-bit address space, so no overcommit
        setting lets the mapping succeed here."""
        with pytest.raises(ConfigError,
                           match=r"cannot allocate capacity_bytes=329853488332800000 .*lower capacity_bytes"):
            make_tier("mem://?capacity=300000TiB&prefault=0")
        with pytest.raises(ConfigError, match="cannot allocate"):
            MemoryTier(capacity_bytes=300000 << 40, prefault=False, huge_pages=False, pin=False)

    def test_pin_true_without_cuda_is_config_error(self):
        if torch.cuda.is_available():
            pytest.skip("CUDA present: pinning works")
        with pytest.raises(ConfigError, match="pin=True needs CUDA"):
            MemoryTier(capacity_bytes=KiB, pin=True)

    def test_registry_url(self):
        t = make_tier("mem://?capacity=1MiB&unit=64KiB&slab=256KiB&pin=false")
        assert isinstance(t, MemoryTier)
        assert (t.capacity_bytes, t.config.unit_bytes, t.config.slab_target_bytes) == (1 << 20, 64 * KiB, 256 * KiB)
        assert not t.pinned


class TestCapacity:
    def test_full_tier_refuses_puts_and_never_exceeds(self, small):
        """16 x 4 KiB fill 64 KiB; the 17th is refused; freeing one slot lets it in."""
        keys = [f"k{i}" for i in range(17)]
        ok = small.put_many("ns", keys, [pl(i, 4 * KiB) for i in range(17)])
        assert ok == [True] * 16 + [False]
        assert small.usage_bytes() == 64 * KiB == small.capacity_bytes
        st = small.stats()
        assert st.put_failures == 1 and st.extra["full_refusals"] == 1
        assert small.delete_many("ns", ["k3"]) == 1
        assert small.put_many("ns", ["k16"], [pl(16, 4 * KiB)]) == [True]
        outs = [torch.empty(4 * KiB, dtype=torch.uint8) for _ in keys]
        hits = small.get_many("ns", keys, outs)
        for i, (h, o) in enumerate(zip(hits, outs)):
            assert h == (i != 3)
            if h:
                assert torch.equal(o, pl(i, 4 * KiB))

    def test_slabs_return_to_pool_for_other_sizes(self, small):
        """Units held by one size class are reusable by another size once its slabs empty."""
        small.put_many("a", [f"k{i}" for i in range(16)], [pl(i, 4 * KiB) for i in range(16)])
        assert small.put_many("b", ["x"], [pl(99, 16 * KiB)]) == [False]
        small.delete_many("a", [f"k{i}" for i in range(16)])
        assert small.usage_bytes() == 0
        # Slabs are at most 1/4 of the tier (here 16 KiB): 4 slabs, all empty, which keep their
        # size until another size class needs the units.
        assert small.stats().extra["slabs"] == 4
        small.check_integrity()
        keys = [f"x{i}" for i in range(4)]
        assert small.put_many("b", keys, [pl(i, 16 * KiB) for i in range(4)]) == [True] * 4
        assert small.usage_bytes() == 64 * KiB
        assert small.put_many("a", ["k0"], [pl(0, 4 * KiB)]) == [False]  # now b holds every unit

    def test_put_delete_cycles_reuse_the_slab(self, small):
        """Deleting the last chunk keeps the slab: the next put reuses it (same slot, same bytes)."""
        small.put_many("a", ["k"], [pl(1, 4 * KiB)])
        before = small.get_views("a", ["k"])[0].data_ptr()
        for i in range(5):
            small.delete_many("a", ["k"])
            assert small.put_many("a", ["k"], [pl(i, 4 * KiB)]) == [True]
            assert small.get_views("a", ["k"])[0].data_ptr() == before
            assert torch.equal(small.get_views("a", ["k"])[0], pl(i, 4 * KiB))
        assert small.stats().extra["slabs"] == 1

    def test_odd_slot_size_packs_slabs(self):
        """A 3 KiB slot size in 8 KiB units: slabs take whole runs, waste stays below one slot each."""
        t = MemoryTier(capacity_bytes=64 * KiB, unit_bytes=8 * KiB, slab_target_bytes=64 * KiB)
        ok = t.put_many("ns", [f"k{i}" for i in range(30)], [pl(i, 3 * KiB) for i in range(30)])
        # Slabs of 16 KiB (1/4 of the tier) hold 5 slots each: 4 slabs, waste below one slot each.
        assert sum(ok) == 20 and t.stats().extra["slabs"] == 4
        t.check_integrity()

    @pytest.mark.parametrize("slot_bytes", [17_568, 35_136, 14 * KiB, 32 * KiB, 80 * KiB])
    def test_a_tier_holds_what_its_bytes_hold(self, slot_bytes):
        """The geometry of real KV chunks scaled down 1024x (2 MiB units, 64 MiB slabs: DeepSeek-V3
        chunks of 256 and 512 tokens, Qwen2.5-7B, Llama-3-8B and -70B chunks of 256 tokens): the tier
        holds as many chunks as its bytes do (a slab wastes less than one slot, and its size is chosen
        to waste little). Before, every slab took the target size: a 17.2 MiB chunk left 12.5 MiB of
        each 64 MiB slab unused (24 chunks where 512 MiB hold 29), a 34.3 MiB one 29.7 MiB (8 where
        14 fit); the simulator, counting a byte capacity in whole chunks, expected what the bytes hold."""
        t = MemoryTier(capacity_bytes=512 * KiB, unit_bytes=2 * KiB, slab_target_bytes=64 * KiB)
        n = 512 * KiB // slot_bytes
        ok = t.put_many("ns", [f"k{i}" for i in range(n + 1)], [pl(i, slot_bytes) for i in range(n + 1)])
        assert sum(ok) == n and not ok[-1], f"{sum(ok)} chunks of {slot_bytes} bytes in 512 KiB; its bytes hold {n}"
        t.check_integrity()


class TestLeases:
    def test_views_are_zero_copy(self, small):
        """get_views and lease views alias the tier's buffer (no copy)."""
        p = pl(1, 4 * KiB)
        small.put_many("ns", ["a"], [p])
        v1 = small.get_views("ns", ["a", "missing"])
        assert v1[1] is None and torch.equal(v1[0], p)
        with small.lease("ns", ["a"]) as lease:
            assert lease.views[0].data_ptr() == v1[0].data_ptr()
        assert small.stats().extra["leased_dead_slots"] == 0

    def test_deleted_leased_slot_is_not_reused_until_release(self, small):
        """Delete while leased: key gone at once, slot freed only at release, view keeps its bytes."""
        keys = [f"k{i}" for i in range(16)]
        small.put_many("ns", keys, [pl(i, 4 * KiB) for i in range(16)])
        lease = small.lease("ns", ["k5"])
        small.delete_many("ns", ["k5"])
        assert small.contains_many("ns", ["k5"]) == 0
        assert small.put_many("ns", ["new"], [pl(100, 4 * KiB)]) == [False]  # k5's slot is still leased
        small.check_integrity()
        assert torch.equal(lease.views[0], pl(5, 4 * KiB))
        lease.release()
        lease.release()  # idempotent
        assert small.stats().extra["deferred_frees"] == 1
        assert small.put_many("ns", ["new"], [pl(100, 4 * KiB)]) == [True]
        out = [torch.empty(4 * KiB, dtype=torch.uint8)]
        assert small.get_many("ns", ["new"], out) == [True] and torch.equal(out[0], pl(100, 4 * KiB))

    def test_clear_while_leased(self, small):
        small.put_many("ns", ["a", "b"], [pl(1, 4 * KiB), pl(2, 4 * KiB)])
        with small.lease("ns", ["a", "b", "c"]) as lease:
            assert lease.views[2] is None
            small.clear()
            small.check_integrity()
            assert small.usage_bytes() == 8 * KiB
        assert small.usage_bytes() == 0

    def test_threads_lease_delete_put(self, small):
        """8 threads leasing, deleting and re-putting: a leased view never changes under its reader."""
        keys = [f"k{i}" for i in range(12)]
        expect = {k: pl(i, 4 * KiB) for i, k in enumerate(keys)}
        bad: list[str] = []
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    batch = rng.sample(keys, 3)
                    r = rng.random()
                    if r < 0.4:
                        small.put_many("ns", batch, [expect[k] for k in batch])
                    elif r < 0.6:
                        small.delete_many("ns", batch)
                    else:
                        with small.lease("ns", batch) as lease:
                            for k, v in zip(batch, lease.views):
                                if v is not None and not torch.equal(v, expect[k]):
                                    bad.append(k)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and not bad, (errors, bad)
        small.check_integrity()
        assert small.stats().extra["leased_dead_slots"] == 0


@pytest.mark.gpu
def test_buffer_pinned_with_cuda():
    """With CUDA the buffer is page-locked by default."""
    t = MemoryTier(capacity_bytes=1 << 20)
    assert t.pinned and t._buffer.is_pinned()
    p = pl(1, 64 * KiB)
    t.put_many("ns", ["a"], [p])
    out = [torch.empty(64 * KiB, dtype=torch.uint8)]
    assert t.get_many("ns", ["a"], out) == [True] and torch.equal(out[0], p)
    t.check_integrity()


@pytest.mark.parametrize("huge", [True, False])
def test_huge_page_buffer_round_trip(huge):
    """An unpinned buffer is an anonymous mapping advised MADV_HUGEPAGE (or plain torch memory when
    off); either way a chunk spanning 2 MiB boundaries round-trips exactly and the advice is reported."""
    t = MemoryTier(capacity_bytes=8 << 20, unit_bytes=2 << 20, huge_pages=huge)
    try:
        assert t.stats().extra["huge_pages"] == int(t.huge_pages)
        assert t.huge_pages == (huge and hasattr(__import__("mmap"), "MADV_HUGEPAGE"))
        p = pl(3, 3 << 20)
        assert t.put_many("ns", ["a"], [p]) == [True]
        out = torch.zeros(3 << 20, dtype=torch.uint8)
        assert t.get_many("ns", ["a"], [out]) == [True] and torch.equal(out, p)
        t.check_integrity()
    finally:
        t.close()


class TestParallelCopies:
    def test_large_batches_round_trip_on_several_threads(self):
        """Batches past the 4 MiB threshold are copied by several threads: still byte for byte."""
        MiB = 1 << 20
        t = make_tier("mem://?capacity=64MiB&copy_threads=3")
        assert t.config.copy_threads == 3
        try:
            keys = [f"k{i}" for i in range(5)]
            data = [pl(i, 3 * MiB + 512) for i in range(5)]
            assert t.put_many("ns", keys, data) == [True] * 5
            outs = [torch.zeros(3 * MiB + 512, dtype=torch.uint8) for _ in keys]
            assert t.get_many("ns", keys[::-1], outs) == [True] * 5
            for o, d in zip(outs, data[::-1]):
                assert torch.equal(o, d)
            t.check_integrity()
        finally:
            t.close()

    @pytest.mark.parametrize("bad", [0, -2, 2.0, False])
    def test_bad_copy_threads(self, bad):
        with pytest.raises(ConfigError, match="copy_threads"):
            MemoryTierConfig(capacity_bytes=KiB, copy_threads=bad)


class TestClearRaces:
    def test_a_put_overtaken_by_clear_publishes_nothing(self, monkeypatch):
        # Found by a review: a put copying across clear(ns) published its slot afterwards, so a
        # later put of another size left two slot sizes in one namespace (and InputErrors).
        import threading
        import time

        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False, copy_threads=1)
        real = tier._copier.copy_spans
        entered = threading.Event()

        def slow(spans, checked=False):
            entered.set()
            time.sleep(0.2)
            return real(spans, checked)

        monkeypatch.setattr(tier._copier, "copy_spans", slow)
        out: list[list[bool]] = []
        th = threading.Thread(target=lambda: out.append(tier.put_many("ns", ["old"], [torch.ones(4096, dtype=torch.uint8)])))
        th.start()
        entered.wait(5)
        tier.clear("ns")
        monkeypatch.setattr(tier._copier, "copy_spans", real)
        assert tier.put_many("ns", ["new"], [torch.ones(8192, dtype=torch.uint8)]) == [True]
        th.join()
        assert out == [[False]] and tier.contains_many("ns", ["old"]) == 0
        got = torch.zeros(8192, dtype=torch.uint8)
        assert tier.get_many("ns", ["new"], [got]) == [True] and bool(got.eq(1).all())
        tier.check_integrity()
        tier.close()

    def test_a_cleared_namespace_leaves_no_generation_behind(self, monkeypatch):
        """A clear's generation is kept only while puts of the namespace are copying: one entry per
        namespace ever cleared was kept for the life of the tier (an engine clearing a namespace
        per weight version). A put that a clear overtook still publishes nothing."""
        import threading

        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False, copy_threads=1)
        for v in range(50):
            assert tier.put_many(f"v{v}", ["a"], [torch.ones(4096, dtype=torch.uint8)]) == [True]
            tier.clear(f"v{v}")
            tier.clear(f"never-held-{v}")
        assert tier._ns_gen == {}
        real = tier._copier.copy_spans
        entered, go = threading.Event(), threading.Event()

        def slow(spans, checked=False):
            entered.set()
            go.wait(5)
            return real(spans, checked)

        monkeypatch.setattr(tier._copier, "copy_spans", slow)
        out: list[list[bool]] = []
        th = threading.Thread(target=lambda: out.append(tier.put_many("ns", ["old"], [torch.ones(4096, dtype=torch.uint8)])))
        th.start()
        entered.wait(5)
        tier.clear("ns")
        assert tier._ns_gen == {"ns": 1}  # the put copying must see it
        go.set()
        th.join()
        assert out == [[False]] and tier.contains_many("ns", ["old"]) == 0
        assert tier._ns_gen == {}
        tier.check_integrity()
        tier.close()

    def test_a_namespace_without_chunks_takes_a_new_size(self):
        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False)
        assert tier.put_many("ns", ["a"], [torch.ones(4096, dtype=torch.uint8)]) == [True]
        assert tier.delete_many("ns", ["a"]) == 1
        assert tier.put_many("ns", ["b"], [torch.ones(8192, dtype=torch.uint8)]) == [True]
        tier.check_integrity()
        tier.close()


class TestPartsCopyChecks:
    """The memory tier skips the general overlap check when its own invariants prove the copy safe
    (slots are disjoint; caller memory outside its buffer): caller memory inside the buffer still
    gets the full check."""

    def test_put_from_a_lease_view_of_the_same_tier(self):
        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False)
        src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
        assert tier.put_many("ns", ["a"], [src]) == [True]
        with tier.lease("ns", ["a"]) as lease:
            view = lease.views[0]
            assert tier.put_many("ns", ["b"], [(view[:100], view[100:])]) == [True]
        out = torch.zeros(4096, dtype=torch.uint8)
        assert tier.get_many("ns", ["b"], [out]) == [True] and torch.equal(out, src)
        tier.check_integrity()
        tier.close()

    def test_get_into_the_chunks_own_slot_is_refused(self):
        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False)
        assert tier.put_many("ns", ["a"], [torch.ones(4096, dtype=torch.uint8)]) == [True]
        view = tier.get_views("ns", ["a"])[0]
        with pytest.raises(InputError, match="overlap"):
            tier.get_many("ns", ["a"], [(view[:10], view[10:])])
        tier.check_integrity()  # the reader count was released
        tier.close()

    def test_chunk_parts_are_validated_once_and_round_trip(self):
        from radixkv.tiers.base import ChunkParts

        with pytest.raises(InputError, match=r"page\[3\]\[1\]"):
            ChunkParts([torch.zeros(4, dtype=torch.uint8), torch.zeros(4)], "page", 3)
        base = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
        parts = ChunkParts([base[:1000], base[1000:]])
        assert parts.nbytes == 4096 and parts.spans[1] == (base[1000:].data_ptr(), 3096)
        tier = MemoryTier(capacity_bytes=1 << 20, unit_bytes=64 << 10, prefault=False)
        assert tier.put_many("ns", ["a"], [parts]) == [True]
        out = torch.zeros(4096, dtype=torch.uint8)
        assert tier.get_many("ns", ["a"], [ChunkParts([out[:7], out[7:]])]) == [True]
        assert torch.equal(out, base)
        tier.close()


class _Trap:
    """A slab id no code may compare: a read of the unit it owns raises."""

    def _refuse(self, other: object) -> bool:
        raise AssertionError("read the owner of a unit allocated before this put")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = None  # type: ignore[assignment]


class _NoIterSet(set):
    def __iter__(self):
        raise AssertionError("iterated every partial slab of the slot size")


class TestScaling:
    """Per-put work of a large tier: bounded by the put, not by the tier's units or slabs. (A 200 GiB
    tier has 10^5 units of 2 MiB and thousands of slabs.)"""

    @staticmethod
    def tier(units: int, slab_units: int) -> MemoryTier:
        return MemoryTier(capacity_bytes=units * 4 * KiB, unit_bytes=4 * KiB, slab_target_bytes=slab_units * 4 * KiB,
                          prefault=False, huge_pages=False, pin=False)

    def test_a_new_slab_is_found_without_reading_the_units_of_older_slabs(self):
        """Every new slab scanned the units from unit 0, so filling a tier was quadratic in its
        units (a 1000-chunk put took 82 -> 178 ms as the tier grew from 10^3 to 3*10^4 units)."""
        t = self.tier(256, 4)
        p = pl(1, KiB)
        t.put_many("ns", [f"k{i}" for i in range(16 * 10)], [p] * 160)  # 10 full slabs of 16 slots
        newest = max(t._slabs)
        saved = list(t._unit_owner)
        for u, sid in enumerate(saved):
            if 0 <= sid < newest:
                t._unit_owner[u] = _Trap()
        try:
            assert t.put_many("ns", [f"n{i}" for i in range(40)], [p] * 40) == [True] * 40  # 3 new slabs
        finally:
            t._unit_owner[: len(saved)] = [o if not isinstance(o, _Trap) else s for o, s in zip(t._unit_owner, saved)]
        t.check_integrity()

    def test_a_put_into_a_full_tier_looks_for_room_once_per_size(self, monkeypatch):
        """Each refused chunk of a batch searched the whole tier again (O(units) each: a 1000-chunk put
        refused by a full 3*10^4-unit tier took ~1 s); nothing frees room while the batch holds the lock."""
        t = self.tier(64, 4)
        p = pl(1, KiB)
        assert all(t.put_many("ns", [f"k{i}" for i in range(256)], [p] * 256))
        calls = []
        alloc = MemoryTier._alloc
        monkeypatch.setattr(MemoryTier, "_alloc", lambda self, n: calls.append(n) or alloc(self, n))
        assert t.put_many("ns", [f"x{i}" for i in range(100)], [p] * 100) == [False] * 100
        assert calls == [KiB]
        t.check_integrity()

    def test_a_put_takes_the_lowest_partial_slab_without_a_scan_of_every_one(self):
        """``min()`` over the slabs with a free slot, per chunk: after evictions freed slots all over a
        large tier, a put of k chunks cost O(k * partial slabs)."""
        t = self.tier(64, 1)
        p = pl(1, KiB)
        t.put_many("ns", [f"k{i}" for i in range(256)], [p] * 256)  # 64 slabs of 4 slots
        t.delete_many("ns", [f"k{i}" for i in range(0, 256, 8)])  # a free slot in every other slab
        lowest = min(t._partial[KiB])
        t._partial[KiB] = _NoIterSet(t._partial[KiB])
        try:
            assert t.put_many("ns", ["a", "b"], [p, p]) == [True, True]
        finally:
            t._partial[KiB] = set(t._partial[KiB] | set())
        assert t._index["ns"]["a"].slab_id == lowest  # the lowest slab first, as before
        t.check_integrity()
