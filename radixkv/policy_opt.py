"""Belady's OPT under prefix semantics: the ordering behind the simulator's offline ``opt`` policy.

OPT needs the future, which no live cache has, so it is never a runtime policy: the simulator
(:mod:`radixkv.sims.opt`, which registers it as ``opt`` and computes the future) tells it each node's
next use through one explicit oracle hook, :meth:`OPTPolicy.set_next_use`. It lives here, beside the
other priority policies, so that it is compiled with them and the tree drives it the same way; see
:mod:`radixkv.sims.opt` for the semantics (farthest next use first, ties deepest first, bypass).
"""

from __future__ import annotations

import math
from typing import ClassVar, Final, Sequence, cast

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import InputError
from radixkv.policy_heap import _ORDERED, _OUT, _PARKED, _HeapPolicy

__all__ = ["NEVER", "OPTPolicy"]

# Next-use index of a block no later request references: above every request index (a trace of 2^53
# requests is out of reach), exact as a float (so is every index below it), and a short int in the
# compiled build (2^62 was not: every comparison with it and its float conversion took a slow path).
NEVER: Final = 1 << 53
_UNKNOWN: Final = -1  # OPTPolicy._next of a node inserted whose next use was not told yet


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass it, as the other built-in policies
class OPTPolicy(_HeapPolicy):
    """Belady's MIN with bypass under prefix semantics; offline only (needs :meth:`set_next_use`).

    The priority of a node is minus its next use (a later next use is a better victim; a next use
    is a request index below 2^53 or :data:`NEVER`, 2^53: exact as floats), and the heap breaks
    ties deepest first. A node inserted but not told its next use yet has priority -inf: it goes
    first, as a block never used again would."""

    name: ClassVar[str] = "opt"
    offline: ClassVar[bool] = True  # needs the future: never a runtime policy (the contract suite skips it)

    def __init__(self) -> None:
        super().__init__()
        self._next: vec[i64] = vec[i64]()  # by node id: its next use (_UNKNOWN: not told yet)

    def _grow(self, n_slots: int) -> None:
        self._next = extend(self._next, vec[i64]([_UNKNOWN] * (n_slots - len(self._next))))
        super()._grow(n_slots)

    def _prio(self, n: i64) -> float:
        t = self._next[n]
        return -math.inf if t == _UNKNOWN else -float(t)

    def _admit(self, node_ids: list[int], now: int) -> None:
        nxt = self._next
        for n in node_ids:
            nxt[n] = _UNKNOWN  # until set_next_use: treated as never used again (evicted first)

    def on_access(self, node_id: int, now: int) -> None:
        pass  # the order depends on the future only

    def set_next_use(self, node_ids: Sequence[int], next_use: Sequence[int]) -> None:
        """Oracle hook: the index of the next request using each node (root->leaf path order; a node
        not in the tier is skipped, a negative id is an InputError). Only tier leaves are ordered: an
        interior node cannot be a victim, and it is ordered when its last child leaves. The two
        sequences must have one entry per node (InputError otherwise, naming the lengths)."""
        st, nxt, order = self._st, self._next, self._order
        tchild, depth = self._cols.tchild[self._t], self._cols.depth
        n_slots = len(st)
        # Lists (copies if need be): compiled, a list[int] is read natively, where zip over two
        # Sequences took the iterator protocol and unboxed each item (this runs for every block of
        # every request of an OPT replay).
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)
        uses: list[int] = next_use if isinstance(next_use, list) else list(next_use)
        if len(ids) != len(uses):
            raise InputError(f"opt: {len(ids)} node ids but {len(uses)} next uses; give one next use per node")
        j = 0
        try:
            for j in range(len(ids)):
                n = ids[j]
                t = uses[j]
                # A negative id would index the columns from their end (another node's state and
                # heap position); one past them is a node created since this tier's last insert:
                # not in it.
                if not 0 <= n < n_slots:
                    if n < 0:
                        raise InputError(f"opt: node id {n!r} must be a node id (>= 0)")
                    continue
                s = st[n]
                if s == _OUT:
                    continue
                if not 0 <= t <= NEVER:
                    raise InputError(
                        f"opt: next_use={t!r} of node {n} must be a request index in [0, 2**53) or NEVER (2**53)"
                    )
                nxt[n] = t
                if tchild[n]:
                    if s == _ORDERED:
                        order.remove(n)
                        st[n] = _PARKED
                else:
                    st[n] = _ORDERED
                    order.push(n, -float(t), depth[n])
        except TypeError:
            # Compiled, a float (or any non-int) id or next use fails its unboxing with a bare
            # TypeError, at position j; the nodes before it are set, each one whole.
            bad_id, bad_use = cast("list[object]", ids)[j], cast("list[object]", uses)[j]
            raise InputError(
                f"opt: node ids and next uses must be integers; got node id {bad_id!r} with next_use={bad_use!r}"
            ) from None

    def unknown(self) -> list[int]:
        """Nodes in the tier whose next use was not told yet (for tests and checks)."""
        st, nxt = self._st, self._next
        return [n for n in range(len(st)) if st[n] != _OUT and nxt[n] == _UNKNOWN]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert len(self._next) == len(self._st), f"opt: {len(self._next)} next uses for {len(self._st)} slots"
        st, nxt = self._st, self._next
        bad = [n for n in range(len(st)) if st[n] != _OUT and not _UNKNOWN <= nxt[n] <= NEVER]
        assert not bad, f"opt: next uses out of range at nodes {bad[:5]}"
        # The order is by the next use: every push of an ordered node is of _prio(n) (on_graft
        # keeps the priority, which is static), so a next use changed without a push is a wrong order.
        order = self._order
        stale = [n for n in range(len(st)) if st[n] == _ORDERED and order.prio_of(n) != self._prio(n)]
        assert not stale, f"opt: nodes ordered by another next use than theirs, e.g. {stale[:5]}"
