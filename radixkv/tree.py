"""The host radix tree: chunks, their prefix structure, tier residency and pins.

Nodes are chunks, named by chain keys (``key_i`` hashes the whole prefix, see :mod:`radixkv.keys`)
inside a namespace (a :attr:`Namespace.digest`). Each node knows its parent, depth, token count, byte
size, the tiers it is resident in (a bitmask over the tree's tier names) and its pins. The tree knows
nothing of tensors, devices or threads: callers serialize access (the store holds one lock).

Invariant (prefix-closed): a node exists only while it is resident in at least one tier and its parent
exists. So a chunk is never reported while part of its prefix is unrecoverable. Removing a node whose
descendants are still resident elsewhere *orphans* them: they are dropped and counted, never served.

:class:`RadixTree` is one class in four modules, one concept each, as a chain of bases:
:mod:`radixkv.tree_nodes` (the node columns, the key index, creation, residency and removal),
:mod:`radixkv.tree_joins` (split chains), :mod:`radixkv.tree_eviction` (eviction in policy order) and
this one (the policies, matching, inserting, touching, pins, clearing). Because the tree is
prefix-closed and keys name whole prefixes, the longest present prefix of a key chain is found by
binary search: a match costs O(log n) dict lookups, not a walk over every chunk.

::

    keys      k0  k1  k2  k3  k4  k5        present? yes yes yes yes no no
    match     |------ hit_chunks=4 ---|     found with 3 probes: k5? no  k2? yes  k3? yes  (k4 no)
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping, Sequence, cast

from radixkv.errors import ConfigError, InputError, PinError
from radixkv.policies import EvictionPolicy, make_policy
from radixkv.policy_base import TierPolicy
from radixkv.tree_eviction import TreeEviction
from radixkv.tree_integrity import check_tree
from radixkv.tree_nodes import _MAX_AWAITING_RUNS, _MAX_FIELD, _NO_PARENT, TreeColumns
from radixkv.tree_results import DropResult, InsertResult, MatchResult

__all__ = ["RadixTree", "MatchResult", "InsertResult", "DropResult", "TreeColumns"]


class RadixTree(TreeEviction):
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
        super().__init__(tiers, clock, max_awaiting_runs)
        if not isinstance(policy, (str, Mapping)):
            raise ConfigError(f"policy={policy!r:.80} must be a policy name or a mapping of tier name to "
                              "policy name")
        if not isinstance(policy, str):
            stray = [t for t in policy if t not in self._tier_pos]
            if stray:  # a misspelt tier name would silently leave that tier on lru
                raise ConfigError(f"policy names tiers {stray!r} this tree does not have; its tiers are "
                                  f"{list(self.tiers)}")
        for i, name in enumerate(self.tiers):
            # as objects: the compiled build checks a str-typed value, refusing None with a bare TypeError
            pname = policy if isinstance(policy, str) else cast("Mapping[str, object]", policy).get(name, "lru")
            p = make_policy(pname, **_options_for(policy_options, name, self.tiers))
            p.bind(self, i)
            self._policies.append(p)
            self._tier_policies.append(p if isinstance(p, TierPolicy) else None)

    # ------------------------------------------------------------------ queries

    def policy(self, tier: str) -> EvictionPolicy:
        return self._policies[self.tier_index(tier)]

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

    def node_fields(self, node_id: int) -> tuple[str, str, int, int, int]:
        """``(namespace, key, size_bytes, tokens, born)`` of a live node: one check for the five.
        ``born`` is its creation serial (:meth:`node_born`)."""
        self._alive(node_id)
        return (self._ns[node_id], self._key[node_id], int(self._size[node_id]),  # type: ignore[return-value]
                int(self._tokens[node_id]), int(self._born[node_id]))

    def nodes_fields(self, node_ids: Sequence[int]) -> list[tuple[int, str, str, int, int, int]]:
        """``(node_id, namespace, key, size_bytes, tokens, born)`` of each live node, in one call (a
        read pins a run of hundreds of chunks); InputError for the first node that is not in the
        tree."""
        key, ns, size, tokens, born = self._key, self._ns, self._size, self._tokens, self._born
        n_slots = len(key)
        out = []
        for n in node_ids:
            k = key[n] if 0 <= n < n_slots else None
            if k is None:
                self._alive(n)  # raises
            out.append((n, ns[n], k, int(size[n]), int(tokens[n]), int(born[n])))
        return out  # type: ignore[return-value]

    def node_born(self, node_id: int) -> int:
        """The node's creation serial: unique over the tree's life (a node id is reused after a
        removal; this is not), so ``(node_id, born)`` names one node for good."""
        self._alive(node_id)
        return int(self._born[node_id])

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
            return MatchResult(self, [], idx or {}, 0)
        # Compiled, a list is indexed natively and idx.get is the dict primitive; a Sequence takes
        # the generic item protocol, and a bound idx.get kept in a local was a Python-level call.
        # (Another sequence is copied: O(n) pointer copies, against the O(log n) probes below.)
        ks: list[str] = keys if isinstance(keys, list) else list(keys)
        first = idx.get(ks[0])
        if first is None:
            return MatchResult(self, ks, idx, 0)
        n = len(ks)
        last = idx.get(ks[n - 1])
        if last is not None:
            hit = n
        else:
            lo, hi = 1, n - 1  # keys[lo-1] present (its node is `last`), keys[hi] absent
            last = first
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                nid = idx.get(ks[mid - 1])
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
            or (hit > 1 and (parent[last] < 0 or self._key[parent[last]] != ks[hit - 2]))
        ):
            # Not one chain (or a chain with a hole): fall back to a checked walk.
            hit, last = self._walk(idx, keys)
        if touch:
            self._now = now = self._now + 1
            mask = self._mask[last]
            if mask == 1:  # held by the first tier only: one policy hears it
                self._on_access(0, last, now)
            else:
                self._touch(last)
                if not mask & 1:  # a faster tier may hold the path above it: that copy was used too
                    self._touch_upper(last, mask)
        return MatchResult(self, ks, idx, hit, last)

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
        parent, tmask = self._parent, self._mask
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
                        self._on_access(i, n, now)
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
                    self._on_access(i, n, now)
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
        # Said here for both builds (the compiled one raised a bare TypeError at the call, the
        # Python one made a namespace None, or looked an int parent_key up and found nothing).
        if not isinstance(namespace, str):
            raise InputError(f"namespace={namespace!r:.60} must be a str (a Namespace's digest)")
        if parent_key is not None and not isinstance(parent_key, str):
            raise InputError(f"parent_key={parent_key!r:.60} must be a chunk key (a str) or None")
        if not keys:
            return InsertResult()
        ks: list[str] = keys if isinstance(keys, list) else list(keys)  # indexed natively (see match)
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
        m = self.match(namespace, ks, False)  # touch=False, by position
        hit = m.hit_chunks
        last = m._last  # match sets it whenever hit_chunks > 0 (last_node_id without the call)
        # Without parent_key the caller does not say where the run starts (SGLang without prefix
        # keys hands over mid-chain runs): present keys keep the parent they have.
        if hit and parent_key is not None and self._parent[idx[ks[0]]] != parent:
            if self._parent[idx[ks[0]]] != _NO_PARENT:
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
            rest = ks[hit:]
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
            leaf_hit: int = last  # type: ignore[assignment]  # set when hit_chunks > 0
            # (an int | None index would box the whole vec column for a generic item read)
            parent, depth = leaf_hit, self._depth[leaf_hit]
        # the claimed keys (the slice made above), or none: nothing is new when claimed is None
        new = self._create(namespace, idx, rest if claimed is not None else (), parent, depth, t,
                           tokens_per_chunk, bytes_per_chunk, claimed)
        if self._awaiting:  # some run awaits a parent key: is it one of these?
            self._join_awaiting(namespace, new)
        leaf: int = new[-1] if new else last  # type: ignore[assignment]
        if self._mask[leaf] == 1:  # held by the first tier only (as in match): one policy hears it
            self._on_access(0, leaf, self._now)
        else:
            self._touch(leaf)
        return InsertResult(m, tuple(new))

    # ------------------------------------------------------------------ pins

    def pin(self, node_ids: Iterable[int], owner: str, lease_s: object = 60.0) -> None:
        """Protect nodes from eviction for ``owner`` until unpinned or ``lease_s`` seconds pass
        (so a crashed owner cannot leak pins). Pinning again renews the lease."""
        ids = list(node_ids)
        # Checked as objects, before a compiled build's typed loop would take a bool for an int.
        for o in cast("list[object]", ids):
            if type(o) is not int:
                raise InputError(f"node id {o!r} must be an int (a node id the tree returned), "
                                 f"not {type(o).__name__}")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)):
            raise PinError(f"lease_s={lease_s!r:.40} must be a number of seconds")
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


def _options_for(
    policy_options: Mapping[str, object] | Mapping[str, Mapping[str, object]] | None,
    tier: str,
    tiers: tuple[str, ...],
) -> dict[str, object]:
    if policy_options is None:
        return {}
    if not isinstance(policy_options, Mapping):
        raise ConfigError(f"policy_options={policy_options!r:.80} must be a mapping of option name to value "
                          "(or of tier name to such a mapping)")
    if not policy_options:
        return {}
    per_tier = all(isinstance(v, Mapping) for v in policy_options.values())
    if per_tier and any(k in tiers for k in policy_options):
        stray = [k for k in policy_options if k not in tiers]
        if stray:  # else read as one option set, and the error named a tier as an unknown option
            raise ConfigError(f"policy_options names tiers {stray!r} this tree does not have; its tiers are "
                              f"{list(tiers)}")
        return dict(policy_options.get(tier, {}))  # type: ignore[arg-type,call-overload]
    return dict(policy_options)
