"""Eviction: choosing and dropping a tier's victims in its policy's exact order.

:class:`TreeEviction` is that layer of :class:`~radixkv.tree.RadixTree` (see
:mod:`radixkv.tree_nodes` for the layering). :meth:`TreeEviction.evict` is the simulator's inner loop:
the built-in policies are driven through :class:`~radixkv.policy_base.TierPolicy`'s eviction steps,
fused by hand with the tree's removal of a leaf.
"""

from __future__ import annotations

import operator
from typing import Callable, Generator, Sequence, SupportsIndex, cast

from mypy_extensions import i64

from radixkv.errors import InputError
from radixkv.policies import LRUPolicy
from radixkv.policy_base import TierPolicy
from radixkv.policy_fifo import S3FIFOPolicy, SIEVEPolicy
from radixkv.policy_heap import AgedRefPolicy, CostPolicy, LFUPolicy
from radixkv.policy_oddsref import OddsRefPolicy
from radixkv.policy_opt import OPTPolicy
from radixkv.tree_joins import TreeJoins
from radixkv.tree_nodes import _unlink
from radixkv.tree_results import DropResult

__all__ = ["TreeEviction"]


def _chunk_count(n_chunks: object) -> int:
    """``n_chunks`` as an int; InputError for what is not an integer (a float, a bool, a str)."""
    if isinstance(n_chunks, bool):
        raise InputError(f"n_chunks={n_chunks!r} must be an integer number of chunks, not a bool")
    try:
        return operator.index(n_chunks)  # type: ignore[arg-type]
    except TypeError:
        raise InputError(f"n_chunks={n_chunks!r} must be an integer number of chunks") from None


class TreeEviction(TreeJoins):
    """Evicting from a tier: :meth:`evict` and :meth:`evict_candidates`."""

    def evict_candidates(self, tier: str, n_chunks: SupportsIndex, drop: bool = False) -> list[int]:
        """Up to ``n_chunks`` nodes to evict from ``tier``, best first per the tier's policy.

        Every candidate is resident in ``tier``, unpinned, and has no child resident in ``tier``.
        With ``drop`` (the caller will not demote it elsewhere) a candidate also has no live child
        unless another tier holds it, so dropping it never orphans anything. Does not mutate the tree.
        """
        t = self.tier_index(tier)
        want = _chunk_count(n_chunks)
        if want <= 0:
            return []
        out: list[int] = []
        seen: set[int] = set()
        gen = self._eligible(t, drop)
        try:
            for n in gen:
                if n in seen:  # a policy may sweep its list again when nothing is evicted (sieve)
                    if len(seen) >= len(self._policies[t]):
                        break
                    continue
                seen.add(n)
                out.append(n)
                if len(out) >= want:
                    break
        finally:
            gen.close()
        return out

    def _eligible(self, t: int, drop: bool) -> Generator[int, None, None]:
        """The tier policy's candidates, filtered to what :meth:`evict_candidates` promises. Each step
        reads the tree afresh, so it stays valid across evictions when the policy's iterator does."""
        bit, mask, nchild = 1 << t, self._mask, self._nchild
        tchild, pins = self._tchild[t], self._pins
        held = pins.by_node  # the dict itself: a plain truth test per candidate, no method call
        gen = self._policies[t].candidates()
        try:
            for n in gen:
                if not mask[n] & bit or tchild[n]:
                    continue
                if held and n in held and pins.is_pinned(n):
                    continue
                if drop and nchild[n] and mask[n] == bit:
                    continue
                yield n
        finally:
            gen.close()

    def evict(self, tier: str, n_chunks: SupportsIndex) -> DropResult:
        """Drop up to ``n_chunks`` chunks from ``tier`` one at a time in exact policy order (each
        eviction may make a parent the next victim). Chunks other tiers hold stay in the tree.

        Policies that declare ``live_candidates = True`` tolerate evictions between the steps of one
        ``candidates()`` iterator, so the whole loop runs on one iterator (the fast path the
        simulator uses); for other policies a fresh iterator is taken per eviction."""
        t = self._tier_pos.get(tier)  # tier_index inlined: once per replayed request
        if t is None:
            t = self.tier_index(tier)  # raises: unknown tier
        removed: list[int] = []
        removed_o = cast("list[object]", removed)  # filled with the index's int objects
        if type(n_chunks) is int:  # the replay's case: no call into operator
            n_evict: int = n_chunks
        else:
            n_evict = _chunk_count(n_chunks)
        if n_evict <= 0:
            return DropResult()
        if n_evict > self._tier_chunks[t]:
            # No more can go; and a count past 2**63 would overflow the compiled loop's machine
            # integer after its first eviction (the compiled build raised there, half done).
            n_evict = self._tier_chunks[t]
        pol = self._policies[t]
        kind = type(pol)
        # The built-in policies (their exact classes: a subclass may override any hook) are driven
        # natively, by TierPolicy's eviction steps (_take, _evict, _end): direct calls, not a
        # generator's resumption and close and a Python-level call per eviction (~25% of an lru
        # replay). A subclass takes the generic path, where its own on_remove and on_leaf are called.
        native: TierPolicy | None = None
        if (kind is LRUPolicy or kind is AgedRefPolicy or kind is OddsRefPolicy or kind is OPTPolicy
                or kind is S3FIFOPolicy or kind is SIEVEPolicy or kind is CostPolicy or kind is LFUPolicy):
            native = cast(TierPolicy, pol)
        if native is None and not getattr(pol, "live_candidates", False):
            orphans: list[int] = []
            for _ in range(n_evict):
                victims = self.evict_candidates(tier, 1, drop=True)
                if not victims:
                    break
                r = self.clear_resident(victims, tier)
                removed.extend(r.removed_node_ids)
                orphans.extend(r.orphaned_node_ids)
            return DropResult(tuple(removed), tuple(orphans))
        # One loop, fused by hand: the policy's live iterator, the eligibility checks of _eligible
        # (resident, tier leaf, unpinned, orphans nothing) and the lean removal of a tier leaf. This
        # is the simulator's inner loop, so it avoids a generator layer and a call per eviction.
        bit, mask, nchild, tchild = 1 << t, self._mask, self._nchild, self._tchild[t]
        parent, size, key, ns, index = self._parent, self._size, self._key, self._ns, self._index
        pins, free = self._pins, self._free
        ids_o = cast("list[object]", self._ids)
        kid, nxt, prv = self._kid, self._next, self._prev
        held = pins.by_node  # the dict itself: a plain truth test per eviction, no method call
        awaits = self._awaits  # likewise: a namespace-root chunk that leaves ends its run's wait
        # Their truth, once, for a built-in policy's loop (compiled, a dict's truth is a call): it pins
        # nothing and starts no wait, and one that ends during it only makes a membership test
        # needless. A Python policy's hooks could pin: its loop tests the dicts themselves.
        any_held, any_awaits = bool(held), bool(awaits)
        # The key index of the last evicted chunk's namespace and that namespace's object: chunks of
        # one namespace (all of a simulation's) share the object, so one probe of the namespace dict
        # per run, not per chunk. A namespace whose last chunk leaves is not seen again in this run.
        last_ns: str | None = None
        last_idx: dict[str, int] = {}
        # A policy's optional on_evict(n, leaf_parent) is on_remove((n,)) plus on_leaf(leaf_parent)
        # in one call (leaf_parent -1: none), made after the tree's own updates: one Python call per
        # evicted chunk instead of two, and no 1-tuple. A built-in policy needs none of the three
        # (looking up an absent on_evict raises and catches an AttributeError: once per call here).
        on_evict: Callable[[int, int], object] | None = None
        on_remove: Callable[[Sequence[int]], object] | None = None
        on_leaf: Callable[[int], object] | None = None
        gen: Generator[int, None, None] | None = None
        if native is None:
            on_remove, on_leaf = pol.on_remove, pol.on_leaf
            on_evict = getattr(pol, "on_evict", None)
            gen = pol.candidates()
        # Machine integers (compiled: no tagged-int checks per evicted chunk).
        evicted: i64 = 0
        freed_bytes: i64 = 0
        n: i64 = -1  # a built-in policy: the node _take returned last (_take or _end sets it aside
        # if it stays)
        try:
            if on_evict is not None or gen is None:  # gen is None: a built-in policy, driven natively
                # The same steps as the loop below, with on_evict(n, leaf_parent) as its last policy
                # call before the key is cleared, and the branches laid out so a chunk no other tier
                # holds (every chunk of a one-tier tree) takes the fewest steps.
                while True:
                    if native is not None:
                        n = native._take(n)
                        if n < 0:
                            break
                    else:
                        x = next(gen, None)  # type: ignore[arg-type]
                        if x is None:
                            break
                        n = x
                    m = mask[n]
                    if not m & bit or tchild[n] or (nchild[n] and m == bit):
                        continue
                    if any_held and n in held and pins.is_pinned(n):
                        continue
                    m = mask[n] = m ^ bit  # the bit is set (checked above)
                    freed_bytes += size[n]
                    p = parent[n]
                    leaf_parent = -1
                    if p >= 0:  # != _NO_PARENT
                        if not m:  # no tier holds it: out of the parent's child list (_unlink, inlined)
                            nchild[p] -= 1
                            nx, pv = nxt[n], prv[n]
                            if pv >= 0:
                                nxt[pv] = nx
                            else:
                                kid[p] = nx
                            if nx >= 0:
                                prv[nx] = pv
                        c = tchild[p] = tchild[p] - 1
                        if c == 0 and mask[p] & bit:
                            leaf_parent = p
                    # before the key is cleared: a policy may remember it
                    if native is not None:
                        native._evict(n, leaf_parent)
                    else:
                        on_evict(n, leaf_parent)  # type: ignore[misc]  # not None (else a built-in is)
                    if not m:  # no tier holds it: it leaves the tree
                        if p < 0 and any_awaits and n in awaits:
                            self._forget_await(n)
                        space = ns[n]
                        if space is not last_ns:
                            last_ns, last_idx = space, index[space]  # type: ignore[index]
                        idx = last_idx
                        k = key[n]
                        # the index's int object for n, not a new box of n (see _claim)
                        removed_o.append(ids_o[n])
                        del idx[k]  # type: ignore[arg-type]
                        if p < 0 and not idx:  # its namespace's last chunk (a root: leaf first)
                            del index[space]  # type: ignore[arg-type]
                        if any_held:
                            pins.forget(n)
                        key[n] = None
                        ns[n] = None
                    evicted += 1
                    if evicted >= n_evict:
                        break
            else:
                for n in gen:  # type: ignore[union-attr]
                    m = mask[n]
                    if not m & bit or tchild[n] or (nchild[n] and m == bit):
                        continue
                    if held and n in held and pins.is_pinned(n):
                        continue
                    on_remove((n,))  # type: ignore[misc]  # set: not a built-in policy
                    m = mask[n] = m ^ bit  # the bit is set (checked above)
                    freed_bytes += size[n]
                    p = parent[n]
                    if p >= 0:  # != _NO_PARENT
                        c = tchild[p] = tchild[p] - 1
                        if m == 0:
                            nchild[p] -= 1
                            _unlink(kid, nxt, prv, n, p)
                        if c == 0 and mask[p] & bit:
                            on_leaf(p)  # type: ignore[misc]
                    if m == 0:
                        if p < 0 and awaits and n in awaits:
                            self._forget_await(n)
                        space = ns[n]
                        if space is not last_ns:
                            last_ns, last_idx = space, index[space]  # type: ignore[index]
                        idx = last_idx
                        k = key[n]
                        # the index's int object for n, not a new box of n (see _claim)
                        removed_o.append(ids_o[n])
                        del idx[k]  # type: ignore[arg-type]
                        if p < 0 and not idx:  # its namespace's last chunk (a root: leaf first)
                            del index[space]  # type: ignore[arg-type]
                        if held:
                            pins.forget(n)
                        key[n] = None
                        ns[n] = None
                    evicted += 1
                    if evicted >= n_evict:
                        break
        finally:
            if native is not None:
                native._end(n)
            else:
                gen.close()  # type: ignore[union-attr]
            free.extend(removed)  # nothing takes a slot during the loop: one extend, same order
            tier_bytes, tier_chunks = self._tier_bytes, self._tier_chunks  # not -= (see _create)
            tier_bytes[t] = tier_bytes[t] - freed_bytes
            tier_chunks[t] = tier_chunks[t] - evicted
        self.stats.removed_chunks += len(removed)
        return DropResult(tuple(removed), ())
