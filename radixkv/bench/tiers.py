"""``python -m radixkv.bench tiers``: put/get throughput and latency of each tier beside its raw baseline.

For payloads of 1, 8 and 32 MiB (``--sizes-mib``) and calls of one chunk and of ``--batch-mib`` worth
of chunks, each tier is timed beside the plain way of moving the same bytes, alternating call by call
so machine noise hits both alike:

* memory tier vs a plain copy of the same bytes into/out of preallocated tensors, glibc ``memmove``
  (12-15% faster here than ``torch``'s ``copy_``) on as many threads as the tier copies on: calls of
  4 MiB and more are cut into 4 MiB pieces spread over :func:`radixkv.hostcopy.default_copy_threads`
  threads, as :mod:`radixkv.hostcopy` does for the tier;
* disk tier (framing + xxh3 checksum + a recycled or temp file + rename; verified ``preadv`` into the
  caller's tensor) vs plain ``open/write`` and ``open/readinto`` of the same bytes in the same
  directory (``--disk-dir``, default a fresh temp dir under /tmp), on as many threads as the tier's
  ``--io-threads``; the plain puts overwrite the previous rep's files in place (the tier reuses removed
  files too, so neither side allocates new page-cache pages per rep);
* Redis tier vs redis-py pipelined ``SET``/``GET`` on the same server, via
  :func:`radixkv.bench._redis_tier.bench_redis` (``--redis-url``; without it a private redis-server is
  started when ``redis-server`` is on PATH; ``--tiers`` drops it).

Deleting between repetitions is untimed (a put of a present key is a no-op). Disk numbers are page-cache
numbers: files are fresh but never forced to the device (``fsync`` off, the tier's default), and reads
hit the page cache (dropping caches needs privileges a benchmark should not use). GB/s = bytes per call
/ median call time; p50/p99 are per-call latencies.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from radixkv.bench import machine_line, positive_int, positive_list
from radixkv.errors import ConfigError
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.memory import MemoryTier

__all__ = ["main"]

_MiB = 1 << 20
TARGETS = {"memory": 0.90, "disk": 0.80, "redis": 0.80}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _time_pair(tier_fn: Callable[[], Any], base_fn: Callable[[], Any], reset: Callable[[], Any] | None,
               reps: int) -> tuple[list[float], list[float]]:
    tier_s: list[float] = []
    base_s: list[float] = []
    for i in range(reps + 1):  # the first round warms up both sides and is dropped
        for fn, out in ((tier_fn, tier_s), (base_fn, base_s)) if i % 2 else ((base_fn, base_s), (tier_fn, tier_s)):
            if reset is not None:
                reset()
            t0 = time.perf_counter()
            fn()
            if i:
                out.append(time.perf_counter() - t0)
    return tier_s, base_s


def _row(tier: str, size: int, batch: int, op: str, t: list[float], b: list[float]) -> dict:
    call_bytes = size * batch
    tier_gbps = call_bytes / statistics.median(t) / 1e9
    base_gbps = call_bytes / statistics.median(b) / 1e9
    return {"tier": tier, "size_bytes": size, "batch": batch, "op": op, "tier_gbps": tier_gbps,
            "base_gbps": base_gbps, "ratio": tier_gbps / base_gbps,
            "tier_p50_ms": _pct(t, 0.5) * 1e3, "tier_p99_ms": _pct(t, 0.99) * 1e3,
            "base_p50_ms": _pct(b, 0.5) * 1e3, "base_p99_ms": _pct(b, 0.99) * 1e3}


def _payloads(size: int, batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(size + batch)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(batch)]


def _run_threads(jobs: list[Callable[[], Any]], threads: int) -> None:
    """Run ``jobs`` on ``threads`` threads (the calling one included), job i on thread i % threads."""
    if threads <= 1 or len(jobs) <= 1:
        for j in jobs:
            j()
        return
    from concurrent.futures import ThreadPoolExecutor

    shares = [jobs[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(threads - 1) as ex:
        futs = [ex.submit(lambda sh=sh: [j() for j in sh]) for sh in shares[1:]]
        for j in shares[0]:
            j()
        for f in futs:
            f.result()


def _memmove_jobs(pairs: list[tuple[int, int]], size: int) -> list[Callable[[], Any]]:
    """memmove jobs for (dst, src) payload addresses: 4 MiB pieces, as the tier's copier cuts them."""
    from radixkv.hostcopy import _PIECE_BYTES

    jobs: list[Callable[[], Any]] = []
    for d, s in pairs:
        for off in range(0, size, _PIECE_BYTES):
            n = min(_PIECE_BYTES, size - off)
            jobs.append(lambda d=d, s=s, off=off, n=n: ctypes.memmove(d + off, s + off, n))
    return jobs


def bench_memory(size: int, batch: int, reps: int) -> list[dict]:
    payloads = _payloads(size, batch)
    outs = [torch.empty(size, dtype=torch.uint8) for _ in range(batch)]
    for o in outs:
        o.zero_()  # fault the pages in, for both sides alike
    tier = MemoryTier(capacity_bytes=size * batch + 64 * _MiB, pin=None)
    raw = torch.zeros(size * batch, dtype=torch.uint8)  # the baseline's "slots"
    raw_slots = [raw[i * size : (i + 1) * size] for i in range(batch)]
    keys = [f"{i:064x}" for i in range(batch)]
    ns = "bench"

    def tier_put() -> None:
        assert all(tier.put_many(ns, keys, payloads))

    put_addr = [(s.data_ptr(), p.data_ptr()) for s, p in zip(raw_slots, payloads)]
    get_addr = [(o.data_ptr(), s.data_ptr()) for o, s in zip(outs, raw_slots)]

    from radixkv.hostcopy import default_copy_threads

    # The tier copies calls of 4 MiB and more on several threads: so does the baseline.
    threads = default_copy_threads() if size * batch >= 4 * _MiB else 1
    put_jobs, get_jobs = _memmove_jobs(put_addr, size), _memmove_jobs(get_addr, size)

    def base_put() -> None:
        _run_threads(put_jobs, threads)

    def tier_get() -> None:
        assert all(tier.get_many(ns, keys, outs))

    def base_get() -> None:
        _run_threads(get_jobs, threads)

    put_t, put_b = _time_pair(tier_put, base_put, lambda: tier.delete_many(ns, keys), reps)
    tier_put()
    get_t, get_b = _time_pair(tier_get, base_get, None, reps)
    tier_get()
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs)), "memory tier returned wrong bytes"
    tier.check_integrity()
    tier.close()
    return [_row("memory", size, batch, "put", put_t, put_b), _row("memory", size, batch, "get", get_t, get_b)]


def bench_disk(size: int, batch: int, reps: int, root: str, io_threads: int,
               overlap_min_bytes: int | None = None) -> list[dict]:
    payloads = _payloads(size, batch)
    outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]
    tier_dir = os.path.join(root, f"tier-{uuid.uuid4().hex[:8]}")
    raw_dir = os.path.join(root, f"raw-{uuid.uuid4().hex[:8]}")
    os.makedirs(raw_dir, mode=0o700)
    tier = DiskTier(root=tier_dir, capacity_bytes=size * batch * 2 + 64 * _MiB, io_threads=io_threads,
                    overlap_min_bytes=overlap_min_bytes)
    keys = [f"{i:064x}" for i in range(batch)]
    raw_paths = [os.path.join(raw_dir, f"{k}.bin") for k in keys]
    ns = "bench"

    def tier_put() -> None:
        assert all(tier.put_many(ns, keys, payloads))

    def write_one(path: str, p: torch.Tensor) -> None:
        # Overwrite in place once the file exists (no truncation: same size), as recycling does.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, memoryview(p.numpy()), 0)
        finally:
            os.close(fd)

    def read_one(path: str, o: torch.Tensor) -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(o.numpy()))

    put_jobs = [lambda a=a, p=p: write_one(a, p) for a, p in zip(raw_paths, payloads)]
    get_jobs = [lambda a=a, o=o: read_one(a, o) for a, o in zip(raw_paths, outs)]

    def base_put() -> None:
        _run_threads(put_jobs, io_threads)

    def reset() -> None:
        tier.delete_many(ns, keys)

    def tier_get() -> None:
        assert all(tier.get_many(ns, keys, outs))

    def base_get() -> None:
        _run_threads(get_jobs, io_threads)

    put_t, put_b = _time_pair(tier_put, base_put, reset, reps)
    tier_put()
    base_put()
    get_t, get_b = _time_pair(tier_get, base_get, None, reps)
    tier_get()
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs)), "disk tier returned wrong bytes"
    tier.check_integrity()
    tier.close()
    shutil.rmtree(tier_dir, ignore_errors=True)
    shutil.rmtree(raw_dir, ignore_errors=True)
    return [_row("disk", size, batch, "put", put_t, put_b), _row("disk", size, batch, "get", get_t, get_b)]


def bench_redis_rows(sizes: list[int], url: str | None, reps: int, batch_bytes: int) -> tuple[list[dict], str]:
    """Rows from the Redis engineer's helper, renamed to this table's columns; and a note."""
    try:
        from radixkv.bench._redis_tier import bench_redis
    except ImportError as e:
        return [], f"redis rows skipped: {e}"
    server = None
    if url is None:
        if shutil.which("redis-server") is None:
            return [], "redis rows skipped: no --redis-url and no redis-server on PATH"
        from radixkv.testing_redis import RedisServerProcess

        server = RedisServerProcess(Path(tempfile.mkdtemp(prefix="radixkv-bench-redis-"))).start()
        url = server.url
    try:
        rows = bench_redis(sizes, url, reps=reps, batch_bytes=batch_bytes)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.workdir, ignore_errors=True)  # its log; the server saves nothing
    out = [{"tier": "redis", **{k: v for k, v in r.items() if not k.startswith("raw_")},
            "base_gbps": r["raw_gbps"], "base_p50_ms": r["raw_p50_ms"], "base_p99_ms": r["raw_p99_ms"]}
           for r in rows]
    return out, "redis baseline: redis-py pipelined SET/GET of the same payloads on the same server" + (
        " (temporary redis-server)" if server is not None else "")


def format_table(rows: list[dict]) -> str:
    lines = ["| tier | payload | chunks/call | op | tier GB/s | baseline GB/s | ratio | target | tier p50 ms "
             "| tier p99 ms | base p50 ms | base p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['tier']} | {r['size_bytes'] / _MiB:g} MiB | {r['batch']} | {r['op']} | {r['tier_gbps']:.2f} "
            f"| {r['base_gbps']:.2f} | {r['ratio']:.2f} | {TARGETS[r['tier']]:.2f} | {r['tier_p50_ms']:.2f} "
            f"| {r['tier_p99_ms']:.2f} | {r['base_p50_ms']:.2f} | {r['base_p99_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench tiers", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=lambda t: positive_list(t, float), default="1,8,32",
                    help="comma-separated payload sizes in MiB")
    ap.add_argument("--batch-mib", type=positive_int, default=64, help="bytes per batched call, MiB (also 1 chunk/call)")
    ap.add_argument("--reps", type=positive_int, default=10, help="timed calls per (tier, size, batch, op, side)")
    ap.add_argument("--tiers", default="memory,disk,redis", help="comma-separated subset of memory,disk,redis")
    ap.add_argument("--disk-dir", default=None, help="directory for disk files (default: a temp dir in /tmp)")
    ap.add_argument("--io-threads", type=positive_int, default=4, help="disk tier I/O threads")
    ap.add_argument("--disk-overlap-mib", type=float, default=0.0,
                    help="disk tier overlap_min_bytes in MiB (hash while writing/reading); 0 = off (default)")
    ap.add_argument("--redis-url", default=None, help="Redis URL (default: start a temporary redis-server)")
    ap.add_argument("--torch-threads", type=positive_int, default=1,
                    help="torch intra-op threads for both sides' copies (default 1: on a shared, loaded "
                         "machine a multi-threaded copy of one chunk mostly measures thread wake-ups)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    sizes = [max(1, int(s * _MiB)) for s in args.sizes_mib]
    sizes_text = ",".join(f"{s:g}" for s in args.sizes_mib)
    if args.disk_overlap_mib < 0 or not math.isfinite(args.disk_overlap_mib):
        ap.error(f"--disk-overlap-mib {args.disk_overlap_mib:g} must be >= 0 MiB (0 = off)")
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = set(tiers) - set(TARGETS)
    if unknown:
        ap.error(f"unknown tiers {sorted(unknown)}; choose from {sorted(TARGETS)}")
    if not tiers:
        ap.error(f"--tiers {args.tiers!r} names no tier; choose one or more of {','.join(TARGETS)}")
    if "redis" in tiers and args.redis_url is not None:
        try:  # before the memory and disk rows: a wrong URL should not cost their minutes
            from radixkv.bench._redis_tier import check_server
        except ImportError:
            pass  # redis-py missing: the redis rows are skipped with a note
        else:
            try:
                check_server(args.redis_url)
            except ConfigError as e:  # the URL names no running server (or is malformed)
                ap.error(f"--redis-url: {e}")
    batch_bytes = args.batch_mib * _MiB
    started = time.perf_counter()
    rows: list[dict] = []
    notes: list[str] = []
    disk_root = args.disk_dir or tempfile.mkdtemp(prefix="radixkv-bench-disk-", dir="/tmp")
    try:
        for size in sizes:
            for batch in sorted({1, max(1, batch_bytes // size)}):
                if "memory" in tiers:
                    rows += bench_memory(size, batch, args.reps)
                if "disk" in tiers:
                    overlap = int(args.disk_overlap_mib * _MiB) or None
                    rows += bench_disk(size, batch, args.reps, disk_root, args.io_threads, overlap)
    finally:
        if args.disk_dir is None:
            shutil.rmtree(disk_root, ignore_errors=True)
    if "redis" in tiers:
        redis_rows, note = bench_redis_rows(sizes, args.redis_url, args.reps, batch_bytes)
        rows += redis_rows
        notes.append(note)
    rows.sort(key=lambda r: (list(TARGETS).index(r["tier"]), r["size_bytes"], r["batch"], r["op"] != "put"))
    print(f"radixkv tiers benchmark: sizes {sizes_text} MiB, batch {args.batch_mib} MiB, reps {args.reps}, "
          f"torch threads {torch.get_num_threads()}, "
          f"disk dir {args.disk_dir or '/tmp (temp)'} (page cache, fsync off, overlap "
          f"{f'from {args.disk_overlap_mib:g} MiB' if args.disk_overlap_mib else 'off'})")
    print(machine_line())
    for n in notes:
        print(n)
    print(format_table(rows))
    for tier in tiers:
        mine = [r for r in rows if r["tier"] == tier]
        if mine:
            worst = min(mine, key=lambda r: r["ratio"])
            verdict = "meets" if worst["ratio"] >= TARGETS[tier] else "BELOW"
            print(f"{tier}: worst ratio {worst['ratio']:.2f} ({worst['op']} {worst['size_bytes'] / _MiB:g} MiB x "
                  f"{worst['batch']}), target >= {TARGETS[tier]:.2f}: {verdict}")
    print(f"elapsed {time.perf_counter() - started:.0f} s")
    return 0
