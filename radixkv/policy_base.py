"""The base of the built-in eviction policies: one policy bound to one tier of one tree.

A built-in policy reads the tree's node columns, read-only, through the tree's column holder
(``tree._views``, a :class:`~radixkv.tree.TreeColumns`). The tree replaces a column when it grows
(``extend`` may move it), so a policy keeps no column, only the holder. It does not keep the tree
either: a policy holding its tree made every tree a reference cycle (tree -> policy -> tree).
:class:`TierPolicy` holds that binding, the tier's index and bit, the tree's key and namespace lists
(views, for the policies that remember keys in a ghost history) and the resident count behind
``len()``. It is compiled with the tree (``setup.py``); the policies subclass it, and a user's Python
subclass of a built-in policy inherits it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from librt.vecs import vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr

if TYPE_CHECKING:
    from radixkv.tree import RadixTree
    from radixkv.tree_nodes import TreeColumns

__all__ = ["TierPolicy", "column_slots"]


def column_slots(have: int, need: int) -> int:
    """The length to grow a policy's per-node columns of ``have`` slots to, for a tree of ``need``
    slots (``need > have``): at least half again as many. A tree that keeps adding nodes (a cache
    filling up, a replay below its capacity) then costs each column O(log n) extends instead of one
    per insert (an opt replay at 50 %: ~9,700 extends of every column, ~3.5 % of its
    instructions). A policy's columns may so be longer than the tree's; it reads a slot only for a
    node it holds."""
    grown = have + (have >> 1) + 16
    return need if need > grown else grown


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class TierPolicy:
    """A policy bound (:meth:`bind`) to tier ``_t`` of one tree; ``len()`` is ``_resident``, the
    number of nodes resident in the tier, which the subclass keeps."""

    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def __init__(self) -> None:
        self._t = 0  # the tier's index in the tree
        self._bit = 1  # 1 << _t: the tier's bit in a node's residency mask
        self._resident = 0  # nodes resident in the tier
        self._keys: list[str | None] = []  # the tree's key list (a view), by node id
        self._ns: list[str | None] = []  # the tree's namespace list (a view), by node id

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index
        self._keys, self._ns = tree._key, tree._ns

    def __len__(self) -> int:
        return self._resident

    # The protocol's two per-request hooks, declared here so that the tree calls them on a built-in
    # policy (or a Python subclass of one: its overrides are called) as direct C calls, not as
    # Python-level method calls with boxed arguments (once or twice per insert).
    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        raise NotImplementedError

    def on_access(self, node_id: int, now: int) -> None:
        raise NotImplementedError

    # The eviction steps. RadixTree.evict drives a built-in policy of its exact class (a subclass
    # may override any hook, so it gets the protocol's candidates(), on_remove and on_leaf) by these
    # three direct calls, not by a generator's resumption and close and a Python-level call per
    # evicted chunk: candidates() is _take until it returns -1, then _end.
    def _take(self, prev: i64) -> i64:
        """The next candidate (-1: none left); ``prev`` is the one returned last in this run (-1:
        the run starts), which the tree may have left in the tier (pinned, or the run stopped)."""
        raise NotImplementedError

    def _evict(self, node_id: i64, leaf_parent: i64) -> None:
        """The tree evicted ``node_id``, the candidate :meth:`_take` returned last: on_remove((node_id,))
        then, if ``leaf_parent`` >= 0, on_leaf(leaf_parent), in one call."""
        raise NotImplementedError

    def _end(self, last: i64) -> None:
        """The run ends; ``last`` is the candidate returned last (-1: none), evicted or not."""

    # The tree's columns by node id, read-only, from tree._views at each use (the hot loops read
    # self._cols directly, once per call).
    @property
    def _tchild(self) -> vec[i64]:
        """Children resident in this tier."""
        return self._cols.tchild[self._t]

    @property
    def _mask(self) -> vec[i64]:
        """Residency masks (bit ``t``: resident in tier ``t``)."""
        return self._cols.mask

    @property
    def _parent(self) -> vec[i64]:
        """Parents (-1: a namespace root)."""
        return self._cols.parent

    @property
    def _depth(self) -> vec[i64]:
        """Depths (a namespace root: 1)."""
        return self._cols.depth

    @property
    def _tokens(self) -> vec[i64]:
        """Tokens per chunk."""
        return self._cols.tokens
