"""A put that passed the store's open check when close() ran: its inline write-through (the pool
refused it) must not surface a tier's "tier 'mem' is closed"; the caller gets the store's own
RuntimeError, and the put leaves no pins or transfer count behind. In write_back, a put that lands
after close() listed what to persist is not acknowledged either."""

from __future__ import annotations

import threading
from typing import Callable

from store_helpers import chain, new_namespace, payload_for


def _put_held_in_memory(store, seed: int) -> tuple[threading.Thread, threading.Event, list[object]]:
    """Start a put on a thread named "writer" and return once its chunks are in the memory tier but
    not yet in the tree: (thread, event that lets it go on, list that gets its result or error)."""
    ns = new_namespace()
    _, keys = chain(seed, 2)
    top = store.tiers[0]
    real_put = top.put_many
    wrote, go_on = threading.Event(), threading.Event()

    def put_many(*a, **k):
        ok = real_put(*a, **k)
        if threading.current_thread().name == "writer":
            wrote.set()            # the chunks are in memory; the put has not inserted them yet
            assert go_on.wait(30)
        return ok

    top.put_many = put_many
    out: list[object] = []

    def run() -> None:
        try:
            out.append(store.put(ns, keys, [payload_for(k) for k in keys]))
        except Exception as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=run, name="writer")
    t.start()
    assert wrote.wait(30)
    return t, go_on, out


def _closed_error_after(store, close: Callable[[], None], seed: int) -> None:
    t, go_on, out = _put_held_in_memory(store, seed)
    close()                        # the whole close runs: pools closed, write_back persisted, tiers closed
    go_on.set()
    t.join(30)
    (r,) = out
    assert isinstance(r, RuntimeError) and "store is closed" in str(r), repr(r)


def test_a_put_racing_close_gets_the_stores_closed_error(make_store):
    store = make_store("mem-disk")
    # Before the fix: RuntimeError("tier 'mem' is closed") from the inline write-through's lease.
    _closed_error_after(store, lambda: store.close(flush=False), seed=7)
    assert store._stack.transfers_inflight == 0
    assert store.stats()["tree"]["pinned_chunks"] == 0


def test_a_write_back_put_that_lands_after_close_began_is_not_acknowledged(make_store):
    """Found by an audit: in write_back, a put whose memory write ended after a flushing close()
    had listed the memory-only chunks to persist returned True, yet nothing wrote it down: the next
    process missed it. It now gets the store's closed error, as a write_through put does."""
    store = make_store("mem-disk", write_policy="write_back")
    _closed_error_after(store, store.close, seed=8)  # flushing: persists what only memory holds
