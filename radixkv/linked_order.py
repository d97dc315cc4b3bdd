"""Doubly linked lists of node ids, threaded through two columns indexed by node id.

lru's recency order, s3fifo's small and main FIFOs and sieve's FIFO are such lists. The lists of one
policy share one :class:`Links`, and a node is in at most one of them: its two entries are the next
newer and the next older node of its list (-1 at either end), :data:`OUT` in both for a node in
none. Putting a node at either end or taking it out is a few machine-integer writes and allocates
nothing (these orders were OrderedDicts: a hash probe, a boxed int and a method call each).

The tree's own child lists are of another shape (one list per parent, its head in a column by
parent) and stay in :mod:`radixkv.tree_nodes`.
"""

from __future__ import annotations

from typing import Final, final

from librt.vecs import extend, vec
from mypy_extensions import i64

__all__ = ["OUT", "Links", "LinkedList"]

OUT: Final = -2  # both links of a node in no list (-1 ends a list); Final: a C constant when compiled


@final
class Links:
    """The two link columns, by node id, of the lists threaded through them."""

    def __init__(self) -> None:
        # They grow by assignment (extend may move them): no alias of them outlives a call.
        self.newer: vec[i64] = vec[i64]()
        self.older: vec[i64] = vec[i64]()

    def __len__(self) -> int:
        return len(self.newer)

    def grow(self, n_slots: int) -> None:
        """Extend both columns to ``n_slots`` (no-op if they are that long); new nodes are in no list."""
        more = n_slots - len(self.newer)
        if more > 0:
            outs = vec[i64]([OUT] * more)
            self.newer = extend(self.newer, outs)
            self.older = extend(self.older, outs)

    def linked(self, n: int) -> bool:
        """Whether node ``n`` (below ``len(self)``) is in a list."""
        return self.newer[n] != OUT

    def check_integrity(self, label: str) -> set[int]:
        """The nodes in a list; both columns must agree on which they are. ``label`` names the
        policy in the assertion messages."""
        newer, older = self.newer, self.older
        assert len(newer) == len(older), f"{label}: link columns of {len(newer)} and {len(older)} slots"
        linked = {n for n in range(len(newer)) if newer[n] != OUT}
        assert linked == {n for n in range(len(older)) if older[n] != OUT}, (
            f"{label}: the newer and older links disagree on which nodes are linked"
        )
        return linked


@final
class LinkedList:
    """One list through ``links``: its ``newest`` and ``oldest`` node (-1: empty) and its ``count``.

    The methods trust their caller about membership (they are the policies' hot path): a node put at
    an end must be in no list, a node taken out must be in this one. :meth:`check_integrity` finds
    what a wrong call broke."""

    def __init__(self, links: Links) -> None:
        self.links = links
        # Machine integers, as the methods' node ids (compiled: no tagged-int checks on the hot path).
        self.newest: i64 = -1
        self.oldest: i64 = -1
        self.count: i64 = 0

    def append_newest(self, n: i64) -> None:
        """Put ``n`` (in no list) at the new end."""
        links, h = self.links, self.newest
        links.older[n] = h
        links.newer[n] = -1
        if h >= 0:
            links.newer[h] = n
        else:
            self.oldest = n
        self.newest = n
        self.count += 1

    def append_new(self, ids: list[int]) -> int:
        """Put each node of ``ids`` that is in no list at the new end, in order (the nodes a policy
        is told of at an insert: one call for all, not one per node); return how many."""
        links = self.links
        newer, older = links.newer, links.older
        h = self.newest
        k: i64 = 0
        for j in range(len(ids)):
            n: i64 = ids[j]
            if newer[n] != OUT:
                continue
            older[n] = h
            newer[n] = -1
            if h >= 0:
                newer[h] = n
            else:
                self.oldest = n
            h = n
            k += 1
        self.newest = h
        self.count += k
        return k

    def push_oldest(self, n: i64) -> None:
        """Put ``n`` (in no list) at the old end."""
        links, o = self.links, self.oldest
        links.newer[n] = o
        links.older[n] = -1
        if o >= 0:
            links.older[o] = n
        else:
            self.newest = n
        self.oldest = n
        self.count += 1

    def unlink(self, n: i64) -> None:
        """Take ``n`` (in this list) out of it."""
        links = self.links
        newer, older = links.newer, links.older
        nw, od = newer[n], older[n]
        newer[n] = OUT
        older[n] = OUT
        if nw >= 0:
            older[nw] = od
        else:
            self.newest = od
        if od >= 0:
            newer[od] = nw
        else:
            self.oldest = nw
        self.count -= 1

    def nodes(self) -> list[int]:
        """The list's nodes, oldest first (for tests and debugging; a cycle stops the walk)."""
        out: list[int] = []
        newer, n = self.links.newer, self.oldest
        while n >= 0 and len(out) <= len(newer):
            out.append(n)
            n = newer[n]
        return out

    def check_integrity(self, label: str) -> set[int]:
        """Walk the list from its old end (each node's older link must name the node before it, and
        the walk must end at the newest end after ``count`` nodes); return its nodes. ``label``
        names the list in the assertion messages."""
        newer, older = self.links.newer, self.links.older
        assert len(newer) == len(older), f"{label}: link columns of {len(newer)} and {len(older)} slots"
        n, prev = self.oldest, -1
        seen: set[int] = set()
        while n >= 0:
            assert n < len(newer), f"{label}: link to node {n}, past the {len(newer)} slots"
            assert n not in seen and len(seen) < self.count, f"{label}: more than its {self.count} nodes (a cycle)"
            assert older[n] == prev, f"{label}: node {n}'s older link {older[n]} != {prev}"
            seen.add(n)
            prev, n = n, newer[n]
        assert n == -1, f"{label}: ends in link {n} after node {prev}"
        assert prev == self.newest, f"{label}: its newest end {self.newest} is not its newest node {prev}"
        assert len(seen) == self.count, f"{label}: {len(seen)} nodes walked, {self.count} counted"
        return seen
