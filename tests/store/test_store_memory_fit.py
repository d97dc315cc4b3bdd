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
