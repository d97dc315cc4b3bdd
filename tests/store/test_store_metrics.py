"""Prometheus metrics: a private registry per store, radixkv_-prefixed names, cascading per-tier
hit/miss counts, tier counters (checksum failures, usage) read at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from store_helpers import CHUNK_TOKENS, buffers, chain, new_namespace, payload_for


def samples(store) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(store.metrics.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_per_store_registry_and_names(make_store):
    a = make_store("mem-disk", write_policy="write_back", promote_on_hit=False)
    b = make_store("mem")
    ns = new_namespace()
    _, first = chain(1, 2)
    a.put(ns, first, [payload_for(k) for k in first])
    for i in range(3):
        keys = chain(10 + i, 4)[1]
        a.put(ns, keys, [payload_for(k) for k in keys])  # first chain goes to disk
    _, longer = chain(1, 3)
    assert a.get(ns, longer, buffers(3)) == 2
    sa, sb = samples(a), samples(b)
    assert all(name.startswith("radixkv_") for name, _ in sa)
    assert sa[("radixkv_hit_chunks_total", (("tier", "disk"),))] == 2
    assert sa[("radixkv_hit_tokens_total", (("tier", "disk"),))] == 2 * CHUNK_TOKENS
    assert sa[("radixkv_miss_chunks_total", (("tier", "mem"),))] == 3  # cascading: all 3 missed mem
    assert sa[("radixkv_miss_chunks_total", (("tier", "disk"),))] == 1
    assert sa[("radixkv_evictions_total", (("action", "demote"), ("tier", "mem")))] >= 2
    assert sa[("radixkv_tier_capacity_bytes", (("tier", "mem"),))] == a.tiers[0].capacity_bytes
    assert ("radixkv_tier_checksum_failures_total", (("tier", "disk"),)) in sa
    assert sa[("radixkv_latency_seconds_count", (("op", "get"), ("tier", "")))] == 1
    assert ("radixkv_queue_depth", (("queue", "write"),)) in sa
    assert (
        "radixkv_hit_chunks_total",
        (("tier", "disk"),),
    ) not in sb  # stores do not share counters
    assert not [
        m for m in REGISTRY.collect() if m.name.startswith("radixkv_")
    ]  # global registry untouched
    a.check_integrity()


def test_metrics_off_keeps_plain_stats(make_store):
    store = make_store("mem", metrics=False)
    ns = new_namespace()
    _, keys = chain(2, 2)
    store.put(ns, keys, [payload_for(k) for k in keys])
    assert store.get(ns, keys, buffers(2)) == 2
    assert store.metrics.registry is None
    assert store.stats()["store"]["mem.hit_chunks"] == 2


def test_unbounded_redis_tier_reports_capacity_zero(redis_url):
    # Documented as "0 = unbounded"; the tier's internal sentinel (2^63 - 1) once leaked into both.
    from radixkv.config import StoreConfig, TierConfig
    from radixkv.store import HierarchicalStore

    cfg = StoreConfig(tiers=[TierConfig(url="mem://", capacity_bytes=1 << 20), TierConfig(url=redis_url)])
    with HierarchicalStore(cfg) as store:
        assert store.stats()["tiers"]["redis"]["capacity_bytes"] == 0
        assert samples(store)[("radixkv_tier_capacity_bytes", (("tier", "redis"),))] == 0
        assert store.stats()["tiers"]["mem"]["capacity_bytes"] == 1 << 20
