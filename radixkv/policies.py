"""Eviction policies: small classes behind one protocol, chosen by name.

This module holds the protocol, the registry and ``lru``; ``lfu``, ``cost`` and ``agedref`` live in
:mod:`radixkv.policy_heap`, ``oddsref`` (agedref plus a learned bypass of fresh chunks) in
:mod:`radixkv.policy_oddsref`, ``s3fifo`` and ``sieve`` in :mod:`radixkv.policy_fifo` (imported and
registered at the end of this module), and the offline ``opt`` in :mod:`radixkv.policy_opt`
(registered by :mod:`radixkv.sims.opt`, which tells it the future). The tree and these modules are
compiled with mypyc when radixkv is installed (:mod:`radixkv.compiled`).

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
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generator, Protocol, Sequence

from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError
from radixkv.linked_order import OUT, LinkedList, Links
from radixkv.policy_base import TierPolicy, column_slots

if TYPE_CHECKING:
    from radixkv.tree import RadixTree

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
    # iterator did to that node before yielding it. A subclass inherits it, so it replaces the
    # subclass's on_remove and on_leaf overrides too: the built-in policies keep their per-eviction
    # step private (``_evict``, which the tree calls for their exact classes) instead.

    # Optional: ``on_graft(node_ids)``: the nodes (resident in this tier, parents first) got deeper,
    # their run having been grafted from the namespace root under a chain that reached its first key
    # (a split chain joined: see ``RadixTree.insert``); their parents changed too, the first one's
    # from none. A policy that derived state from depth re-derives it (the heap policies re-key
    # their entries, whose tie-break is -depth; cost re-prices). Without it nothing is called.

    # Optional: ``on_cleared()``, called by ``RadixTree.clear`` (a namespace or everything: the
    # store's ``clear``) once it removed the chunks it dropped from this tier, after their
    # ``on_remove`` calls: state sized by the tier's past may shrink to what stays (agedref trims
    # its ghost history, which one removal at a time never shrinks). Eviction and
    # ``clear_resident`` (the simulator's demotions) never call it.

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


def make_policy(name: object, **options: Any) -> EvictionPolicy:
    """A new policy instance by registered name; unknown names list the supported ones."""
    # Typed `object`, checked here: a compiled `str` parameter refused None or 5 with a bare TypeError.
    if not isinstance(name, str):
        raise ConfigError(
            f"eviction policy name {name!r:.80} must be a str; supported policies: {', '.join(sorted(POLICIES))}"
        )
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
        # Options the constructor cannot take (a missing required one, say) fail in the call itself:
        # no frame below this one. A TypeError from the constructor's own code (frames below: its
        # own, or a compiled one's) is a bug to see with its traceback, not "bad options". (A compiled
        # class's signature reads as positional-only, so binding the options to it first is no test.)
        tb = exc.__traceback__
        if tb is not None and tb.tb_next is not None:
            raise
        raise ConfigError(f"bad options {options!r} for eviction policy {name!r}: {exc}") from None


def _check_option_types(name: str, cls: type, options: dict[str, Any]) -> None:
    """Options must be the policy's own, and a numeric option (its default is a number) must be given
    a number, an integer where the default is one: a string from a config file or a command line
    would otherwise fail deep inside the policy. Checked here, so the compiled build (whose typed
    signatures would raise first, with a terser message) and the Python build answer alike."""
    if not options:
        # Nothing to check. A compiled class's signature is parsed from its text signature by the
        # tokenizer, whose first use in a process compiles its regular expression: ~3-9 ms, paid by
        # every simulator worker's first replay (a few % of a replay's time) for no check.
        return
    try:
        params = dict(inspect.signature(cls).parameters)  # a compiled class signs itself here too
    except (TypeError, ValueError):
        return  # no signature to check against: the constructor judges
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if takes_any:  # a subclass may pass its bases' options on as **kwargs: those are named too
        for klass in cls.__mro__[1:-1]:
            if "__init__" not in vars(klass):
                continue
            try:
                # The class, not its __init__: a compiled class's __init__ reads as (*args, **kwargs),
                # which named none of a built-in base's options in the compiled build.
                base = inspect.signature(klass).parameters
            except (TypeError, ValueError):
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
        if isinstance(value, float) and not math.isfinite(value):
            # inf passed each policy's "> 0" checks: an infinite half-life made every priority NaN
            # (the heap's order lost), an infinite ghost_factor a history that never trims.
            raise ConfigError(f"option {key}={value!r} of eviction policy {name!r} must be a finite number "
                              f"(default {p.default!r})")


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class LRUPolicy(TierPolicy):
    """Least recently used *leaf* first; ties (one request's path) deepest first.

    This is SGLang's and LMCache's default, and vLLM APC's order. It is exact with lazy path touches:
    leaves sit in a list by the time of their own last touch. An interior node is *parked* (kept out
    of the order): its effective time is the newest touch in its subtree, which is known only when
    its last child leaves. When that happens (:meth:`on_leaf`) every remaining child was evicted from
    the old end, so the parent's effective time is no newer than anything left and it enters at the
    old end. A parked node that is touched again enters at the new end. (A last child that left by
    ``clear_resident`` instead, e.g. a delete, may have been recent: its parent still enters at the
    old end, the one departure from exact LRU; see docs/design.md.)

    Parking is implicit: a resident node that is not in the order is parked. So inserting a chain
    costs one entry in the order (its leaf), not one per chunk; an ordered node that gains a child
    is parked when the scan reaches it.

    The order is a doubly linked list through two vec columns indexed by node id
    (:class:`~radixkv.linked_order.LinkedList`): a touch, an insert or an eviction is a few
    machine-integer writes.
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        super().__init__()
        # The order: its links grow to at least the tree's column length in on_insert (new slots in
        # no list).
        self._links = Links()
        self._order = LinkedList(self._links)  # its old end is the next victim
        self._aside: list[int] = []  # skipped candidates, only during one candidates() run
        # A parent that RadixTree.evict's last eviction made a leaf, due at the old end (-1: none):
        # held here instead, since the next _take would take it straight back out of the order (a
        # push and an unlink per chained eviction). Only between _evict and the next _take or _end
        # of one evict run, which put it in the order if it is still due.
        self._due: i64 = -1
        # (_resident, TierPolicy's: nodes in the tier, ordered + parked + aside + due)

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        # The tree hands its hooks lists; compiled, a loop over a list[int] reads it natively, one over
        # a Sequence[int] takes the iterator protocol and unboxes each id (the other policies' on_insert
        # do the same).
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)
        self._resident += len(ids)
        links, order = self._links, self._order
        if len(links) < len(self._cols.mask):  # the tree created nodes: their links, in no list
            links.grow(column_slots(len(links), len(self._cols.mask)))
        # Only tier leaves are ordered; a chain arrives root->leaf, so that is usually just its last
        # node, and the rest are parked until on_leaf (or a touch) brings them in. A node already in
        # the order keeps its place.
        tchild, newer = self._cols.tchild[self._t], links.newer
        for n in ids:
            if not tchild[n] and newer[n] == OUT:
                order.append_newest(n)

    def on_access(self, node_id: int, now: int) -> None:
        order = self._order
        if self._links.newer[node_id] != OUT:
            if node_id == order.newest:
                return  # already the newest
            order.unlink(node_id)
        order.append_newest(node_id)

    def on_leaf(self, node_id: int) -> None:
        if self._links.newer[node_id] == OUT:
            self._order.push_oldest(node_id)

    def _evict(self, node_id: i64, leaf_parent: i64) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), in one call: RadixTree.evict's step for
        # this exact class (private, not on_evict: see EvictionPolicy). node_id is the node
        # candidates() just yielded, which it already took out of the order (and never set aside):
        # only the count and the parent are left to update.
        self._resident -= 1
        if leaf_parent >= 0 and self._links.newer[leaf_parent] == OUT:
            if self._due >= 0:  # not taken since (never, from RadixTree.evict): it goes first
                self._order.push_oldest(self._due)
            self._due = leaf_parent

    def on_remove(self, node_ids: Sequence[int]) -> None:
        self._resident -= len(node_ids)
        newer, order = self._links.newer, self._order
        n_slots = len(newer)
        for n in node_ids:
            if 0 <= n < n_slots and newer[n] != OUT:
                order.unlink(n)
        if self._aside:
            gone = set(node_ids)
            self._aside[:] = [n for n in self._aside if n not in gone]

    live_candidates: ClassVar[bool] = True

    def candidates(self) -> Generator[int, None, None]:
        # Always take the current oldest entry, so the tree may evict what we yield (and on_leaf may
        # put a parent in front) between steps. The entry is taken out before it is yielded: a
        # yielded node the tree did not evict (still resident in the tier: pinned, or the caller
        # stopped before evicting it) is set aside and put back in front when iteration ends, in
        # the order it was yielded. RadixTree.evict runs these same steps (_take, _end) itself,
        # without a generator.
        n = -1
        try:
            while True:
                n = self._take(n)
                if n < 0:
                    break
                yield n
        finally:
            self._end(n)  # also when closed at the yield: n is set aside unless it was evicted

    def _take(self, prev: i64) -> i64:
        """One step of :meth:`candidates`: set ``prev`` (the node it yielded last, -1: none) aside if
        it is still in the tier, then take the oldest ordered tier leaf out of the order and return
        it (-1: none left). Nodes passed over (parked: they gained a child since they were ordered)
        leave the order. The tree creates no node during a run, so the columns read here stay current."""
        mask, tchild = self._cols.mask, self._cols.tchild[self._t]
        if prev >= 0 and mask[prev] & self._bit:
            self._aside.append(prev)  # skipped by the tree (pinned), or the run stopped before it
        due = self._due
        if due >= 0:
            # the oldest ordered node it would have been: a tier leaf (nothing is created during a
            # run), resident (nothing left it since _evict made it due)
            self._due = -1
            return due
        order = self._order
        while order.oldest >= 0:
            n = order.oldest
            order.unlink(n)
            if not tchild[n]:
                return n
        return -1

    def _end(self, last: i64) -> None:
        """End a :meth:`candidates` run whose last yielded node is ``last`` (-1: none): set it aside if
        it is still in the tier, then put every set-aside node back in front, the first yielded
        first."""
        aside = self._aside
        if last >= 0 and self._cols.mask[last] & self._bit:
            aside.append(last)
        order, newer = self._order, self._links.newer
        if self._due >= 0:  # made a leaf by the run's last eviction: the old end, behind the aside ones
            order.push_oldest(self._due)
            self._due = -1
        while aside:
            n = aside.pop()
            if newer[n] != OUT:  # touched again while set aside: it still goes in front
                order.unlink(n)
            order.push_oldest(n)

    def check_integrity(self) -> None:
        mask, bit, tchild = self._cols.mask, self._bit, self._cols.tchild[self._t]
        linked = self._links.check_integrity("lru")
        walked = self._order.check_integrity("lru's order")
        assert walked == linked, f"lru: {len(linked)} nodes linked, {len(walked)} in the order"
        assert self._due == -1, f"lru: node {self._due} is still due at the old end after an eviction run"
        assert len(linked) + len(self._aside) <= self._resident, (
            f"lru: {len(linked)} ordered + {len(self._aside)} aside > {self._resident} resident"
        )
        stale = [n for n in linked if not mask[n] & bit]
        assert not stale, f"lru: {len(stale)} ordered nodes not resident in the tier, e.g. {stale[:5]}"
        # Implicit parking must never hide a leaf: every tier leaf is ordered (or set aside).
        lost = [n for n in range(len(mask)) if mask[n] & bit and not tchild[n] and n not in linked
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
