"""Eviction policies: small classes behind one protocol, chosen by name.

This module holds the protocol, the registry and ``lru``; ``lfu``, ``cost`` and ``agedref`` live in
:mod:`radixkv.policy_heap`, ``s3fifo`` and ``sieve`` in :mod:`radixkv.policy_fifo` (imported below, which
registers them), and the offline ``opt`` in :mod:`radixkv.sims.opt`.

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

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from radixkv.errors import ConfigError

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

    def candidates(self) -> Iterator[int]:
        """Resident node ids, best victim first. May include ineligible nodes; must be lazy."""
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
        cls.name = name
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
    try:
        return cls(**options)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"bad options {options!r} for eviction policy {name!r}: {exc}") from None


@register_policy("lru")
class LRUPolicy:
    """Least recently used *leaf* first; ties (one request's path) deepest first.

    This is SGLang's and LMCache's default, and vLLM APC's order. It is exact with lazy path touches:
    nodes sit in an ordered dict by the time of their own last touch. Scanning from the oldest end, an
    interior node is *parked* (set aside): its effective time is the newest touch in its subtree, which
    is known only when its last child leaves. When that happens (:meth:`on_leaf`) every remaining child
    was evicted from the old end, so the parent's effective time is no newer than anything left and it
    re-enters at the old end. A parked node that is touched again re-enters at the new end.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._parked: set[int] = set()
        self._aside: list[int] = []  # skipped candidates, only during one candidates() run
        self._is_leaf: Callable[[int], bool] = lambda _n: True

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        self._is_leaf = tree.tier_leaf_predicate(tier_index)

    def __len__(self) -> int:
        return len(self._order) + len(self._parked) + len(self._aside)

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._order.update(dict.fromkeys(node_ids))

    def on_access(self, node_id: int, now: int) -> None:
        if node_id in self._parked:
            self._parked.discard(node_id)
            self._order[node_id] = None
        else:
            self._order.move_to_end(node_id)

    def on_leaf(self, node_id: int) -> None:
        if node_id in self._parked:
            self._parked.discard(node_id)
            self._order[node_id] = None
            self._order.move_to_end(node_id, last=False)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        order, parked = self._order, self._parked
        for n in node_ids:
            if n in order:
                del order[n]
            elif n in parked:
                parked.discard(n)
            elif n in self._aside:
                self._aside.remove(n)

    live_candidates = True

    def candidates(self) -> Iterator[int]:
        # Always look at the current oldest entry, so the tree may evict what we yield (and
        # on_leaf may put a parent in front) between steps. A yielded node the tree skipped
        # (pinned) is set aside and put back in front when iteration ends.
        order, parked, is_leaf = self._order, self._parked, self._is_leaf
        aside = self._aside
        try:
            while order:
                n = next(iter(order))
                if not is_leaf(n):
                    del order[n]
                    parked.add(n)
                    continue
                yield n
                if n in order and next(iter(order)) == n:
                    del order[n]
                    aside.append(n)
        finally:
            while aside:
                n = aside.pop()
                order[n] = None
                order.move_to_end(n, last=False)

    def check_integrity(self) -> None:
        both = self._parked.intersection(self._order)
        assert not both, f"lru: {len(both)} nodes both parked and ordered, e.g. {sorted(both)[:5]}"


# The other policies live in their own modules; importing them registers them by name.
from radixkv import policy_fifo, policy_heap  # noqa: E402,F401
