"""A memory tier holds less than its byte count says: slab slots leave a remainder per slab, and free
slots of one chunk size cannot hold another size until their slab is empty. The store must then
evict beyond the byte count (found by a review: once full, such a tier refused every put forever)."""

from __future__ import annotations

import random

import torch

from radixkv.config import StoreConfig, TierConfig
from radixkv.keys import Namespace, chunk_keys
from radixkv.store import HierarchicalStore


def payload(ns: Namespace, key: str, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(key[:8], 16) ^ int(ns.digest[:8], 16))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_slab_remainders_do_not_stop_puts(tmp_path):
    # 6000-byte chunks: each 16 KiB slab holds 2 slots and wastes 4 KiB, so the byte count admits
    # more chunks than the tier holds.
    tiers = [
        TierConfig(url="mem://", capacity_bytes=96 << 10,
                   options=dict(unit_bytes=8 << 10, slab_target_bytes=16 << 10, prefault=False)),
        TierConfig(url=f"file://{tmp_path}", capacity_bytes=10 << 20),
    ]
    ns = Namespace(model="m", dtype="uint8", layout="x", chunk_tokens=4)
    with HierarchicalStore(StoreConfig(tiers=tiers, metrics=False)) as store:
        for i in range(40):
            keys = chunk_keys([i * 7 + 1, i, 3, 4], 4)
            assert store.put(ns, keys, [payload(ns, keys[0], 6000)]) == [True], i
        store.flush(30)
        for i in range(40):  # every chunk readable, byte for byte, from whichever tier holds it
            keys = chunk_keys([i * 7 + 1, i, 3, 4], 4)
            got = torch.zeros(6000, dtype=torch.uint8)
            assert store.get(ns, keys, [got]) == 1 and torch.equal(got, payload(ns, keys[0], 6000))
        store.check_integrity()


def test_another_chunk_size_gets_room_when_free_slots_are_scattered():
    tiers = [TierConfig(url="mem://", capacity_bytes=256 << 10,
                        options=dict(unit_bytes=16 << 10, slab_target_bytes=64 << 10, prefault=False))]
    a = Namespace(model="m", dtype="uint8", layout="x", chunk_tokens=4, extra="A")
    b = Namespace(model="m", dtype="uint8", layout="x", chunk_tokens=4, extra="B")
    with HierarchicalStore(StoreConfig(tiers=tiers, metrics=False)) as store:
        akeys = [chunk_keys([i, 9, 9, 9], 4) for i in range(64)]
        for k in akeys:
            assert store.put(a, k, [payload(a, k[0], 4096)]) == [True]
        for k in random.Random(0).sample(akeys, 64):  # LRU order scattered across the slabs
            assert store.get(a, k, [torch.empty(4096, dtype=torch.uint8)]) == 1
        for i in range(16):
            k = chunk_keys([i, 7, 7, 7], 4)
            assert store.put(b, k, [payload(b, k[0], 8192)]) == [True], i
            got = torch.zeros(8192, dtype=torch.uint8)
            assert store.get(b, k, [got]) == 1 and torch.equal(got, payload(b, k[0], 8192))
        store.check_integrity()


def test_a_put_never_evicts_its_own_chunks_to_store_the_rest():
    # Found by a fuzz: the chain's first chunk, already in the top tier and its oldest leaf, was the
    # victim of the room-making for the chain's new chunks; the run then started with a hole and the
    # put stored nothing (losing the chunk it had).
    b = 512
    with HierarchicalStore(StoreConfig(tiers=[TierConfig(url="mem://", capacity_bytes=2 * b)],
                                       metrics=False)) as store:
        ns = Namespace(model="m", dtype="bfloat16", layout="page_first", chunk_tokens=16)
        p = {k: torch.full((b,), v, dtype=torch.uint8) for k, v in (("a", 1), ("b", 2), ("c", 3))}
        assert store.put(ns, ["a"], [p["a"]]) == [True]
        assert store.put(ns, ["a", "b", "c"], [p["a"], p["b"], p["c"]]) == [True, True, False]
        got = [torch.zeros(b, dtype=torch.uint8) for _ in range(2)]
        assert store.get(ns, ["a", "b"], got) == 2 and torch.equal(got[1], p["b"])
        store.check_integrity()


def test_a_restart_adopts_a_chain_split_across_two_persistent_tiers(tmp_path):
    # Found by a fuzz: with write_back over mem -> disk -> disk, the chain's head was demoted to the
    # last tier and its tail persisted by the flushing close to the middle one; adoption took one
    # tier's run per call, so the first read after a restart missed the tail.
    b = 512
    cfg = StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=b),
               TierConfig(url=f"file://{tmp_path}/d1", capacity_bytes=b + 300),
               TierConfig(url=f"file://{tmp_path}/d2", capacity_bytes=50 * (b + 300))],
        write_policy="write_back", metrics=False, promote_on_hit=False)
    ns = Namespace(model="m", dtype="bfloat16", layout="page_first", chunk_tokens=16)
    p = {k: torch.full((b,), v, dtype=torch.uint8) for k, v in (("a", 1), ("b", 2), ("c", 3))}
    with HierarchicalStore(cfg) as a:
        assert a.put(ns, ["a"], [p["a"]]) == [True]
        assert a.put(ns, ["b"], [p["b"]], parent_key="a") == [True]
        assert a.put(ns, ["c"], [p["c"]], parent_key="b") == [True]
    with HierarchicalStore(cfg) as b2:
        got = [torch.zeros(b, dtype=torch.uint8) for _ in range(3)]
        assert b2.get(ns, ["a", "b", "c"], got) == 3
        assert all(torch.equal(g, p[k]) for g, k in zip(got, "abc"))
        b2.check_integrity()
