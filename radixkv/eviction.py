"""Room-making in one tier: eviction in exact policy order, with demotion to the next tier.

``reserve(stack, t, charges)`` is the only entry point (:meth:`TierStack.reserve` delegates here).
It evicts from tier ``t`` one candidate at a time, in the order of the tier's policy (the tree's
``evict_candidates`` never offers an interior chunk of the tier, so each eviction may expose its
parent as the next victim). A candidate that needs no copy (the next tier already holds it, or ``t``
is the last tier and it can be dropped without orphaning anything) leaves the tree at once under the
lock; its bytes stay counted as reserved until they are deleted outside the lock. A candidate the
next tier lacks is pinned, copied down (which may make room there in turn: the recursion goes only
downwards, so threads never wait on each other in a cycle), then cleared and deleted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from radixkv.transfer import ChunkRef, TierStack

__all__ = ["reserve"]

logger = logging.getLogger(__name__)

_ROOM_WAIT_S = 2.0  # how long a writer waits for other threads' evictions before giving up


def reserve(
    stack: TierStack, t: int, charges: Sequence[int], wait_for_transfers: bool = False
) -> int:
    """Reserve room in tier ``t`` for the leading chunks of ``charges`` (bytes each, frame overhead
    included), evicting as needed. Returns how many leading chunks got room; the caller releases
    ``sum(charges[:k])`` with :meth:`release_locked` once those chunks are resident (or failed).

    With ``wait_for_transfers`` (foreground writers only, never background workers, so nothing
    waits on itself) a writer that finds every candidate pinned by a background copy waits up to
    a bound for those copies to finish instead of giving up at once."""
    cap = stack.capacity(t)
    k = len(charges)
    if k == 0:
        return 0
    deadline = time.monotonic() + _ROOM_WAIT_S
    owner = stack.owner("evict")
    kept: list[ChunkRef] = []  # victims that could not leave: pinned by `owner` until we return
    progress = False  # a chunk left tier t since the victims in `kept` were kept
    try:
        while True:
            with stack.cond:
                need = sum(charges[:k])
                used = stack.used_locked(t)
                if cap == 0 or used + need <= cap:
                    stack.reserved[t] += need
                    return k
                deficit = used + need - cap - stack.claimed[t]
                victim, claim, freed, pending, entries = None, 0, 0, 0, []
                if deficit > 0:
                    victim, claim, freed, pending, entries = _claim_locked(stack, t, deficit, owner)
                if victim is None and not freed and kept and progress and time.monotonic() < deadline:
                    # Chunks left this tier since these victims were kept: what kept them may be
                    # gone (the descendants a failed demotion would have orphaned, dropped since:
                    # a leaf whose demotion fails is dropped), or the next tier may have room now.
                    # Offer them again. Before, each victim was tried once: a put into memory over a
                    # full disk stored 2 chunks of 3 while a kept chunk had become such a leaf.
                    # Each new round needs a chunk to have left the tier (and the deadline bounds it).
                    stack.unpin_locked(kept, owner)
                    kept, progress = [], False
                    continue
                if victim is None and not freed:
                    busy = stack.claimed[t] > 0 or (wait_for_transfers and stack.transfers_inflight > 0)
                    if busy and time.monotonic() < deadline:
                        stack.cond.wait(0.05)  # another thread's eviction or copy will free room
                        continue
                    return _shrink_locked(stack, t, charges, k, used, cap)
            if entries:
                stack.delete_entries(entries)
            if pending:
                # Released even when no entry was left to delete (mark_deleting_locked leaves out a
                # key another thread is writing): the claim counted its charge either way.
                with stack.cond:
                    stack.release_locked(t, pending)
            left = _evict(stack, t, [victim], owner, claim) if victim is not None else 0
            progress = progress or bool(kept and (freed or left))
            if victim is not None and left == 0:
                with stack.cond:  # the victim could not leave (its demotion failed)
                    if stack.keep_anchor_locked(victim.node_id):
                        continue  # kept, and pinned, for a put hanging from it: try the next candidate
                    if stack.mask_locked(victim) & (1 << t):
                        # It stays (dropping it would orphan its descendants): skip it, as the
                        # anchor above, and try the next candidate in policy order. Before, the
                        # writer stopped here with what fitted, while later candidates (leaves whose
                        # failed demotion drops them, chunks the next tier holds) could leave: a put
                        # into a memory tier over a disk full of chains' heads stored nothing.
                        stack.tree.pin([victim.node_id], owner, stack.lease_s)
                        kept.append(victim)
    finally:
        if kept:
            with stack.cond:
                stack.unpin_locked(kept, owner)
                stack.cond.notify_all()


def _shrink_locked(
    stack: TierStack, t: int, charges: Sequence[int], k: int, used: int, cap: int
) -> int:
    while k > 0 and used + sum(charges[:k]) > cap:
        k -= 1
    stack.reserved[t] += sum(charges[:k])
    return k


def _claim_locked(
    stack: TierStack, t: int, deficit: int, owner: str
) -> tuple[ChunkRef | None, int, int, int, list[tuple[int, str, str]]]:
    """Free room in exact policy order, one candidate at a time (each eviction may expose a
    parent as the next victim). Chunks that need no copy (the next tier holds them, or ``t`` is
    the last tier) leave the tree at once; their bytes stay counted as reserved until deleted.
    Stops at the first chunk that must be demoted: it is pinned and returned as the victim.
    Returns (victim, its charge, chunks freed now, bytes pending deletion, bytes to delete)."""
    name, tree = stack.names[t], stack.tree
    next_bit = 1 << (t + 1) if t < stack.last else 0
    freed = pending = 0
    entries: list[tuple[int, str, str]] = []
    released = dropped = 0
    try:
        while deficit > 0:
            ids = tree.evict_candidates(name, 1, drop=(t == stack.last))
            if not ids:
                return None, 0, freed, pending, entries
            # A put's chain hangs from it and only this tier holds it: dropping it would leave the
            # chain nothing to hang from. Kept by a pin (the policy offers the next candidate), which
            # blocks it in every tier: so only then, a copy above may still leave for free (a put
            # under a chunk memory and disk both held stored less than it could when the disk's
            # room-making pinned it, and memory could not release its copy).
            if not next_bit and tree.node_tier_mask(ids[0]) == 1 << t and stack.keep_anchor_locked(ids[0]):
                continue
            ref = stack.ref_locked(ids[0])
            charge = stack.charge(t, ref.size_bytes)
            if next_bit and not tree.node_tier_mask(ref.node_id) & next_bit:
                tree.pin([ref.node_id], owner, stack.lease_s)
                stack.claimed[t] += charge
                return ref, charge, freed, pending, entries
            entries += stack.evicted_entries_locked(
                [(t, ref.namespace, ref.key)] + stack.clear_locked([ref.node_id], t)
            )
            stack.reserved[t] += charge  # still on the medium until deleted outside the lock
            pending += charge
            deficit -= charge
            freed += 1
            released += bool(next_bit)
            dropped += not next_bit
        return None, 0, freed, pending, entries
    finally:
        stack.metrics.evictions(name, "release", released)
        stack.metrics.evictions(name, "drop", dropped)


def _evict(stack: TierStack, t: int, victims: list[ChunkRef], owner: str, claim: int) -> int:
    """Demote (or drop, from the last tier) the claimed victims; returns how many left tier t."""
    name = stack.names[t]
    demoted: set[int] = set()
    below: set[int] = set()
    pending = 0
    try:
        if t < stack.last:
            with stack.cond:
                move = [v for v in victims if not stack.mask_locked(v) & (1 << (t + 1))]
                below = {v.node_id for v in victims if stack.mask_locked(v) & (1 << (t + 1))}
            if move:
                try:
                    ok = stack.copy(t, t + 1, move)
                except Exception as e:  # a tier must fail a put, not raise; if one does, the
                    # demotion failed: the caller's put goes on and the victims' pins are released
                    logger.warning("radixkv: demoting %d chunks from tier %r failed: %s: %s",
                                   len(move), name, type(e).__name__, e)
                    ok = [False] * len(move)
                demoted = {v.node_id for v, o in zip(move, ok) if o}
        with stack.cond:
            out: list[ChunkRef] = []
            for v in victims:
                mask = stack.mask_locked(v)
                if not mask & (1 << t):
                    continue
                failed_demotion = (
                    t < stack.last and v.node_id not in demoted and mask & (1 << (t + 1)) == 0
                )
                if failed_demotion and mask == 1 << t and (
                    stack.tree.node_children_alive(v.node_id) or stack.keep_anchor_locked(v.node_id)
                ):
                    continue  # dropping it would orphan its descendants (or a put's chain): keep it
                out.append(v)
            entries = stack.clear_locked([v.node_id for v in out], t)
            entries = stack.evicted_entries_locked([(t, v.namespace, v.key) for v in out] + entries)
            # Their bytes stay on the medium until deleted outside the lock: keep them counted (as
            # _claim_locked does), or a concurrent writer gets room the tier lacks and the tier
            # evicts on its own, out of the tree's leaf-first order.
            pending = sum(stack.charge(t, v.size_bytes) for v in out)
            stack.reserved[t] += pending
            stack.unpin_locked(victims, owner)
        stack.delete_entries(entries)
        n_demoted = sum(v.node_id in demoted for v in out)
        n_below = sum(v.node_id in below for v in out)
        stack.metrics.evictions(name, "demote", n_demoted)
        stack.metrics.evictions(name, "release", n_below)  # the next tier already held it
        stack.metrics.evictions(name, "drop", len(out) - n_demoted - n_below)
        return len(out)
    finally:
        with stack.cond:
            stack.claimed[t] -= claim
            stack.reserved[t] -= pending
            stack.cond.notify_all()
