"""FIFO-family eviction policies (s3fifo, sieve).

Imported by :mod:`radixkv.policies`, which registers them; see its docstring for the protocol."""

from __future__ import annotations

from typing import ClassVar, Final, Generator, Sequence

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError
from radixkv.ghosts import GhostHistory
from radixkv.policy_base import TierPolicy


_OUT: Final = -2  # a link of a node in no queue (-1 ends a queue); Final: a C constant when compiled
# (a plain module global is a dict lookup at each use)
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

    Both FIFOs are doubly linked lists through two vec columns indexed by node id (the next newer
    and next older node in its queue, -1 at either end, ``_OUT`` in both for a node in neither),
    and a third column names the queue (or that the node is parked, and from which queue): a step, an
    insert or an eviction is a few machine-integer writes (they were OrderedDicts: a hash probe, a
    boxed int and a method call each)."""

    name: ClassVar[str] = "s3fifo"

    live_candidates: ClassVar[bool] = True

    def __init__(self, small_fraction: float = 0.1) -> None:
        super().__init__()
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"s3fifo: small_fraction={small_fraction!r} must be in (0, 1)")
        self._small_fraction = small_fraction
        # Grown to the tree's column length with _freq (new slots _OUT / _NONE). They grow by
        # assignment (extend may move them): no alias of them outlives a call.
        self._newer: vec[i64] = vec[i64]()
        self._older: vec[i64] = vec[i64]()
        self._queue: vec[i64] = vec[i64]()  # _SMALL, _MAIN, _PARKED_SMALL, _PARKED_MAIN or _NONE by node id
        self._small_old = self._small_new = -1  # the small FIFO's ends (-1: empty)
        self._main_old = self._main_new = -1
        self._n_small = 0
        self._n_main = 0
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
        """Extend the per-node columns to the tree's column length (new slots out of the tier)."""
        n_slots = len(self._cols.parent)
        if len(self._freq) < n_slots:
            more = n_slots - len(self._freq)
            self._freq = extend(self._freq, vec[i64]([-1] * more))
            outs = vec[i64]([_OUT] * more)
            self._newer = extend(self._newer, outs)
            self._older = extend(self._older, outs)
            self._queue = extend(self._queue, vec[i64]([_NONE] * more))

    def _append(self, n: int, main: bool) -> None:
        """Put ``n`` (in no queue) at the new end of the main or the small FIFO."""
        if main:
            h = self._main_new
            self._main_new = n
            self._n_main += 1
            if h < 0:
                self._main_old = n
            self._queue[n] = _MAIN
        else:
            h = self._small_new
            self._small_new = n
            self._n_small += 1
            if h < 0:
                self._small_old = n
            self._queue[n] = _SMALL
        self._older[n] = h
        self._newer[n] = -1
        if h >= 0:
            self._newer[h] = n

    def _push_oldest(self, n: int, main: bool) -> None:
        """Put ``n`` (in no queue) at the old end of the main or the small FIFO: its next step."""
        if main:
            o = self._main_old
            self._main_old = n
            self._n_main += 1
            if o < 0:
                self._main_new = n
            self._queue[n] = _MAIN
        else:
            o = self._small_old
            self._small_old = n
            self._n_small += 1
            if o < 0:
                self._small_new = n
            self._queue[n] = _SMALL
        self._newer[n] = o
        self._older[n] = -1
        if o >= 0:
            self._older[o] = n

    def _unlink(self, n: int) -> None:
        """Take ``n`` out of its queue (it is in one)."""
        newer, older = self._newer, self._older
        nw, od = newer[n], older[n]
        newer[n] = _OUT
        older[n] = _OUT
        if self._queue[n] == _MAIN:
            self._n_main -= 1
            if nw >= 0:
                older[nw] = od
            else:
                self._main_new = od
            if od >= 0:
                newer[od] = nw
            else:
                self._main_old = nw
        else:
            self._n_small -= 1
            if nw >= 0:
                older[nw] = od
            else:
                self._small_new = od
            if od >= 0:
                newer[od] = nw
            else:
                self._small_old = nw
        self._queue[n] = _NONE

    def _fifo(self, main: bool) -> list[int]:
        """The main or the small FIFO's nodes, oldest first (for tests and debugging)."""
        out: list[int] = []
        n = self._main_old if main else self._small_old
        while n >= 0 and len(out) <= len(self._newer):
            out.append(n)
            n = self._newer[n]
        return out

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
            for n in ids:
                self._append(n, False)
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

    def _evict(self, node_id: int, leaf_parent: int) -> None:
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
            limit = self._n_main
            ghost.trim(limit if limit > 16 else 16)

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

    def _take(self, prev: int) -> int:
        """One step of :meth:`candidates`: set ``prev`` (the node it yielded last, -1: none) aside if
        it is still in the tier, then return the next victim, taken out of its queue (-1: none
        left). On the way, interior nodes are parked and touched ones move to main. _took_small
        tells on_evict (and the next step) which queue the returned node came from. The tree
        creates no node during a run, so the columns read here stay current."""
        if prev >= 0 and self._cols.mask[prev] & self._bit:
            # skipped by the tree (pinned), or the run stopped before it
            self._aside.append((prev, not self._took_small))
        tchild, freq, frac = self._cols.tchild[self._t], self._freq, self._small_fraction
        while self._n_small or self._n_main:
            if self._n_small and (not self._n_main or self._n_small >= frac * self._resident):
                use_small = True
                n = self._small_old
            else:
                use_small = False
                n = self._main_old
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

    def _end(self, last: int) -> None:
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
        newer, older, queue = self._newer, self._older, self._queue
        assert len(newer) == len(older) == len(queue) == len(self._freq) <= len(self._mask), (
            f"s3fifo: columns of {len(newer)}, {len(older)}, {len(queue)} and {len(self._freq)} slots "
            f"for a tree of {len(self._mask)}"
        )
        walked: list[set[int]] = []
        fifos = (("small", _SMALL, self._small_old, self._small_new, self._n_small),
                 ("main", _MAIN, self._main_old, self._main_new, self._n_main))
        for label, q, oldest, newest, count in fifos:
            # Walked from the old end: each node's older link names the node before it (_unlink
            # splices by both links), and the walk ends at the newest end.
            n, prev = oldest, -1
            seen: set[int] = set()
            while n >= 0:
                assert n not in seen and len(seen) < count, (
                    f"s3fifo: the {label} FIFO holds more than its {count} nodes (a cycle)"
                )
                assert queue[n] == q, (
                    f"s3fifo: node {n} in the {label} FIFO is marked as queue {queue[n]}"
                )
                assert older[n] == prev, f"s3fifo: node {n}'s older link {older[n]} != {prev}"
                seen.add(n)
                prev, n = n, newer[n]
            assert n == -1, f"s3fifo: the {label} FIFO ends in link {n} after node {prev}"
            assert prev == newest, (
                f"s3fifo: the {label} FIFO's newest end {newest} is not its newest node {prev}"
            )
            assert len(seen) == count, (
                f"s3fifo: {len(seen)} nodes walked in the {label} FIFO, {count} counted"
            )
            walked.append(seen)
        s, m = walked[0], walked[1]
        p = {n for n, q in enumerate(queue) if q >= _PARKED_SMALL}
        assert all(_NONE <= q <= _PARKED_MAIN for q in queue), "s3fifo: a node marked with no such queue"
        assert len(p) == self._n_parked, f"s3fifo: {len(p)} nodes parked, {self._n_parked} counted"
        assert not (s & m or s & p or m & p), "s3fifo: a node is in two queues"
        marked = {n for n, q in enumerate(queue) if q == _SMALL or q == _MAIN}
        linked = {n for n, nw in enumerate(newer) if nw != _OUT}
        assert marked == linked == {n for n, od in enumerate(older) if od != _OUT} == s | m, (
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
        # The FIFO as links in vecs indexed by node id (cheaper than int-keyed dicts): the next
        # newer and older node, -1 at either end; _OUT in both for a node not in the tier. They
        # grow by assignment (extend may move them): no alias of them outlives a call.
        self._newer: vec[i64] = vec[i64]()
        self._older: vec[i64] = vec[i64]()
        self._head = -1  # newest
        self._tail = -1  # oldest
        self._hand = -1
        self._idle = 0  # candidates(): steps since its last eviction (see _take)
        self._visited: vec[i64] = vec[i64]()  # 1: touched since the hand last passed (by node id)
        self._inserted_at = -1  # clock of the last insert: its own path touch is not a reuse

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._inserted_at = now
        self._grow()
        newer, older = self._newer, self._older
        ids: list[int] = node_ids if isinstance(node_ids, list) else list(node_ids)  # see LRUPolicy.on_insert
        for n in ids:
            if newer[n] != _OUT:
                continue  # already in the FIFO: keeps its place
            self._resident += 1
            newer[n] = -1
            older[n] = self._head
            if self._head >= 0:
                newer[self._head] = n
            else:
                self._tail = n
            self._head = n

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # As S3FIFOPolicy.on_graft: on_remove reads the new parent's link, which may be newer than
        # this tier's last insert.
        self._grow()

    def _grow(self) -> None:
        """Extend the links to the tree's column length (new slots _OUT)."""
        n_slots = len(self._parent)
        if len(self._newer) < n_slots:
            more = n_slots - len(self._newer)
            self._newer = extend(self._newer, vec[i64]([_OUT] * more))
            self._older = extend(self._older, vec[i64]([_OUT] * more))
            self._visited = extend(self._visited, vec[i64]([0] * more))

    def on_access(self, node_id: int, now: int) -> None:
        if now != self._inserted_at:  # not the touch of the insert that just created it
            self._visited[node_id] = 1

    def on_leaf(self, node_id: int) -> None:
        pass

    def on_remove(self, node_ids: Sequence[int]) -> None:
        newer, older, visited, parent = self._newer, self._older, self._visited, self._parent
        n_slots = len(newer)
        for n in node_ids:
            if n >= n_slots or newer[n] == _OUT:
                continue
            nw, od = newer[n], older[n]
            newer[n] = older[n] = _OUT
            self._resident -= 1
            if self._hand == n:
                self._hand = nw
            if nw >= 0:
                older[nw] = od
            else:
                self._head = od
            if od >= 0:
                newer[od] = nw
            else:
                self._tail = nw
            if visited[n]:
                visited[n] = 0
                p = parent[n]
                if p >= 0 and newer[p] != _OUT:
                    visited[p] = 1

    def _evict(self, node_id: int, leaf_parent: int) -> None:
        """on_remove((node_id,)) for the node _take returned last, which is in the FIFO (on_leaf
        does nothing here: ``leaf_parent`` is not used); see TierPolicy._evict."""
        newer, older, visited = self._newer, self._older, self._visited
        n = node_id
        nw, od = newer[n], older[n]
        newer[n] = older[n] = _OUT
        self._resident -= 1
        if self._hand == n:
            self._hand = nw
        if nw >= 0:
            older[nw] = od
        else:
            self._head = od
        if od >= 0:
            newer[od] = nw
        else:
            self._tail = nw
        if visited[n]:  # as on_remove (the hand cleared it before _take returned the node)
            visited[n] = 0
            p = self._cols.parent[n]
            if p >= 0 and newer[p] != _OUT:
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

    def _take(self, prev: int) -> int:
        """One step of :meth:`candidates`: the next unvisited tier leaf under the hand, which moves
        past it (-1: none left, after two full sweeps without an eviction). ``prev`` is the node
        returned last in this run (-1: the run starts): if it left the FIFO the idle count restarts."""
        newer, visited, tchild = self._newer, self._visited, self._cols.tchild[self._t]
        if prev < 0 or newer[prev] == _OUT:
            # steps since the last eviction; two full sweeps without one: none is possible
            self._idle = 0
        if not self._resident:
            return -1
        # The sweep runs on locals (the hand passes many interior and visited nodes per victim),
        # stored back on every exit.
        hand, idle, limit, tail = self._hand, self._idle, 2 * self._resident + 2, self._tail
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
        # Walked from the old end: each node's older link names the node before it (on_remove
        # splices by both links), and the walk ends at the head (where on_insert appends).
        n, prev, seen = self._tail, -1, 0
        while n >= 0:
            seen += 1
            assert seen <= self._resident, "sieve: cycle in the FIFO"
            assert self._older[n] == prev, f"sieve: node {n}'s older link {self._older[n]} != {prev}"
            prev, n = n, self._newer[n]
        assert prev == self._head, f"sieve: head {self._head} is not the newest node {prev}"
        linked = {n for n, nw in enumerate(self._newer) if nw != _OUT}
        assert seen == self._resident == len(linked), "sieve: FIFO links broken"
        assert linked == {n for n, od in enumerate(self._older) if od != _OUT}, "sieve: FIFO links broken"
        assert len(self._visited) == len(self._newer), (
            f"sieve: visited column of {len(self._visited)} slots, links of {len(self._newer)}"
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
