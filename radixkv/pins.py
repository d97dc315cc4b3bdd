"""Pins with owners and leases: what protects a tree node from eviction while someone uses it.

A pin belongs to an owner (a request id, a transfer, ...) and expires after its lease, so a crashed
owner cannot leak pins: an expired pin stops protecting the node, but stays recorded until its owner
unpins it or the node leaves the tree, so the owner's late ``unpin`` is a no-op rather than an error.
Knows nothing of the tree beyond node ids (ints); the clock is injected.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from radixkv.errors import PinError

__all__ = ["PinTable"]

_FOREVER_S = float("inf")


class PinTable:
    """node id -> {owner: lease expiry (clock seconds)}. ``n in table`` is true while any pin, expired
    or not, is recorded for ``n``; :meth:`is_pinned` asks whether one still protects it."""

    __slots__ = ("by_node", "_clock")

    def __init__(self, clock: Callable[[], float]) -> None:
        # Public so hot loops (the tree's eviction) can test "any pin on n?" without a method call
        # per node. Read-only outside this class: change pins through the methods.
        self.by_node: dict[int, dict[str, float]] = {}
        self._clock = clock

    def __contains__(self, node_id: int) -> bool:
        return node_id in self.by_node

    def __len__(self) -> int:
        return len(self.by_node)

    def __iter__(self) -> Iterator[int]:
        return iter(self.by_node)

    def pin(self, node_ids: Iterable[int], owner: str, lease_s: float) -> None:
        """Record ``owner``'s pin on each node until ``lease_s`` seconds from now (pinning again
        renews the lease). The caller checks the nodes exist and that ``lease_s`` is a number
        (:meth:`RadixTree.pin`, before a compiled call would take a bool for 1.0)."""
        if not isinstance(owner, str) or not owner:
            raise PinError(f"pin owner={owner!r:.60} must be a non-empty string naming the holder (request id, ...)")
        # Seconds as floats, whatever number the caller or the clock gives: the compiled build
        # converts them at the call (float annotations), so the Python build does too. (With an
        # integer clock past 2**53 the Python build compared exact ints and kept a pin the compiled
        # one had let expire; an int lease named itself as 0 in one build and 0.0 in the other.)
        lease = lease_s + 0.0  # float(), without accepting a str
        if not 0 < lease < _FOREVER_S:  # an infinite lease is a pin a crashed owner leaks for good
            raise PinError(f"lease_s={lease!r} must be a finite number of seconds > 0")
        expiry = float(self._clock()) + lease
        for n in node_ids:
            self.by_node.setdefault(n, {})[owner] = expiry

    def unpin(self, node_ids: Iterable[int], owner: str) -> None:
        """Release ``owner``'s pins; PinError (and nothing released) if a node is not pinned by it."""
        ids = list(dict.fromkeys(node_ids))  # a node listed twice is released once
        for n in ids:
            held = self.by_node.get(n)
            if held is None or owner not in held:
                raise PinError(f"node {n} is not pinned by owner {owner!r}")
        for n in ids:
            held = self.by_node[n]
            del held[owner]
            if not held:
                del self.by_node[n]

    def is_pinned(self, node_id: int) -> bool:
        """True while some owner's lease on the node is unexpired."""
        held = self.by_node.get(node_id)
        if not held:
            return False
        now = float(self._clock())  # as pin(): seconds as a float in both builds
        for exp in held.values():
            if exp > now:
                return True
        return False

    def forget(self, node_id: int) -> None:
        """The node left the tree: its pins, expired or not, go with it."""
        self.by_node.pop(node_id, None)

    def pinned_count(self) -> int:
        """Nodes some unexpired pin protects."""
        return sum(1 for n in list(self.by_node) if self.is_pinned(n))

    def check_integrity(self) -> None:
        """Every recorded node has at least one owner, each with a numeric expiry."""
        for n, held in self.by_node.items():
            assert isinstance(n, int) and held, f"pins: node {n!r} has no owner left"
            for owner, exp in held.items():
                assert owner and isinstance(exp, (int, float)), f"pins: node {n} owner {owner!r} expiry {exp!r}"
