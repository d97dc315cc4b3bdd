"""Prometheus metrics: a private registry per store, radixkv_-prefixed names, cascading per-tier
hit/miss counts, tier counters (checksum failures, usage) read at scrape time."""

from __future__ import annotations

import os

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from store_helpers import CHUNK_TOKENS, buffers, chain, new_namespace, payload_for


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


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
    assert sa[("radixkv_evicted_chunks_total", (("action", "demote"), ("tier", "mem")))] >= 2
    assert sa[("radixkv_tier_capacity_bytes", (("tier", "mem"),))] == a.tiers[0].capacity_bytes
    assert ("radixkv_tier_spare_bytes", (("tier", "disk"),)) in sa  # recycled files: on disk, not chunks
    assert ("radixkv_tier_spare_bytes", (("tier", "mem"),)) not in sa
    assert ("radixkv_tier_checksum_failed_chunks_total", (("tier", "disk"),)) in sa
    assert sa[("radixkv_latency_seconds_count", (("op", "get"), ("tier", "")))] == 1
    assert ("radixkv_queue_depth_jobs", (("queue", "write"),)) in sa
    assert (
        "radixkv_hit_chunks_total",
        (("tier", "disk"),),
    ) not in sb  # stores do not share counters
    assert not [
        m for m in REGISTRY.collect() if m.name.startswith("radixkv_")
    ]  # global registry untouched
    a.check_integrity()


def test_lookups_count_hits_and_misses(make_store):
    # Engines check existence before they read (SGLang's batch_exists, vLLM's lookup): without
    # lookup counters the hit ratio of a deployment was invisible (reads only ask for what exists).
    store = make_store("mem")
    ns = new_namespace()
    _, keys = chain(3, 4)
    store.put(ns, keys[:3], [payload_for(k) for k in keys[:3]])
    assert store.lookup(ns, keys) == 3
    assert store.lookup(ns, keys, record=False) == 3  # a caller composing a lookup counts it once
    store.record_lookup(ns, 2, 4)
    sa = samples(store)
    assert sa[("radixkv_lookup_chunks_total", (("result", "hit"),))] == 5
    assert sa[("radixkv_lookup_chunks_total", (("result", "miss"),))] == 3
    assert sa[("radixkv_lookup_tokens_total", (("result", "miss"),))] == 3 * CHUNK_TOKENS
    st = store.stats()["store"]
    assert st["lookup_hit_chunks"] == 5 and st["lookup_miss_tokens"] == 3 * CHUNK_TOKENS


def test_reads_continued_across_calls_count_each_miss_once(make_store):
    store = make_store("mem")
    ns = new_namespace()
    _, keys = chain(4, 3)
    store.put(ns, keys[:1], [payload_for(keys[0])])
    assert store.get(ns, keys, buffers(3), count_misses=False) == 1
    assert store.stats()["store"].get("mem.miss_chunks", 0) == 0
    store.record_misses(ns, 2)
    assert store.stats()["store"]["mem.miss_chunks"] == 2


@pytest.mark.parametrize(("hit", "asked", "match"), [
    (-2, 4, "hit_chunks=-2"), (9, 4, "hit_chunks=9 exceeds asked_chunks=4"), (1.5, 4, "hit_chunks=1.5"),
    (True, 4, "hit_chunks=True"), (0, -1, "asked_chunks=-1"),
])
def test_impossible_lookup_counts_are_input_errors(make_store, hit, asked, match):
    """Found by an audit: record_lookup took a negative hit (a Prometheus counter went down), more hits
    than chunks asked, and fractions; record_misses ignored negatives silently."""
    from radixkv.errors import InputError

    store = make_store("mem")
    ns = new_namespace()
    store.record_lookup(ns, 3, 4)
    with pytest.raises(InputError, match=match):
        store.record_lookup(ns, hit, asked)
    with pytest.raises(InputError, match="chunks=-1"):
        store.record_misses(ns, -1)
    st = store.stats()["store"]
    assert st["lookup_hit_chunks"] == 3 and st["lookup_miss_chunks"] == 1


def test_a_prefetch_that_finds_nothing_counts_its_misses_as_get_does(make_store):
    """Found by an audit: a prefetch with no chunk to read returned before counting anything (get
    counted every chunk a miss in every tier), so a vLLM load of chunks that left between its
    lookup and its read went uncounted."""
    store = make_store("mem-disk")
    ns = new_namespace()
    _, keys = chain(5, 4)
    assert store.get(ns, keys, buffers(4)) == 0
    assert store.prefetch(ns, keys, buffers(4)).wait(5) == 0
    st = store.stats()["store"]
    assert st["mem.miss_chunks"] == 8 and st["disk.miss_chunks"] == 8
    assert samples(store)[("radixkv_latency_seconds_count", (("op", "prefetch"), ("tier", "")))] == 1


def test_every_metric_name_carries_its_unit(make_store):
    # docs/design.md: names carry units (chunks, tokens, bytes, jobs, errors, seconds).
    store = make_store("mem-disk")
    names = {m.name for m in store.metrics.registry.collect()}
    units = ("_chunks", "_tokens", "_bytes", "_jobs", "_errors", "_seconds")
    assert names and all(n.endswith(units) for n in names), sorted(n for n in names if not n.endswith(units))


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


def test_metrics_are_served_over_http_and_stop_with_the_store(make_store):
    import urllib.request

    port = _free_port()
    store = make_store("mem", metrics_port=port, metrics_addr="127.0.0.1")
    ns = new_namespace()
    _, keys = chain(5, 2)
    store.put(ns, keys, [payload_for(k) for k in keys])
    store.lookup(ns, keys)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'radixkv_lookup_chunks_total{result="hit"} 2.0' in body
    store.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_closes_without_hanging_and_leaves_the_port_to_the_parent(make_store):
    """Found by an audit: a child forked after the store served its metrics inherited the listening
    socket but not the thread answering it: its close() hung forever in the server's shutdown (which
    waits for that thread's loop), and a child outliving its parent kept the port bound, answering
    nothing. The child now closes its copy of the socket at the fork."""
    import socket
    import urllib.request

    from fork_helpers import in_child

    port = _free_port()
    store = make_store("mem", metrics_port=port, metrics_addr="127.0.0.1")
    ns = new_namespace()
    _, keys = chain(6, 2)
    store.put(ns, keys, [payload_for(k) for k in keys])

    def child() -> bool:
        store.lookup(ns, keys)
        store.close()  # hung here
        return True

    in_child(child, deadline_s=20.0)
    store.lookup(ns, keys)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'radixkv_lookup_chunks_total{result="hit"} 2.0' in body  # the parent's own numbers

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that outlives the parent's store
        os.close(read)
        os.write(write, b"1")
        import time

        time.sleep(5)
        os._exit(0)
    try:
        os.close(write)
        assert os.read(read, 1) == b"1"
        store.close()
        with socket.socket() as sk:  # the port is free again though the child lives on
            sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past the scrape's TIME_WAIT)
            sk.bind(("127.0.0.1", port))
            sk.listen()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)


def test_a_metrics_port_in_use_is_a_warning_not_an_error(make_store, caplog):
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        sk.listen()
        port = sk.getsockname()[1]
        store = make_store("mem", metrics_port=port, metrics_addr="127.0.0.1")
        assert "cannot serve metrics" in caplog.text
        ns = new_namespace()
        _, keys = chain(6, 1)
        assert store.put(ns, keys, [payload_for(keys[0])]) == [True]


def test_a_store_dropped_without_close_stops_serving_its_metrics(tmp_path, request):
    """A store nobody closed must give its metrics port back once it is collected. Before: the HTTP
    server's thread held the registry (and through its tier collector, every tier) forever, so each
    dropped store kept a listening socket, a thread and its tier stack, and a new store on the same
    port could not serve (a warning, no metrics)."""
    import gc
    import threading
    import time
    import urllib.request

    from radixkv.config import StoreConfig
    from radixkv.store import HierarchicalStore
    from store_helpers import tier_config

    port = _free_port()
    threads_before = threading.active_count()
    for i in range(3):
        store = HierarchicalStore(StoreConfig(tiers=[tier_config("mem", tmp_path, request)],
                                              metrics_port=port, metrics_addr="127.0.0.1"))
        ns = new_namespace()
        _, keys = chain(i, 1)
        store.lookup(ns, keys)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'radixkv_lookup_chunks_total{result="miss"} 1.0' in body, f"cycle {i}: not served"
        del store, body  # never closed
        gc.collect()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before


# Run in a fresh interpreter: prometheus_client picks its multiprocess mode when first imported.
_MULTIPROC_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])  # this checkout's radixkv
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from radixkv.config import StoreConfig
from radixkv.keys import Namespace, chunk_keys
from radixkv.store import HierarchicalStore

def hit_chunks(store):
    for fam in text_string_to_metric_families(generate_latest(store.metrics.registry).decode()):
        for s in fam.samples:
            if s.name == "radixkv_hit_chunks_total":
                return s.value
    return 0

ns = Namespace(model="multiproc", dtype="bfloat16", layout="page_first", chunk_tokens=16)
keys = chunk_keys(list(range(16 * 3)), 16)
payload = torch.zeros(64, dtype=torch.uint8)
stores = [HierarchicalStore(StoreConfig(tiers=[{"url": "mem://", "capacity": "4MiB"}])) for _ in range(2)]
for s in stores:
    s.put(ns, keys, [payload] * 3)
stores[0].get(ns, keys, [torch.empty(64, dtype=torch.uint8) for _ in keys])  # 3 hits
stores[1].get(ns, keys[:1], [torch.empty(64, dtype=torch.uint8)])  # 1 hit
stores[0].get(ns, keys[:1], [torch.empty(64, dtype=torch.uint8)])  # 1 more: 4
print(json.dumps({"hits": [hit_chunks(s) for s in stores],
                  "stats": [s.stats()["store"]["mem.hit_chunks"] for s in stores]}))
for s in stores:
    s.close()
"""


@pytest.mark.parametrize("dir_exists", [True, False])
def test_stores_keep_their_own_metrics_under_prometheus_multiproc_dir(tmp_path, dir_exists):
    # SGLang (--enable-metrics) and vLLM (several API servers) export PROMETHEUS_MULTIPROC_DIR to
    # their worker processes. prometheus_client's Counter then kept its values in that directory's
    # per-process file, keyed by name and labels: two stores of one process read and overwrote each
    # other's counts (the second reported 4 hits for its 1), the engine's /metrics summed them, and a
    # directory that was not there made the store's construction raise FileNotFoundError.
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    mp_dir = tmp_path / "prom"
    if dir_exists:
        mp_dir.mkdir()
    out = subprocess.run([sys.executable, "-c", _MULTIPROC_SCRIPT, str(root), str(mp_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["stats"] == [4, 1]
    assert got["hits"] == got["stats"]  # each registry shows its own store's numbers
    if dir_exists:
        assert not list(mp_dir.iterdir())  # nothing of radixkv in the engine's shared files
