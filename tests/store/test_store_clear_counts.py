"""clear() keeps a namespace's bytes counted until the tiers dropped them: otherwise another
namespace's writer gets room a disk tier lacks, and the disk evicts on its own, out of the tree's
order (here a chunk another writer committed but has not made resident yet)."""

from __future__ import annotations

import threading

from store_helpers import buffers, chain, new_namespace, payload_for


def test_clear_of_one_namespace_keeps_its_disk_bytes_counted_until_the_disk_cleared(make_store):
    """store.clear(X) empties X from the tree at once but the disk only later (outside the lock).
    Meanwhile the store's books undercount the disk by X's files, so another namespace's put gets
    room the disk lacks and the disk evicts on its own, LRU first: here the chunk Y a slower writer
    has committed but not yet inserted. The tree then places Y on a disk that deleted it."""
    store = make_store(("disk",), chunks={"disk": 2}, probe_tiers=False)
    disk = store.tiers[0]
    X, Y, Z = new_namespace(), new_namespace(), new_namespace()
    (x,), (y,), (z,) = chain(1, 1)[1], chain(2, 1)[1], chain(3, 1)[1]
    real_put, real_clear = disk.put_many, disk.clear
    y_committed, y_go, clearing, clear_go = (threading.Event() for _ in range(4))

    def put_many(ns, keys, payloads):
        ok = real_put(ns, keys, payloads)
        if threading.current_thread().name == "slow-writer":
            y_committed.set()          # the file is on disk and indexed; the store inserts it later
            assert y_go.wait(30)
        return ok

    def clear(ns=None):
        if threading.current_thread().name == "clearer":
            clearing.set()             # the tree forgot X; the disk still holds X's file
            assert clear_go.wait(30)
        return real_clear(ns)

    disk.put_many, disk.clear = put_many, clear
    out = []
    a = threading.Thread(target=lambda: out.append(store.put(Y, [y], [payload_for(y)])), name="slow-writer")
    a.start()
    assert y_committed.wait(30)
    assert store.put(X, [x], [payload_for(x)]) == [True]   # disk (LRU first): y, x
    c = threading.Thread(target=lambda: store.clear(X), name="clearer")
    c.start()
    assert clearing.wait(30)
    store.put(Z, [z], [payload_for(z)])   # before: the books say 1 of 2 used; the disk has 2
    y_go.set(); a.join(30)
    clear_go.set(); c.join(30)
    assert out == [[True]]
    assert store.lookup(Y, [y]) == 1
    b = buffers(1)
    assert store.get(Y, [y], b) == 1, "the tree placed y on the disk, which had evicted it"
    store.check_integrity()


def test_cleared_namespaces_leave_no_clear_in_progress_behind(make_store):
    """A clear's in-progress count leaves with the clear: a Counter keeps a key decremented to 0,
    so every namespace ever cleared stayed in ``clearing`` (an engine clears one per weight
    version), and the memory tier kept a clear generation per namespace too."""
    store = make_store(("mem",), chunks={"mem": 8})
    for _ in range(20):
        ns = new_namespace()
        keys = chain(4, 2)[1]
        assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True, True]
        store.clear(ns)
    store.clear()
    s = store._stack
    assert dict(s.clearing) == {}, f"{len(s.clearing)} namespaces left in clearing"
    assert store.tiers[0]._ns_gen == {}
    store.check_integrity()
