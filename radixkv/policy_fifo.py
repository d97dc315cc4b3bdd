"""FIFO-family eviction policies (s3fifo, sieve).

Imported by :mod:`radixkv.policies`, which registers them; see its docstring for the protocol."""

from __future__ import annotations

from typing import ClassVar, Final, Generator, Sequence

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError
from radixkv.ghosts import GhostHistory
from radixkv.linked_order import OUT, LinkedList, Links
from radixkv.policy_base import TierPolicy, column_slots


# S3FIFOPolicy._queue values. Final: C constants when compiled (a plain module global is a dict
# lookup at each use).
_NONE: Final = 0  # S3FIFOPolicy._queue of a node in neither FIFO nor parked (aside, or not in the tier)
_SMALL: Final = 1
_MAIN: Final = 2
# Parked (an interior node waiting for its last child in the tier to leave), from the small or the
# main FIFO: it goes back to the old end of that one (_unpark). At least _PARKED_SMALL: parked.
_PARKED_SMALL: Final = 3
_PARKED_MAIN: Final = 4


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class S3FIFOPolicy(TierPolicy):
    """S3-FIFO (SOSP'23) on leaves: a small FIFO for new chunks (``small_fraction`` of the tier), a main
    FIFO with 2-bit frequencies, and a ghost FIFO of keys recently evicted from the small queue.

    A new chunk enters the small queue, or the main queue if its key is in the ghost. At the small
    queue's old end a chunk touched since insertion moves to main, otherwise it is the victim (its key
    goes to the ghost); at the main queue's old end a touched chunk is reinserted with its frequency
    decremented. Interior chunks are parked until their last child leaves (lazy path touches: a
    parent's frequency is folded from its children as they leave).

    Both FIFOs are doubly linked lists through two shared vec columns indexed by node id
    (:class:`~radixkv.linked_order.LinkedList`), and a third column names the queue (or that the
    node is parked, and from which queue): a step, an insert or an eviction is a few machine-integer
    writes."""

    name: ClassVar[str] = "s3fifo"

    live_candidates: ClassVar[bool] = True

    def __init__(self, small_fraction: float = 0.1) -> None:
        super().__init__()
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"s3fifo: small_fraction={small_fraction!r} must be in (0, 1)")
        self._small_fraction = small_fraction
        # The two FIFOs through one pair of link columns, and the queue column; all grown to the
        # tree's column length with _freq (new slots in no list, _NONE). A column grows by
        # assignment (extend may move it): no alias of one outlives a call.
        self._links = Links()
        self._small = LinkedList(self._links)
        self._main = LinkedList(self._links)
        self._queue: vec[i64] = vec[i64]()  # _SMALL, _MAIN, _PARKED_SMALL, _PARKED_MAIN or _NONE by node id
        # Parked nodes are marked in _queue (a dict of them cost a boxed id and a method call per
        # eviction); their count tells whether a leaf needs looking up at all.
        self._n_parked = 0
        # 2-bit frequency by node id (a vec slot is cheaper than an int-keyed dict probe, and it is
        # read on every touch and every queue step); -1: not resident in the tier.
        self._freq: vec[i64] = vec[i64]()
        self._inserted_at = -1  # clock of the last insert: its own path touch is not a reuse
        self._ghost = GhostHistory()  # keys recently evicted from the small queue
        self._aside: list[tuple[int, bool]] = []
        # (_resident, TierPolicy's: small + main + parked + aside, kept as a count: asked once per step)
        self._took_small = False  # the queue of the node candidates() yielded last

    def _grow(self) -> None:
        """Extend the per-node columns to the tree's column length, or more (:func:`column_slots`;
        new slots out of the tier)."""
        n_slots = len(self._cols.parent)
        if len(self._freq) < n_slots:
            n_slots = column_slots(len(self._freq), n_slots)
            more = n_slots - len(self._freq)
            self._freq = extend(self._freq, vec[i64]([-1] * more))
            self._links.grow(n_slots)
            self._queue = extend(self._queue, vec[i64]([_NONE] * more))

    def _append(self, n: int, main: bool) -> None:
        """Put ``n`` (in no queue) at the new end of the main or the small FIFO."""
        if main:
            self._main.append_newest(n)
            self._queue[n] = _MAIN
        else:
            self._small.append_newest(n)
            self._queue[n] = _SMALL

    def _push_oldest(self, n: int, main: bool) -> None:
        """Put ``n`` (in no queue) at the old end of the main or the small FIFO: its next step."""
        if main:
            self._main.push_oldest(n)
            self._queue[n] = _MAIN
        else:
            self._small.push_oldest(n)
            self._queue[n] = _SMALL

    def _unlink(self, n: int) -> None:
        """Take ``n`` out of its queue (it is in one)."""
        if self._queue[n] == _MAIN:
            self._main.unlink(n)
        else:
            self._small.unlink(n)
        self._queue[n] = _NONE

    def _fifo(self, main: bool) -> list[int]:
        """The main or the small FIFO's nodes, oldest first (for tests and debugging)."""
        return self._main.nodes() if main else self._small.nodes()

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        # The nodes are new to the tier (the tree reports each once): none is queued yet.
        self._inserted_at = now
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)  # see LRUPolicy.on_insert
        self._resident += len(ids)
        self._grow()
        ghost, freq, ns, keys = self._ghost, self._freq, self._ns, self._keys
        for n in ids:
            freq[n] = 0
        returning = False
        if len(ghost):
            for n in ids:
                if ghost.contains(ns[n], keys[n]):
                    returning = True
                    break
        if not returning:
            # The usual case, none of the keys is a ghost: the whole chain enters the small queue.
            self._small.append_new(ids)  # all of them: they are new to the tier
            queue = self._queue
            for n in ids:
                queue[n] = _SMALL
            return
        for n in ids:
            if ghost.take(ns[n], keys[n]):
                self._append(n, True)
            else:
                self._append(n, False)

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # The nodes' run was grafted under a chain (RadixTree._graft): no state depends on depth,
        # but the new parent may be newer than this tier's last insert, and on_remove folds a
        # frequency into it: the columns grow to the tree's.
        self._grow()

    def on_access(self, node_id: int, now: int) -> None:
        if now == self._inserted_at:
            return  # the touch of the insert that just created the chunk
        f = self._freq
        if f[node_id] < 3:
            f[node_id] += 1

    def on_leaf(self, node_id: int) -> None:
        if self._n_parked:
            self._unpark(node_id)

    def _unpark(self, n: int) -> None:
        # A node that became a tier leaf: if it is parked, back to the old end of its FIFO (its
        # position is as old as it gets).
        q = self._queue[n]
        if q >= _PARKED_SMALL:
            self._queue[n] = _NONE
            self._n_parked -= 1
            self._push_oldest(n, q == _PARKED_MAIN)

    def _evict(self, node_id: i64, leaf_parent: i64) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), written out for one node: the replay's
        # eviction loop calls this once per evicted chunk of this exact class (private, not
        # on_evict: see EvictionPolicy). node_id is the node
        # candidates() just yielded: it already took it out of its queue (never set aside) and
        # noted the queue, and its frequency is 0 (a touched chunk is moved, not yielded), so
        # there is no count to fold into the parent.
        n = node_id
        self._resident -= 1
        self._freq[n] = -1
        if self._took_small:
            self._ghost.put(self._ns[n], self._keys[n])
        self._bound_ghost()
        if leaf_parent >= 0 and self._n_parked:
            self._unpark(leaf_parent)

    def _bound_ghost(self) -> None:
        # The ghost FIFO holds at most as many keys as the main queue (at least 16).
        ghost = self._ghost
        if len(ghost) > 16:
            limit = self._main.count
            ghost.trim(float(limit if limit > 16 else 16))

    def on_remove(self, node_ids: Sequence[int]) -> None:
        freq, parent, queue = self._freq, self._parent, self._queue
        ghost = self._ghost
        self._resident -= len(node_ids)
        for n in node_ids:
            q = queue[n]
            if q == _SMALL:
                self._unlink(n)
                if freq[n] == 0:
                    ghost.put(self._ns[n], self._keys[n])
            elif q == _MAIN:
                self._unlink(n)
            elif q >= _PARKED_SMALL:
                queue[n] = _NONE
                self._n_parked -= 1
            else:
                # Out of every queue: taken by a live candidates() run, either set aside (yielded and
                # skipped) or the node it yielded last, which a caller evicting through on_remove (a
                # Python subclass's path through RadixTree.evict) removes now. A one-hit chunk taken
                # from the small queue becomes a ghost, as _evict makes it.
                for i, (m, in_main) in enumerate(self._aside):
                    if m == n:
                        del self._aside[i]
                        small = not in_main
                        break
                else:
                    small = self._took_small
                if small and freq[n] == 0:
                    ghost.put(self._ns[n], self._keys[n])
            p = parent[n]
            f = freq[n]
            freq[n] = -1
            if p >= 0 and f > 0 and freq[p] >= 0 and freq[p] < f:  # f == 0 never raises a parent's
                freq[p] = f  # count; freq[p] < 0: the parent is not resident in the tier
        self._bound_ghost()

    def candidates(self) -> Generator[int, None, None]:
        # The queue's oldest entry is taken out before it is looked at; one the tree did not evict
        # (still resident in the tier: pinned, or the run was closed before the caller evicted it)
        # is set aside and put back in front of its queue when iteration ends, in the order it was
        # yielded. RadixTree.evict runs these same steps (_take, _end) itself, without a generator.
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
        it is still in the tier, then return the next victim, taken out of its queue (-1: none
        left). On the way, interior nodes are parked and touched ones move to main. _took_small
        tells on_evict (and the next step) which queue the returned node came from. The tree
        creates no node during a run, so the columns read here stay current."""
        if prev >= 0 and self._cols.mask[prev] & self._bit:
            # skipped by the tree (pinned), or the run stopped before it
            self._aside.append((prev, not self._took_small))
        tchild, freq, frac = self._cols.tchild[self._t], self._freq, self._small_fraction
        small, main = self._small, self._main
        while small.count or main.count:
            if small.count and (not main.count or float(small.count) >= frac * self._resident):
                use_small = True
                n = small.oldest
            else:
                use_small = False
                n = main.oldest
            self._unlink(n)
            if tchild[n]:
                self._queue[n] = _PARKED_SMALL if use_small else _PARKED_MAIN
                self._n_parked += 1
                continue
            f = freq[n]
            if f > 0:
                freq[n] = 0 if use_small else f - 1
                self._append(n, True)
                continue
            self._took_small = use_small
            return n
        return -1

    def _end(self, last: i64) -> None:
        """End a :meth:`candidates` run whose last returned node is ``last`` (-1: none): set it aside
        if it is still in the tier, then put every set-aside node back in front of its queue, the
        first yielded first."""
        aside = self._aside
        if last >= 0 and self._cols.mask[last] & self._bit:
            aside.append((last, not self._took_small))
        while aside:
            n, in_main = aside.pop()
            self._push_oldest(n, in_main)

    def check_integrity(self) -> None:
        self._ghost.check_integrity()
        queue = self._queue
        assert len(self._links) == len(queue) == len(self._freq), (
            f"s3fifo: columns of {len(self._links)}, {len(queue)} and {len(self._freq)} slots"
        )
        linked = self._links.check_integrity("s3fifo")
        walked: list[set[int]] = []
        for label, q, fifo in (("small", _SMALL, self._small), ("main", _MAIN, self._main)):
            seen = fifo.check_integrity(f"s3fifo's {label} FIFO")
            wrong = [n for n in seen if queue[n] != q]
            assert not wrong, f"s3fifo: nodes in the {label} FIFO marked as another queue, e.g. {wrong[:5]}"
            walked.append(seen)
        s, m = walked[0], walked[1]
        p = {n for n, q in enumerate(queue) if q >= _PARKED_SMALL}
        assert all(_NONE <= q <= _PARKED_MAIN for q in queue), "s3fifo: a node marked with no such queue"
        assert len(p) == self._n_parked, f"s3fifo: {len(p)} nodes parked, {self._n_parked} counted"
        assert not (s & m or s & p or m & p), "s3fifo: a node is in two queues"
        marked = {n for n, q in enumerate(queue) if q == _SMALL or q == _MAIN}
        assert marked == linked == s | m, (
            "s3fifo: queue marks and links disagree with the FIFOs"
        )
        assert self._resident == len(s) + len(m) + len(p) + len(self._aside), "s3fifo: resident count drifted"
        resident = {n for n, f in enumerate(self._freq) if f >= 0}
        assert resident == s | m | p, "s3fifo: frequency table out of step with the queues"
        assert not self._aside, "s3fifo: candidates left aside"
        tier = {n for n, mk in enumerate(self._mask) if mk & self._bit}
        assert resident == tier, (
            f"s3fifo: queued nodes not in the tier {sorted(resident - tier)[:5]}, tier nodes in no "
            f"queue {sorted(tier - resident)[:5]}"
        )
        # on_leaf takes a parked node back when its last child in the tier leaves: a parked leaf
        # would never be a candidate again.
        lost = [n for n in p if not self._tchild[n]]
        assert not lost, f"s3fifo: {len(lost)} tier leaves parked (never candidates), e.g. {lost[:5]}"


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class SIEVEPolicy(TierPolicy):
    """SIEVE (NSDI'24) on leaves: one FIFO and a hand that moves from the old end towards the new end,
    clearing visited bits and stopping at the first unvisited evictable leaf. Retained chunks keep
    their place (unlike CLOCK's reinsertion). Interior chunks are passed over; a removed child's
    visited bit is folded into its parent (lazy path touches)."""

    name: ClassVar[str] = "sieve"

    live_candidates: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        # The FIFO (new chunks at its newest end), through links grown to at least the tree's column
        # length (new slots in no list), and the hand: the node it looks at next (-1: the oldest).
        self._links = Links()
        self._fifo = LinkedList(self._links)
        self._hand = -1
        self._idle = 0  # candidates(): steps since its last eviction (see _take)
        self._visited: vec[i64] = vec[i64]()  # 1: touched since the hand last passed (by node id)
        self._inserted_at = -1  # clock of the last insert: its own path touch is not a reuse

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._inserted_at = now
        self._grow()
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)  # see LRUPolicy.on_insert
        self._resident += self._fifo.append_new(ids)  # a node already in the FIFO keeps its place

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # As S3FIFOPolicy.on_graft: on_remove reads the new parent's link, which may be newer than
        # this tier's last insert.
        self._grow()

    def _grow(self) -> None:
        """Extend the links and the visited bits to the tree's column length, or more
        (:func:`column_slots`; new slots out)."""
        n_slots = len(self._cols.parent)
        if len(self._links) < n_slots:
            n_slots = column_slots(len(self._links), n_slots)
            self._visited = extend(self._visited, vec[i64]([0] * (n_slots - len(self._links))))
            self._links.grow(n_slots)

    def on_access(self, node_id: int, now: int) -> None:
        if now != self._inserted_at:  # not the touch of the insert that just created it
            self._visited[node_id] = 1

    def on_leaf(self, node_id: int) -> None:
        pass

    def on_remove(self, node_ids: Sequence[int]) -> None:
        newer = self._links.newer
        n_slots = len(newer)
        for n in node_ids:
            if n < n_slots and newer[n] != OUT:
                self._evict(n, -1)

    def _evict(self, node_id: i64, leaf_parent: i64) -> None:
        """on_remove((node_id,)) for a node in the FIFO (on_leaf does nothing here: ``leaf_parent``
        is not used); see TierPolicy._evict. The node leaves the FIFO: a hand on it moves to the next
        newer node, and a visited bit (a touch the hand has not passed) is folded into the parent,
        which the touch reached too (lazy path touches)."""
        n = node_id
        newer = self._links.newer
        if self._hand == n:
            self._hand = newer[n]
        self._fifo.unlink(n)
        self._resident -= 1
        visited = self._visited
        if visited[n]:
            visited[n] = 0
            p = self._cols.parent[n]
            if p >= 0 and newer[p] != OUT:
                visited[p] = 1

    def candidates(self) -> Generator[int, None, None]:
        # The hand's steps are _take's, which RadixTree.evict runs itself, without a generator. A
        # yielded node stays in the FIFO until it is removed: nothing is set aside. The idle count
        # is this iterator's own (kept in a local between steps, as another run may interleave).
        n, idle = -1, 0
        while True:
            self._idle = idle
            n = self._take(n)
            idle = self._idle
            if n < 0:
                break
            yield n

    def _take(self, prev: i64) -> i64:
        """One step of :meth:`candidates`: the next unvisited tier leaf under the hand, which moves
        past it (-1: none left, after two full sweeps without an eviction). ``prev`` is the node
        returned last in this run (-1: the run starts): if it left the FIFO the idle count restarts."""
        newer, visited, tchild = self._links.newer, self._visited, self._cols.tchild[self._t]
        if prev < 0 or newer[prev] == OUT:
            # steps since the last eviction; two full sweeps without one: none is possible
            self._idle = 0
        if not self._resident:
            return -1
        # The sweep runs on locals (the hand passes many interior and visited nodes per victim),
        # stored back on every exit; machine integers (compiled: no tagging per step).
        hand: i64 = self._hand
        idle: i64 = self._idle
        limit: i64 = 2 * self._resident + 2
        tail: i64 = self._fifo.oldest
        n: i64 = -1
        while idle <= limit:
            n = hand if hand >= 0 else tail
            hand = newer[n]
            idle += 1
            if visited[n]:
                visited[n] = 0
                continue
            if tchild[n]:
                continue
            self._hand, self._idle = hand, idle
            return n
        self._hand, self._idle = hand, idle
        return -1

    def check_integrity(self) -> None:
        linked = self._links.check_integrity("sieve")
        walked = self._fifo.check_integrity("sieve's FIFO")
        assert walked == linked and len(linked) == self._resident, (
            f"sieve: {len(walked)} nodes in the FIFO, {len(linked)} linked, {self._resident} resident"
        )
        assert len(self._visited) == len(self._links), (
            f"sieve: visited column of {len(self._visited)} slots, links of {len(self._links)}"
        )
        assert all(v in (0, 1) for v in self._visited), "sieve: a visited bit other than 0/1"
        assert {n for n, v in enumerate(self._visited) if v} <= linked, (
            "sieve: visited bit on a node not in the tier"
        )
        assert self._hand == -1 or self._hand in linked, f"sieve: hand {self._hand} is not in the FIFO"
        tier = {n for n, m in enumerate(self._mask) if m & self._bit}
        assert linked == tier, (
            f"sieve: FIFO nodes not in the tier {sorted(linked - tier)[:5]}, tier nodes not in the "
            f"FIFO {sorted(tier - linked)[:5]}"
        )
