"""The host radix tree: chunks, their prefix structure, tier residency and pins.

Nodes are chunks, named by chain keys (``key_i`` hashes the whole prefix, see :mod:`radixkv.keys`)
inside a namespace (a :attr:`Namespace.digest`). Each node knows its parent, depth, token count, byte
size, the tiers it is resident in (a bitmask over the tree's tier names) and its pins. The tree knows
nothing of tensors, devices or threads: callers serialize access (the store holds one lock).

Invariant (prefix-closed): a node exists only while it is resident in at least one tier and its parent
exists. So a chunk is never reported while part of its prefix is unrecoverable. Removing a node whose
descendants are still resident elsewhere *orphans* them: they are dropped and counted, never served.

Layout: node fields live in parallel columns indexed by an int node id (struct of arrays) and
``_index[namespace][key] -> id``. The integer fields are ``vec[i64]`` (:mod:`librt.vecs`: unboxed
machine integers when compiled, so reading or writing one allocates nothing); key and namespace
(strings) and tokens and bytes (ints of any size) are lists. A vec grows by assignment (``extend``
returns it, possibly moved), so nothing keeps a view of one across the creation of a node: policies
read them through :class:`TreeColumns`. Because the tree is prefix-closed and keys name whole prefixes, the
longest present prefix of a key chain is found by binary search: a match costs O(log n) dict lookups,
not a walk over every chunk.

::

    keys      k0  k1  k2  k3  k4  k5        present? yes yes yes yes no no
    match     |------ hit_chunks=4 ---|     found with 3 probes: k5? no  k2? yes  k3? yes  (k4 no)
"""

from __future__ import annotations

import operator
import time
from typing import Callable, Final, Generator, Iterable, Mapping, Sequence, SupportsIndex, cast

from librt.vecs import extend, vec
from mypy_extensions import i64

from radixkv.errors import ConfigError, InputError
from radixkv.pins import PinTable
from radixkv.policies import EvictionPolicy, LRUPolicy, make_policy
from radixkv.policy_fifo import S3FIFOPolicy, SIEVEPolicy
from radixkv.policy_base import TierPolicy
from radixkv.policy_heap import AgedRefPolicy, CostPolicy, LFUPolicy
from radixkv.policy_oddsref import OddsRefPolicy
from radixkv.policy_opt import OPTPolicy
from radixkv.tree_integrity import check_tree
from radixkv.tree_results import DropResult, InsertResult, MatchResult, TreeStats

__all__ = ["RadixTree", "MatchResult", "InsertResult", "DropResult"]

# Final: a C constant when compiled (a plain module global is a dict lookup at each use, and
# _create writes it per chunk).
_NO_PARENT: Final = -1
_MAX_TIERS = 16
# Bound of a chunk's tokens and bytes (the columns are 64-bit; 2**48 bytes is 256 TiB per chunk, and a
# tier's byte count sums chunks well below 2**63).
_MAX_FIELD: Final = 1 << 48
_MAX_AWAITING_RUNS = 4096


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


class RadixTree:
    """Chunk tree over an ordered list of tiers (fastest first), one eviction policy per tier.

    ``policy`` is a registered policy name for every tier, or a mapping tier -> name;
    ``policy_options`` are keyword options for the policy constructor (or a mapping tier -> options).
    ``max_awaiting_runs`` bounds how many runs hanging at a namespace root wait for a named parent
    (``insert(..., root_if_missing=True)``); past it the oldest wait is forgotten (that run stays a
    separate chain).
    """

    def __init__(
        self,
        tiers: Sequence[str] = ("mem",),
        policy: str | Mapping[str, str] = "lru",
        policy_options: Mapping[str, object] | Mapping[str, Mapping[str, object]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_awaiting_runs: int = _MAX_AWAITING_RUNS,
    ) -> None:
        tiers = tuple(tiers)
        if (not isinstance(max_awaiting_runs, int) or isinstance(max_awaiting_runs, bool)
                or max_awaiting_runs < 0):
            raise ConfigError(f"max_awaiting_runs={max_awaiting_runs!r} must be an integer >= 0")
        if not tiers or len(tiers) > _MAX_TIERS or len(set(tiers)) != len(tiers):
            raise ConfigError(f"tiers={tiers!r} must be 1..{_MAX_TIERS} distinct tier names")
        self.tiers: tuple[str, ...] = tiers
        self._tier_pos = {name: i for i, name in enumerate(tiers)}
        if not isinstance(policy, str):
            stray = [t for t in policy if t not in self._tier_pos]
            if stray:  # a misspelt tier name would silently leave that tier on lru
                raise ConfigError(f"policy names tiers {stray!r} this tree does not have; its tiers are "
                                  f"{list(tiers)}")
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
        for i, name in enumerate(tiers):
            pname = policy if isinstance(policy, str) else policy.get(name, "lru")
            p = make_policy(pname, **_options_for(policy_options, name, tiers))
            p.bind(self, i)
            self._policies.append(p)

    # ------------------------------------------------------------------ queries

    def tier_index(self, tier: str) -> int:
        try:
            return self._tier_pos[tier]
        except KeyError:
            raise InputError(f"unknown tier {tier!r}; this tree's tiers are {list(self.tiers)}") from None

    def policy(self, tier: str) -> EvictionPolicy:
        return self._policies[self.tier_index(tier)]

    def __len__(self) -> int:
        return len(self._key) - len(self._free)

    def lookup(self, namespace: str, key: str) -> int | None:
        idx = self._index.get(namespace)
        return None if idx is None else idx.get(key)

    def node_key(self, node_id: int) -> str:
        self._alive(node_id)
        return self._key[node_id]  # type: ignore[return-value]

    def node_namespace(self, node_id: int) -> str:
        self._alive(node_id)
        return self._ns[node_id]  # type: ignore[return-value]

    def node_parent(self, node_id: int) -> int | None:
        self._alive(node_id)
        p = self._parent[node_id]
        return None if p == _NO_PARENT else p

    def node_depth(self, node_id: int) -> int:
        """Chunks from the namespace root (a namespace's first chunk has depth 1)."""
        self._alive(node_id)
        return self._depth[node_id]

    def node_tier_mask(self, node_id: int) -> int:
        self._alive(node_id)
        return self._mask[node_id]

    def node_tiers(self, node_id: int) -> list[str]:
        mask = self.node_tier_mask(node_id)
        return [t for i, t in enumerate(self.tiers) if mask >> i & 1]

    def node_size_bytes(self, node_id: int) -> int:
        self._alive(node_id)
        return int(self._size[node_id])

    def node_fields(self, node_id: int) -> tuple[str, str, int, int]:
        """``(namespace, key, size_bytes, tokens)`` of a live node: one check for the four."""
        self._alive(node_id)
        return (self._ns[node_id], self._key[node_id], int(self._size[node_id]),  # type: ignore[return-value]
                int(self._tokens[node_id]))

    def nodes_fields(self, node_ids: Sequence[int]) -> list[tuple[int, str, str, int, int]]:
        """``(node_id, namespace, key, size_bytes, tokens)`` of each live node, in one call (a read
        pins a run of hundreds of chunks); InputError for the first node that is not in the tree."""
        key, ns, size, tokens = self._key, self._ns, self._size, self._tokens
        n_slots = len(key)
        out = []
        for n in node_ids:
            k = key[n] if 0 <= n < n_slots else None
            if k is None:
                self._alive(n)  # raises
            out.append((n, ns[n], k, int(size[n]), int(tokens[n])))
        return out  # type: ignore[return-value]

    def node_tokens(self, node_id: int) -> int:
        self._alive(node_id)
        return int(self._tokens[node_id])

    def node_children_alive(self, node_id: int) -> int:
        self._alive(node_id)
        return self._nchild[node_id]

    def tier_bytes(self, tier: str) -> int:
        return self._tier_bytes[self.tier_index(tier)]

    def tier_chunks(self, tier: str) -> int:
        t = self._tier_pos.get(tier)  # tier_index inlined (asked once per replayed request)
        return self._tier_chunks[self.tier_index(tier) if t is None else t]

    def chunks_only_in(self, tier: str) -> int:
        """Chunks no other tier holds (a scan of every node: for reports, not hot paths)."""
        bit = 1 << self.tier_index(tier)
        return sum(1 for m in self._mask if m == bit)

    def tier_leaf_predicate(self, tier_index: int) -> Callable[[int], bool]:
        """``f(node_id) -> True`` when the node has no child resident in the tier (for policies)."""
        tchild = self._tchild  # read at each call: a column is replaced when it grows
        return lambda n: tchild[tier_index][n] == 0

    def items(self, namespace: str) -> list[tuple[str, int]]:
        """``(key, node id)`` of every chunk of a namespace (a snapshot)."""
        return list(self._index.get(namespace, {}).items())

    def descendants(self, node_ids: Iterable[int]) -> list[int]:
        """Live descendants of the nodes (excluding them), parents before children. O(their
        subtrees' size), not O(tree size)."""
        roots = set(node_ids)
        for n in roots:
            self._alive(n)
        return self._descendants(roots)

    def namespaces(self) -> list[str]:
        return [ns for ns, idx in self._index.items() if idx]

    def _alive(self, node_id: int) -> bool:
        if not (0 <= node_id < len(self._key)) or self._key[node_id] is None:
            raise InputError(f"node id {node_id} is not in the tree (removed or never inserted)")
        return True

    # ------------------------------------------------------------------ match

    def match(
        self, namespace: str, keys: Sequence[str], touch: bool = True, verify: bool = False
    ) -> MatchResult:
        """Longest prefix of ``keys`` present in any tier. Does not change residency; with ``touch``
        it tells each policy holding the last hit chunk that the path was used.

        ``keys`` must be one chain (each key names its whole prefix, as engine page hashes do): then
        O(log len(keys)) dict lookups suffice. The depth span and the last link are always checked, so
        most malformed inputs fall back to a link-by-link walk; ``verify=True`` always walks."""
        if isinstance(keys, (str, bytes)):  # a str is a sequence of 1-char "keys": never meant
            raise InputError(f"keys={keys!r:.60} must be a sequence of chunk keys, not one str")
        idx = self._index.get(namespace)
        if not idx or not keys:
            return MatchResult(self, keys, idx or {}, 0)
        get = idx.get
        first = get(keys[0])
        if first is None:
            return MatchResult(self, keys, idx, 0)
        n = len(keys)
        last = get(keys[-1])
        if last is not None:
            hit = n
        else:
            lo, hi = 1, n - 1  # keys[lo-1] present (its node is `last`), keys[hi] absent
            last = first
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                nid = get(keys[mid - 1])
                if nid is not None:
                    lo, last = mid, nid
                else:
                    hi = mid - 1
            hit = lo
        depth, parent = self._depth, self._parent
        # The last link is checked by comparing the parent's stored key (one string compare) rather
        # than probing the index again (three cache misses on a large index).
        if (
            verify
            or depth[last] - depth[first] != hit - 1
            or (hit > 1 and (parent[last] < 0 or self._key[parent[last]] != keys[hit - 2]))
        ):
            # Not one chain (or a chain with a hole): fall back to a checked walk.
            hit, last = self._walk(idx, keys)
        if touch:
            self._now = now = self._now + 1
            mask = self._mask[last]
            if mask == 1:  # held by the first tier only: one policy hears it
                self._policies[0].on_access(last, now)
            else:
                self._touch(last)
                if not mask & 1:  # a faster tier may hold the path above it: that copy was used too
                    self._touch_upper(last, mask)
        return MatchResult(self, keys, idx, hit, last)

    def _touch_upper(self, node_id: int, mask: int, allowed: int = -1, now: int = -1) -> None:
        """Tell each tier *faster* than every tier holding ``node_id`` (the deepest hit chunk) that
        its part of the path was used: its policy hears the deepest path node it holds. Without
        this, a hit whose deepest chunks only a lower tier held never refreshed the top tier's copy
        of the prefix above them (lazy path touches reach only the tiers holding the deepest node),
        so making room for the promotion of those very chunks evicted that prefix first, and the
        next hit read it from the slower tier (the simulator, which inserts the whole path into the
        top tier, keeps it there). Slower tiers' copies of the path are not touched (their order is
        the demotion order, see docs/simulator.md). O(the path up to the last such tier's node).
        ``allowed``: a tier bitmask, only those tiers hear it; ``now``: their time (default the
        clock's) (both for :meth:`touch` with ``tiers``)."""
        want = ((mask & -mask) - 1) & allowed  # the tiers faster than the fastest one holding node_id
        parent, tmask, policies = self._parent, self._mask, self._policies
        if now < 0:
            now = self._now
        n = parent[node_id]
        while n >= 0 and want:
            new = tmask[n] & want
            if new:
                want &= ~new
                i = 0
                while new:
                    if new & 1:
                        policies[i].on_access(n, now)
                    new >>= 1
                    i += 1
            n = parent[n]

    def _walk(self, idx: Mapping[str, int], keys: Sequence[str]) -> tuple[int, int]:
        parent = self._parent
        prev = idx[keys[0]]
        hit = 1
        for k in keys[1:]:
            nid = idx.get(k)
            if nid is None or parent[nid] != prev:
                break
            prev, hit = nid, hit + 1
        return hit, prev

    def _touch(self, node_id: int) -> None:
        mask, now = self._mask[node_id], self._now
        i = 0
        while mask:
            if mask & 1:
                self._policies[i].on_access(node_id, now)
            mask >>= 1
            i += 1

    def touch(self, node_ids: Sequence[int], tiers: Sequence[str] | None = None) -> None:
        """Tell the policies the path ending at the last of ``node_ids`` was used.

        ``tiers``: only those tiers' policies hear what ``match(..., touch=True)`` of that path tells
        them (each tier holding the node, and a tier faster than all of them its deepest node on the
        path), at the next tick of the clock, which does not advance: the other tiers see the same
        times as without the call, and the next event shares that tick (a tick of its own, as a
        match takes, so no policy takes the touch for part of an earlier insert: S3-FIFO ignores
        an access at its last insert's time). The simulator uses it to give a lower tier's copies of
        a hit the touch a store's ``get`` gives them, without a second touch of the top tier
        (docs/simulator.md)."""
        if node_ids:
            self._alive(node_ids[-1])
            if tiers is None:
                self._now += 1
                self._touch(node_ids[-1])
                return
            n, now = node_ids[-1], self._now + 1
            allowed = 0
            for name in tiers:
                allowed |= 1 << self.tier_index(name)
            mask = self._mask[n]
            held, i = mask & allowed, 0
            while held:
                if held & 1:
                    self._policies[i].on_access(n, now)
                held >>= 1
                i += 1
            if not mask & 1:
                self._touch_upper(n, mask, allowed, now)

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        namespace: str,
        keys: Sequence[str],
        tier: str,
        chunk_tokens: object,  # an int in 1 .. 2**48-1; checked here (a compiled build would raise a
        size_bytes: object,  # bare TypeError for a float at the call): an int in 0 .. 2**48-1
        parent_key: str | None = None,
        root_if_missing: bool = False,
    ) -> InsertResult:
        """Make ``keys`` (one chain, continuing ``parent_key`` or starting at the namespace root)
        resident in ``tier``: existing chunks gain the residency and are touched, missing ones are
        created. Inserting what is present is a documented no-op apart from the touch.

        If ``parent_key`` is given but not in the tree, nothing is inserted (the chain's prefix is not
        recoverable) and the result is empty; with ``root_if_missing`` the run is inserted as
        without ``parent_key`` instead and, when its first chunk then hangs at the namespace root,
        *awaits* ``parent_key``: the insert that later creates that key grafts the run (its first
        chunk, still in the tree and still at the namespace root) under it, as below. The tree
        remembers at most ``max_awaiting_runs`` such waits (the oldest is forgotten first); a wait
        ends with the run's first chunk leaving the tree or being grafted. Without ``parent_key``,
        a run whose first key is present continues from where that key is; a run whose first key
        is new starts at the namespace root. Raises InputError for keys that contradict the tree
        (not one chain) or invalid sizes (each must be below 2**48: the columns are 64-bit).
        ``keys`` must be one chain, as for :meth:`match`, whose fast
        path this insert shares: a list that is not one chain but whose depth span and last link agree
        with one (never a real hash chain) is an InputError where the insert reads the matched nodes,
        and may be taken as present where it need not (every chunk already in the tier).

        A key after the chain's end (or ``keys[0]`` under ``parent_key``) that is already the first
        node of a run at the namespace root (a *split chain*: its chunks arrived first) is grafted
        under the chain, with its subtree, and followed as far as it matches ``keys``; a key present
        under another parent is still a contradiction. See :meth:`_insert_joining`."""
        t = self._tier_pos.get(tier)  # tier_index inlined: the replay inserts twice per request
        if t is None:
            t = self.tier_index(tier)  # raises: unknown tier
        if (not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0
                or chunk_tokens >= _MAX_FIELD):
            raise InputError(f"chunk_tokens={chunk_tokens!r} must be a positive integer below 2**48")
        if (not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes < 0
                or size_bytes >= _MAX_FIELD):
            raise InputError(f"size_bytes={size_bytes!r} must be a non-negative integer below 2**48")
        tokens_per_chunk: int = chunk_tokens
        bytes_per_chunk: int = size_bytes
        if isinstance(keys, (str, bytes)):
            raise InputError(f"keys={keys!r:.60} must be a sequence of chunk keys, not one str")
        if not keys:
            return InsertResult()
        idx = self._index.setdefault(namespace, {})
        if parent_key is None:
            parent, depth = _NO_PARENT, 0
        else:
            p = idx.get(parent_key)
            if p is None:
                if not root_if_missing:
                    if not idx:
                        del self._index[namespace]  # no empty index left behind (see _remove_nodes)
                    return InsertResult()
                r = self.insert(namespace, keys, tier, tokens_per_chunk, bytes_per_chunk)
                self._await_parent(namespace, idx, keys[0], parent_key)
                return r
            parent, depth = p, self._depth[p]
        m = self.match(namespace, keys, False)  # touch=False, by position
        hit = m.hit_chunks
        last = m._last  # match sets it whenever hit_chunks > 0 (last_node_id without the call)
        # Without parent_key the caller does not say where the run starts (SGLang without prefix
        # keys hands over mid-chain runs): present keys keep the parent they have.
        if hit and parent_key is not None and self._parent[idx[keys[0]]] != parent:
            if self._parent[idx[keys[0]]] != _NO_PARENT:
                raise InputError(
                    f"key {keys[0]!r} is already in the tree under another parent than parent_key="
                    f"{parent_key!r}: the keys are not a continuation of that chain"
                )
            # keys[0] starts a run at the namespace root (a split chain): graft it under parent_key
            return self._insert_joining(namespace, idx, keys, m, 0, parent, t, tokens_per_chunk,
                                        bytes_per_chunk)
        claimed: list[int] | None = None
        if hit < len(keys):
            # The new keys claim their index entries now, with the node ids _create will give them:
            # one probe per new key. A key after the matched prefix that is in the tree already is
            # a split chain to join, or a contradiction; the claim stops there and is undone.
            rest = keys[hit:]
            self._check_new_keys(namespace, idx, rest)
            claimed = self._new_ids(len(rest))
            if self._claim(namespace, idx, rest, claimed):
                return self._insert_joining(namespace, idx, keys, m, hit, last if hit else parent, t,  # type: ignore[arg-type]
                                            tokens_per_chunk, bytes_per_chunk)
        self._now += 1
        if hit and self._tier_chunks[t] != len(self._key) - len(self._free):  # != len(self)
            # Some chunk is not in this tier: the matched ones that are not gain it. (When every
            # chunk is in the tier, the matched prefix is not even looked up.)
            bit = 1 << t
            missing_tier = [n for n in m.node_ids if not self._mask[n] & bit]
            if missing_tier:
                if len(set(keys)) != len(keys):
                    # A key repeated in the matched prefix (the new keys' claim above refused every
                    # other contradiction): the fast match can take such a list for one chain, and
                    # the repeated node would gain the tier twice (its parent's child count and the
                    # tier's totals counted twice). Refused before the residency changes, so a
                    # contradicting chain changes nothing (an uncommon path: no cost to inserts).
                    if claimed is not None:
                        self._unclaim(namespace, idx, keys[hit:])
                    raise InputError(
                        "keys are not one chain: a key repeats, or a key after the matched prefix is "
                        "already in the tree under another prefix"
                    )
                self._add_residency(missing_tier, t)
        if hit:
            parent, depth = last, self._depth[last]  # type: ignore[assignment,index]
        # the claimed keys (the slice made above), or none: nothing is new when claimed is None
        new = self._create(namespace, idx, rest if claimed is not None else (), parent, depth, t,
                           tokens_per_chunk, bytes_per_chunk, claimed)
        if self._awaiting:  # some run awaits a parent key: is it one of these?
            self._join_awaiting(namespace, new)
        leaf: int = new[-1] if new else last  # type: ignore[assignment]
        if self._mask[leaf] == 1:  # held by the first tier only (as in match): one policy hears it
            self._policies[0].on_access(leaf, self._now)
        else:
            self._touch(leaf)
        return InsertResult(m, tuple(new))

    def _insert_joining(
        self, ns: str, idx: dict[str, int], keys: Sequence[str], m: MatchResult, pos: int, start: int,
        t: int, chunk_tokens: int, size_bytes: int,
    ) -> InsertResult:
        """:meth:`insert` of ``keys[pos:]`` after node ``start`` (-1: the namespace root) when some of
        them are in the tree already. Each such key must be the first node of a run hanging at the
        namespace root (a *split chain*: its chunks arrived before their prefix, e.g. SGLang backing
        up a child page first): the run is grafted under the key before it and followed as far as it
        matches ``keys``; anything else (a key under another parent, a repeat, a run that is this
        chain's own root) is a contradiction, refused before anything changes. The rare path: one
        graft costs O(the grafted subtree + the start's depth), not O(tree size)."""
        n, parent, idx_get = len(keys), self._parent, idx.get
        if len(set(keys)) != n:
            raise InputError("keys are not one chain: a key repeats, or a key after the matched prefix is "
                             "already in the tree under another prefix")
        _check_keys(keys[pos:])
        top = start  # the chain's namespace-root node, which must not be grafted under its own chain
        while top != _NO_PARENT and parent[top] != _NO_PARENT:
            top = parent[top]
        # Plan in full first: (a, b, run root) -- keys[a:b] are new (run root -1) or the run of a
        # namespace-root node, grafted under the node before it.
        plan: list[tuple[int, int, int]] = []
        a, joined = pos, start != _NO_PARENT
        while a < n:
            j = a
            while j < n and keys[j] not in idx:
                j += 1
            if j > a:
                plan.append((a, j, _NO_PARENT))
                joined = True
            if j == n:
                break
            r = idx[keys[j]]
            if parent[r] != _NO_PARENT or r == top or not joined:
                raise InputError(
                    f"keys are not one chain: key {keys[j]!r} is already in the tree under another prefix "
                    "(only a run at the namespace root can continue a chain)"
                )
            b, node = j + 1, r
            while b < n:
                c = idx_get(keys[b])
                if c is None or parent[c] != node:
                    break
                node, b = c, b + 1
            plan.append((j, b, r))
            a = b
        self._now += 1
        bit, mask = 1 << t, self._mask
        ids: list[int] = list(m.node_ids) if pos else []
        missing = [x for x in ids if not mask[x] & bit]
        if missing:  # the matched prefix gains the tier, as in insert
            self._add_residency(missing, t)
        created: list[int] = []
        cur = start
        for a, b, r in plan:
            if r == _NO_PARENT:
                new = self._create(ns, idx, keys[a:b], cur, self._depth[cur] if cur != _NO_PARENT else 0,
                                   t, chunk_tokens, size_bytes)
                created += new
                ids += new
            else:
                self._graft(r, cur)
                new = [idx[k] for k in keys[a:b]]
                mask = self._mask  # again: a _create above may have replaced the column
                missing = [x for x in new if not mask[x] & bit]
                if missing:  # the grafted run's matched chunks gain the tier, like a matched prefix
                    self._add_residency(missing, t)
                ids += new
            cur = new[-1]
        if self._awaiting and created:
            self._join_awaiting(ns, created)
        if self._mask[cur] == 1:
            self._policies[0].on_access(cur, self._now)
        else:
            self._touch(cur)
        r_ = InsertResult(m, tuple(created))
        r_._ids = tuple(ids)  # every key's node, root->leaf (the matched ids are not one prefix here)
        return r_

    def _graft(self, r: int, p: int) -> None:
        """Hang the namespace-root node ``r`` (and its subtree) under ``p``: parent, child lists, the
        new parent's child counts per tier ``r`` is resident in, the depth of every node of the
        subtree (O(its size), down the child lists), then each tier policy's optional
        ``on_graft(node_ids)`` with the subtree's nodes resident in its tier (parents first), for
        state it derived from depth. A wait of ``r`` for a parent key ends (it has one now)."""
        if self._awaits and r in self._awaits:
            self._forget_await(r)
        self._parent[r] = p
        self._nchild[p] += 1
        kid, nxt, prv = self._kid, self._next, self._prev
        head = kid[p]
        nxt[r], prv[r] = head, _NO_PARENT
        if head != _NO_PARENT:
            prv[head] = r
        kid[p] = r
        mask = self._mask
        m_r = mask[r]
        for i, tc in enumerate(self._tchild):
            if m_r >> i & 1:
                tc[p] += 1
        sub = [r] + self._descendants({r})
        depth, shift = self._depth, self._depth[p]  # r had depth 1: it now has depth[p] + 1
        for x in sub:
            depth[x] += shift
        for i, pol in enumerate(self._policies):
            on_graft = getattr(pol, "on_graft", None)
            if on_graft is not None:
                bit = 1 << i
                mine = [x for x in sub if mask[x] & bit]
                if mine:
                    on_graft(mine)

    def _await_parent(self, ns: str, idx: dict[str, int], first_key: str, parent_key: str) -> None:
        """Remember that the run whose first chunk is ``first_key`` awaits ``parent_key`` (see
        :meth:`insert`'s ``root_if_missing``): only a run at the namespace root waits, and not for a
        key the tree holds (nor, so, for one of its own keys); a node waits for one parent key, the
        latest named. Past ``max_awaiting_runs`` the oldest wait is forgotten."""
        r = idx.get(first_key)
        if (r is None or self._parent[r] != _NO_PARENT or parent_key in idx
                or not self.max_awaiting_runs):
            return
        if r in self._awaits:
            self._forget_await(r)
        while len(self._awaits) >= self.max_awaiting_runs:
            self._forget_await(next(iter(self._awaits)))
        self._awaits[r] = (ns, first_key, parent_key)
        self._awaiting.setdefault(ns, {}).setdefault(parent_key, []).append(r)

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

    def _join_awaiting(self, ns: str, new: list[int]) -> None:
        """Graft the runs awaiting a key of the just-created nodes ``new`` under that key's node
        (the rare path: O(len(new)) probes, then each graft). A run that is the root of the new
        node's own chain is not grafted under it (that would be a cycle): its wait just ends."""
        w = self._awaiting.get(ns)
        if not w:
            return
        key, parent = self._key, self._parent
        for p in new:
            runs = w.get(key[p])  # type: ignore[arg-type]
            if runs is None:
                continue
            top = p
            while parent[top] != _NO_PARENT:
                top = parent[top]
            for r in list(runs):
                self._forget_await(r)
                if r != top:  # still at the namespace root: its wait would have ended otherwise
                    self._graft(r, p)
            w = self._awaiting.get(ns)
            if not w:
                return

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
            kid, nxt, prv = self._kid, self._next, self._prev
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
                p = n
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
        self._tier_bytes[t] += size_bytes * m
        self._tier_chunks[t] += m
        self.stats.inserted_chunks += m
        self._policies[t].on_insert(ids, self._now)
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
        for n in node_ids:
            self._mask[n] |= bit
            p = parent[n]
            if p != _NO_PARENT:
                tchild[p] += 1
            self._tier_bytes[t] += self._size[n]
        self._tier_chunks[t] += len(node_ids)
        self._policies[t].on_insert(node_ids, self._now)

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
        for n in node_ids:
            mask[n] &= ~bit
            self._tier_bytes[t] -= self._size[n]
            p = parent[n]
            if p != _NO_PARENT:
                tchild[p] -= 1
                if tchild[p] == 0 and mask[p] & bit:
                    leaves.append(p)
        self._tier_chunks[t] -= len(node_ids)
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

    # ------------------------------------------------------------------ eviction

    def evict_candidates(self, tier: str, n_chunks: int, drop: bool = False) -> list[int]:
        """Up to ``n_chunks`` nodes to evict from ``tier``, best first per the tier's policy.

        Every candidate is resident in ``tier``, unpinned, and has no child resident in ``tier``.
        With ``drop`` (the caller will not demote it elsewhere) a candidate also has no live child
        unless another tier holds it, so dropping it never orphans anything. Does not mutate the tree.
        """
        t = self.tier_index(tier)
        if n_chunks <= 0:
            return []
        out: list[int] = []
        seen: set[int] = set()
        gen = self._eligible(t, drop)
        try:
            for n in gen:
                if n in seen:  # a policy may sweep its list again when nothing is evicted (sieve)
                    if len(seen) >= len(self._policies[t]):
                        break
                    continue
                seen.add(n)
                out.append(n)
                if len(out) >= n_chunks:
                    break
        finally:
            gen.close()
        return out

    def _eligible(self, t: int, drop: bool) -> Generator[int, None, None]:
        """The tier policy's candidates, filtered to what :meth:`evict_candidates` promises. Each step
        reads the tree afresh, so it stays valid across evictions when the policy's iterator does."""
        bit, mask, nchild = 1 << t, self._mask, self._nchild
        tchild, pins = self._tchild[t], self._pins
        held = pins.by_node  # the dict itself: a plain truth test per candidate, no method call
        gen = self._policies[t].candidates()
        try:
            for n in gen:
                if not mask[n] & bit or tchild[n]:
                    continue
                if held and n in held and pins.is_pinned(n):
                    continue
                if drop and nchild[n] and mask[n] == bit:
                    continue
                yield n
        finally:
            gen.close()

    def evict(self, tier: str, n_chunks: SupportsIndex) -> DropResult:
        """Drop up to ``n_chunks`` chunks from ``tier`` one at a time in exact policy order (each
        eviction may make a parent the next victim). Chunks other tiers hold stay in the tree.

        Policies that declare ``live_candidates = True`` tolerate evictions between the steps of one
        ``candidates()`` iterator, so the whole loop runs on one iterator (the fast path the
        simulator uses); for other policies a fresh iterator is taken per eviction."""
        t = self._tier_pos.get(tier)  # tier_index inlined: once per replayed request
        if t is None:
            t = self.tier_index(tier)  # raises: unknown tier
        removed: list[int] = []
        removed_o = cast("list[object]", removed)  # filled with the index's int objects
        if isinstance(n_chunks, int):  # the replay's case: no call into operator
            n_evict: int = n_chunks
        else:
            try:
                n_evict = operator.index(n_chunks)
            except TypeError:
                raise InputError(f"n_chunks={n_chunks!r} must be an integer number of chunks") from None
        if n_evict <= 0:
            return DropResult()
        pol = self._policies[t]
        kind = type(pol)
        # The built-in policies (their exact classes: a subclass may override any hook) are driven
        # natively, by TierPolicy's eviction steps (_take, _evict, _end): direct calls, not a
        # generator's resumption and close and a Python-level call per eviction (~25% of an lru
        # replay). A subclass takes the generic path, where its own on_remove and on_leaf are called.
        native: TierPolicy | None = None
        if (kind is LRUPolicy or kind is AgedRefPolicy or kind is OddsRefPolicy or kind is OPTPolicy
                or kind is S3FIFOPolicy or kind is SIEVEPolicy or kind is CostPolicy or kind is LFUPolicy):
            native = cast(TierPolicy, pol)
        if native is None and not getattr(pol, "live_candidates", False):
            orphans: list[int] = []
            for _ in range(n_evict):
                victims = self.evict_candidates(tier, 1, drop=True)
                if not victims:
                    break
                r = self.clear_resident(victims, tier)
                removed.extend(r.removed_node_ids)
                orphans.extend(r.orphaned_node_ids)
            return DropResult(tuple(removed), tuple(orphans))
        # One loop, fused by hand: the policy's live iterator, the eligibility checks of _eligible
        # (resident, tier leaf, unpinned, orphans nothing) and the lean removal of a tier leaf. This
        # is the simulator's inner loop, so it avoids a generator layer and a call per eviction.
        bit, mask, nchild, tchild = 1 << t, self._mask, self._nchild, self._tchild[t]
        parent, size, key, ns, index = self._parent, self._size, self._key, self._ns, self._index
        pins, free = self._pins, self._free
        ids_o = cast("list[object]", self._ids)
        kid, nxt, prv = self._kid, self._next, self._prev
        held = pins.by_node  # the dict itself: a plain truth test per eviction, no method call
        awaits = self._awaits  # likewise: a namespace-root chunk that leaves ends its run's wait
        # Their truth, once, for a built-in policy's loop (compiled, a dict's truth is a call): it pins
        # nothing and starts no wait, and one that ends during it only makes a membership test
        # needless. A Python policy's hooks could pin: its loop tests the dicts themselves.
        any_held, any_awaits = bool(held), bool(awaits)
        # A policy's optional on_evict(n, leaf_parent) is on_remove((n,)) plus on_leaf(leaf_parent)
        # in one call (leaf_parent -1: none), made after the tree's own updates: one Python call per
        # evicted chunk instead of two, and no 1-tuple. A built-in policy needs none of the three
        # (looking up an absent on_evict raises and catches an AttributeError: once per call here).
        on_evict: Callable[[int, int], object] | None = None
        on_remove: Callable[[Sequence[int]], object] | None = None
        on_leaf: Callable[[int], object] | None = None
        gen: Generator[int, None, None] | None = None
        if native is None:
            on_remove, on_leaf = pol.on_remove, pol.on_leaf
            on_evict = getattr(pol, "on_evict", None)
            gen = pol.candidates()
        # Machine integers (compiled: no tagged-int checks per evicted chunk).
        evicted: i64 = 0
        freed_bytes: i64 = 0
        n: i64 = -1  # a built-in policy: the node _take returned last (_take or _end sets it aside
        # if it stays)
        try:
            if on_evict is not None or gen is None:  # gen is None: a built-in policy, driven natively
                # The same steps as the loop below, with on_evict(n, leaf_parent) as its last policy
                # call before the key is cleared, and the branches laid out so a chunk no other tier
                # holds (every chunk of a one-tier tree) takes the fewest steps.
                while True:
                    if native is not None:
                        n = native._take(n)
                        if n < 0:
                            break
                    else:
                        x = next(gen, None)  # type: ignore[arg-type]
                        if x is None:
                            break
                        n = x
                    m = mask[n]
                    if not m & bit or tchild[n] or (nchild[n] and m == bit):
                        continue
                    if any_held and n in held and pins.is_pinned(n):
                        continue
                    m = mask[n] = m ^ bit  # the bit is set (checked above)
                    freed_bytes += size[n]
                    p = parent[n]
                    leaf_parent = -1
                    if p >= 0:  # != _NO_PARENT
                        if not m:  # no tier holds it: out of the parent's child list (_unlink, inlined)
                            nchild[p] -= 1
                            nx, pv = nxt[n], prv[n]
                            if pv >= 0:
                                nxt[pv] = nx
                            else:
                                kid[p] = nx
                            if nx >= 0:
                                prv[nx] = pv
                        c = tchild[p] = tchild[p] - 1
                        if c == 0 and mask[p] & bit:
                            leaf_parent = p
                    # before the key is cleared: a policy may remember it
                    if native is not None:
                        native._evict(n, leaf_parent)
                    else:
                        on_evict(n, leaf_parent)  # type: ignore[misc]  # not None (else a built-in is)
                    if not m:  # no tier holds it: it leaves the tree
                        if p < 0 and any_awaits and n in awaits:
                            self._forget_await(n)
                        idx = index[ns[n]]  # type: ignore[index]
                        k = key[n]
                        # the index's int object for n, not a new box of n (see _claim)
                        removed_o.append(ids_o[n])
                        del idx[k]  # type: ignore[arg-type]
                        if p < 0 and not idx:  # its namespace's last chunk (a root: leaf first)
                            del index[ns[n]]  # type: ignore[arg-type]
                        if any_held:
                            pins.forget(n)
                        key[n] = None
                        ns[n] = None
                    evicted += 1
                    if evicted >= n_evict:
                        break
            else:
                for n in gen:  # type: ignore[union-attr]
                    m = mask[n]
                    if not m & bit or tchild[n] or (nchild[n] and m == bit):
                        continue
                    if held and n in held and pins.is_pinned(n):
                        continue
                    on_remove((n,))  # type: ignore[misc]  # set: not a built-in policy
                    m = mask[n] = m ^ bit  # the bit is set (checked above)
                    freed_bytes += size[n]
                    p = parent[n]
                    if p >= 0:  # != _NO_PARENT
                        c = tchild[p] = tchild[p] - 1
                        if m == 0:
                            nchild[p] -= 1
                            _unlink(kid, nxt, prv, n, p)
                        if c == 0 and mask[p] & bit:
                            on_leaf(p)  # type: ignore[misc]
                    if m == 0:
                        if p < 0 and awaits and n in awaits:
                            self._forget_await(n)
                        idx = index[ns[n]]  # type: ignore[index]
                        k = key[n]
                        # the index's int object for n, not a new box of n (see _claim)
                        removed_o.append(ids_o[n])
                        del idx[k]  # type: ignore[arg-type]
                        if p < 0 and not idx:  # its namespace's last chunk (a root: leaf first)
                            del index[ns[n]]  # type: ignore[arg-type]
                        if held:
                            pins.forget(n)
                        key[n] = None
                        ns[n] = None
                    evicted += 1
                    if evicted >= n_evict:
                        break
        finally:
            if native is not None:
                native._end(n)
            else:
                gen.close()  # type: ignore[union-attr]
            free.extend(removed)  # nothing takes a slot during the loop: one extend, same order
            self._tier_bytes[t] -= freed_bytes
            self._tier_chunks[t] -= evicted
        self.stats.removed_chunks += len(removed)
        return DropResult(tuple(removed), ())

    # ------------------------------------------------------------------ pins

    def pin(self, node_ids: Iterable[int], owner: str, lease_s: float = 60.0) -> None:
        """Protect nodes from eviction for ``owner`` until unpinned or ``lease_s`` seconds pass
        (so a crashed owner cannot leak pins). Pinning again renews the lease."""
        ids = list(node_ids)
        for n in ids:
            self._alive(n)
        self._pins.pin(ids, owner, lease_s)

    def unpin(self, node_ids: Iterable[int], owner: str) -> None:
        """Release ``owner``'s pins. Raises PinError if a node is not pinned by ``owner``; unpinning
        a pin whose lease expired is a no-op (the lease already stopped protecting the node) while the
        node is in the tree. Once an expired node was evicted its pins are gone with it, and its id
        may name another chunk: callers that can outlive their lease keep the key and check it (the
        store's ChunkRef does)."""
        self._pins.unpin(node_ids, owner)

    def is_pinned(self, node_id: int) -> bool:
        """True while some owner's lease on the node is unexpired. Expired leases are ignored (they
        cannot block eviction) but kept until unpinned or the node leaves the tree, so the owner's
        late ``unpin`` is still a no-op rather than an error; they never outlive the node."""
        return self._pins.is_pinned(node_id)

    def pinned_count(self) -> int:
        return self._pins.pinned_count()

    # ------------------------------------------------------------------ clear

    def clear(
        self, namespace: str | None = None, tier: str | None = None, subtree_key: str | None = None
    ) -> DropResult:
        """Drop chunks: everything, one namespace, one subtree (``subtree_key`` and below, needs
        ``namespace``), restricted to one tier if given (chunks other tiers hold stay)."""
        if tier is not None:
            self.tier_index(tier)  # an unknown tier is an error even when nothing would be dropped
        if subtree_key is not None:
            if namespace is None:
                raise InputError("clear(subtree_key=...) needs the namespace the key belongs to")
            root = self.lookup(namespace, subtree_key)
            if root is None:
                return DropResult()
            targets = [root] + self._descendants({root})
        else:
            spaces = [namespace] if namespace is not None else list(self._index)
            targets = [n for ns in spaces for n in self._index.get(ns, {}).values()]
        if not targets:
            return DropResult()
        removed: list[int] = []
        orphans: list[int] = []
        tiers = [self.tier_index(tier)] if tier is not None else range(len(self.tiers))
        # Deepest first, and every tier of a node before the next node, so every removal is a leaf
        # removal and nothing is counted as an orphan (tier by tier, a parent only the first tier
        # held would leave before its child another tier holds, which would count as orphaned).
        depth = self._depth
        targets.sort(key=lambda n: depth[n], reverse=True)
        for n in targets:
            for t in tiers:
                if self._key[n] is not None and self._mask[n] & (1 << t):
                    r = self.clear_resident([n], self.tiers[t])
                    removed.extend(r.removed_node_ids)
                    orphans.extend(r.orphaned_node_ids)
        for t in tiers:
            on_cleared = getattr(self._policies[t], "on_cleared", None)
            if on_cleared is not None:
                on_cleared()
        return DropResult(tuple(removed), tuple(orphans))

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Verify every invariant; raises AssertionError naming the broken one with numbers."""
        check_tree(self)


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


def _options_for(
    policy_options: Mapping[str, object] | Mapping[str, Mapping[str, object]] | None,
    tier: str,
    tiers: tuple[str, ...],
) -> dict[str, object]:
    if not policy_options:
        return {}
    if all(k in tiers for k in policy_options) and all(isinstance(v, Mapping) for v in policy_options.values()):
        return dict(policy_options.get(tier, {}))  # type: ignore[arg-type,call-overload]
    return dict(policy_options)
