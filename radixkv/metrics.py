"""Counters and Prometheus metrics of one hierarchical store.

Every store owns a private :class:`prometheus_client.CollectorRegistry` (never the global one), so
tests and several stores in one process do not collide. Serve it with
``prometheus_client.start_http_server(port, registry=store.metrics.registry)`` or render it with
``prometheus_client.generate_latest(store.metrics.registry)``. All names start with ``radixkv_``.

The same numbers are kept as plain integers for :meth:`StoreMetrics.snapshot` (``store.stats()``),
so nothing depends on prometheus internals. Tier-reported counters (checksum failures, usage) are
read from each tier's :class:`~radixkv.tiers.base.TierStats` at scrape time by a custom collector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixkv.tiers.base import capacity_limit

__all__ = ["StoreMetrics"]

logger = logging.getLogger(__name__)

# Latency buckets from 50 us (memory copies) to 10 s (a slow remote store).
_LATENCY_BUCKETS_S = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class _TierStatsCollector:
    """Exports each tier's own counters (TierStats) and usage when the registry is scraped."""

    def __init__(self, tiers: Callable[[], Sequence[object]]) -> None:
        self._tiers = tiers

    def describe(self) -> Iterator[object]:
        return self._families()

    def collect(self) -> Iterator[object]:
        return self._families(self._tiers())

    def _families(self, tiers: Sequence[object] = ()) -> Iterator[object]:
        checks = CounterMetricFamily(
            "radixkv_tier_checksum_failed_chunks",
            "Chunks whose checksum or header did not verify when read",
            labels=["tier"],
        )
        errors = CounterMetricFamily(
            "radixkv_tier_errors",
            "Medium errors of a tier (server down, I/O errors), in errors",
            labels=["tier"],
        )
        usage = GaugeMetricFamily(
            "radixkv_tier_usage_bytes", "Bytes of the chunks the tier holds (and puts in flight)",
            labels=["tier"],
        )
        spare = GaugeMetricFamily(
            "radixkv_tier_spare_bytes",
            "Bytes of removed files a disk tier keeps to recycle (they count in its capacity)",
            labels=["tier"],
        )
        cap = GaugeMetricFamily(
            "radixkv_tier_capacity_bytes", "Capacity of the tier (0 = unbounded)", labels=["tier"]
        )
        for tier in tiers:
            name = tier.name  # type: ignore[attr-defined]
            try:
                st = tier.stats()  # type: ignore[attr-defined]
                checks.add_metric([name], st.checksum_failures)
                errors.add_metric([name], st.errors)
                usage.add_metric([name], tier.usage_bytes())  # type: ignore[attr-defined]
                if "spare_bytes" in st.extra:
                    spare.add_metric([name], st.extra["spare_bytes"])
            except Exception:  # a closed or failing tier must not break the scrape
                continue
            cap.add_metric([name], capacity_limit(tier))
        yield from (checks, errors, usage, spare, cap)


class StoreMetrics:
    """Thread-safe counters of one store, mirrored into a private Prometheus registry."""

    def __init__(
        self,
        tier_names: Sequence[str],
        tiers: Callable[[], Sequence[object]] | None = None,
        prometheus: bool = True,
    ) -> None:
        self.tier_names = tuple(tier_names)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._gauges: dict[str, int] = {}
        self.registry: CollectorRegistry | None = None
        if not prometheus:
            return
        r = self.registry = CollectorRegistry(auto_describe=True)
        t = ["tier"]
        self._p_hit_chunks = Counter("radixkv_hit_chunks", "Chunks read from a tier", t, registry=r)
        self._p_miss_chunks = Counter(
            "radixkv_miss_chunks",
            "Chunks asked for and not served by the tier (cascading: a chunk served by a slower "
            "tier, or by none, is a miss in every faster one)",
            t,
            registry=r,
        )
        self._p_hit_tokens = Counter(
            "radixkv_hit_tokens", "Tokens in chunks read from a tier", t, registry=r
        )
        self._p_miss_tokens = Counter(
            "radixkv_miss_tokens", "Tokens in chunks not served", t, registry=r
        )
        self._p_bytes_in = Counter(
            "radixkv_written_bytes", "Payload bytes written into a tier", t, registry=r
        )
        self._p_bytes_out = Counter(
            "radixkv_read_bytes", "Payload bytes read out of a tier", t, registry=r
        )
        self._p_evictions = Counter(
            "radixkv_evicted_chunks", "Chunks evicted from a tier", ["tier", "action"], registry=r
        )
        self._p_promotions = Counter(
            "radixkv_promoted_chunks", "Chunks promoted into a tier", t, registry=r
        )
        self._p_lookup_chunks = Counter(
            "radixkv_lookup_chunks",
            "Chunks asked for by lookups (engines' existence checks), by result: hit (held by some "
            "tier, in the leading run) or miss",
            ["result"],
            registry=r,
        )
        self._p_lookup_tokens = Counter(
            "radixkv_lookup_tokens", "Tokens in the chunks asked for by lookups, by result", ["result"],
            registry=r,
        )
        self._p_adopted = Counter(
            "radixkv_adopted_chunks",
            "Chunks a tier held that the tree did not know (restart, shared tier), added on a probe",
            t,
            registry=r,
        )
        self._p_read_failures = Counter(
            "radixkv_read_failed_chunks",
            "Reads where the tree said present and the tier could not deliver",
            t,
            registry=r,
        )
        self._p_write_failures = Counter(
            "radixkv_write_failed_chunks", "Chunks a tier refused to store", t, registry=r
        )
        self._p_orphans = Counter(
            "radixkv_orphan_dropped_chunks",
            "Chunks dropped because their prefix became unrecoverable",
            registry=r,
        )
        self._p_dropped_jobs = Counter(
            "radixkv_dropped_jobs",
            "Background jobs skipped, in jobs (promotions on a full queue)",
            ["queue"],
            registry=r,
        )
        self._p_queue = Gauge(
            "radixkv_queue_depth_jobs", "Background jobs waiting", ["queue"], registry=r
        )
        self._p_latency = Histogram(
            "radixkv_latency_seconds",
            "Latency of store operations and tier batches",
            ["op", "tier"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        if tiers is not None:
            r.register(_TierStatsCollector(tiers))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ recording
    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self._counts[key] += n

    def hits(self, tier: str, chunks: int, tokens: int, nbytes: int) -> None:
        if chunks <= 0:
            return
        self._add(f"{tier}.hit_chunks", chunks)
        self._add(f"{tier}.hit_tokens", tokens)
        self._add(f"{tier}.bytes_out", nbytes)
        if self.registry is not None:
            self._p_hit_chunks.labels(tier).inc(chunks)
            self._p_hit_tokens.labels(tier).inc(tokens)
            self._p_bytes_out.labels(tier).inc(nbytes)

    def misses(self, tier: str, chunks: int, tokens: int) -> None:
        if chunks <= 0:
            return
        self._add(f"{tier}.miss_chunks", chunks)
        self._add(f"{tier}.miss_tokens", tokens)
        if self.registry is not None:
            self._p_miss_chunks.labels(tier).inc(chunks)
            self._p_miss_tokens.labels(tier).inc(tokens)

    def lookups(self, hit_chunks: int, miss_chunks: int, hit_tokens: int, miss_tokens: int) -> None:
        """One lookup (an engine's existence check): the leading run held by some tier, and the rest."""
        self._add("lookup_hit_chunks", hit_chunks)
        self._add("lookup_miss_chunks", miss_chunks)
        self._add("lookup_hit_tokens", hit_tokens)
        self._add("lookup_miss_tokens", miss_tokens)
        if self.registry is not None:
            self._p_lookup_chunks.labels("hit").inc(hit_chunks)
            self._p_lookup_chunks.labels("miss").inc(miss_chunks)
            self._p_lookup_tokens.labels("hit").inc(hit_tokens)
            self._p_lookup_tokens.labels("miss").inc(miss_tokens)

    def written(self, tier: str, chunks: int, nbytes: int) -> None:
        if chunks <= 0:
            return
        self._add(f"{tier}.put_chunks", chunks)
        self._add(f"{tier}.bytes_in", nbytes)
        if self.registry is not None:
            self._p_bytes_in.labels(tier).inc(nbytes)

    def write_failures(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.write_failures", chunks, "_p_write_failures", tier)

    def read_failures(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.read_failures", chunks, "_p_read_failures", tier)

    def adopted(self, tier: str, chunks: int) -> None:
        """Chunks found in ``tier`` by a probe and added to the tree (see :mod:`radixkv.adoption`)."""
        self._count1(f"{tier}.adopted_chunks", chunks, "_p_adopted", tier)

    def promotions(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.promotions", chunks, "_p_promotions", tier)

    def evictions(self, tier: str, action: str, chunks: int) -> None:
        if chunks <= 0:
            return
        self._add(f"{tier}.evicted_{action}", chunks)
        if self.registry is not None:
            self._p_evictions.labels(tier, action).inc(chunks)

    def orphans(self, chunks: int) -> None:
        if chunks <= 0:
            return
        self._add("orphan_drops", chunks)
        if self.registry is not None:
            self._p_orphans.inc(chunks)

    def dropped_job(self, queue: str) -> None:
        self._add(f"{queue}.dropped_jobs", 1)
        if self.registry is not None:
            self._p_dropped_jobs.labels(queue).inc()

    def queue_depth(self, queue: str, depth: int) -> None:
        with self._lock:
            self._gauges[f"{queue}.queue_depth"] = depth
        if self.registry is not None:
            self._p_queue.labels(queue).set(depth)

    @contextmanager
    def timed(self, op: str, tier: str = "") -> Iterator[None]:
        """Observe the wall time of the block into the latency histogram."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.registry is not None:
                self._p_latency.labels(op, tier).observe(time.perf_counter() - t0)

    def _count1(self, key: str, n: int, attr: str, tier: str) -> None:
        if n <= 0:
            return
        self._add(key, n)
        if self.registry is not None:
            getattr(self, attr).labels(tier).inc(n)

    # ------------------------------------------------------------------ serving
    def serve(self, port: int, addr: str = "0.0.0.0") -> object | None:
        """Serve the registry over HTTP for Prometheus (``port`` 0: not served). A port in use is a
        logged warning, not an error: metrics must never stop the cache. Returns a handle for
        :meth:`stop_serving`."""
        if not port or self.registry is None:
            return None
        from prometheus_client import start_http_server

        try:
            server, thread = start_http_server(port, addr=addr, registry=self.registry)
        except (OSError, OverflowError) as e:  # taken, bad address, or (per-rank) past 65535
            logger.warning("radixkv: cannot serve metrics on %s:%d (%s); they stay in stats() and "
                           "store.metrics.registry", addr, port, e)
            return None
        logger.info("radixkv: Prometheus metrics on http://%s:%d/metrics", addr, port)
        return (server, thread)

    @staticmethod
    def stop_serving(handle: object | None) -> None:
        if handle is None:
            return
        server, thread = handle  # type: ignore[misc]
        if thread is threading.current_thread():
            # A dropped store's finalizer, run by the garbage collector in the server's own thread:
            # shutdown() would wait forever for the loop this thread is running.
            threading.Thread(target=StoreMetrics.stop_serving, args=(handle,),
                             name="radixkv-metrics-stop", daemon=True).start()
            return
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, int]:
        """All counters and gauges as ``{"<tier>.<counter>": n, "orphan_drops": n, ...}``."""
        with self._lock:
            out = dict(self._counts)
            out.update(self._gauges)
            return out

    def get(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)
