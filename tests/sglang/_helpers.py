"""Shared helpers for the SGLang backend tests (not a test module)."""

from __future__ import annotations

import random

RADIXKV_BACKEND = {
    "backend_name": "radixkv",
    "module_path": "radixkv.adapters.sglang",
    "class_name": "RadixKVStore",
    "hicache_storage_pass_prefix_keys": True,
}


def extra_config(tiers, interface_v1=1, **more):
    cfg = dict(RADIXKV_BACKEND)
    cfg.update({"interface_v1": interface_v1, "tiers": tiers, "io_threads": 1, "prefetch_threads": 1})
    cfg.update(more)
    return cfg


def mem_tier(capacity="256MiB"):
    return {"url": "mem://", "capacity": capacity}


def disk_tier(path, capacity="256MiB", shared=False):
    tier = {"url": f"file://{path}", "capacity": capacity}
    if shared:
        tier["options"] = {"shared": True}
    return tier


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 100_000) for _ in range(n)]


def unwrap(backend):
    """The RadixKVStore under SGLang's failure injector, if any."""
    return getattr(backend, "_backend", backend)
