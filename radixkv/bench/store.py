"""``python -m radixkv.bench store``: the hierarchical store's overhead over the tier it sits on.

For payloads of 1 and 8 MiB (``--sizes-mib``) in batches of ``--batch`` chunks, each operation is timed
through :class:`~radixkv.store.HierarchicalStore` and directly on the same tier object, alternating
call by call so machine noise hits both alike (median of ``--reps``):

* get: ``store.get`` (one tree match, pins, one ``get_many``, accounting) vs ``tier.get_many`` into
  the same buffers;
* put: ``store.put`` (validation, room reservation, write intents, ``put_many``, tree insert) vs
  ``tier.put_many``; deleting between repetitions is untimed.

Tiers: the memory tier and the disk tier (page-cache numbers: files are fresh, never fsynced). The
ratio column is raw time / store time (1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from typing import Any, Callable

import torch

from radixkv.bench import positive_int
from radixkv.bench.tiers import _time_pair
from radixkv.config import StoreConfig, TierConfig
from radixkv.keys import Namespace
from radixkv.store import HierarchicalStore
from radixkv.tiers.registry import make_tier

__all__ = ["main"]

_MiB = 1 << 20


def _pair(
    store_fn: Callable[[], Any],
    raw_fn: Callable[[], Any],
    reset: Callable[[], Any] | None,
    reps: int,
) -> tuple[float, float]:
    """Median seconds of ``store_fn`` and ``raw_fn``, interleaved as in the tiers benchmark."""
    store_s, raw_s = _time_pair(store_fn, raw_fn, reset, reps)
    return statistics.median(store_s), statistics.median(raw_s)


def _bench_tier(
    kind: str, url: str, size_mib: int, batch: int, reps: int
) -> list[tuple[str, float, float]]:
    chunk = size_mib * _MiB
    cap = 4 * batch * (chunk + 4096)
    tier = make_tier(url, capacity_bytes=cap, name=kind)
    store = HierarchicalStore(
        StoreConfig(tiers=[TierConfig(url, cap, name=kind)], promote_on_hit=False), tiers=[tier]
    )
    ns = Namespace(model="bench-store", dtype="bfloat16", layout="page_first", chunk_tokens=64)
    keys = [f"{i:064x}" for i in range(batch)]
    raw_keys = [f"{i + batch:064x}" for i in range(batch)]
    g = torch.Generator().manual_seed(size_mib)
    payloads = [
        torch.randint(0, 256, (chunk,), dtype=torch.uint8, generator=g) for _ in range(batch)
    ]
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(batch)]
    rows = []
    try:

        def reset_put() -> None:
            store.delete(ns, keys)
            tier.delete_many(ns.digest, raw_keys)

        s, r = _pair(
            lambda: store.put(ns, keys, payloads),
            lambda: tier.put_many(ns.digest, raw_keys, payloads),
            reset_put,
            reps,
        )
        rows.append(("put", s, r))
        reset_put()
        assert all(store.put(ns, keys, payloads)) and all(
            tier.put_many(ns.digest, raw_keys, payloads)
        )
        s, r = _pair(
            lambda: store.get(ns, keys, bufs),
            lambda: tier.get_many(ns.digest, raw_keys, bufs),
            None,
            reps,
        )
        rows.append(("get", s, r))
        assert store.get(ns, keys, bufs) == batch and all(
            torch.equal(a, b) for a, b in zip(bufs, payloads)
        )
    finally:
        store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m radixkv.bench store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes-mib", type=positive_int, nargs="+", default=[1, 8])
    ap.add_argument("--batch", type=positive_int, default=8, help="chunks per call")
    ap.add_argument("--reps", type=positive_int, default=9)
    ap.add_argument(
        "--disk-dir", default=None, help="directory for the disk tier (default: a temp dir)"
    )
    args = ap.parse_args(argv)
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="radixkv-bench-store-")
    print(f"{'tier':6} {'MiB':>4} {'op':4} {'store GB/s':>10} {'raw GB/s':>9} {'raw/store':>9}")
    try:
        for size in args.sizes_mib:
            for kind, url in (("mem", "mem://"), ("disk", f"file://{disk_dir}/s{size}")):
                gb = args.batch * size * _MiB / 1e9
                for op, s, r in _bench_tier(kind, url, size, args.batch, args.reps):
                    print(f"{kind:6} {size:>4} {op:4} {gb / s:>10.2f} {gb / r:>9.2f} {r / s:>9.2f}")
    finally:
        # The chunk files stay after the tiers close (a disk tier keeps them for the next start):
        # a default run left 2 x 8 x (1 + 8) MiB in /tmp every time. A --disk-dir given stays.
        if args.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    return 0
