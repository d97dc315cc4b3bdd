"""Split chains: runs of a chain that reach the tree before their prefix.

An engine may hand over a chain's chunks out of order (SGLang backing up a child page before its
parent, a run stored while its parent key was unknown). Such a run hangs at the namespace root; the
insert that later brings its prefix *grafts* it under the chunk before it. :class:`TreeJoins` is that
layer of :class:`~radixkv.tree.RadixTree` (see :mod:`radixkv.tree_nodes` for the layering).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from radixkv.errors import InputError
from radixkv.tree_nodes import _NO_PARENT, TreeNodes, _check_keys
from radixkv.tree_results import InsertResult

if TYPE_CHECKING:
    from radixkv.tree_results import MatchResult

__all__ = ["TreeJoins"]


class TreeJoins(TreeNodes):
    """Grafting split chains (:meth:`_insert_joining`) and the runs awaiting a parent key."""

    def _insert_joining(
        self, ns: str, idx: dict[str, int], keys: Sequence[str], m: MatchResult, pos: int, start: int,
        t: int, chunk_tokens: int, size_bytes: int,
    ) -> InsertResult:
        """:meth:`insert` of ``keys[pos:]`` after node ``start`` (-1: the namespace root) when some of
        them are in the tree already. Each such key must be the first node of a run hanging at the
        namespace root (a *split chain*: its chunks arrived before their prefix, e.g. SGLang backing
        up a child page first): the run is grafted under the key before it and followed as far as it
        matches ``keys``; anything else (a key under another parent, a repeat, a run that is this
        chain's own root) is a contradiction, refused before anything changes. The rare path: one
        graft costs O(the grafted subtree + the start's depth), not O(tree size)."""
        n, parent, idx_get = len(keys), self._parent, idx.get
        if len(set(keys)) != n:
            raise InputError("keys are not one chain: a key repeats, or a key after the matched prefix is "
                             "already in the tree under another prefix")
        _check_keys(keys[pos:])
        top = start  # the chain's namespace-root node, which must not be grafted under its own chain
        while top != _NO_PARENT and parent[top] != _NO_PARENT:
            top = parent[top]
        # Plan in full first: (a, b, run root) -- keys[a:b] are new (run root -1) or the run of a
        # namespace-root node, grafted under the node before it.
        plan: list[tuple[int, int, int]] = []
        a, joined = pos, start != _NO_PARENT
        while a < n:
            j = a
            while j < n and keys[j] not in idx:
                j += 1
            if j > a:
                plan.append((a, j, _NO_PARENT))
                joined = True
            if j == n:
                break
            r = idx[keys[j]]
            if parent[r] != _NO_PARENT or r == top or not joined:
                raise InputError(
                    f"keys are not one chain: key {keys[j]!r} is already in the tree under another prefix "
                    "(only a run at the namespace root can continue a chain)"
                )
            b, node = j + 1, r
            while b < n:
                c = idx_get(keys[b])
                if c is None or parent[c] != node:
                    break
                node, b = c, b + 1
            plan.append((j, b, r))
            a = b
        self._now += 1
        bit, mask = 1 << t, self._mask
        ids: list[int] = list(m.node_ids) if pos else []
        missing = [x for x in ids if not mask[x] & bit]
        if missing:  # the matched prefix gains the tier, as in insert
            self._add_residency(missing, t)
        created: list[int] = []
        cur = start
        for a, b, r in plan:
            if r == _NO_PARENT:
                new = self._create(ns, idx, keys[a:b], cur, self._depth[cur] if cur != _NO_PARENT else 0,
                                   t, chunk_tokens, size_bytes)
                created += new
                ids += new
            else:
                self._graft(r, cur)
                new = [idx[k] for k in keys[a:b]]
                mask = self._mask  # again: a _create above may have replaced the column
                missing = [x for x in new if not mask[x] & bit]
                if missing:  # the grafted run's matched chunks gain the tier, like a matched prefix
                    self._add_residency(missing, t)
                ids += new
            cur = new[-1]
        if self._awaiting and created:
            self._join_awaiting(ns, created)
        if self._mask[cur] == 1:
            self._on_access(0, cur, self._now)
        else:
            self._touch(cur)
        r_ = InsertResult(m, tuple(created))
        r_._ids = tuple(ids)  # every key's node, root->leaf (the matched ids are not one prefix here)
        return r_

    def _graft(self, r: int, p: int) -> None:
        """Hang the namespace-root node ``r`` (and its subtree) under ``p``: parent, child lists, the
        new parent's child counts per tier ``r`` is resident in, the depth of every node of the
        subtree (O(its size), down the child lists), then each tier policy's optional
        ``on_graft(node_ids)`` with the subtree's nodes resident in its tier (parents first), for
        state it derived from depth. A wait of ``r`` for a parent key ends (it has one now)."""
        if self._awaits and r in self._awaits:
            self._forget_await(r)
        self._parent[r] = p
        self._nchild[p] += 1
        kid, nxt, prv = self._kid, self._next, self._prev
        head = kid[p]
        nxt[r], prv[r] = head, _NO_PARENT
        if head != _NO_PARENT:
            prv[head] = r
        kid[p] = r
        mask = self._mask
        m_r = mask[r]
        for i, tc in enumerate(self._tchild):
            if m_r >> i & 1:
                tc[p] += 1
        sub = [r] + self._descendants({r})
        depth, shift = self._depth, self._depth[p]  # r had depth 1: it now has depth[p] + 1
        for x in sub:
            depth[x] += shift
        for i, pol in enumerate(self._policies):
            on_graft = getattr(pol, "on_graft", None)
            if on_graft is not None:
                bit = 1 << i
                mine = [x for x in sub if mask[x] & bit]
                if mine:
                    on_graft(mine)

    def _await_parent(self, ns: str, idx: dict[str, int], first_key: str, parent_key: str) -> None:
        """Remember that the run whose first chunk is ``first_key`` awaits ``parent_key`` (see
        :meth:`insert`'s ``root_if_missing``): only a run at the namespace root waits, and not for a
        key the tree holds (nor, so, for one of its own keys); a node waits for one parent key, the
        latest named. Past ``max_awaiting_runs`` the oldest wait is forgotten."""
        r = idx.get(first_key)
        if (r is None or self._parent[r] != _NO_PARENT or parent_key in idx
                or not self.max_awaiting_runs):
            return
        if r in self._awaits:
            self._forget_await(r)
        while len(self._awaits) >= self.max_awaiting_runs:
            self._forget_await(next(iter(self._awaits)))
        self._awaits[r] = (ns, first_key, parent_key)
        self._awaiting.setdefault(ns, {}).setdefault(parent_key, []).append(r)

    def _join_awaiting(self, ns: str, new: list[int]) -> None:
        """Graft the runs awaiting a key of the just-created nodes ``new`` under that key's node
        (the rare path: O(len(new)) probes, then each graft). A run that is the root of the new
        node's own chain is not grafted under it (that would be a cycle): its wait just ends."""
        w = self._awaiting.get(ns)
        if not w:
            return
        key, parent = self._key, self._parent
        for p in new:
            runs = w.get(key[p])  # type: ignore[arg-type]
            if runs is None:
                continue
            top = p
            while parent[top] != _NO_PARENT:
                top = parent[top]
            for r in list(runs):
                self._forget_await(r)
                if r != top:  # still at the namespace root: its wait would have ended otherwise
                    self._graft(r, p)
            w = self._awaiting.get(ns)
            if not w:
                return

