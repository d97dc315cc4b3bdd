"""Redis tier throughput and latency beside raw redis-py on the same server, in the same run.

``bench_redis(sizes_bytes, url)`` returns one row per (size, op, batch): GB/s and p50/p99 latency per
call for the tier (framing + checksum + copy into caller tensors) and for raw redis-py pipelined
``SET``/``GET`` of the same payloads as ``bytes`` (hiredis packer and parser, no framing, no copy into
a tensor), plus their ratio. Tier and raw calls alternate, so machine noise hits both alike.

Run: ``python -m radixkv.bench._redis_tier [--url URL] [--sizes-mib 1,8,32] [--reps N]`` (without
``--url`` it starts a private redis-server on loopback). ``radixkv.bench.tiers`` calls
:func:`bench_redis` for its Redis rows.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import redis
import torch

from radixkv.bench import positive_int, positive_list
from radixkv.errors import ConfigError
from radixkv.tiers.redis import RedisTier
from radixkv.tiers.redis_client import parse_redis_url

__all__ = ["bench_redis", "main"]

_MIB = 1 << 20


def _pct(values_s: list[float], q: float) -> float:
    ordered = sorted(values_s)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _raw_client(url: str) -> Any:
    """A default redis-py client (hiredis packer) for the raw baseline; cluster URLs get RedisCluster."""
    parsed = parse_redis_url(url)
    if parsed.cluster:  # same factory, but the stock connection class (hiredis packer)
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in parsed.hosts],
                            username=parsed.username, password=parsed.password)
    (host, port), = parsed.hosts
    return redis.Redis(host=host, port=port, db=parsed.db, username=parsed.username,
                       password=parsed.password, ssl=parsed.tls, **({"ssl_ca_certs": dict(parsed.tls_options).get("ssl_ca_certs")} if parsed.tls else {}))


def check_server(url: str) -> None:
    """ConfigError naming the URL unless a Redis server answers a PING there. The tier turns an
    unreachable server into failed puts (a cache miss, by design): the timed loop would then end in
    an AssertionError, after every other row ran."""
    try:
        client = _raw_client(url)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
        raise ConfigError(f"cannot reach the Redis server at {parse_redis_url(url).redacted()} "
                          f"({type(e).__name__}: {e}); start one there, or give the URL of a running "
                          "server (without a URL a private redis-server is started)") from None


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_redis(sizes_bytes: Sequence[int], url: str, reps: int = 12, batch_bytes: int = 64 * _MIB) -> list[dict]:
    """Rows ``{size_bytes, batch, op, tier_gbps, raw_gbps, ratio, tier_p50_ms, tier_p99_ms, raw_p50_ms,
    raw_p99_ms}`` for ``op`` in put/get; ``batch`` chunks per call (1, and up to ``batch_bytes``)."""
    rows: list[dict] = []
    check_server(url)
    tier = RedisTier(url, socket_timeout_s=30.0)
    raw = _raw_client(url)
    ns = "bench" + uuid.uuid4().hex[:16]
    try:
        for size in sizes_bytes:
            for batch in sorted({1, max(1, batch_bytes // size)}):
                rows += _bench_one(tier, raw, ns, size, batch, reps)
            tier.clear(ns)
            raw.delete(*[f"rawbench:{ns}:{i}" for i in range(max(1, batch_bytes // size))])
    finally:
        tier.clear(ns)
        tier.close()
        raw.close()
    return rows


def _bench_one(tier: RedisTier, raw: Any, ns: str, size: int, batch: int, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(size)
    payloads = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(batch)]
    raw_values = [p.numpy().tobytes() for p in payloads]
    outs = [torch.empty(size, dtype=torch.uint8) for _ in range(batch)]
    keys = [f"{i:064x}" for i in range(batch)]
    raw_keys = [f"rawbench:{ns}:{i}" for i in range(batch)]

    def tier_put() -> None:
        assert all(tier.put_many(ns, keys, payloads)), "tier put failed"

    def tier_get() -> None:
        assert all(tier.get_many(ns, keys, outs)), "tier get missed"

    def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for k, v in zip(raw_keys, raw_values):
            pipe.set(k, v)
        pipe.execute()

    def raw_get() -> None:
        pipe = raw.pipeline(transaction=False)
        for k in raw_keys:
            pipe.get(k)
        got = pipe.execute()
        assert all(v is not None and len(v) == size for v in got), "raw get missed"

    times: dict[str, list[float]] = {"tier_put": [], "raw_put": [], "tier_get": [], "raw_get": []}
    for fn in (tier_put, raw_put, tier_get, raw_get):  # warm-up: connections, server allocations
        fn()
    for _ in range(reps):
        times["tier_put"].append(_timed(tier_put))
        times["raw_put"].append(_timed(raw_put))
        times["tier_get"].append(_timed(tier_get))
        times["raw_get"].append(_timed(raw_get))
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs)), "tier returned wrong bytes"
    rows = []
    for op in ("put", "get"):
        t, r = times[f"tier_{op}"], times[f"raw_{op}"]
        call_bytes = size * batch
        tier_gbps = call_bytes / statistics.median(t) / 1e9
        raw_gbps = call_bytes / statistics.median(r) / 1e9
        rows.append({
            "size_bytes": size, "batch": batch, "op": op,
            "tier_gbps": tier_gbps, "raw_gbps": raw_gbps, "ratio": tier_gbps / raw_gbps,
            "tier_p50_ms": _pct(t, 0.5) * 1e3, "tier_p99_ms": _pct(t, 0.99) * 1e3,
            "raw_p50_ms": _pct(r, 0.5) * 1e3, "raw_p99_ms": _pct(r, 0.99) * 1e3,
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    head = ("| payload | chunks/call | op | tier GB/s | raw GB/s | tier/raw | tier p50 ms | tier p99 ms "
            "| raw p50 ms | raw p99 ms |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['size_bytes'] / _MIB:g} MiB | {r['batch']} | {r['op']} | {r['tier_gbps']:.2f} | "
            f"{r['raw_gbps']:.2f} | {r['ratio']:.2f} | {r['tier_p50_ms']:.1f} | {r['tier_p99_ms']:.1f} | "
            f"{r['raw_p50_ms']:.1f} | {r['raw_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench._redis_tier", description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="Redis URL (default: start a private redis-server on loopback)")
    ap.add_argument("--sizes-mib", type=lambda t: positive_list(t, float), default="1,8,32",
                    help="comma-separated payload sizes in MiB")
    ap.add_argument("--reps", type=positive_int, default=12, help="timed calls per (size, batch, op, side)")
    ap.add_argument("--batch-mib", type=positive_int, default=64, help="bytes per batched call, MiB")
    args = ap.parse_args(argv)
    sizes = [max(1, int(s * _MIB)) for s in args.sizes_mib]
    server = None
    url = args.url
    if url is None:
        from radixkv.testing_redis import RedisServerProcess

        server = RedisServerProcess(Path(tempfile.mkdtemp(prefix="radixkv-bench-redis-"))).start()
        url = server.url
    try:
        rows = bench_redis(sizes, url, reps=args.reps, batch_bytes=args.batch_mib * _MIB)
    except ConfigError as e:  # an unreachable or malformed --url: one line, no traceback
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.workdir, ignore_errors=True)  # its log; the server saves nothing
    print(f"redis tier vs raw redis-py, {parse_redis_url(url).redacted()}, reps={args.reps}, "
          f"hiredis={redis.utils.HIREDIS_AVAILABLE}")
    print(format_rows(rows))
    worst = min(r["ratio"] for r in rows)
    print(f"worst tier/raw ratio: {worst:.2f} (target >= 0.80)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
