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
from heapq import heappush
from typing import TYPE_CHECKING, Generator, Sequence

from radixkv.policies import register_policy

if TYPE_CHECKING:
    from librt.vecs import vec
    from mypy_extensions import i64

    from radixkv.sims.traces import Trace
    from radixkv.tree import RadixTree, TreeColumns

__all__ = ["OPTPolicy", "NEVER", "next_use_table"]

NEVER = 1 << 62  # next-use index of a block no later request references

# A heap entry is one int that sorts like the tuple (-next_use, -depth, node): int comparisons cost
# a third of tuple comparisons, and the heap is the policy's inner loop (one pop per eviction, one
# push per new leaf). Fields: NEVER - next_use (0..2^62), 2^48 - depth, node (both below 2^48).
_FIELD = 48
_NODE_MASK = (1 << _FIELD) - 1
_DEPTH_TOP = 1 << _FIELD
_OUT = -1  # OPTPolicy._cur of a node not in the tier (entries are >= 0; None: next use not told yet)


def _entry(next_use: int, depth: int, node: int) -> int:
    """The heap entry of a node (see above): smaller is a better victim."""
    return ((NEVER - next_use) << (2 * _FIELD)) | (((1 << _FIELD) - depth) << _FIELD) | node


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
        self._heap: list[int] = []  # entries (see _entry): farthest next use, then deepest, first
        # By node id (a list slot: cheaper than a dict probe, twice per block reference): the node's
        # live heap entry, None while its next use is not told yet, _OUT if not in the tier.
        self._cur: list[int | None] = []
        self._resident = 0
        self._unknown: set[int] = set()  # inserted, next use not yet told
        self._t = 0
        self._bit = 1

    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        # The tree's columns are read through it at each use: one is replaced when it grows.
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index

    @property
    def _depth(self) -> vec[i64]:  # read-only: the tree's depth column
        return self._cols.depth

    @property
    def _tchild(self) -> vec[i64]:  # read-only: children resident in the tier
        return self._cols.tchild[self._t]

    @property
    def _mask(self) -> vec[i64]:  # read-only: residency masks (check_integrity)
        return self._cols.mask

    def __len__(self) -> int:
        return self._resident

    def set_next_use(self, node_ids: Sequence[int], next_use: Sequence[int]) -> None:
        """Oracle hook: the index of the next request using each node (root->leaf path order).

        Only tier leaves enter the heap: an interior node cannot be a victim, and its entry is
        pushed by :meth:`on_leaf` when its last child leaves (most of a path is interior, so this
        keeps the heap a few times smaller)."""
        cur, heap, depth, tchild = self._cur, self._heap, self._depth, self._tchild
        never, top = NEVER, _DEPTH_TOP  # locals: no global lookups per block
        for n, t in zip(node_ids, next_use):
            if cur[n] != _OUT:
                # _entry(t, depth[n], n), written out: once per block reference of the trace
                e = cur[n] = ((never - t) << 96) | ((top - depth[n]) << 48) | n
                if not tchild[n]:
                    heappush(heap, e)
        # Unknown nodes are a subset of cur's: one set operation rather than a discard per node.
        if self._unknown:
            self._unknown.difference_update(node_ids)

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        # Unknown future until set_next_use: treat as never used again (evicted first).
        cur = self._cur
        if len(cur) < len(self._depth):
            cur.extend([_OUT] * (len(self._depth) - len(cur)))
        for n in node_ids:
            if cur[n] == _OUT:
                self._resident += 1
            cur[n] = None
        self._unknown.update(node_ids)

    def on_access(self, node_id: int, now: int) -> None:
        pass  # the order depends on the future only

    def on_leaf(self, node_id: int) -> None:
        # A live candidates() run may have popped this node while it was interior; put its entry
        # back so the same run sees it now that it is a leaf (a duplicate entry is skipped later).
        e = self._cur[node_id]
        if e is not None and e != _OUT:
            heappush(self._heap, e)

    def on_evict(self, node_id: int, leaf_parent: int) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), in one call (see EvictionPolicy)
        cur = self._cur
        if cur[node_id] != _OUT:
            cur[node_id] = _OUT
            self._resident -= 1
        if self._unknown:
            self._unknown.discard(node_id)
        if leaf_parent >= 0:
            e = cur[leaf_parent]
            if e is not None and e != _OUT:
                heappush(self._heap, e)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        cur = self._cur
        n_slots = len(cur)
        for n in node_ids:
            if n < n_slots and cur[n] != _OUT:
                cur[n] = _OUT
                self._resident -= 1
        if self._unknown:
            self._unknown.difference_update(node_ids)

    def candidates(self) -> Generator[int, None, None]:
        cur, heap = self._cur, self._heap
        if self._unknown:
            yield from sorted(self._unknown, key=self._depth.__getitem__, reverse=True)
        skipped: list[int] = []  # yielded entries still live afterwards (not evicted): pushed back
        heappop = heapq.heappop
        try:
            while heap:
                e = heappop(heap)
                n = e & _NODE_MASK
                if cur[n] is not e:
                    continue  # stale entry
                try:
                    yield n
                except GeneratorExit:
                    if cur[n] is e:
                        skipped.append(e)  # closed before the caller evicted it
                    raise
                if cur[n] is e:
                    skipped.append(e)
        finally:
            for e in skipped:
                if cur[e & _NODE_MASK] is e:
                    heapq.heappush(heap, e)
            if len(heap) > 4 * self._resident + 1024:
                tchild = self._tchild
                self._heap = [
                    e for n, e in enumerate(cur) if e is not None and e != _OUT and not tchild[n]
                ]
                heapq.heapify(self._heap)

    def check_integrity(self) -> None:
        cur = self._cur
        live = {e & _NODE_MASK for e in self._heap if cur[e & _NODE_MASK] is e}
        known = {n for n, e in enumerate(cur) if e is not None and e != _OUT}
        known_leaves = {n for n in known if not self._tchild[n]}
        assert self._unknown == {n for n, e in enumerate(cur) if e is None}, "opt: unknown set drifted"
        assert self._resident == len(known) + len(self._unknown), "opt: resident count drifted"
        missing = known_leaves - live
        assert not missing, f"opt: {len(missing)} tier leaves missing from the heap, e.g. {sorted(missing)[:5]}"
        assert live <= known, "opt: a live heap entry for a node not in the tier"
        held = known | self._unknown
        tier = {n for n, m in enumerate(self._mask) if m & self._bit}
        assert held == tier, (
            f"opt: tracked nodes not in the tier {sorted(held - tier)[:5]}, tier nodes not tracked "
            f"{sorted(tier - held)[:5]}"
        )
