"""Counters and Prometheus metrics of one hierarchical store.

Every store owns a private :class:`prometheus_client.CollectorRegistry` (never the global one), so
tests and several stores in one process do not collide; its series are rendered from the store's
own numbers at scrape time, so an engine's ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's
multiprocess mode) neither mixes them with another store's nor carries them to the engine's
``/metrics``. Serve it with
``prometheus_client.start_http_server(port, registry=store.metrics.registry)`` or render it with
``prometheus_client.generate_latest(store.metrics.registry)``. All names start with ``radixkv_``.

The same numbers are kept as plain integers for :meth:`StoreMetrics.snapshot` (``store.stats()``). Tier-reported counters (checksum failures, usage) are
read from each tier's :class:`~radixkv.tiers.base.TierStats` at scrape time by a custom collector.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from radixkv.forksafe import hold_across_fork
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


# name -> (kind, help, label names) of the series a store records; the registry renders them from
# the store's own numbers (_StoreCollector), never from prometheus_client's Counter/Gauge/Histogram:
# under PROMETHEUS_MULTIPROC_DIR (set by SGLang with --enable-metrics, by vLLM with several API
# servers) those keep their values in the engine's per-process files, keyed by name and labels only,
# so two stores of one process shared (and overwrote) each other's counts, and a directory that was
# gone made the store's construction fail.
_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "radixkv_hit_chunks": ("counter", "Chunks read from a tier", ("tier",)),
    "radixkv_miss_chunks": (
        "counter",
        "Chunks asked for and not served by the tier (cascading: a chunk served by a slower "
        "tier, or by none, is a miss in every faster one)",
        ("tier",),
    ),
    "radixkv_hit_tokens": ("counter", "Tokens in chunks read from a tier", ("tier",)),
    "radixkv_miss_tokens": ("counter", "Tokens in chunks not served", ("tier",)),
    "radixkv_written_bytes": ("counter", "Payload bytes written into a tier", ("tier",)),
    "radixkv_read_bytes": ("counter", "Payload bytes read out of a tier", ("tier",)),
    "radixkv_evicted_chunks": ("counter", "Chunks evicted from a tier", ("tier", "action")),
    "radixkv_promoted_chunks": ("counter", "Chunks promoted into a tier", ("tier",)),
    "radixkv_lookup_chunks": (
        "counter",
        "Chunks asked for by lookups (engines' existence checks), by result: hit (held by some "
        "tier, in the leading run) or miss",
        ("result",),
    ),
    "radixkv_lookup_tokens": (
        "counter", "Tokens in the chunks asked for by lookups, by result", ("result",)
    ),
    "radixkv_adopted_chunks": (
        "counter",
        "Chunks a tier held that the tree did not know (restart, shared tier), added on a probe",
        ("tier",),
    ),
    "radixkv_read_failed_chunks": (
        "counter", "Reads where the tree said present and the tier could not deliver", ("tier",)
    ),
    "radixkv_write_failed_chunks": ("counter", "Chunks a tier refused to store", ("tier",)),
    "radixkv_orphan_dropped_chunks": (
        "counter", "Chunks dropped because their prefix became unrecoverable", ()
    ),
    "radixkv_dropped_jobs": (
        "counter", "Background jobs skipped, in jobs (promotions on a full queue)", ("queue",)
    ),
    "radixkv_queue_depth_jobs": ("gauge", "Background jobs waiting", ("queue",)),
}
_LATENCY = ("radixkv_latency_seconds", "Latency of store operations and tier batches", ("op", "tier"))


class _StoreCollector:
    """Renders a :class:`StoreMetrics`' series and latency histograms when the registry is scraped."""

    def __init__(self, metrics: StoreMetrics) -> None:
        # A weak reference: the metrics own the registry that holds this collector, and a strong
        # one closed a cycle that kept a closed store's tiers (their GBs of buffers) alive until
        # the next cycle collection.
        self._metrics = weakref.ref(metrics)

    def describe(self) -> Iterator[object]:
        return self._families({}, {})

    def collect(self) -> Iterator[object]:
        m = self._metrics()
        if m is None:  # the store is gone: its families, empty
            return self._families({}, {})
        with m._lock:
            series = {name: dict(values) for name, values in m._series.items()}
            hists = {labels: (list(h[0]), h[1]) for labels, h in m._hists.items()}
        return self._families(series, hists)

    @staticmethod
    def _families(
        series: dict[str, dict[tuple[str, ...], float]],
        hists: dict[tuple[str, ...], tuple[list[int], float]],
    ) -> Iterator[object]:
        for name, (kind, doc, labels) in _FAMILIES.items():
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = family_type(name, doc, labels=list(labels))
            values = series.get(name, {})
            if not labels and not values:
                values = {(): 0}  # an unlabelled series exists from the start, as with a Counter
            for label_values, v in values.items():
                fam.add_metric(list(label_values), v)
            yield fam
        name, doc, labels = _LATENCY
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        for label_values, (counts, total_s) in hists.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*_LATENCY_BUCKETS_S, float("inf")), counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            fam.add_metric(list(label_values), buckets, total_s)
        yield fam


class StoreMetrics:
    """Thread-safe counters of one store, rendered into a private Prometheus registry.

    The values live in this object only (not in prometheus_client's value classes), so they stay
    the store's own in every process: two stores, or a store reopened in one process, never share
    or overwrite counts, and an engine's ``PROMETHEUS_MULTIPROC_DIR`` is neither written nor
    needed. Serve the registry on ``metrics_port`` (:meth:`serve`); the engine's own ``/metrics``
    does not carry these series."""

    def __init__(
        self,
        tier_names: Sequence[str],
        tiers: Callable[[], Sequence[object]] | None = None,
        prometheus: bool = True,
    ) -> None:
        self.tier_names = tuple(tier_names)
        self._lock = threading.Lock()
        # A leaf lock every get and put takes: a fork while another thread held it left it held in
        # the child forever (its first get or put hung).
        hold_across_fork(self, in_child=StoreMetrics._after_fork_in_child)
        self._served: tuple[Any, threading.Thread, int] | None = None  # serve()'s, in the process that serves
        self._counts: dict[str, int] = defaultdict(int)
        self._gauges: dict[str, int] = {}
        # Prometheus series: family name -> label values -> value; latency: (op, tier) -> [counts
        # per bucket (+Inf last), sum of seconds].
        self._series: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        self._hists: dict[tuple[str, str], list] = {}
        self.registry: CollectorRegistry | None = None
        if not prometheus:
            return
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(_StoreCollector(self))  # type: ignore[arg-type]
        if tiers is not None:
            r.register(_TierStatsCollector(tiers))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ recording
    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self._counts[key] += n

    def _record(self, counts: Sequence[tuple[str, int]], series: Sequence[tuple[str, tuple[str, ...], int]]) -> None:
        """Add plain counts (``stats()``) and Prometheus series values under one lock."""
        with self._lock:
            for key, n in counts:
                self._counts[key] += n
            if self.registry is not None:
                for name, labels, n in series:
                    self._series[name][labels] += n

    def hits(self, tier: str, chunks: int, tokens: int, nbytes: int) -> None:
        if chunks <= 0:
            return
        self._record(
            ((f"{tier}.hit_chunks", chunks), (f"{tier}.hit_tokens", tokens), (f"{tier}.bytes_out", nbytes)),
            (("radixkv_hit_chunks", (tier,), chunks), ("radixkv_hit_tokens", (tier,), tokens),
             ("radixkv_read_bytes", (tier,), nbytes)),
        )

    def misses(self, tier: str, chunks: int, tokens: int) -> None:
        if chunks <= 0:
            return
        self._record(
            ((f"{tier}.miss_chunks", chunks), (f"{tier}.miss_tokens", tokens)),
            (("radixkv_miss_chunks", (tier,), chunks), ("radixkv_miss_tokens", (tier,), tokens)),
        )

    def lookups(self, hit_chunks: int, miss_chunks: int, hit_tokens: int, miss_tokens: int) -> None:
        """One lookup (an engine's existence check): the leading run held by some tier, and the rest."""
        self._record(
            (("lookup_hit_chunks", hit_chunks), ("lookup_miss_chunks", miss_chunks),
             ("lookup_hit_tokens", hit_tokens), ("lookup_miss_tokens", miss_tokens)),
            (("radixkv_lookup_chunks", ("hit",), hit_chunks), ("radixkv_lookup_chunks", ("miss",), miss_chunks),
             ("radixkv_lookup_tokens", ("hit",), hit_tokens), ("radixkv_lookup_tokens", ("miss",), miss_tokens)),
        )

    def written(self, tier: str, chunks: int, nbytes: int) -> None:
        if chunks <= 0:
            return
        self._record(
            ((f"{tier}.put_chunks", chunks), (f"{tier}.bytes_in", nbytes)),
            (("radixkv_written_bytes", (tier,), nbytes),),
        )

    def write_failures(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.write_failures", chunks, "radixkv_write_failed_chunks", tier)

    def read_failures(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.read_failures", chunks, "radixkv_read_failed_chunks", tier)

    def adopted(self, tier: str, chunks: int) -> None:
        """Chunks found in ``tier`` by a probe and added to the tree (see :mod:`radixkv.adoption`)."""
        self._count1(f"{tier}.adopted_chunks", chunks, "radixkv_adopted_chunks", tier)

    def promotions(self, tier: str, chunks: int) -> None:
        self._count1(f"{tier}.promotions", chunks, "radixkv_promoted_chunks", tier)

    def evictions(self, tier: str, action: str, chunks: int) -> None:
        if chunks <= 0:
            return
        self._record(((f"{tier}.evicted_{action}", chunks),),
                     (("radixkv_evicted_chunks", (tier, action), chunks),))

    def orphans(self, chunks: int) -> None:
        if chunks <= 0:
            return
        self._record((("orphan_drops", chunks),), (("radixkv_orphan_dropped_chunks", (), chunks),))

    def dropped_job(self, queue: str) -> None:
        self._record(((f"{queue}.dropped_jobs", 1),), (("radixkv_dropped_jobs", (queue,), 1),))

    def queue_depth(self, queue: str, depth: int) -> None:
        with self._lock:
            self._gauges[f"{queue}.queue_depth"] = depth
            if self.registry is not None:
                self._series["radixkv_queue_depth_jobs"][(queue,)] = depth

    @contextmanager
    def timed(self, op: str, tier: str = "") -> Iterator[None]:
        """Observe the wall time of the block into the latency histogram."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.registry is not None:
                self._observe(op, tier, time.perf_counter() - t0)

    def _observe(self, op: str, tier: str, seconds: float) -> None:
        i = bisect.bisect_left(_LATENCY_BUCKETS_S, seconds)  # a bucket counts values <= its bound
        with self._lock:
            h = self._hists.get((op, tier))
            if h is None:
                h = self._hists[(op, tier)] = [[0] * (len(_LATENCY_BUCKETS_S) + 1), 0.0]
            h[0][i] += 1
            h[1] += seconds

    def _count1(self, key: str, n: int, family: str, tier: str) -> None:
        if n <= 0:
            return
        self._record(((key, n),), ((family, (tier,), n),))

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
        self._served = (server, thread, os.getpid())
        return self._served

    def _after_fork_in_child(self) -> None:
        # The child inherits the listening socket but not the thread answering it: the port would
        # answer nothing once the parent let go of it, and held it until the child ended. The port
        # stays the parent's; the child's numbers are in stats() and the registry.
        if self._served is not None:
            self._served[0].server_close()
            self._served = None

    @staticmethod
    def stop_serving(handle: object | None) -> None:
        if handle is None:
            return
        server, thread, pid = handle  # type: ignore[misc]
        if pid != os.getpid():
            # A forked child's copy: the serving thread is the parent's, so shutdown() would wait
            # forever for a loop that does not run here (a child's close() hung). Only the socket.
            server.server_close()
            return
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
