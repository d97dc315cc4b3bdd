"""HierarchicalStore.check_integrity() must catch what an operation forgot to give back: each test
builds a small valid store through the public API (memory over disk, write-through copies done,
a get and a delete run), then leaks one record an operation takes while it runs (a reservation,
a pin, a put anchor, a write or delete intent, ...) and expects the check to raise.

Before, ``check_store`` took any reservation, eviction claim, background copy count, write or delete
intent as a transfer in flight and skipped its deep checks: a store that leaked one looked clean to
every test forever, and pins, anchors, copies, watches and clears were never looked at. Now a store
with no public call running (``TierStack.calls``) and no background job queued or running must hold
none of them."""

from __future__ import annotations

import threading

import pytest
import torch

from radixkv.config import StoreConfig, TierConfig
from radixkv.errors import InputError
from radixkv.store import HierarchicalStore
from store_helpers import CHUNK_BYTES, FRAME_SLACK, buffers, new_namespace, payload_for


@pytest.fixture
def built(tmp_path):
    """A quiescent store holding a chain a in memory and on disk, and chain b (a leaf removed)."""
    store = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=8 * CHUNK_BYTES, name="mem"),
               TierConfig(url=f"file://{tmp_path / 'disk'}", name="disk",
                          capacity_bytes=16 * (CHUNK_BYTES + FRAME_SLACK))],
        policy="lru", write_policy="write_through", metrics=False, probe_tiers=False))
    ns = new_namespace()
    a = [f"a{i}" for i in range(4)]
    b = [f"b{i}" for i in range(3)]
    for keys in (a, b):
        assert all(store.put(ns, keys, [payload_for(k) for k in keys]))
    assert store.flush(10.0)
    assert store.get(ns, a, buffers(len(a))) == len(a)
    assert store.delete(ns, b[2:]) == 1
    store.check_integrity()
    with store.lock:
        assert store.tree.node_tier_mask(store.tree.lookup(ns.digest, a[3])) == 0b11
    yield store, ns, a
    store.close()


def _node(store, ns, key: str) -> int:
    n = store.tree.lookup(ns.digest, key)
    assert n is not None
    return n


def _charge(store, t: int) -> int:
    return store._stack.charge(t, CHUNK_BYTES)


def test_a_leaked_reservation_in_the_top_tier(built):
    store, ns, a = built
    with store.lock:
        store._stack.reserved[0] += _charge(store, 0)  # a put that never released its room
    with pytest.raises(AssertionError, match="reservations"):
        store.check_integrity()


def test_a_reserved_total_off_by_one_chunk_in_a_lower_tier(built):
    store, ns, a = built
    with store.lock:
        store._stack.reserved[1] += _charge(store, 1)  # a demotion's pending delete never released
    with pytest.raises(AssertionError, match="reservations"):
        store.check_integrity()


def test_a_leaked_eviction_claim(built):
    store, ns, a = built
    with store.lock:
        store._stack.claimed[0] += _charge(store, 0)
    with pytest.raises(AssertionError, match="eviction claims"):
        store.check_integrity()


def test_a_background_copy_count_that_never_drops(built):
    store, ns, a = built
    with store.lock:
        store._stack.transfers_inflight += 1  # a write-through job that ended without release()
    with pytest.raises(AssertionError, match="background copies"):
        store.check_integrity()


def test_a_negative_background_copy_count(built):
    store, ns, a = built
    with store.lock:
        store._stack.transfers_inflight -= 1  # released twice
    with pytest.raises(AssertionError, match="negative background copies"):
        store.check_integrity()


@pytest.mark.parametrize("owner", ["get-7", "put-7", "promote-7", "adopt-7", "close-flush"])
def test_a_leaked_pin(built, owner):
    """Pins taken through ``store.tree`` under other owners (tests, tools) are their takers'."""
    store, ns, a = built
    with store.lock:
        store.tree.pin([_node(store, ns, a[1])], "reader", 60.0)
    store.check_integrity()
    with store.lock:
        store.tree.pin([_node(store, ns, a[1])], owner, store._stack.lease_s)
    with pytest.raises(AssertionError, match="pins the store took"):
        store.check_integrity()


def test_a_kept_victim_never_offered_again(built):
    """Room-making pins a victim that must stay (its demotion failed, it has descendants) under its
    own owner until it returns; one it never unpinned blocks that chunk's eviction."""
    store, ns, a = built
    with store.lock:
        store.tree.pin([_node(store, ns, a[0])], "evict-7", store._stack.lease_s)
    with pytest.raises(AssertionError, match="pins the store took"):
        store.check_integrity()


def test_an_expired_leaked_pin_is_still_a_leak(built):
    store, ns, a = built
    with store.lock:
        store.tree.pin([_node(store, ns, a[1])], "get-7", 1e-9)  # recorded, no longer protecting
    with pytest.raises(AssertionError, match="pins the store took"):
        store.check_integrity()


def test_an_anchor_never_released(built):
    store, ns, a = built
    s = store._stack
    with store.lock:
        s.anchor_locked(s.ref_locked(_node(store, ns, a[3])), "put-7")
    with pytest.raises(AssertionError, match="put anchors"):
        store.check_integrity()


def test_a_write_count_that_never_drops(built):
    store, ns, a = built
    with store.lock:
        store._stack.begin_write_locked(1, ns.digest, ["zz"])
    with pytest.raises(AssertionError, match="writes in flight"):
        store.check_integrity()


def test_a_deferred_delete_whose_writer_leaked_its_write(built):
    """A delete deferred to a writer that never ended its write: before, the write made the store
    look busy and the deferred delete (bytes the tree does not place) was never looked at."""
    store, ns, a = built
    s = store._stack
    with store.lock:
        s.begin_write_locked(1, ns.digest, ["zz"])
        assert s.mark_deleting_locked([(1, ns.digest, "zz")]) == []  # deferred to the writer
        assert s._deferred
    with pytest.raises(AssertionError, match="writes in flight"):
        store.check_integrity()


def test_a_stale_deleting_entry(built):
    store, ns, a = built
    with store.lock:
        store._stack._deleting[(1, ns.digest, "b2")] += 1  # a delete that never unmarked itself
    with pytest.raises(AssertionError, match="deletes in flight"):
        store.check_integrity()


def test_a_copy_never_ended(built):
    """A copy between tiers that never ended makes every later clear() of its namespace wait."""
    store, ns, a = built
    with store.lock:
        store._stack.begin_copy_locked(ns.digest)
    with pytest.raises(AssertionError, match="copies between tiers"):
        store.check_integrity()


def test_a_clear_that_never_ended(built):
    """A clear counted as running makes every put of its namespace return False."""
    store, ns, a = built
    with store.lock:
        store._stack.clearing[ns.digest] += 1
    with pytest.raises(AssertionError, match="clears"):
        store.check_integrity()


def test_an_adoption_watch_never_ended(built):
    store, ns, a = built
    with store.lock:
        store._stack.watch_locked(ns.digest)
    with pytest.raises(AssertionError, match="adoption watches"):
        store.check_integrity()


def test_a_namespace_chunk_size_off_by_one_chunk(built):
    """The namespace's chunk size (fixed by its first put) must be every one of its chunks' size."""
    store, ns, a = built
    with store.lock:
        store._ns_bytes[ns.digest] += CHUNK_BYTES
    with pytest.raises(AssertionError, match="bytes, the namespace's chunks"):
        store.check_integrity()


def test_a_call_running_is_not_a_leak(built):
    """While a call runs (here: the check from inside one), what it holds is not checked."""
    store, ns, a = built
    with store._stack.calls:
        with store.lock:
            store._stack.reserved[0] += _charge(store, 0)
        store.check_integrity()
        with store.lock:
            store._stack.release_locked(0, _charge(store, 0))
    store.check_integrity()


def test_a_put_a_clear_overtook_before_it_wrote_fixes_the_chunk_size_again(tmp_path):
    """Found by the idle check above (a 4-thread put/get/delete/clear stress): a clear of the
    namespace that ran while a put made room forgot the chunk size the put had fixed, and the put
    then inserted its chunks with no size on record. A later put of another size was accepted, and
    the first chain could no longer be read (its buffers were 'the wrong size')."""
    store = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=8 * CHUNK_BYTES, name="mem")],
        metrics=False, probe_tiers=False))
    ns, keys = new_namespace(), ["a0", "a1"]
    s, reserve = store._stack, store._stack.reserve

    def reserve_after_a_clear(*args, **kwargs):
        s.reserve = reserve
        store.clear(ns)
        return reserve(*args, **kwargs)

    s.reserve = reserve_after_a_clear
    try:
        assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True, True]  # fresh bytes
        store.check_integrity()
        with pytest.raises(InputError, match=f"stores {CHUNK_BYTES}-byte chunks"):
            store.put(ns, ["b0"], [torch.zeros(2 * CHUNK_BYTES, dtype=torch.uint8)])
        assert store.get(ns, keys, buffers(len(keys))) == len(keys)
        store.check_integrity()
    finally:
        store.close()


def test_a_prefetch_cancel_still_unpinning_is_a_call_running(tmp_path):
    """Found by the idle check in a concurrent prefetch/cancel fuzz: a cancel that wins a queued
    prefetch unpins its chunks in the cancelling thread, and the reader thread that then takes the
    cancelled job counts it done at once. A check in between found no call and no job running and
    took the read's get-* pins for a leak. The handle's cancel() now counts as a store call."""
    store = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=8 * CHUNK_BYTES, name="mem")],
        metrics=False, probe_tiers=False, prefetch_threads=1))
    ns, keys = new_namespace(), ["a0", "a1"]
    try:
        assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True, True]
        busy = threading.Event()
        store._reader.submit(lambda job: busy.wait(10.0), None)  # the prefetch below stays queued
        handle = store.prefetch(ns, keys, buffers(len(keys)))
        unpinning, resume = threading.Event(), threading.Event()
        unpin = store._unpin

        def slow_unpin(refs, owner):
            unpinning.set()
            resume.wait(10.0)
            unpin(refs, owner)

        store._unpin = slow_unpin
        cancel = threading.Thread(target=handle.cancel)
        cancel.start()
        try:
            assert unpinning.wait(10.0)
            busy.set()
            assert store._reader.drain(10.0)  # the cancelled job is done, its unpin still running
            store.check_integrity()
        finally:
            resume.set()
            cancel.join(10.0)
        assert handle.wait(1.0) == 0
        with store.lock:
            assert not store.tree.pinned_count()
        store.check_integrity()
    finally:
        store.close()
