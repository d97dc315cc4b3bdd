"""An indexed binary min-heap of node ids, for the priority-ordered eviction policies.

Each node in it carries a priority (a float) and a depth; the order is ``(priority, -depth, node)``
ascending: smallest priority first, ties deepest first, then lowest id. That is a strict total order,
so the minimum is unique and any correct heap yields the same sequence of minima as a sorted list
would (and as the lazily invalidated ``heapq`` of tuples the policies used before).

A position column (by node id) makes every operation direct: pushing a node already in the heap
moves it to its new key, and removing one takes it out at once. Nothing goes stale, so the heap never
holds more entries than nodes and needs no compaction; all state is in ``vec`` columns (unboxed
machine numbers in the compiled build), so no operation allocates.
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
    node taken out with :meth:`pop` can be put back as it was with :meth:`restore`."""

    def __init__(self) -> None:
        self._heap: vec[i64] = vec[i64]()  # node ids in heap order; slots past _n are unused
        self._n: i64 = 0
        self._pos: vec[i64] = vec[i64]()  # by node id: its index in _heap, -1 if not in the heap
        self._prio: vec[float] = vec[float]()  # by node id: its priority as last pushed
        self._depth: vec[i64] = vec[i64]()  # by node id: its depth as last pushed

    def __len__(self) -> int:
        return int(self._n)

    @property
    def capacity(self) -> int:
        """Node ids below this may be pushed (:meth:`grow` raises it)."""
        return len(self._pos)

    def grow(self, n_slots: int) -> None:
        """Accept node ids below ``n_slots`` (no-op if it already does)."""
        k = n_slots - len(self._pos)
        if k <= 0:
            return
        self._heap = extend(self._heap, vec[i64]([0] * k))
        self._pos = extend(self._pos, vec[i64]([-1] * k))
        self._prio = extend(self._prio, vec[float]([0.0] * k))
        self._depth = extend(self._depth, vec[i64]([0] * k))

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
        return self._heap[0] if self._n > 0 else -1

    def push(self, n: i64, prio: float, depth: i64) -> None:
        """Order ``n`` by ``(prio, -depth, n)``: insert it, or move it if it is in the heap already."""
        self._prio[n] = prio
        self._depth[n] = depth
        i = self._pos[n]
        if i < 0:
            i = self._n
            self._n = i + 1
            self._heap[i] = n
            self._pos[n] = i
            self._up(i)
        else:
            self._up(i)
            self._down(self._pos[n])

    def restore(self, n: i64) -> None:
        """Put ``n`` back with the priority and depth it was last pushed with (no-op if it is in)."""
        if self._pos[n] < 0:
            i = self._n
            self._n = i + 1
            self._heap[i] = n
            self._pos[n] = i
            self._up(i)

    def pop(self) -> i64:
        """Take the smallest node out and return it (-1: empty)."""
        n = self._n
        if n <= 0:
            return -1
        heap = self._heap
        first = heap[0]
        self._pos[first] = -1
        n -= 1
        self._n = n
        if n > 0:
            last = heap[n]
            heap[0] = last
            self._pos[last] = 0
            self._down(0)
        return first

    def remove(self, n: i64) -> bool:
        """Take ``n`` out wherever it is; False if it was not in the heap."""
        i = self._pos[n]
        if i < 0:
            return False
        self._pos[n] = -1
        k = self._n - 1
        self._n = k
        if i < k:
            last = self._heap[k]
            self._heap[i] = last
            self._pos[last] = i
            self._up(i)
            self._down(self._pos[last])
        return True

    def clear(self) -> None:
        """Empty the heap (priorities are kept, as after :meth:`pop`)."""
        heap, pos = self._heap, self._pos
        for i in range(self._n):
            pos[heap[i]] = -1
        self._n = 0

    def nodes(self) -> list[int]:
        """The nodes in the heap, in no particular order."""
        heap = self._heap
        return [int(heap[i]) for i in range(self._n)]

    def _less(self, a: i64, b: i64) -> bool:
        pa, pb = self._prio[a], self._prio[b]
        if pa != pb:
            return pa < pb
        da, db = self._depth[a], self._depth[b]
        if da != db:
            return da > db  # deeper first
        return a < b

    # _up and _down compare with _less written out (with the node's own key in locals): they are the
    # heap's inner loops, one comparison per level.
    def _up(self, i: i64) -> None:
        heap, pos, prio, depth = self._heap, self._pos, self._prio, self._depth
        n = heap[i]
        pn, dn = prio[n], depth[n]
        while i > 0:
            j = (i - 1) >> 1
            q = heap[j]
            pq = prio[q]
            if pq < pn:
                break
            if pq == pn:
                dq = depth[q]
                if dq > dn or (dq == dn and q < n):
                    break
            heap[i] = q
            pos[q] = i
            i = j
        heap[i] = n
        pos[n] = i

    def _down(self, i: i64) -> None:
        heap, pos, prio, depth, size = self._heap, self._pos, self._prio, self._depth, self._n
        n = heap[i]
        pn, dn = prio[n], depth[n]
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            q = heap[c]
            pq = prio[q]
            if c + 1 < size:
                r = heap[c + 1]
                pr = prio[r]
                if pr < pq or (pr == pq and self._less(r, q)):
                    c += 1
                    q, pq = r, pr
            if pn < pq:
                break
            if pn == pq:
                dq = depth[q]
                if dn > dq or (dn == dq and n < q):
                    break
            heap[i] = q
            pos[q] = i
            i = c
        heap[i] = n
        pos[n] = i

    def check_integrity(self) -> None:
        heap, pos, size = self._heap, self._pos, self._n
        assert 0 <= size <= len(heap) == len(pos) == len(self._prio) == len(self._depth), (
            f"prio heap: {size} entries, columns of {len(heap)}/{len(pos)}/{len(self._prio)}/{len(self._depth)}"
        )
        for i in range(size):
            n = heap[i]
            assert 0 <= n < len(pos) and pos[n] == i, f"prio heap: slot {i} holds {n}, whose position is not {i}"
            if i > 0:
                assert not self._less(n, heap[(i - 1) >> 1]), f"prio heap: {n} at {i} is below its parent"
        held = sum(1 for p in pos if p >= 0)
        assert held == size, f"prio heap: {held} nodes with a position, {size} entries"
