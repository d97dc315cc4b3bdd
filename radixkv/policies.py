"""Eviction policies: small classes behind one protocol, chosen by name.

This module holds the protocol, the registry and ``lru``; ``lfu``, ``cost`` and ``agedref`` live in
:mod:`radixkv.policy_heap`, ``oddsref`` (agedref plus a learned bypass of fresh chunks) in
:mod:`radixkv.policy_oddsref`, ``s3fifo`` and ``sieve`` in :mod:`radixkv.policy_fifo` (imported and
registered at the end of this module), and the offline ``opt`` in :mod:`radixkv.sims.opt`. The tree
and these modules are compiled with mypyc when radixkv is installed (:mod:`radixkv.compiled`).

One policy instance serves one tier of one :class:`~radixkv.tree.RadixTree` (the runtime store and the
offline simulator use the very same objects). The tree tells the policy what happens to the nodes
resident in its tier; the policy only orders eviction candidates.

Path touches are *lazy*: when a request touches a root->leaf path, the tree reports only the deepest
node of the path (:meth:`EvictionPolicy.on_access`). Every ancestor was touched too, so a policy that
needs per-ancestor state derives it when it matters: ancestors are evicted only after their children
(leaf-first), at which point :meth:`on_leaf` tells the policy the parent became a leaf. This keeps a
match O(log n) instead of O(path length).

A policy may yield candidates that are not evictable right now (pinned, or interior in its tier):
the tree skips them. By default ``candidates()`` is not resumed after the tree mutates the policy; a
policy that sets ``live_candidates = True`` promises its iterator tolerates the tree evicting each
yielded node (``on_remove`` / ``on_leaf``) before the next step, which lets ``RadixTree.evict`` run
one iterator for a whole batch while staying exact.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generator, Protocol, Sequence

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.tree import RadixTree, TreeColumns

__all__ = ["EvictionPolicy", "POLICIES", "register_policy", "make_policy", "LRUPolicy"]


class EvictionPolicy(Protocol):
    """What the tree tells a tier's policy, and what it asks of it. ``now`` is the tree's logical clock
    (it grows by one per tree operation); node ids are ints, valid while the node is in the tier."""

    name: str

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        """Called once before any other hook: the tree whose nodes are ordered, and the tier."""

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        """The nodes entered the tier (root->leaf order; each is a child of the one before it or
        of an already resident node)."""

    def on_access(self, node_id: int, now: int) -> None:
        """A path ending at ``node_id`` was used; all its ancestors were used too."""

    def on_leaf(self, node_id: int) -> None:
        """``node_id`` lost its last child in this tier: it is now a leaf here."""

    def on_remove(self, node_ids: Sequence[int]) -> None:
        """The nodes left the tier."""

    # Optional: ``on_evict(node_id, leaf_parent)``, called by ``RadixTree.evict`` instead of
    # ``on_remove((node_id,))`` followed by ``on_leaf(leaf_parent)`` (``leaf_parent`` -1: no parent
    # became a leaf), after the tree updated its residency columns. One call per evicted chunk
    # instead of two; a policy defines it when that saves work on the simulator's hot path.
    # ``node_id`` is always the node the running ``candidates()`` iterator yielded last (the tree
    # calls on_evict only from its loop over that iterator), so a policy may rely on what its
    # iterator did to that node before yielding it (lru, s3fifo and the heap policies take it out of
    # their order first).

    # Optional: ``on_graft(node_ids)``: the nodes (resident in this tier, parents first) got deeper,
    # their run having been grafted from the namespace root under a chain that reached its first key
    # (a split chain joined: see ``RadixTree.insert``); their parents changed too, the first one's
    # from none. A policy that derived state from depth re-derives it (the heap policies re-key
    # their entries, whose tie-break is -depth; cost re-prices). Without it nothing is called.

    def candidates(self) -> Generator[int, None, None]:
        """Resident node ids, best victim first. May include ineligible nodes; must be lazy.

        The consumer must exhaust the iterator or ``close()`` it (the tree does, in a ``finally``):
        a policy takes each node out of its order before yielding it and puts back, when the
        iterator ends, what was not evicted. A compiled build does not finalize a generator that
        is merely dropped, so a dropped one would lose that node from the order."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError if the policy's state disagrees with the tree's residency."""

    def __len__(self) -> int:
        ...


POLICIES: dict[str, type] = {}


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy available to :func:`make_policy` under ``name``."""

    def deco(cls: type) -> type:
        if name in POLICIES:
            raise ValueError(f"eviction policy {name!r} is registered twice")
        if getattr(cls, "name", None) != name:
            cls.name = name  # type: ignore[attr-defined]
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """A new policy instance by registered name; unknown names list the supported ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; supported policies: {', '.join(sorted(POLICIES))}"
        ) from None
    _check_option_types(name, cls, options)
    try:
        return cls(**options)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"bad options {options!r} for eviction policy {name!r}: {exc}") from None


def _check_option_types(name: str, cls: type, options: dict[str, Any]) -> None:
    """Options must be the policy's own, and a numeric option (its default is a number) must be given
    a number, an integer where the default is one: a string from a config file or a command line
    would otherwise fail deep inside the policy. Checked here, so the compiled build (whose typed
    signatures would raise first, with a terser message) and the Python build answer alike."""
    try:
        params = dict(inspect.signature(cls).parameters)  # a compiled class signs itself here too
    except (TypeError, ValueError):
        return  # no signature to check against: the constructor judges
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if takes_any:  # a subclass may pass its bases' options on as **kwargs: those are named too
        for klass in cls.__mro__[1:-1]:
            try:
                base = inspect.signature(vars(klass)["__init__"]).parameters
            except (KeyError, TypeError, ValueError):
                continue
            for k, bp in base.items():
                params.setdefault(k, bp)
    named = sorted(k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    for key, value in options.items():
        p = params.get(key)
        if p is None:
            if takes_any:
                continue
            raise ConfigError(f"unknown option {key!r} for eviction policy {name!r}; its options: "
                              f"{', '.join(named) or 'none'}")
        if isinstance(p.default, bool) or not isinstance(p.default, (int, float)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"option {key}={value!r} of eviction policy {name!r} must be a number "
                              f"(default {p.default!r})")
        if isinstance(p.default, int) and not isinstance(value, int):
            raise ConfigError(f"option {key}={value!r} of eviction policy {name!r} must be an integer "
                              f"(default {p.default!r})")


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class LRUPolicy:
    """Least recently used *leaf* first; ties (one request's path) deepest first.

    This is SGLang's and LMCache's default, and vLLM APC's order. It is exact with lazy path touches:
    leaves sit in an ordered dict by the time of their own last touch. An interior node is *parked*
    (kept out of the order): its effective time is the newest touch in its subtree, which is known only
    when its last child leaves. When that happens (:meth:`on_leaf`) every remaining child was evicted
    from the old end, so the parent's effective time is no newer than anything left and it enters at
    the old end. A parked node that is touched again enters at the new end. (A last child that left by
    ``clear_resident`` instead, e.g. a delete, may have been recent: its parent still enters at the
    old end, the one departure from exact LRU; see docs/design.md.)

    Parking is implicit: a resident node that is not in the order is parked. So inserting a chain
    costs one ordered-dict entry (its leaf), not one per chunk; an ordered node that gains a child
    is parked when the scan reaches it.
    """

    name: ClassVar[str] = "lru"
    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._aside: list[int] = []  # skipped candidates, only during one candidates() run
        self._resident = 0  # nodes in the tier: ordered + parked + aside
        self._t = 0
        self._bit = 1

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        # Read-only: the tree's columns (children resident in the tier, residency masks), read
        # through the tree's column holder (tree._views) at each use: a column is replaced when it
        # grows, so no view is kept.
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index

    def __len__(self) -> int:
        return self._resident

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._resident += len(node_ids)
        # Only tier leaves are ordered; a chain arrives root->leaf, so that is usually just its last
        # node, and the rest are parked until on_leaf (or a touch) brings them in.
        order, tchild = self._order, self._cols.tchild[self._t]
        for n in node_ids:
            if not tchild[n]:
                order[n] = None

    def on_access(self, node_id: int, now: int) -> None:
        order = self._order
        if node_id in order:
            order.move_to_end(node_id)
        else:
            order[node_id] = None

    def on_leaf(self, node_id: int) -> None:
        order = self._order
        if node_id not in order:
            order[node_id] = None
            order.move_to_end(node_id, False)  # last=False, passed by position: no keyword parsing

    def on_evict(self, node_id: int, leaf_parent: int) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), in one call (see EvictionPolicy). node_id
        # is the node candidates() just yielded, which it already took out of the order (and never
        # set aside): only the count and the parent are left to update.
        self._resident -= 1
        if leaf_parent >= 0:
            order = self._order
            if leaf_parent not in order:
                order[leaf_parent] = None
                order.move_to_end(leaf_parent, False)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        self._resident -= len(node_ids)
        pop = self._order.pop
        for n in node_ids:
            pop(n, None)
        if self._aside:
            gone = set(node_ids)
            self._aside[:] = [n for n in self._aside if n not in gone]

    live_candidates: ClassVar[bool] = True

    def candidates(self) -> Generator[int, None, None]:
        # Always take the current oldest entry, so the tree may evict what we yield (and on_leaf may
        # put a parent in front) between steps. The entry is taken out before it is yielded (one
        # popitem, no iterator per step): a yielded node the tree did not evict (still resident in
        # the tier: pinned, or the caller stopped before evicting it) is set aside and put back in
        # front when iteration ends, in the order it was yielded.
        # The tree creates no node while a candidates() iterator is open: these views stay current.
        order, tchild, mask, bit = self._order, self._cols.tchild[self._t], self._cols.mask, self._bit
        aside = self._aside
        popitem = order.popitem
        try:
            while order:
                n = popitem(False)[0]  # last=False, by position: the oldest entry
                if tchild[n]:
                    continue  # parked: it gained a child since it was ordered
                try:
                    yield n
                except GeneratorExit:
                    if mask[n] & bit:
                        aside.append(n)  # closed at the yield before the caller evicted it
                    raise
                if mask[n] & bit:
                    aside.append(n)  # skipped by the tree (pinned)
        finally:
            while aside:
                n = aside.pop()
                order[n] = None
                order.move_to_end(n, False)

    def check_integrity(self) -> None:
        assert len(self._order) + len(self._aside) <= self._resident, (
            f"lru: {len(self._order)} ordered + {len(self._aside)} aside > {self._resident} resident"
        )
        mask, bit, tchild, order = self._cols.mask, self._bit, self._cols.tchild[self._t], self._order
        stale = [n for n in order if not mask[n] & bit]
        assert not stale, f"lru: {len(stale)} ordered nodes not resident in the tier, e.g. {stale[:5]}"
        # Implicit parking must never hide a leaf: every tier leaf is ordered (or set aside).
        lost = [n for n in range(len(mask)) if mask[n] & bit and not tchild[n] and n not in order
                and n not in self._aside]
        assert not lost, f"lru: {len(lost)} tier leaves neither ordered nor set aside, e.g. {lost[:5]}"


# The other built-in policies live in their own modules, which do not import this one (so any of
# them can be imported first); they are registered here, after the class bodies (mypyc compiles an
# undecorated class to a native one).
from radixkv.policy_fifo import S3FIFOPolicy, SIEVEPolicy
from radixkv.policy_heap import AgedRefPolicy, CostPolicy, LFUPolicy
from radixkv.policy_oddsref import OddsRefPolicy

for _cls in (LRUPolicy, S3FIFOPolicy, SIEVEPolicy, LFUPolicy, CostPolicy, AgedRefPolicy, OddsRefPolicy):
    register_policy(_cls.name)(_cls)
