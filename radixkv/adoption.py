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
  namespace root: the tree stays prefix-closed. It stops before a key the tree already holds under
  another prefix, and (per tier) before a key whose delete from that tier is in flight;
* the longest run wins, the fastest tier on a tie; every other probed tier holding a prefix of it
  gains that residency too (reads then use the fastest);
* a bounded tier adopts only what fits its capacity in the store's books (``used + charges <=
  capacity``), so reservations and eviction keep their meaning; a tier that counts its chunks has its
  "held before the store opened it" allowance (``store._foreign_chunks``) reduced by what it adopted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from radixkv.errors import InputError
from radixkv.keys import Namespace
from radixkv.store_checks import register_namespace
from radixkv.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from radixkv.store import HierarchicalStore
    from radixkv.transfer import TierStack

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
    ``(hit, adopted)``: the leading run of ``keys`` the tree holds now, chunks added to the tree."""
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
    if size is None and chunk_bytes is None:
        return hit, 0  # nothing sizes this namespace's chunks yet: the tree alone answers
    if hit >= len(keys):
        return hit, 0
    rest = list(keys[hit:])
    runs = probe(s, nsd, rest)
    if not any(runs):
        return hit, 0
    if size is None:  # found chunks of a namespace new to this store: fix its chunk size now
        size = register_namespace(store, nsd, chunk_bytes, "chunk_bytes")  # type: ignore[arg-type]
    chunk_bytes = size
    chunk_tokens = ns.chunk_tokens
    order = sorted((t for t in range(len(runs)) if runs[t]), key=lambda t: (-runs[t], t))
    with s.cond:
        tree = s.tree
        if tree.match(nsd, keys, touch=False).hit_chunks != hit:
            return tree.match(nsd, keys, touch=False).hit_chunks, 0
        if hit:
            parent = keys[hit - 1]
        else:
            parent = parent_key if parent_key is not None and tree.lookup(nsd, parent_key) is not None else None
        free = 0  # keys not in the tree at all (a key held under another prefix ends the run)
        while free < len(rest) and tree.lookup(nsd, rest[free]) is None:
            free += 1
        longest = 0
        for t in order:
            k = min(runs[t], free)
            j = 0
            while j < k and (t, nsd, rest[j]) not in s._deleting:
                j += 1
            k = j
            cap = s.capacity(t)
            if cap:
                charge = s.charge(t, chunk_bytes)
                k = min(k, max(0, cap - s.used_locked(t)) // charge)
            if not k:
                continue
            try:
                r = tree.insert(
                    nsd,
                    rest[:k],
                    tier=s.names[t],
                    chunk_tokens=chunk_tokens,
                    size_bytes=chunk_bytes,
                    parent_key=parent,
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
