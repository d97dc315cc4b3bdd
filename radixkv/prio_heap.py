"""An indexed binary min-heap of node ids, for the priority-ordered eviction policies.

Each node in it carries a priority (a float) and a depth; the order is ``(priority, -depth, node)``
ascending: smallest priority first, ties deepest first, then lowest id. That is a strict total order,
so the minimum is unique and any correct heap yields the same sequence of minima as a sorted list
would (and as the lazily invalidated ``heapq`` of tuples the policies used before).

A position column (by node id) makes every operation direct: pushing a node already in the heap
moves it to its new key, and removing one takes it out at once. Nothing goes stale, so the heap never
holds more entries than nodes and needs no compaction; all state is in ``vec`` columns (unboxed
machine numbers in the compiled build), so no operation allocates.

A pop leaves the root slot empty (a *hole*) and the next operation fills it. When that operation
puts a new node in (the policies' usual step after an eviction: the evicted chunk's parent becomes a
leaf, its priority close to the minimum), the node goes into the hole and sifts down from the root,
usually a level or two. A plain pop would sift the last entry down from the root, and the push
would then sift the parent up from the bottom: two walks of the heap's height instead of one short
one. Any other operation first fills the hole as a pop always did.
"""

from __future__ import annotations

from typing import final

from librt.vecs import extend, vec
from mypy_extensions import i64

__all__ = ["PrioHeap"]


@final
class PrioHeap:
    """Node ids ``0 .. capacity-1`` ordered by ``(priority, -depth, node)``; see the module docstring.

    A node's last priority and depth are kept after it leaves the heap (:meth:`prio_of`), so a
    node taken out with :meth:`pop` can be put back as it was with :meth:`restore`.

    Internal to the policies, which pass only ids of the tree's nodes after :meth:`grow`: the methods
    do not check ``0 <= n < capacity`` (they are the heap's hot path; a negative id would index the
    columns from their end). ``check_integrity`` finds what a bad id broke."""

    def __init__(self) -> None:
        # By heap position (slots past _n unused): the node there and its key. The key is kept beside
        # the node, not only by node id, so a sift compares neighbouring slots instead of reading two
        # random nodes' entries (a cache miss each in a large heap).
        self._heap: vec[i64] = vec[i64]()
        self._hprio: vec[float] = vec[float]()
        self._hdepth: vec[i64] = vec[i64]()
        self._n: i64 = 0  # slots in use, the hole included
        self._hole = False  # slot 0 is empty: the last pop took the root and left the refill (_fill)
        self._pos: vec[i64] = vec[i64]()  # by node id: its index in _heap, -1 if not in the heap
        self._prio: vec[float] = vec[float]()  # by node id: its priority as last pushed
        self._depth: vec[i64] = vec[i64]()  # by node id: its depth as last pushed

    def __len__(self) -> int:
        return int(self._n - 1) if self._hole else int(self._n)

    def _fill(self) -> None:
        # Complete the last pop: the last entry fills the root's slot and sifts down from it.
        self._hole = False
        k = self._n - 1
        self._n = k
        if k > 0:
            self._down(0, self._heap[k], self._hprio[k], self._hdepth[k])

    @property
    def capacity(self) -> int:
        """Node ids below this may be pushed (:meth:`grow` raises it)."""
        return len(self._pos)

    def grow(self, n_slots: int) -> None:
        """Accept node ids below ``n_slots`` (no-op if it already does)."""
        k = n_slots - len(self._pos)
        if k <= 0:
            return
        zeros, floats = vec[i64]([0] * k), vec[float]([0.0] * k)
        self._heap = extend(self._heap, zeros)
        self._hprio = extend(self._hprio, floats)
        self._hdepth = extend(self._hdepth, zeros)
        self._pos = extend(self._pos, vec[i64]([-1] * k))
        self._prio = extend(self._prio, floats)
        self._depth = extend(self._depth, zeros)

    def contains(self, n: i64) -> bool:
        return self._pos[n] >= 0

    def prio_of(self, n: i64) -> float:
        """The priority ``n`` was last pushed with (also after it left the heap)."""
        return self._prio[n]

    def depth_of(self, n: i64) -> i64:
        """The depth ``n`` was last pushed with (also after it left the heap)."""
        return self._depth[n]

    def top(self) -> i64:
        """The smallest node, left in the heap (-1: empty)."""
        if self._hole:
            self._fill()
        return self._heap[0] if self._n > 0 else -1

    def push(self, n: i64, prio: float, depth: i64) -> None:
        """Order ``n`` by ``(prio, -depth, n)``: insert it, or move it if it is in the heap already."""
        self._prio[n] = prio
        self._depth[n] = depth
        if self._pos[n] < 0:
            self._insert(n, prio, depth)
            return
        if self._hole:
            self._fill()
        i = self._up(self._pos[n], n, prio, depth)
        self._down(i, n, prio, depth)

    def _insert(self, n: i64, prio: float, depth: i64) -> None:
        # n (not in the heap) into the hole, sifting down from the root, or at the end, sifting up.
        if self._hole:
            self._hole = False
            self._down(0, n, prio, depth)
        else:
            i = self._n
            self._n = i + 1
            self._up(i, n, prio, depth)

    def restore(self, n: i64) -> None:
        """Put ``n`` back with the priority and depth it was last pushed with (no-op if it is in)."""
        if self._pos[n] < 0:
            self._insert(n, self._prio[n], self._depth[n])

    def pop(self) -> i64:
        """Take the smallest node out and return it (-1: empty). Its slot stays a hole until the
        next operation (see the module docstring)."""
        if self._hole:
            self._fill()
        if self._n <= 0:
            return -1
        first = self._heap[0]
        self._pos[first] = -1
        self._hole = True
        return first

    def remove(self, n: i64) -> bool:
        """Take ``n`` out wherever it is; False if it was not in the heap."""
        if self._pos[n] < 0:
            return False
        if self._hole:
            self._fill()  # moves entries: n's position is read after
        i = self._pos[n]
        self._pos[n] = -1
        k = self._n - 1
        self._n = k
        if i < k:
            # the last entry fills the hole, moving up or down from there
            last, lp, ld = self._heap[k], self._hprio[k], self._hdepth[k]
            i = self._up(i, last, lp, ld)
            self._down(i, last, lp, ld)
        return True

    def clear(self) -> None:
        """Empty the heap (priorities are kept, as after :meth:`pop`)."""
        heap, pos = self._heap, self._pos
        for i in range(self._n):  # a hole's slot holds a node already out (no refill needed)
            pos[heap[i]] = -1
        self._n = 0
        self._hole = False

    def nodes(self) -> list[int]:
        """The nodes in the heap, in no particular order."""
        if self._hole:
            self._fill()
        heap = self._heap
        return [int(heap[i]) for i in range(self._n)]

    # _up and _down place node n with key (p, d) at slot i or wherever the order takes it from there,
    # moving the entries it passes; they compare with the key written out (one comparison per level:
    # the heap's inner loops). Both return the slot where n ends.
    def _up(self, i: i64, n: i64, p: float, d: i64) -> i64:
        heap, hprio, hdepth, pos = self._heap, self._hprio, self._hdepth, self._pos
        while i > 0:
            j = (i - 1) >> 1
            pq = hprio[j]
            if pq < p:
                break
            q = heap[j]
            if pq == p:
                dq = hdepth[j]
                if dq > d or (dq == d and q < n):
                    break
            heap[i] = q
            hprio[i] = pq
            hdepth[i] = hdepth[j]
            pos[q] = i
            i = j
        heap[i] = n
        hprio[i] = p
        hdepth[i] = d
        pos[n] = i
        return i

    def _down(self, i: i64, n: i64, p: float, d: i64) -> i64:
        heap, hprio, hdepth, pos, size = self._heap, self._hprio, self._hdepth, self._pos, self._n
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            pc = hprio[c]
            if c + 1 < size:
                pr = hprio[c + 1]
                if pr < pc:
                    c += 1
                    pc = pr
                elif pr == pc:  # a tie: the deeper child, then the lower id (_slot_less written out)
                    dr, dc = hdepth[c + 1], hdepth[c]
                    if dr > dc or (dr == dc and heap[c + 1] < heap[c]):
                        c += 1
            if p < pc:
                break
            q = heap[c]
            if p == pc:
                dq = hdepth[c]
                if d > dq or (d == dq and n < q):
                    break
            heap[i] = q
            hprio[i] = pc
            hdepth[i] = hdepth[c]
            pos[q] = i
            i = c
        heap[i] = n
        hprio[i] = p
        hdepth[i] = d
        pos[n] = i
        return i

    def _slot_less(self, a: i64, b: i64) -> bool:
        """Whether the entry at slot ``a`` orders before the one at slot ``b``."""
        pa, pb = self._hprio[a], self._hprio[b]
        if pa != pb:
            return pa < pb
        da, db = self._hdepth[a], self._hdepth[b]
        if da != db:
            return da > db  # deeper first
        return self._heap[a] < self._heap[b]

    def check_integrity(self) -> None:
        if self._hole:
            # The hole's slot still holds the popped node, which left the heap (no position).
            assert self._n > 0 and self._pos[self._heap[0]] < 0, (
                f"prio heap: a hole at the root, {self._n} slots, the popped node "
                f"{self._heap[0] if self._n > 0 else None} still placed"
            )
            self._fill()  # an invisible step (the next operation would make it): check the heap after it
        heap, pos, size = self._heap, self._pos, self._n
        cols = (len(heap), len(self._hprio), len(self._hdepth), len(pos), len(self._prio), len(self._depth))
        assert 0 <= size <= len(heap) and len(set(cols)) == 1, f"prio heap: {size} entries, columns of {cols}"
        for i in range(size):
            n = heap[i]
            assert 0 <= n < len(pos) and pos[n] == i, f"prio heap: slot {i} holds {n}, whose position is not {i}"
            assert self._hprio[i] == self._prio[n] and self._hdepth[i] == self._depth[n], (
                f"prio heap: slot {i} keys {n} as ({self._hprio[i]}, {self._hdepth[i]}), its own key is "
                f"({self._prio[n]}, {self._depth[n]})"
            )
            if i > 0:
                assert not self._slot_less(i, (i - 1) >> 1), f"prio heap: {n} at {i} is below its parent"
        held = sum(1 for p in pos if p >= 0)
        assert held == size, f"prio heap: {held} nodes with a position, {size} entries"
