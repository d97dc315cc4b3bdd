"""Shutdown races: a job submitted as close() ends, or cancelled by a non-flushing close, still
completes its handle and releases what its submitter took for it (pins, the transfer count).
Each test forces the interleaving with events; each failed before its fix."""

from __future__ import annotations

import threading
import time

import pytest

from store_helpers import buffers, chain, new_namespace, payload_for


def _stall_queue_put(pool, thread_name, entered, go):
    """The submitting thread is preempted between WorkerPool.submit's `_closed` check and its
    queue.put (a plain bytecode boundary): model that by holding its put until `go`."""
    real_put = pool._queue.put

    def put(item, *a, **k):
        if threading.current_thread().name == thread_name and item is not None:
            entered.set()
            assert go.wait(30)
        return real_put(item, *a, **k)

    pool._queue.put = put


def test_a_second_close_returns_only_once_the_store_is_closed(make_store, monkeypatch):
    """Found by an audit: a second close() (an engine's shutdown path and an exit hook) returned at
    once while the first still persisted write_back chunks with the tiers open; a caller exiting
    after it lost chunks only memory held."""
    import radixkv.store as store_mod

    store = make_store("mem-disk", write_policy="write_back")
    ns = new_namespace()
    _, keys = chain(2, 3)
    assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True] * 3
    entered, go = threading.Event(), threading.Event()
    real = store_mod.writeback.persist_volatile

    def slow_persist(*args, **kwargs):
        entered.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_mod.writeback, "persist_volatile", slow_persist)
    first = threading.Thread(target=store.close)
    first.start()
    assert entered.wait(30)
    threading.Timer(0.5, go.set).start()
    store.close()  # the second call
    assert go.is_set(), "the second close() returned while the first was still persisting"
    assert store.tiers[1].contains_many(ns.digest, keys) == 3
    first.join(30)
    store.close()  # and a third, after both: at once


def test_a_prefetch_submitted_as_close_ends_still_completes(make_store):
    store = make_store("mem-disk")
    ns = new_namespace()
    _, keys = chain(1, 3)
    assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True] * 3
    entered, go = threading.Event(), threading.Event()
    _stall_queue_put(store._reader, "prefetcher", entered, go)
    out = []
    t = threading.Thread(target=lambda: out.append(store.prefetch(ns, keys, buffers(3))), name="prefetcher")
    t.start()
    assert entered.wait(30)        # prefetch passed the pool's closed check, its put not yet done
    store.close(flush=False)       # the whole close runs: threads joined, queue swept
    go.set()
    t.join(30)
    (h,) = out
    # Before the fix: the job sits in a queue no thread serves; wait() never returns, done() stays
    # False, and the chunks stay pinned.
    assert h.wait(5) == 0
    assert h.done()
    assert store.stats()["tree"]["pinned_chunks"] == 0


def test_a_write_through_submitted_as_close_ends_releases_its_pins(make_store):
    store = make_store("mem-disk")
    ns = new_namespace()
    _, keys = chain(2, 2)
    entered, go = threading.Event(), threading.Event()
    _stall_queue_put(store._writer, "writer", entered, go)
    out = []
    t = threading.Thread(target=lambda: out.append(store.put(ns, keys, [payload_for(k) for k in keys])),
                         name="writer")
    t.start()
    assert entered.wait(30)        # the put inserted its chunks, pinned them, counted a transfer
    store.close(flush=False)
    go.set()
    t.join(30)
    assert out == [[True, True]]
    s = store._stack
    assert s.transfers_inflight == 0
    assert store.stats()["tree"]["pinned_chunks"] == 0


def test_a_prefetch_cancelled_by_close_releases_its_pins(make_store):
    """close() cancels the prefetches still queued; the pins they took must go with them."""
    store = make_store("mem-disk", prefetch_threads=1)
    ns = new_namespace()
    _, a = chain(3, 2)
    _, b = chain(4, 2)
    for keys in (a, b):
        assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True, True]
    tier = store.tiers[0]
    real_get = tier.get_many
    entered, go = threading.Event(), threading.Event()

    def get_many(namespace, keys, bufs):
        if threading.current_thread().name.startswith("radixkv-prefetch"):
            entered.set()
            assert go.wait(30)
        return real_get(namespace, keys, bufs)

    tier.get_many = get_many
    h1 = store.prefetch(ns, a, buffers(2))
    assert entered.wait(30)          # the only prefetch thread is busy with h1
    h2 = store.prefetch(ns, b, buffers(2))  # queued: its chunks are pinned
    closer = threading.Thread(target=lambda: store.close(flush=False))
    closer.start()
    deadline = time.monotonic() + 30
    while not store._reader._closed and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.2)  # close() cancelled h2 and waits for h1's thread
    go.set()
    closer.join(30)
    assert h2.wait(5) == 0 and h2.done()
    h1.wait(5)
    assert store.stats()["tree"]["pinned_chunks"] == 0


def test_a_closed_store_is_freed_without_the_cycle_collector(tmp_path, request):
    """An engine detaching its backend closes and drops the store: its memory tier's buffer (GBs in
    production) must go at once. Before: callbacks the store gave its metrics and worker pools
    referred back to it (reference cycles), so store and buffer lived until the next cycle
    collection (a fuzz of SGLang attach/detach grew by ~1.5 GB over 30 runs)."""
    import gc
    import weakref

    from radixkv.config import StoreConfig
    from radixkv.store import HierarchicalStore
    from store_helpers import tier_config

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for policy in ("lru", "oddsref"):
            tiers = [tier_config(k, tmp_path / policy, request) for k in ("mem", "disk")]
            tiers[0].policy = policy
            store = HierarchicalStore(StoreConfig(tiers=tiers))
            ns = new_namespace()
            _, keys = chain(9, 3)
            assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True] * 3
            assert store.get(ns, keys, buffers(3)) == 3
            assert store.flush(30)
            refs = [weakref.ref(store), weakref.ref(store.tiers[0])]
            store.close()
            del store
            assert [r() for r in refs] == [None, None], f"{policy}: the closed store is still alive"
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize(
    "kinds", [("mem", "disk"), ("mem", "disk", "redis")], ids=["mem-disk", "mem-disk-redis"]
)
def test_a_store_dropped_without_close_leaves_no_threads_or_sockets(tmp_path, request, kinds):
    """A store nobody closed (an exception between building and closing it, an engine that never
    calls shutdown) is collected with its tiers once dropped, and its threads and Redis sockets
    end. Before: its worker pools' threads were never stopped and, through the pools' depth
    callbacks, kept the metrics and the whole tier stack alive: every such store left 4 store
    threads, the tiers' I/O threads, the memory tier's buffer and its Redis connections behind
    (measured: +5 threads and +1 Redis connection per cycle)."""
    import gc
    import os
    import weakref

    from radixkv.config import StoreConfig
    from radixkv.store import HierarchicalStore
    from store_helpers import tier_config

    def radixkv_threads() -> int:
        return sum(t.name.startswith("radixkv") for t in threading.enumerate())

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    cycles = 12
    gc.collect()
    threads_before, fds_before = radixkv_threads(), fds()
    refs = []
    for i in range(cycles):
        tiers = [tier_config(k, tmp_path, request) for k in kinds]
        store = HierarchicalStore(StoreConfig(tiers=tiers))
        ns = new_namespace()
        _, keys = chain(i, 3)
        assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True] * 3
        assert store.get(ns, keys, buffers(3)) == 3
        assert store.flush(30)
        refs.append(weakref.ref(store.tiers[0]))
        del store  # never closed
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        gc.collect()
        if radixkv_threads() <= threads_before and fds() <= fds_before + 2:
            break
        time.sleep(0.1)
    gc.collect()
    assert [r() for r in refs].count(None) == cycles, "tiers of dropped stores are still alive"
    assert radixkv_threads() <= threads_before, (
        f"{radixkv_threads() - threads_before} threads of {cycles} dropped stores still run"
    )
    assert fds() <= fds_before + 2, (
        f"{fds() - fds_before} file descriptors more after {cycles} dropped stores"
    )
