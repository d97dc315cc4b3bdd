"""A store forked while another thread is inside its lock (engines fork workers while serving).

Found by the fourth race hunt: the child inherited the store's lock held by a thread it does not
have, and hung on its first call. Interleaving forced with events (drop into tests/store/)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from fork_helpers import in_child
from store_helpers import CHUNK_BYTES, chain, new_namespace, payload_for

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.mark.parametrize("which", ["store", "metrics", "memory tier"])
def test_fork_while_a_thread_holds_the_store_lock(make_store, which):
    """Also the metrics' lock (every get and put takes it; found by an audit: not held across a
    fork, a child forked while another thread was inside it hung on its first get)."""
    store = make_store("mem-disk")
    lock = {"store": store.lock, "metrics": store.metrics._lock, "memory tier": store.tiers[0]._lock}[which]
    ns = new_namespace()
    _, keys = chain(4, 3)
    data = [payload_for(k) for k in keys]
    assert store.put(ns, keys, data) == [True] * 3
    assert store.flush(10)
    inside, release = threading.Event(), threading.Event()

    def reader() -> None:  # a caller reading the tree under store.lock, as documented
        with lock:
            inside.set()
            release.wait(10)

    t = threading.Thread(target=reader)
    t.start()
    assert inside.wait(10)
    timer = threading.Timer(0.5, release.set)  # it leaves on its own a little later
    timer.start()
    expect = [d.numpy().copy() for d in data]

    def child() -> bool:
        outs = [torch.from_numpy(np.zeros(CHUNK_BYTES, dtype=np.uint8)) for _ in keys]
        n = store.get(ns, keys, outs)
        return n == 3 and all(np.array_equal(o.numpy(), e) for o, e in zip(outs, expect))

    try:
        in_child(child, deadline_s=20.0)
    finally:
        release.set()
        t.join(10)
    store.check_integrity()


def test_a_child_forked_while_a_write_job_runs_is_never_idle(make_store):
    """Found by the idle check (huntS2): a child forked while the parent's write-through job held a
    disk reservation inherits that reservation, and no job in the child ever gives it back. The
    child counted as busy only until its first writer call (flush here) restarted its pool and
    zeroed the count of jobs in flight; the check then reported the parent's reservation as a leak
    of the child's. Like the calls a child inherits, inherited jobs keep the child from being idle."""
    store = make_store("mem-disk", write_policy="write_through")
    ns = new_namespace()
    disk = store.tiers[1]
    parent, inside, release = os.getpid(), threading.Event(), threading.Event()
    put_many = disk.put_many

    def held_put_many(*args, **kwargs):
        if os.getpid() == parent:
            inside.set()
            release.wait(10)
        return put_many(*args, **kwargs)

    disk.put_many = held_put_many
    data = [payload_for("a0")]
    assert store.put(ns, ["a0"], data) == [True]
    assert inside.wait(10)  # the write-through job holds its disk reservation now

    def child() -> bool:
        assert store.flush(5)  # the child's writer starts over: none of the parent's jobs runs here
        store.check_integrity(deep=False)
        return True

    try:
        in_child(child, deadline_s=20.0)
    finally:
        release.set()
    assert store.flush(10)
    store.check_integrity()
