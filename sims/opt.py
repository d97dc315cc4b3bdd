"""Belady's OPT under prefix semantics, as an (offline) eviction policy behind the normal protocol.

OPT needs the future, which no live cache has. The simulator gives it that through one explicit
*oracle hook*: right after a request's blocks are inserted, :meth:`OPTPolicy.set_next_use` receives,
for every node of the request's path, the index of the next request that references it
(:data:`NEVER` if none). :func:`next_use_table` precomputes those indices for a whole trace in one
backward pass. Nothing else differs from an online policy: the tree asks for candidates, skips
ineligible ones, and calls ``on_remove`` for the victims.

Order: farthest next use first (blocks never used again first); ties deepest first. Because any later
request that uses a block also uses its whole prefix, a parent's next use is never later than its
child's, so with the deepest-first tie-break the best victim is always a leaf and the cache stays
prefix-closed. *Bypass* needs no special hook: the simulator inserts a request's blocks and then evicts
down to capacity, so a new block whose next use is the farthest leaves at once, as if never admitted.
For unit-size blocks this is Belady with bypass, the exact optimum of the block hit count under prefix
semantics.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterator, Sequence

from radixkv.policies import register_policy

if TYPE_CHECKING:
    from radixkv.sims.traces import Trace
    from radixkv.tree import RadixTree

__all__ = ["OPTPolicy", "NEVER", "next_use_table"]

NEVER = 1 << 62  # next-use index of a block no later request references


def next_use_table(trace: Trace) -> list[list[int]]:
    """``table[i][j]``: index of the next request after ``i`` that references block ``j`` of request
    ``i`` (:data:`NEVER` if none). One backward pass, O(total block references)."""
    nxt: dict[str, int] = {}
    table: list[list[int]] = [[]] * len(trace.requests)
    get = nxt.get
    for i in range(len(trace.requests) - 1, -1, -1):
        keys = trace.requests[i].block_keys
        table[i] = [get(k, NEVER) for k in keys]
        for k in keys:
            nxt[k] = i
    return table


@register_policy("opt")
class OPTPolicy:
    """Belady's MIN with bypass under prefix semantics; offline only (needs :meth:`set_next_use`)."""

    name = "opt"
    offline = True  # needs the future: never a runtime policy (the contract suite skips it)
    # One candidates() run survives the tree evicting each yielded node: a popped interior node can
    # only become eligible through on_leaf (OPT models one tier), which re-pushes it.
    live_candidates = True

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, node)
        self._cur: dict[int, tuple[int, int, int] | None] = {}  # node -> its live heap entry
        self._unknown: set[int] = set()  # inserted, next use not yet told
        self._depth: list[int] = []
        self._tchild: list[int] = []

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        self._depth = tree._depth  # read-only views of the tree's depth column
        self._tchild = tree._tchild[tier_index]  # and of the children resident in the tier

    def __len__(self) -> int:
        return len(self._cur)

    def set_next_use(self, node_ids: Sequence[int], next_use: Sequence[int]) -> None:
        """Oracle hook: the index of the next request using each node (root->leaf path order).

        Only tier leaves enter the heap: an interior node cannot be a victim, and its entry is
        pushed by :meth:`on_leaf` when its last child leaves (most of a path is interior, so this
        keeps the heap a few times smaller)."""
        cur, heap, depth, tchild = self._cur, self._heap, self._depth, self._tchild
        for n, t in zip(node_ids, next_use):
            if n in cur:
                self._unknown.discard(n)
                e = (-t, -depth[n], n)
                cur[n] = e
                if not tchild[n]:
                    heapq.heappush(heap, e)

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        cur = self._cur
        for n in node_ids:
            # Unknown future until set_next_use: treat as never used again (evicted first).
            cur[n] = None
        self._unknown.update(node_ids)

    def on_access(self, node_id: int, now: int) -> None:
        pass  # the order depends on the future only

    def on_leaf(self, node_id: int) -> None:
        # A live candidates() run may have popped this node while it was interior; put its entry
        # back so the same run sees it now that it is a leaf (a duplicate entry is skipped later).
        e = self._cur.get(node_id)
        if e is not None:
            heapq.heappush(self._heap, e)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        cur = self._cur
        for n in node_ids:
            cur.pop(n, None)
        if self._unknown:
            self._unknown.difference_update(node_ids)

    def candidates(self) -> Iterator[int]:
        cur, heap = self._cur, self._heap
        if self._unknown:
            yield from sorted(self._unknown, key=self._depth.__getitem__, reverse=True)
        popped: list[tuple[int, int, int]] = []
        try:
            while heap:
                e = heapq.heappop(heap)
                n = e[2]
                if cur.get(n) is not e:
                    continue  # stale entry
                popped.append(e)
                yield n
        finally:
            for e in popped:
                if cur.get(e[2]) is e:
                    heapq.heappush(heap, e)
            if len(heap) > 4 * len(cur) + 1024:
                tchild = self._tchild
                self._heap = [e for n, e in cur.items() if e is not None and not tchild[n]]
                heapq.heapify(self._heap)

    def check_integrity(self) -> None:
        live = {e[2] for e in self._heap if self._cur.get(e[2]) is e}
        known_leaves = {n for n, e in self._cur.items() if e is not None and not self._tchild[n]}
        assert self._unknown == {n for n, e in self._cur.items() if e is None}, "opt: unknown set drifted"
        missing = known_leaves - live
        assert not missing, f"opt: {len(missing)} tier leaves missing from the heap, e.g. {sorted(missing)[:5]}"
        assert live <= set(self._cur), "opt: a live heap entry for a node not in the tier"
