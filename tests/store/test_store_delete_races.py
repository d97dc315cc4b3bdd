"""delete() and reconcile() against what runs beside them: a Redis blip that interrupts a delete,
a copy between tiers that began before the delete, an eviction during a reconcile. Found by an
audit; each test reproduces its finding on the code before the fix."""

from __future__ import annotations

import threading
import time

import torch

from radixkv.config import StoreConfig, TierConfig
from radixkv.keys import Namespace, chunk_keys
from radixkv.store import HierarchicalStore

CB = 1024


def _ns(model: str) -> Namespace:
    return Namespace(model=model, dtype="bfloat16", layout="page_first", chunk_tokens=16)


def _blip_store(url: str, socket_timeout_s: float = 0.5, connect_timeout_s: float = 0.3,
                **config: object) -> HierarchicalStore:
    """Memory over a Redis tier that gives up on a paused server fast, with a 1 s fail-fast window."""
    return HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=1 << 22),
        TierConfig(url=url, capacity_bytes=1 << 24,
                   options={"socket_timeout_s": socket_timeout_s, "socket_connect_timeout_s": connect_timeout_s,
                            "down_backoff_s": 1.0}),
    ], **config))


def test_a_delete_a_redis_blip_interrupted_is_not_adopted_back(redis_server_factory):
    """The delete cleared the tree and memory, but Redis was in its fail-fast window: the UNLINKs
    waited for a retry, and the next lookup or get once Redis answered adopted the deleted chunks
    back from it and served their bytes."""
    server = redis_server_factory()
    store = _blip_store(server.url)
    try:
        ns = _ns("blip")
        keys = chunk_keys(list(range(48)), 16)
        assert store.put(ns, keys, [torch.full((CB,), 7, dtype=torch.uint8) for _ in keys]) == [True] * 3
        store.flush(10)
        server.pause()
        store.lookup(ns, chunk_keys(list(range(1000, 1016)), 16))  # times out: the window opens
        assert store.delete(ns, keys) == 3
        server.resume()
        time.sleep(1.2)  # the window closes
        bufs = [torch.zeros(CB, dtype=torch.uint8) for _ in keys]
        assert store.get(ns, keys, bufs) == 0
        assert store.lookup(ns, keys) == 0
        assert store.tiers[1].contains_many(ns.digest, keys) == 3  # the bytes wait for the retry
        assert store.lookup(ns, keys) == 0  # and are never adopted meanwhile
        store.check_integrity(deep=False)
    finally:
        store.close()


def _delete_in_a_blip(server, store: HierarchicalStore, ns: Namespace, keys: list[str]) -> None:
    assert store.put(ns, keys, [torch.full((CB,), 7, dtype=torch.uint8) for _ in keys]) == [True] * len(keys)
    store.flush(10)
    server.pause()
    store.lookup(ns, chunk_keys(list(range(1000, 1016)), 16))  # times out: the window opens
    assert store.delete(ns, keys) == len(keys)
    server.resume()


def test_a_delete_a_blip_interrupted_runs_once_the_tier_takes_puts_again(redis_server_factory):
    """Found by an audit: such a delete was retried only when a later put to the tier was refused,
    so with Redis healthy it waited for good, and a restart (or another process) adopted the bytes."""
    server = redis_server_factory()
    store = _blip_store(server.url)
    try:
        ns = _ns("blip-put")
        keys = chunk_keys(list(range(48)), 16)
        _delete_in_a_blip(server, store, ns, keys)
        time.sleep(1.2)  # the window closes
        other = chunk_keys(list(range(2000, 2032)), 16)
        assert store.put(ns, other, [torch.full((CB,), 3, dtype=torch.uint8) for _ in other]) == [True] * 2
        assert store.flush(10)
        assert store.tiers[1].contains_many(ns.digest, keys) == 0
        store.check_integrity()
    finally:
        store.close()


def test_a_delete_a_blip_interrupted_runs_at_close(redis_server_factory):
    """Found by an audit: close() dropped such a delete (Redis still in its fail-fast window right
    after the blip), and the next store over the server served the deleted chunks."""
    server = redis_server_factory()
    store = _blip_store(server.url)
    ns = _ns("blip-close")
    keys = chunk_keys(list(range(48)), 16)
    try:
        _delete_in_a_blip(server, store, ns, keys)
    finally:
        store.close()  # inside the window: the retry's ping ends it
    with _blip_store(server.url) as again:
        assert again.get(ns, keys, [torch.zeros(CB, dtype=torch.uint8) for _ in keys]) == 0
        assert again.tiers[1].contains_many(ns.digest, keys) == 0


def test_close_retries_missed_deletes_within_its_timeout_while_redis_is_down(redis_server_factory):
    """Found by the review: close() tried the missed deletes of every namespace, each costing a ping
    timeout with Redis unreachable, past close_timeout_s (about a second per namespace)."""
    server = redis_server_factory()
    store = _blip_store(server.url, socket_timeout_s=1.0, connect_timeout_s=0.5, close_timeout_s=2.0)
    spaces = [_ns(f"close-{i}") for i in range(6)]
    keys = chunk_keys(list(range(32)), 16)
    try:
        for ns in spaces:
            store.put(ns, keys, [torch.full((CB,), 7, dtype=torch.uint8) for _ in keys])
        assert store.flush(10)
        server.pause()
        for ns in spaces:
            store.delete(ns, keys)
        assert len(store._stack._retry_deletes[1]) == 12
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 4.0  # 6 s before: a ping timeout per namespace
    finally:
        server.resume()
        store.close()


def test_delete_waits_for_a_copy_of_the_old_bytes_in_flight(tmp_path, monkeypatch):
    """A write-through copy of K's old bytes was inside the disk write when delete(K) and a put of
    K's new bytes ran; it committed last over the new copy, and once memory released K a get
    served the deleted bytes. delete() is now a barrier for copies that began before it."""
    import radixkv.tiers.disk as disk_mod

    store = HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=2 * CB),
        TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=1 << 20),
    ], write_policy="write_through", io_threads=2))
    try:
        ns = _ns("barrier")
        (key,) = chunk_keys(list(range(16)), 16)
        real_write = disk_mod.write_frame
        started, go = threading.Event(), threading.Event()

        def slow_write(fd, nsd, k, payload):  # the old bytes' disk write is slow (a busy disk)
            if payload[0][0] == 1:
                started.set()
                go.wait(10)
            return real_write(fd, nsd, k, payload)

        monkeypatch.setattr(disk_mod, "write_frame", slow_write)
        assert store.put(ns, [key], [torch.full((CB,), 1, dtype=torch.uint8)]) == [True]
        assert started.wait(10)
        threading.Timer(0.5, go.set).start()  # the old copy ends while delete() waits for it
        assert store.delete(ns, [key]) == 1
        assert go.is_set(), "delete() returned before the copy that began before it ended"
        assert store.put(ns, [key], [torch.full((CB,), 2, dtype=torch.uint8)]) == [True]
        store.flush(10)
        for i in range(1, 4):  # memory releases K (the disk holds it)
            ks = chunk_keys(list(range(100 * i, 100 * i + 16)), 16)
            store.put(ns, ks, [torch.zeros(CB, dtype=torch.uint8)])
            store.flush(10)
        out = torch.zeros(CB, dtype=torch.uint8)
        assert store.get(ns, [key], [out]) == 1
        assert int(out[0]) == 2 and torch.equal(out, torch.full((CB,), 2, dtype=torch.uint8))
        store.check_integrity()
    finally:
        store.close()


def test_check_integrity_passes_while_a_delete_waits_at_its_barrier(tmp_path):
    """Found by an audit: delete() lets go of the tree first, then waits for copies in flight before
    it deletes from the tiers; a deep check in that window saw a tier hold more chunks than the tree
    places there and failed a healthy store (seen under load with write_back demotions)."""
    store = HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=8 * CB),
        TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=1 << 20),
    ], write_policy="write_through"))
    try:
        ns = _ns("barrier-check")
        keys = chunk_keys(list(range(32)), 16)
        assert store.put(ns, keys, [torch.full((CB,), 1, dtype=torch.uint8) for _ in keys]) == [True] * 2
        assert store.flush(10)  # on disk
        s, go = store._stack, threading.Event()
        real_wait = s.wait_copies_locked

        def copy_in_flight(nsd):  # a copy between tiers that has not ended yet (lock released meanwhile)
            s.cond.wait_for(go.is_set, timeout=10)
            real_wait(nsd)

        s.wait_copies_locked = copy_in_flight
        deleter = threading.Thread(target=store.delete, args=(ns, keys))
        deleter.start()
        deadline = time.monotonic() + 10
        while not s._delete_barrier and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s._delete_barrier, "the delete never reached its barrier"
        try:
            store.check_integrity()  # failed here: the disk still held the chunks the tree let go
        finally:
            with s.cond:
                go.set()
                s.cond.notify_all()
            deleter.join(10)
        del s.wait_copies_locked
        store.check_integrity()
        assert store.tiers[1].contains_many(ns.digest, keys) == 0
    finally:
        store.close()


def test_reconcile_does_not_count_a_residency_an_eviction_ended(tmp_path):
    """A chunk whose disk copy an ordinary eviction dropped while reconcile() waited for the disk's
    answer (it stays in memory) was counted lost, and a delete was issued for it."""
    store = HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=64 * CB),
        TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=2 * (CB + 200)),
    ]))
    try:
        ns = _ns("reconcile")
        a = chunk_keys(list(range(16)), 16)
        store.put(ns, a, [torch.ones(CB, dtype=torch.uint8)])
        store.flush()
        disk = store.tiers[1]
        real = disk.contains_many
        entered, go = threading.Event(), threading.Event()

        def slow_contains(nsd, keys):
            if threading.current_thread().name == "reconciler":
                entered.set()
                go.wait(10)
            return real(nsd, keys)

        disk.contains_many = slow_contains
        out: dict[str, int] = {}
        th = threading.Thread(target=lambda: out.setdefault("n", store.reconcile()), name="reconciler")
        th.start()
        assert entered.wait(10)
        for i in range(1, 4):  # the disk evicts a's copy (a stays in memory)
            k = chunk_keys(list(range(100 * i, 100 * i + 16)), 16)
            store.put(ns, k, [torch.full((CB,), i, dtype=torch.uint8)])
            store.flush()
        with store.lock:
            assert store.tree.node_tier_mask(store.tree.lookup(ns.digest, a[0])) == 1
        go.set()
        th.join(10)
        assert out["n"] == 0
        disk.contains_many = real
        store.check_integrity()
    finally:
        store.close()


def test_delete_does_not_stall_on_a_copy_that_reaches_its_write_while_it_waits(tmp_path):
    """Found by a review of the barrier above: delete marked its keys deleting, then waited for a
    copy whose write waited (up to 5 s) for those marked deletes. It now marks them after the wait."""
    store = HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=64 * CB),
        TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=1 << 20),
    ], write_policy="write_through", io_threads=2))
    try:
        ns = _ns("stall")
        (key,) = chunk_keys(list(range(16)), 16)
        s = store._stack
        real_write = s.write
        entered = threading.Event()

        def slow_write(t, refs, payloads):  # the copy read its source; its write comes a moment later
            entered.set()
            time.sleep(0.3)
            return real_write(t, refs, payloads)

        s.write = slow_write
        assert store.put(ns, [key], [torch.full((CB,), 1, dtype=torch.uint8)]) == [True]
        assert entered.wait(5)
        started = time.monotonic()
        assert store.delete(ns, [key]) == 1
        assert time.monotonic() - started < 2.0
        store.flush(10)
        assert store.tiers[1].contains_many(ns.digest, [key]) == 0
        assert store.lookup(ns, [key]) == 0
        store.check_integrity()
    finally:
        store.close()


def test_a_put_under_a_missing_parent_stores_nothing_with_a_lower_tier(tmp_path):
    """Found by a review: a put that stored nothing in its first run went on after the leading keys
    the tree held (the rule for a chain whose own pinned chunks fill the top tier), also when it
    stored nothing because its parent_key was missing."""
    store = HierarchicalStore(StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=1 << 20),
        TierConfig(url=f"file://{tmp_path}/d", capacity_bytes=1 << 20),
    ]))
    try:
        ns = _ns("parent")
        p, a, b, c = chunk_keys(list(range(64)), 16)
        one = torch.ones(CB, dtype=torch.uint8)
        assert store.put(ns, [a], [one], parent_key=p, root_if_missing=True) == [True]
        assert store.put(ns, [a, b, c], [one] * 3, parent_key=p) == [False] * 3
        store.check_integrity()
    finally:
        store.close()
