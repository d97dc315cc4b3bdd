"""Adoption: chunks a persistent or shared tier holds that the store's tree never recorded.

A disk tier reopened on the same directory (a restart; it rebuilds its own index by scanning), a disk
directory shared with other processes (``shared=True``) or a Redis server shared by several stores
holds chunks this store's tree does not know, so a tree-only lookup would miss them. When the tree's
match ends early, :func:`adopt` asks those tiers about the next keys and inserts the leading run
found into the tree as resident where it is held; the normal read path then serves it (checksums
verified; a failed read clears the residency and stops the run, as for any chunk). Memory tiers are
process-local and never probed.

Rules (what keeps the store's invariants):

* the probe (tier I/O) runs outside the lock; the insert runs under it and only if the tree's match
  still ends where it ended before the probe (else nothing is adopted this time);
* the run continues the tree's hit, or starts at ``parent_key`` when the tree holds it, else at the
  namespace root, awaiting ``parent_key`` (the insert that creates it later grafts the run under it:
  ``RadixTree.insert(..., root_if_missing=True)``): the tree stays prefix-closed. It stops before a
  key the tree already holds under another prefix, and (per tier) before a key whose delete from
  that tier is in flight;
* the longest run wins, the fastest tier on a tie; every other probed tier holding a prefix of it
  gains that residency too (reads then use the fastest);
* a bounded tier adopts only what fits its capacity in the store's books (``used + charges <=
  capacity``), so reservations and eviction keep their meaning. When it lacks room, the adoption
  first makes room as a put does: it reserves the chunks' charges through the normal eviction path
  (:meth:`TierStack.reserve`: the tier's own policy order, demotion to the next tier, or a drop from
  the last one, bytes deleted after the tree forgets them), with the chunk it hangs from pinned so
  the eviction cannot cut the chain it continues. Without this a store that only ever adopts (a
  reader sharing a tier with a writer: SGLang's MLA non-writer ranks) fills its books once and then
  adopts nothing, forever, while the entries it holds go stale as the writer evicts them;
* a tier that counts its chunks has its "held before the store opened it" allowance
  (``store._foreign_chunks``) reduced by what it adopted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from radixkv.errors import InputError
from radixkv.intents import AdoptionWatch
from radixkv.keys import Namespace
from radixkv.store_checks import register_namespace
from radixkv.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from radixkv.store import HierarchicalStore
    from radixkv.transfer import ChunkRef, TierStack

__all__ = ["adopt", "probe"]

logger = logging.getLogger("radixkv.store")


def probe(stack: TierStack, nsd: str, keys: Sequence[str]) -> list[int]:
    """Leading run of ``keys`` each tier holds (0 for memory tiers and tiers that fail to answer)."""
    runs = [0] * len(stack.tiers)
    if not keys:
        return runs
    for t, tier in enumerate(stack.tiers):
        if isinstance(tier, MemoryTier):
            continue  # process-local: it cannot hold anything this store's tree does not know
        try:
            runs[t] = max(0, min(len(keys), int(tier.contains_many(nsd, keys))))
        except Exception as e:  # a tier that cannot answer is a miss (faults never raise)
            logger.debug("radixkv: probe of tier %s failed: %s", stack.names[t], e)
    return runs


def adopt(
    store: HierarchicalStore,
    ns: Namespace,
    nsd: str,
    keys: Sequence[str],
    parent_key: str | None,
    chunk_bytes: int | None,
) -> tuple[int, int]:
    """Adopt the chunks after the tree's hit on ``keys`` that a non-memory tier holds (see the
    module docstring). ``chunk_bytes`` sizes the chunks of a namespace this store has no size for
    yet (it must agree with the known size otherwise); without any size nothing is adopted. Returns
    ``(hit, adopted)``: the leading run of ``keys`` the tree holds now, chunks added to the tree.

    A run may continue in another tier (a chain's head demoted to Redis, its tail on disk): while a
    round adopts something and keys remain, the next round probes from the new hit (at most one
    round per tier, plus the one that finds nothing)."""
    hit, total = 0, 0
    for _ in range(len(store._stack.tiers)):
        hit, got = _adopt_once(store, ns, nsd, keys, parent_key, chunk_bytes)
        total += got
        if not got or hit >= len(keys):
            break
    return hit, total


def _adopt_once(
    store: HierarchicalStore,
    ns: Namespace,
    nsd: str,
    keys: Sequence[str],
    parent_key: str | None,
    chunk_bytes: int | None,
) -> tuple[int, int]:
    s = store._stack
    size = store._ns_bytes.get(nsd)
    if chunk_bytes is not None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise InputError(f"chunk_bytes={chunk_bytes!r} must be a positive int (bytes per chunk)")
        if size is not None and chunk_bytes != size:
            raise InputError(
                f"chunk_bytes={chunk_bytes} but namespace {ns} stores {size}-byte chunks; "
                "every chunk of a namespace has one size (fixed by its first put)"
            )
    with s.cond:
        hit = s.tree.match(nsd, keys, touch=False).hit_chunks
        if (
            hit >= len(keys)
            or (size is None and chunk_bytes is None)  # nothing sizes this namespace's chunks yet
            or all(isinstance(t, MemoryTier) for t in s.tiers)  # nothing to probe
            or s.clearing_locked(nsd)  # a clear is deleting what a probe would see
        ):
            return hit, 0
        watch = s.watch_locked(nsd)  # deletes from now on spoil what the probe sees
        clears = (s.clears[None], s.clears[nsd])  # a clear from now on spoils it too
    owner = s.owner("adopt")
    room: dict[int, int] = {}  # tier -> bytes reserved for this adoption (released before the insert)
    pinned: list[ChunkRef] = []
    try:
        rest = list(keys[hit:])
        runs = probe(s, nsd, rest)
        if size is None and chunk_bytes is not None:
            # A tier that knows another size for the namespace's chunks (a disk's files, read by its
            # startup scan) holds nothing of this size: adopting them at the caller's size (a get
            # with wrong-size buffers) fixed that size for the namespace, the reads failed, and the
            # valid files were deleted (found by an audit). A miss instead, nothing changed.
            for t, tier in enumerate(s.tiers):
                known = getattr(tier, "chunk_bytes_of", None)
                if runs[t] and known is not None and known(nsd) not in (None, chunk_bytes):
                    runs[t] = 0
        if any(runs) and size is None:  # chunks of a namespace new to this store: fix its size
            assert chunk_bytes is not None
            size = register_namespace(store, nsd, chunk_bytes, "chunk_bytes")
        if any(runs) and size is not None:
            pinned = _make_room(store, nsd, keys, hit, runs, parent_key, size, owner, room)
        with s.cond:
            s.unwatch_locked(watch)
            # The reservations only held the evicted room against other writers until now: the
            # insert below (same lock hold) counts it as free again and fills it.
            _release_locked(s, room, pinned, owner)
            overtaken = (s.clears[None], s.clears[nsd]) != clears
            if not any(runs) or watch.all_gone or size is None or overtaken:
                return s.tree.match(nsd, keys, touch=False).hit_chunks, 0
            return _insert_locked(
                store, nsd, keys, hit, runs, watch, parent_key, size, ns.chunk_tokens
            )
    except BaseException:
        with s.cond:
            if watch in s._watches:
                s.unwatch_locked(watch)
            _release_locked(s, room, pinned, owner)
        raise


def _make_room(
    store: HierarchicalStore,
    nsd: str,
    keys: Sequence[str],
    hit: int,
    runs: list[int],
    parent_key: str | None,
    chunk_bytes: int,
    owner: str,
    room: dict[int, int],
) -> list[ChunkRef]:
    """Reserve room in each bounded tier the probe found chunks in, for as many of them as the
    insert could take (the keys the tree lacks), evicting through :meth:`TierStack.reserve` as a put
    does; fills ``room`` (tier -> reserved bytes, to release) and returns the pinned refs (to unpin).

    The chunk the run hangs from (the tree's last hit, else ``parent_key``) is pinned first: making
    room must not evict it, or the insert would find the chain changed and adopt nothing."""
    s, tree = store._stack, store._stack.tree
    need: dict[int, int] = {}
    with s.cond:
        anchor = keys[hit - 1] if hit else parent_key
        node = tree.lookup(nsd, anchor) if anchor is not None else None
        pinned = s.pin_locked([s.ref_locked(node)], owner) if node is not None else []
        free = 0
        while free < len(keys) - hit and tree.lookup(nsd, keys[hit + free]) is None:
            free += 1
        for t, run in enumerate(runs):
            k = min(run, free)
            cap = s.capacity(t)
            if k and cap and s.used_locked(t) + k * s.charge(t, chunk_bytes) > cap:
                need[t] = k
    try:
        for t, k in need.items():
            charge = s.charge(t, chunk_bytes)
            # Adoption runs in the caller's thread (lookup/get/prefetch), never on a background
            # worker, so it may wait (bounded) for a background copy (a promotion of the very
            # chunks it would evict) instead of adopting nothing.
            granted = s.reserve(t, [charge] * k, wait_for_transfers=True)
            if granted:
                room[t] = granted * charge
    except BaseException:
        with s.cond:
            _release_locked(s, room, pinned, owner)
        raise
    return pinned


def _release_locked(s: TierStack, room: dict[int, int], pinned: list[ChunkRef], owner: str) -> None:
    """Give back what :func:`_make_room` holds (idempotent: it empties ``room`` and ``pinned``)."""
    for t, nbytes in room.items():
        s.release_locked(t, nbytes)
    room.clear()
    if pinned:
        s.unpin_locked(pinned, owner)
        pinned.clear()


def _insert_locked(
    store: HierarchicalStore,
    nsd: str,
    keys: Sequence[str],
    hit: int,
    runs: list[int],
    watch: AdoptionWatch,
    parent_key: str | None,
    chunk_bytes: int,
    chunk_tokens: int,
) -> tuple[int, int]:
    s, tree = store._stack, store._stack.tree
    now = tree.match(nsd, keys, touch=False).hit_chunks
    if now != hit or s.clearing_locked(nsd):  # the tree changed since the probe, or a clear of
        return now, 0  # the namespace is deleting what the probe saw: adopt nothing this time
    rest = keys[hit:]
    # A parent_key the tree lacks: the run hangs at the namespace root, awaiting it
    parent = keys[hit - 1] if hit else parent_key
    free = 0  # keys the tree lacks entirely (a key held under another prefix ends the run)
    while free < len(rest) and tree.lookup(nsd, rest[free]) is None:
        free += 1
    longest = 0
    for t in sorted((t for t in range(len(runs)) if runs[t]), key=lambda t: (-runs[t], t)):
        k, limit = 0, min(runs[t], free)
        while k < limit and not _busy(s, watch, t, nsd, rest[k]):
            k += 1
        if s.capacity(t):  # bounded: only what fits the store's books (reservations keep meaning)
            room = s.capacity(t) - s.used_locked(t)
            k = min(k, max(0, room) // s.charge(t, chunk_bytes))
        if not k:
            continue
        try:
            r = tree.insert(
                nsd, list(rest[:k]), tier=s.names[t], chunk_tokens=chunk_tokens,
                size_bytes=chunk_bytes, parent_key=parent, root_if_missing=not hit,
            )
        except InputError as e:  # keys that contradict the tree: adopt nothing from this tier
            logger.debug("radixkv: adoption from tier %s refused: %s", s.names[t], e)
            continue
        got = len(r.node_ids)
        if got:
            store._foreign_chunks[t] = max(0, store._foreign_chunks[t] - got)
            store.metrics.adopted(s.names[t], got)
        longest = max(longest, got)
    return hit + longest, longest


def _busy(s: TierStack, watch: AdoptionWatch, t: int, nsd: str, key: str) -> bool:
    """Bytes of ``key`` in tier ``t`` that may be going: deleted since the probe began, a delete in
    flight, waiting at its copy barrier or one a fault interrupted (still to retry, which a later
    write of the tier or a close runs: adopted, a deleted chunk's bytes were served once the server
    answered again), or a write in flight (its writer decides whether they stay)."""
    ident = (t, nsd, key)
    return ((t, key) in watch.spoiled or ident in s._deleting or ident in s._writing
            or ident in s._delete_barrier or (nsd, key) in s._retry_deletes[t])
