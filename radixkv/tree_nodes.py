"""The radix tree's nodes: their columns, the key index, creation, residency and removal.

:class:`TreeNodes` is the lowest layer of :class:`~radixkv.tree.RadixTree` (above it,
:class:`~radixkv.tree_joins.TreeJoins` joins split chains and :class:`~radixkv.tree_eviction.TreeEviction`
evicts; :mod:`radixkv.tree` adds the policies, matching, inserting, pins and clearing). One class
split over modules by concept, as a chain of bases: compiled by mypyc, a native class has one base,
and the layers share the node columns without a call between them.

Layout: node fields live in parallel columns indexed by an int node id (struct of arrays) and
``_index[namespace][key] -> id``. The integer fields are ``vec[i64]`` (:mod:`librt.vecs`: unboxed
machine integers when compiled, so reading or writing one allocates nothing); key and namespace
(strings) are lists. A vec grows by assignment (``extend`` returns it, possibly moved), so nothing
keeps a view of one across the creation of a node: policies read them through :class:`TreeColumns`.

Invariant (prefix-closed): a node exists only while it is resident in at least one tier and its parent
exists. Removing a node whose descendants are still resident elsewhere *orphans* them: they are
dropped and counted, never served.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Final, Iterable, Sequence, cast

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.errors import ConfigError, InputError
from radixkv.pins import PinTable
from radixkv.tree_results import DropResult, TreeStats

if TYPE_CHECKING:
    from radixkv.policies import EvictionPolicy
    from radixkv.policy_base import TierPolicy

__all__ = ["TreeColumns", "TreeNodes"]

# Final: a C constant when compiled (a plain module global is a dict lookup at each use, and
# _create writes it per chunk).
_NO_PARENT: Final = -1
_MAX_TIERS: Final = 16
# Bound of a chunk's tokens and bytes (the columns are 64-bit; 2**48 bytes is 256 TiB per chunk, and a
# tier's byte count sums chunks well below 2**63).
_MAX_FIELD: Final = 1 << 48
_MAX_AWAITING_RUNS: Final = 4096


class TreeColumns:
    """The node columns a tree's policies read (read-only for them): children resident per tier,
    residency masks, parents, depths, live children, tokens and bytes per chunk. The tree replaces a
    vec column when it grows (``extend`` may move it) and updates this holder then, so a policy
    reads the current one here.
    Policies hold this, not the tree: a policy holding its tree made every tree a reference cycle
    (tree -> policy -> tree), freed only by the cycle collector."""

    def __init__(self, tchild: list[vec[i64]], mask: vec[i64], parent: vec[i64], depth: vec[i64],
                 nchild: vec[i64], tokens: vec[i64], size: vec[i64]) -> None:
        self.tchild = tchild  # one column per tier, replaced in place in this same list
        self.mask = mask
        self.parent = parent
        self.depth = depth
        self.nchild = nchild
        self.tokens = tokens
        self.size = size


class TreeNodes:
    """The node store of a tree over an ordered list of tiers: columns, key index, pins, per-tier
    totals, and the runs awaiting a parent key (see :class:`~radixkv.tree.RadixTree`, which fills
    ``_policies``, one per tier, before any node is created)."""

    def __init__(self, tiers: Sequence[str], clock: Callable[[], float] = time.monotonic,
                 max_awaiting_runs: int = _MAX_AWAITING_RUNS) -> None:
        if isinstance(tiers, (str, bytes)):  # tuple("disk") would be four tiers d, i, s, k
            raise ConfigError(f"tiers={tiers!r} must be a sequence of tier names, e.g. ({tiers!r},)")
        tiers = tuple(tiers)
        for name in tiers:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"tier name {name!r} must be a non-empty str")
        if (not isinstance(max_awaiting_runs, int) or isinstance(max_awaiting_runs, bool)
                or max_awaiting_runs < 0):
            raise ConfigError(f"max_awaiting_runs={max_awaiting_runs!r} must be an integer >= 0")
        if not tiers or len(tiers) > _MAX_TIERS or len(set(tiers)) != len(tiers):
            raise ConfigError(f"tiers={tiers!r} must be 1..{_MAX_TIERS} distinct tier names")
        self.tiers: tuple[str, ...] = tiers
        self._tier_pos = {name: i for i, name in enumerate(tiers)}
        self._now = 0
        # Node fields (struct of arrays). A free slot has _key None.
        self._key: list[str | None] = []
        self._ns: list[str | None] = []
        self._parent: vec[i64] = vec[i64]()
        self._depth: vec[i64] = vec[i64]()
        self._nchild: vec[i64] = vec[i64]()  # children alive in any tier
        # Each node's live children as a doubly linked list (first child, next and previous sibling;
        # -1: none), so a subtree is walked in O(its size) (a failed read, a delete or a clear of one
        # chunk with descendants, by the store, under its lock), not by a scan of every node.
        # Namespace-root nodes are in no list (no parent to walk from).
        self._kid: vec[i64] = vec[i64]()
        self._next: vec[i64] = vec[i64]()
        self._prev: vec[i64] = vec[i64]()
        self._tchild: list[vec[i64]] = [vec[i64]() for _ in tiers]  # children resident per tier
        self._mask: vec[i64] = vec[i64]()
        # Unboxed (vec) like the links: an eviction reads the victim's size, and a boxed int there
        # was a cache miss of its own per evicted chunk.
        self._tokens: vec[i64] = vec[i64]()
        self._size: vec[i64] = vec[i64]()
        # Each node's creation serial (1, 2, ...; never reused, unlike its id): a caller that
        # captured a node (the store's ChunkRef) tells it from a later node of the same key that
        # reuses the id after a delete (the free list hands freed ids back first).
        self._born: vec[i64] = vec[i64]()
        self._births: i64 = 0
        self._free: list[int] = []
        # Each slot's id as one int object, the one the key index and the free list hold: a removal
        # hands it to the free list without a read of the index (one probe, the delete, not two).
        self._ids: list[int] = []
        # The columns its policies read (they hold this, not the tree: no reference cycle).
        self._views = TreeColumns(self._tchild, self._mask, self._parent, self._depth, self._nchild,
                                  self._tokens, self._size)
        self._index: dict[str, dict[str, int]] = {}
        self._pins = PinTable(clock)
        # Runs stored at a namespace root although their caller named a parent key the tree lacked
        # (insert(..., root_if_missing=True)): the insert creating that key grafts them under it.
        # _awaiting: namespace -> parent key -> the runs' root nodes (no empty dicts: its truth
        # test is the whole cost to an insert while nothing waits); _awaits: root node ->
        # (namespace, its key, parent key), oldest first (the bound forgets the oldest). Entries
        # leave with a graft of the node or its removal, so a node id is never stale here.
        self._awaiting: dict[str, dict[str, list[int]]] = {}
        self._awaits: dict[int, tuple[str, str, str]] = {}
        self.max_awaiting_runs: int = max_awaiting_runs
        self._tier_bytes = [0] * len(tiers)
        self._tier_chunks = [0] * len(tiers)
        self.stats = TreeStats()
        self._policies: list[EvictionPolicy] = []
        # By tier: its policy if it is a TierPolicy (a built-in one, or a subclass of one), whose
        # hooks _on_insert and _on_access call natively; None for any other policy object.
        self._tier_policies: list[TierPolicy | None] = []

    def tier_index(self, tier: str) -> int:
        try:
            return self._tier_pos[tier]
        except KeyError:
            raise InputError(f"unknown tier {tier!r}; this tree's tiers are {list(self.tiers)}") from None

    def __len__(self) -> int:
        return len(self._key) - len(self._free)

    def _alive(self, node_id: int) -> bool:
        # Exactly int: a numpy integer (the compiled build refuses it at the call) or a bool would
        # be stored as such in the pins and the policies' tables, which then fail their checks.
        if type(node_id) is not int:
            raise InputError(f"node id {node_id!r} must be an int (a node id the tree returned), "
                             f"not {type(node_id).__name__}")
        if not (0 <= node_id < len(self._key)) or self._key[node_id] is None:
            raise InputError(f"node id {node_id} is not in the tree (removed or never inserted)")
        return True

    def _on_access(self, t: int, node_id: int, now: int) -> None:
        # tier t's policy's on_access
        tp = self._tier_policies[t]
        if tp is not None:
            tp.on_access(node_id, now)
        else:
            self._policies[t].on_access(node_id, now)

    def _on_insert(self, t: int, node_ids: list[int], now: int) -> None:
        # tier t's policy's on_insert
        tp = self._tier_policies[t]
        if tp is not None:
            tp.on_insert(node_ids, now)
        else:
            self._policies[t].on_insert(node_ids, now)

    def _touch(self, node_id: int) -> None:
        mask, now = self._mask[node_id], self._now
        i = 0
        while mask:
            if mask & 1:
                self._on_access(i, node_id, now)
            mask >>= 1
            i += 1

    def _forget_await(self, r: int) -> None:
        """End node ``r``'s wait for a parent key (grafted, leaving the tree, or past the bound)."""
        ns, _, parent_key = self._awaits.pop(r)
        w = self._awaiting[ns]
        runs = w[parent_key]
        runs.remove(r)
        if not runs:
            del w[parent_key]
            if not w:
                del self._awaiting[ns]

    # ------------------------------------------------------------------ creation

    def _check_new_keys(self, ns: str, idx: dict[str, int], keys: Sequence[str]) -> None:
        """:func:`_check_keys`; a refused first insert of a namespace leaves no empty index."""
        try:
            _check_keys(keys)
        except InputError:
            if not idx:
                del self._index[ns]
            raise

    def _new_ids(self, m: int) -> list[int]:
        """The node ids the next :meth:`_create` of ``m`` chunks gives them: free slots first (the
        last ones), then new slots at the end of the columns."""
        free = self._free
        n_reuse = min(m, len(free))
        ids: list[int] = free[len(free) - n_reuse :]
        if m > n_reuse:
            start = len(self._key)
            ids.extend(range(start, start + m - n_reuse))
        return ids

    def _claim(self, ns: str, idx: dict[str, int], keys: Sequence[str], ids: list[int]) -> bool:
        """Point each of ``keys`` at its node id in ``ids`` (one ``setdefault`` probe each). If a key
        is in the index already (or repeats in ``keys``), the keys claimed so far are released and
        the result is True: the index is as before, and for a repeat an InputError is raised."""
        # The ids' own int objects go into the index (read as objects: a native int would be boxed
        # again, one allocation per new chunk); evict hands them back to the free list the same way.
        ids_o, idx_o = cast("list[object]", ids), cast("dict[str, object]", idx)
        # a list (compiled: indexed natively; a Sequence takes the iterator protocol per key)
        ks: list[str] = keys if isinstance(keys, list) else list(keys)
        j = 0
        for k in ks:
            o = ids_o[j]
            held = idx_o.setdefault(k, o)
            if held is not o and held != o:
                repeat = idx[k] in ids[:j]  # claimed by an earlier key of this run
                self._unclaim(ns, idx, keys[:j])
                if repeat:
                    raise InputError(
                        "keys are not one chain: a key repeats, or a key after the matched prefix is "
                        "already in the tree under another prefix"
                    )
                return True
            j += 1
        return False

    def _unclaim(self, ns: str, idx: dict[str, int], keys: Sequence[str]) -> None:
        """Release the index entries :meth:`_claim` made for ``keys`` (distinct, all claimed); a
        namespace left without chunks leaves no empty index behind."""
        for k in keys:
            del idx[k]
        if not idx:
            del self._index[ns]

    def _create(
        self, ns: str, idx: dict[str, int], keys: Sequence[str], parent: int, depth: int,
        t: int, chunk_tokens: int, size_bytes: int, claimed: list[int] | None = None,
    ) -> list[int]:
        """Create a chain of new nodes under ``parent``, in free slots first, then at the end of the
        columns. The index is updated first, so a chain that contradicts the tree changes nothing.
        ``claimed``: the keys' index entries are made already (:meth:`_claim`), with these ids."""
        m = len(keys)
        if not m:
            return []
        free = self._free
        n_reuse = min(m, len(free))
        n_new = m - n_reuse
        if claimed is not None:
            ids = claimed
        else:
            self._check_new_keys(ns, idx, keys)
            # Index first: if the index does not grow by m, a key repeats or is already in the tree
            # under another prefix; undo and refuse before any column changes.
            n_before = len(idx)
            ids = self._new_ids(m)
            idx.update(zip(keys, ids))
            if len(idx) != n_before + m:
                self._undo_index(idx, keys, ids)
                if not idx:
                    del self._index[ns]
                raise InputError(
                    "keys are not one chain: a key repeats, or a key after the matched prefix is already "
                    "in the tree under another prefix"
                )
        del free[len(free) - n_reuse :]
        if n_reuse:
            # Reused slots are scattered. One plain loop writing every column per node is ~5x faster
            # than one map(column.__setitem__) pass per column (CPython specializes list stores).
            # The loop carries the parent and depth along (no per-column index arithmetic), on
            # machine integers: in a replay that evicts, nearly every chunk is created here.
            kc, nsc, pc, dc, ncc, mc = self._key, self._ns, self._parent, self._depth, self._nchild, self._mask
            tkc, szc, tct = self._tokens, self._size, self._tchild[t]
            kid, nxt, prv, born = self._kid, self._next, self._prev, self._born
            births: i64 = self._births
            bit: i64 = 1 << t
            p: i64 = parent
            d: i64 = depth
            up: i64 = _NO_PARENT  # the previous new node
            # Indexed lists, not a zip (compiled: no iterator protocol, no slice of the ids).
            ks: list[str] = keys if isinstance(keys, list) else list(keys)
            for j in range(n_reuse):
                n: i64 = ids[j]
                key = ks[j]
                kc[n] = key
                nsc[n] = ns
                pc[n] = p
                kid[n] = nxt[n] = prv[n] = _NO_PARENT
                if up != _NO_PARENT:
                    kid[up] = n  # its only child
                up = n
                d += 1
                dc[n] = d
                ncc[n] = tct[n] = 1  # each node is the next one's parent...
                mc[n] = bit
                tkc[n] = chunk_tokens
                szc[n] = size_bytes
                births += 1
                born[n] = births
                p = n
            self._births = births
            if not n_new:
                ncc[p] = tct[p] = 0  # ...but the chain's last node has no child yet
            if len(self._tchild) > 1:
                for i, tc in enumerate(self._tchild):
                    if i != t:
                        for n in ids[:n_reuse]:
                            tc[n] = 0
        if n_new:
            # Fresh slots are contiguous at the end: one extend per column. A vec column grows by
            # assignment (extend may move it): no alias of one outlives this. Each extends from a
            # vec built in one pass (compiled: a loop of native appends, no list): extend from a
            # list would ask it for a buffer (raising and clearing a TypeError), then box by box.
            r, k = n_reuse, n_new
            self._key.extend(keys[r:] if r else keys)
            self._ids.extend(ids[r:] if r else ids)  # the objects the index holds (see _claim)
            self._ns.extend([ns] * k)
            self._tokens = extend(self._tokens, vec[i64]([chunk_tokens] * k))
            self._size = extend(self._size, vec[i64]([size_bytes] * k))
            b0 = self._births
            self._born = extend(self._born, vec[i64]([b for b in range(b0 + 1, b0 + k + 1)]))
            self._births = b0 + k
            # node ids[j]'s parent is the node before it (the chain's first: `parent`)
            parents = vec[i64]([ids[j - 1] if j else parent for j in range(r, m)])
            self._parent = extend(self._parent, parents)
            depths = vec[i64]([d for d in range(depth + 1 + r, depth + m + 1)])
            self._depth = extend(self._depth, depths)
            children = vec[i64]([1] * k)  # each new node is the next one's parent...
            children[k - 1] = 0  # ...but the chain's last node has no child yet
            self._nchild = extend(self._nchild, children)
            self._mask = extend(self._mask, vec[i64]([1 << t] * k))
            zeros = vec[i64]([0] * k)
            tcs = self._tchild
            for i in range(len(tcs)):
                tcs[i] = extend(tcs[i], children if i == t else zeros)
            # each new node's only child is the next one (the last one's: none)
            kids = vec[i64]([ids[j + 1] if j + 1 < m else _NO_PARENT for j in range(r, m)])
            self._kid = extend(self._kid, kids)
            nones = vec[i64]([_NO_PARENT] * k)
            self._next = extend(self._next, nones)
            self._prev = extend(self._prev, nones)
            views = self._views  # the policies' columns: the grown ones
            views.mask, views.parent, views.depth = self._mask, self._parent, self._depth
            views.nchild, views.tokens, views.size = self._nchild, self._tokens, self._size
            if r:
                self._kid[ids[r - 1]] = ids[r]  # the last reused slot's child is the first fresh one
        if parent != _NO_PARENT:
            self._nchild[parent] += 1
            self._tchild[t][parent] += 1
            first, head = ids[0], self._kid[parent]  # the chain joins its parent's child list first
            self._next[first] = head
            if head != _NO_PARENT:
                self._prev[head] = first
            self._kid[parent] = first
        # a[i] = a[i] + x, not a[i] += x: compiled, an augmented item assignment is a generic
        # in-place add on objects, this one the int primitive
        tier_bytes, tier_chunks = self._tier_bytes, self._tier_chunks
        tier_bytes[t] = tier_bytes[t] + size_bytes * m
        tier_chunks[t] = tier_chunks[t] + m
        self.stats.inserted_chunks += m
        self._on_insert(t, ids, self._now)
        return ids

    def _undo_index(self, idx: dict[str, int], keys: Sequence[str], ids: list[int]) -> None:
        """Roll back a refused ``idx.update(zip(keys, ids))``: drop the new entries and point keys that
        were already present back at their own nodes (found by a scan: error path only)."""
        new_ids = set(ids)
        for k in keys:
            if idx.get(k) in new_ids:
                del idx[k]
        want = set(keys)
        for n, key in enumerate(self._key):
            space = self._ns[n]
            if key is not None and key in want and space is not None and self._index.get(space) is idx:
                idx[key] = n

    # ------------------------------------------------------------------ residency

    def set_resident(self, node_ids: Iterable[int], tier: str) -> None:
        """Add ``tier`` to the residency of each node (already resident: no-op)."""
        t = self.tier_index(tier)
        bit = 1 << t
        # dict.fromkeys: an id listed twice is one node (counting it twice corrupted the totals)
        todo = list(dict.fromkeys(n for n in node_ids if self._alive(n) and not self._mask[n] & bit))
        if todo:
            self._now += 1
            self._add_residency(todo, t)

    def _add_residency(self, node_ids: list[int], t: int) -> None:
        bit, parent, tchild = 1 << t, self._parent, self._tchild[t]
        added_bytes = 0
        for n in node_ids:
            self._mask[n] |= bit
            p = parent[n]
            if p != _NO_PARENT:
                tchild[p] += 1
            added_bytes += self._size[n]
        tier_bytes, tier_chunks = self._tier_bytes, self._tier_chunks  # not += (see _create)
        tier_bytes[t] = tier_bytes[t] + added_bytes
        tier_chunks[t] = tier_chunks[t] + len(node_ids)
        self._on_insert(t, node_ids, self._now)

    def clear_resident(self, node_ids: Iterable[int], tier: str) -> DropResult:
        """Remove ``tier`` from each node's residency. Nodes no tier holds any more leave the tree;
        their descendants (whose prefix is now unrecoverable) are dropped as orphans."""
        t = self.tier_index(tier)
        bit = 1 << t
        todo = list(dict.fromkeys(n for n in node_ids if self._alive(n) and self._mask[n] & bit))
        if not todo:
            return DropResult()
        self._drop_residency(todo, t)
        gone = [n for n in todo if self._mask[n] == 0]
        if not gone:
            return DropResult()
        return self._remove_nodes(gone)

    def _drop_residency(self, node_ids: list[int], t: int) -> None:
        bit, parent, tchild, mask = 1 << t, self._parent, self._tchild[t], self._mask
        pol = self._policies[t]
        pol.on_remove(node_ids)
        leaves: list[int] = []
        dropped_bytes = 0
        for n in node_ids:
            mask[n] &= ~bit
            dropped_bytes += self._size[n]
            p = parent[n]
            if p != _NO_PARENT:
                tchild[p] -= 1
                if tchild[p] == 0 and mask[p] & bit:
                    leaves.append(p)
        tier_bytes, tier_chunks = self._tier_bytes, self._tier_chunks  # not -= (see _create)
        tier_bytes[t] = tier_bytes[t] - dropped_bytes
        tier_chunks[t] = tier_chunks[t] - len(node_ids)
        for p in leaves:
            if mask[p] & bit and tchild[p] == 0:
                pol.on_leaf(p)

    def _remove_nodes(self, gone: list[int]) -> DropResult:
        """Unlink nodes no tier holds; drop their live descendants as orphans."""
        orphans: list[int] = []
        if any(self._nchild[n] for n in gone):
            orphans = self._descendants(set(gone))
            for n in orphans:
                m, t = self._mask[n], 0
                while m:
                    if m & 1:
                        self._drop_residency([n], t)
                    m >>= 1
                    t += 1
        kid, nxt, prv = self._kid, self._next, self._prev
        awaits = self._awaits
        free_o, ids_o = cast("list[object]", self._free), cast("list[object]", self._ids)
        for n in gone + orphans:
            p = self._parent[n]
            if p != _NO_PARENT:
                self._nchild[p] -= 1
                _unlink(kid, nxt, prv, n, p)
            elif awaits and n in awaits:  # a run awaiting its parent key leaves: so does its wait
                self._forget_await(n)
            space, k = self._ns[n], self._key[n]
            idx = self._index[space]  # type: ignore[index]
            free_o.append(ids_o[n])  # the index's int object for n, not a new box (see _claim)
            del idx[k]  # type: ignore[arg-type]
            if not idx:
                # A dict never shrinks as keys leave: a namespace that once held 10^5 chunks kept a
                # 3.8 MB table after its last chunk left (every weight version an engine served).
                del self._index[space]  # type: ignore[arg-type]
            self._pins.forget(n)
            self._key[n] = None
            self._ns[n] = None
        self.stats.removed_chunks += len(gone)
        self.stats.orphan_drops += len(orphans)
        return DropResult(tuple(gone), tuple(orphans))

    def _descendants(self, roots: set[int]) -> list[int]:
        """Live descendants of ``roots`` (excluding them), parents before children (by depth, then
        id). O(the subtrees' size): a walk down the child lists, never a scan of every node."""
        kid, nxt, depth = self._kid, self._next, self._depth
        seen: set[int] = set(roots)
        out: list[tuple[int, int]] = []
        stack = list(roots)
        while stack:
            c = kid[stack.pop()]
            while c != _NO_PARENT:
                if c not in seen:  # a root below another root is walked once
                    seen.add(c)
                    out.append((depth[c], c))
                    stack.append(c)
                c = nxt[c]
        out.sort()
        return [n for _, n in out]

def _unlink(kid: vec[i64], nxt: vec[i64], prv: vec[i64], n: int, p: int) -> None:
    """Take node ``n`` out of its parent ``p``'s child list."""
    nx, pv = nxt[n], prv[n]
    if pv != _NO_PARENT:
        nxt[pv] = nx
    else:
        kid[p] = nx
    if nx != _NO_PARENT:
        prv[nx] = pv


def _check_keys(keys: Sequence[str]) -> None:
    """InputError unless every key is a non-empty str."""
    # Compiled, a loop over a list is indexed natively and each test is a type flag and a length
    # (a str.join type-checked them in one C pass but built and freed the joined string, and all()
    # took the iterator protocol: ~6 % of an lru replay).
    ks = cast("list[object]", keys) if isinstance(keys, list) else list(cast("Sequence[object]", keys))
    for k in ks:
        if not isinstance(k, str) or not k:
            raise InputError(f"chunk key {k!r} must be a non-empty str")


