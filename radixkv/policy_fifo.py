"""FIFO-family eviction policies (s3fifo, sieve).

Imported by :mod:`radixkv.policies`, which registers them; see its docstring for the protocol."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar, Final, Generator, Sequence

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.compiler_hints import mypyc_attr
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.tree import RadixTree, TreeColumns


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class S3FIFOPolicy:
    """S3-FIFO (SOSP'23) on leaves: a small FIFO for new chunks (``small_fraction`` of the tier), a main
    FIFO with 2-bit frequencies, and a ghost FIFO of keys recently evicted from the small queue.

    A new chunk enters the small queue, or the main queue if its key is in the ghost. At the small
    queue's old end a chunk touched since insertion moves to main, otherwise it is the victim (its key
    goes to the ghost); at the main queue's old end a touched chunk is reinserted with its frequency
    decremented. Interior chunks are parked until their last child leaves (lazy path touches: a
    parent's frequency is folded from its children as they leave)."""

    name: ClassVar[str] = "s3fifo"

    live_candidates: ClassVar[bool] = True

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"s3fifo: small_fraction={small_fraction!r} must be in (0, 1)")
        self._small_fraction = small_fraction
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._parked: dict[int, bool] = {}  # node -> was in main
        # 2-bit frequency by node id (a vec slot is cheaper than an int-keyed dict probe, and it is
        # read on every touch and every queue step); -1: not resident in the tier. It grows by
        # assignment (extend may move it): no alias of it outlives a call.
        self._freq: vec[i64] = vec[i64]()
        self._inserted_at = -1  # clock of the last insert: its own path touch is not a reuse
        self._ghost: OrderedDict[tuple[str | None, str | None], None] = OrderedDict()
        self._aside: list[tuple[int, bool]] = []
        self._resident = 0  # small + main + parked + aside, kept as a count (asked once per step)
        self._keys: list[str | None] = []
        self._ns: list[str | None] = []
        self._t = 0
        self._bit = 1
        self._took_small = False  # the queue of the node candidates() yielded last

    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        # The tree's vec columns are read through its column holder (tree._views: one is replaced when
        # it grows; the tree itself is not kept, which would make a reference cycle); its key
        # and namespace lists are kept as views.
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index
        self._keys, self._ns = tree._key, tree._ns

    @property
    def _tchild(self) -> vec[i64]:
        # The tree's column of children resident in the tier (read-only), from tree._views at each use.
        return self._cols.tchild[self._t]

    @property
    def _parent(self) -> vec[i64]:
        # The tree's column of parents (read-only), from tree._views at each use.
        return self._cols.parent

    @property
    def _mask(self) -> vec[i64]:
        # The tree's column of residency masks (read-only), from tree._views at each use.
        return self._cols.mask

    def __len__(self) -> int:
        return self._resident

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._inserted_at = now
        self._resident += len(node_ids)
        if len(self._freq) < len(self._parent):
            self._freq = extend(self._freq, vec[i64]([-1] * (len(self._parent) - len(self._freq))))
        ghost, freq, small, ns, keys = self._ghost, self._freq, self._small, self._ns, self._keys
        for n in node_ids:
            freq[n] = 0
        if ghost.keys().isdisjoint(zip(map(ns.__getitem__, node_ids), map(keys.__getitem__, node_ids))):
            # The usual case, none of the keys is a ghost: the whole chain enters the small queue
            # in one C-level pass (the key tuples are built and probed in C too).
            small.update(dict.fromkeys(node_ids))
            return
        for n in node_ids:
            k = (ns[n], keys[n])
            if k in ghost:
                del ghost[k]
                self._main[n] = None
            else:
                small[n] = None

    def on_graft(self, node_ids: Sequence[int]) -> None:
        # The nodes' run was grafted under a chain (RadixTree._graft): no state depends on depth,
        # but the new parent may be newer than this tier's last insert, and on_remove folds a
        # frequency into it: the column grows to the tree's.
        if len(self._freq) < len(self._parent):
            self._freq = extend(self._freq, vec[i64]([-1] * (len(self._parent) - len(self._freq))))

    def on_access(self, node_id: int, now: int) -> None:
        if now == self._inserted_at:
            return  # the touch of the insert that just created the chunk
        f = self._freq
        if f[node_id] < 3:
            f[node_id] += 1

    def on_leaf(self, node_id: int) -> None:
        in_main = self._parked.pop(node_id, None)
        if in_main is not None:
            q = self._main if in_main else self._small
            q[node_id] = None
            q.move_to_end(node_id, False)  # last=False: its FIFO position is as old as it gets

    def on_evict(self, node_id: int, leaf_parent: int) -> None:
        # on_remove((node_id,)) then on_leaf(leaf_parent), written out for one node: the replay's
        # eviction loop calls this once per evicted chunk (see EvictionPolicy). node_id is the node
        # candidates() just yielded: it already took it out of its queue (never set aside) and
        # noted the queue, and its frequency is 0 (a touched chunk is moved, not yielded), so
        # there is no count to fold into the parent.
        n, small, main = node_id, self._small, self._main
        self._resident -= 1
        self._freq[n] = -1
        ghost = self._ghost
        if self._took_small:
            ghost[(self._ns[n], self._keys[n])] = None
        if len(ghost) > 16:
            limit = len(main)
            if limit < 16:
                limit = 16
            while len(ghost) > limit:
                ghost.popitem(False)
        if leaf_parent >= 0:
            in_main = self._parked.pop(leaf_parent, None)
            if in_main is not None:
                q = main if in_main else small
                q[leaf_parent] = None
                q.move_to_end(leaf_parent, False)

    def on_remove(self, node_ids: Sequence[int]) -> None:
        # Columns and queues are locals, no builtin calls (on_evict is this for one node).
        freq, parent, small, main, parked = self._freq, self._parent, self._small, self._main, self._parked
        ghost = self._ghost
        self._resident -= len(node_ids)
        for n in node_ids:
            if n in small:
                del small[n]
                if freq[n] == 0:
                    ghost[(self._ns[n], self._keys[n])] = None
            elif n in main:
                del main[n]
            elif n in parked:
                del parked[n]
            else:
                for i, (m, _) in enumerate(self._aside):
                    if m == n:
                        del self._aside[i]
                        break
            p = parent[n]
            f = freq[n]
            freq[n] = -1
            if p >= 0 and f > 0 and freq[p] >= 0 and freq[p] < f:  # f == 0 never raises a parent's
                freq[p] = f  # count; freq[p] < 0: the parent is not resident in the tier
        if len(ghost) > 16:
            limit = len(main)
            if limit < 16:
                limit = 16
            while len(ghost) > limit:
                ghost.popitem(False)  # last=False, by position: no keyword parsing per eviction

    def candidates(self) -> Generator[int, None, None]:
        # The queue's oldest entry is taken out before it is looked at (one popitem, no iterator
        # per step); one the tree did not evict (still resident in the tier: pinned, or the run
        # was closed before the caller evicted it) is set aside and put back in front of its queue
        # when iteration ends, in the order it was yielded. _took_small tells on_evict which queue
        # the yielded node came from.
        small, main, freq, tchild, parked, aside = (
            self._small, self._main, self._freq, self._tchild, self._parked, self._aside,
        )
        mask, bit = self._mask, self._bit
        frac = self._small_fraction
        try:
            while small or main:
                if small and (not main or len(small) >= frac * self._resident):
                    use_small, q = True, small
                else:
                    use_small, q = False, main
                n = q.popitem(False)[0]  # last=False, by position: the oldest entry
                if tchild[n]:
                    parked[n] = not use_small
                    continue
                if freq[n] > 0:
                    if use_small:
                        freq[n] = 0
                    else:
                        freq[n] -= 1
                    main[n] = None
                    continue
                self._took_small = use_small
                try:
                    yield n
                except GeneratorExit:
                    if mask[n] & bit:
                        aside.append((n, not use_small))  # closed before the caller evicted it
                    raise
                if mask[n] & bit:
                    aside.append((n, not use_small))  # skipped by the tree (pinned)
        finally:
            while aside:
                n, in_main = aside.pop()
                q = main if in_main else small
                q[n] = None
                q.move_to_end(n, False)

    def check_integrity(self) -> None:
        s, m, p = set(self._small), set(self._main), set(self._parked)
        assert not (s & m or s & p or m & p), "s3fifo: a node is in two queues"
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


_OUT: Final = -2  # SIEVEPolicy's link of a node not in the tier (-1 ends the FIFO); Final: a C constant
# when compiled (a plain module global is a dict lookup at each use)


@mypyc_attr(allow_interpreted_subclasses=True)  # users may subclass a built-in policy
class SIEVEPolicy:
    """SIEVE (NSDI'24) on leaves: one FIFO and a hand that moves from the old end towards the new end,
    clearing visited bits and stopping at the first unvisited evictable leaf. Retained chunks keep
    their place (unlike CLOCK's reinsertion). Interior chunks are passed over; a removed child's
    visited bit is folded into its parent (lazy path touches)."""

    name: ClassVar[str] = "sieve"

    live_candidates: ClassVar[bool] = True

    def __init__(self) -> None:
        # The FIFO as links in vecs indexed by node id (cheaper than int-keyed dicts): the next
        # newer and older node, -1 at either end; _OUT in both for a node not in the tier. They
        # grow by assignment (extend may move them): no alias of them outlives a call.
        self._newer: vec[i64] = vec[i64]()
        self._older: vec[i64] = vec[i64]()
        self._resident = 0
        self._head = -1  # newest
        self._tail = -1  # oldest
        self._hand = -1
        self._visited: set[int] = set()
        self._inserted_at = -1  # clock of the last insert: its own path touch is not a reuse
        self._t = 0
        self._bit = 1

    _cols: TreeColumns  # set by bind: the tree's columns (not the tree: no reference cycle)

    def bind(self, tree: RadixTree, tier_index: int) -> None:
        self._cols, self._t, self._bit = tree._views, tier_index, 1 << tier_index

    @property
    def _tchild(self) -> vec[i64]:
        # The tree's column of children resident in the tier (read-only), from tree._views at each use.
        return self._cols.tchild[self._t]

    @property
    def _parent(self) -> vec[i64]:
        # The tree's column of parents (read-only), from tree._views at each use.
        return self._cols.parent

    @property
    def _mask(self) -> vec[i64]:
        # The tree's column of residency masks (read-only), from tree._views at each use.
        return self._cols.mask

    def __len__(self) -> int:
        return self._resident

    def on_insert(self, node_ids: Sequence[int], now: int) -> None:
        self._inserted_at = now
        self._grow()
        newer, older = self._newer, self._older
        for n in node_ids:
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
            self._newer = extend(self._newer, vec[i64]([_OUT] * (n_slots - len(self._newer))))
            self._older = extend(self._older, vec[i64]([_OUT] * (n_slots - len(self._older))))

    def on_access(self, node_id: int, now: int) -> None:
        if now != self._inserted_at:  # not the touch of the insert that just created it
            self._visited.add(node_id)

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
            if n in visited:
                visited.discard(n)
                p = parent[n]
                if p >= 0 and newer[p] != _OUT:
                    visited.add(p)

    def candidates(self) -> Generator[int, None, None]:
        newer, visited, tchild = self._newer, self._visited, self._tchild
        idle = 0  # steps since the last eviction; two full sweeps without one means none is possible
        while self._resident and idle <= 2 * self._resident + 2:
            n = self._hand if self._hand >= 0 else self._tail
            self._hand = newer[n]
            idle += 1
            if n in visited:
                visited.discard(n)
                continue
            if tchild[n]:
                continue
            yield n
            if newer[n] == _OUT:
                idle = 0

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
        assert self._visited <= linked, "sieve: visited bit on a node not in the tier"
        assert self._hand == -1 or self._hand in linked, f"sieve: hand {self._hand} is not in the FIFO"
        tier = {n for n, m in enumerate(self._mask) if m & self._bit}
        assert linked == tier, (
            f"sieve: FIFO nodes not in the tier {sorted(linked - tier)[:5]}, tier nodes not in the "
            f"FIFO {sorted(tier - linked)[:5]}"
        )
