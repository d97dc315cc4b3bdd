"""Moving chunks between tiers: room-making (eviction with demotion), copies, reads with fallback.

:class:`TierStack` is the store's engine room. It owns the tiers, the tree and the one lock around
tree calls (a :class:`threading.Condition`); all tier I/O runs outside that lock. The public API lives
in :mod:`radixkv.store`.

Capacity protocol (per bounded tier ``t``)::

    used(t) = tree bytes resident in t + per-chunk frame overhead + reserved(t)   (in-flight writes)

A writer first *reserves* room (evicting while ``used + need > capacity``), then writes, then makes
the chunks resident in the tree and releases the reservation in one locked step, so the bytes a tier
holds never exceed ``used(t) <= capacity``. Eviction claims victims by pinning them (so no other
thread claims or reads... them mid-transfer), demotes those the next tier lacks, then clears their
residency in the tree *before* deleting their bytes: a reader that matched just before sees a miss
in this tier and falls back to the next one, which already holds the chunk.

A tier that cannot deliver a chunk the tree says it holds (miss, checksum failure, server down)
loses that residency in the tree; descendants that no tier can reach any more are dropped as
orphans and their bytes deleted everywhere. Never wrong bytes: a run stops at the first chunk no
tier could deliver.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from radixkv.errors import CapacityError, InputError, PinError
from radixkv.metrics import StoreMetrics
from radixkv.tiers.framing import HEADER_BYTES
from radixkv.tree import RadixTree

__all__ = ["TierStack", "ChunkRef"]

_UNBOUNDED_BYTES = 1 << 62
_ROOM_WAIT_S = 2.0  # how long a writer waits for other threads' evictions before giving up
_NS_DIGEST_CHARS = 32


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A tree node captured under the lock (its identity survives the node's removal)."""

    node_id: int
    namespace: str
    key: str
    size_bytes: int
    tokens: int


class TierStack:
    """Tiers fastest first + the tree + the lock. Thread-safe; see the module docstring."""

    def __init__(self, tiers: Sequence[Any], tree: RadixTree, metrics: StoreMetrics, lease_s: float) -> None:
        self.tiers = list(tiers)
        self.names = tuple(t.name for t in self.tiers)
        self.tree = tree
        self.metrics = metrics
        self.lease_s = lease_s
        self.cond = threading.Condition(threading.Lock())
        n = len(self.tiers)
        self.reserved = [0] * n
        self.claimed = [0] * n
        self.transfers_inflight = 0  # background copies holding pins (a writer may wait for them)
        # (tier, namespace, key) with a put or a delete in flight on the medium. A delete skips keys
        # being written (the writer will make them resident again) and a writer waits for deletes of
        # its keys, so the tree never says "resident" for bytes a racing delete removed.
        self._writing: dict[tuple[int, str, str], int] = defaultdict(int)
        self._deleting: dict[tuple[int, str, str], int] = defaultdict(int)
        self.max_key_chars = 64
        # Tiers that persist frames count header + identity per chunk against their capacity.
        self._framed = [not hasattr(t, "lease") for t in self.tiers]
        self._owner_seq = itertools.count()

    # ------------------------------------------------------------------ small helpers
    @property
    def last(self) -> int:
        return len(self.tiers) - 1

    def owner(self, kind: str) -> str:
        return f"{kind}-{next(self._owner_seq)}"

    def capacity(self, t: int) -> int:
        cap = self.tiers[t].capacity_bytes
        return 0 if not cap or cap >= _UNBOUNDED_BYTES else cap

    def overhead(self, t: int) -> int:
        return HEADER_BYTES + _NS_DIGEST_CHARS + self.max_key_chars if self._framed[t] else 0

    def charge(self, t: int, size_bytes: int) -> int:
        return size_bytes + self.overhead(t)

    def used_locked(self, t: int) -> int:
        name = self.names[t]
        return self.tree.tier_bytes(name) + self.tree.tier_chunks(name) * self.overhead(t) + self.reserved[t]

    def ref_locked(self, node_id: int) -> ChunkRef:
        tr = self.tree
        return ChunkRef(node_id, tr.node_namespace(node_id), tr.node_key(node_id),
                        tr.node_size_bytes(node_id), tr.node_tokens(node_id))

    def alive_locked(self, ref: ChunkRef) -> bool:
        return self.tree.lookup(ref.namespace, ref.key) == ref.node_id

    def mask_locked(self, ref: ChunkRef) -> int:
        return self.tree.node_tier_mask(ref.node_id) if self.alive_locked(ref) else 0

    def pin_locked(self, refs: Sequence[ChunkRef], owner: str) -> list[ChunkRef]:
        live = [r for r in refs if self.alive_locked(r)]
        if live:
            self.tree.pin([r.node_id for r in live], owner, self.lease_s)
        return live

    def unpin_locked(self, refs: Sequence[ChunkRef], owner: str) -> None:
        """Release ``owner``'s pins on the refs still alive (a removed node lost its pins already)."""
        live = [r.node_id for r in refs if self.alive_locked(r)]
        try:
            self.tree.unpin(live, owner)
        except PinError:  # an expired lease or a removed-and-reused id: release one by one
            for n in live:
                try:
                    self.tree.unpin([n], owner)
                except PinError:
                    pass

    # ------------------------------------------------------------------ guarded tier I/O
    def tier_put(self, t: int, ns: str, keys: Sequence[str], payloads: Sequence[torch.Tensor]) -> list[bool]:
        if not keys:
            return []
        with self.metrics.timed("tier_put", self.names[t]):
            try:
                ok = self.tiers[t].put_many(ns, keys, payloads)
            except (InputError, CapacityError):
                raise
            except Exception:  # a tier must not raise for faults; if one does, it is a failed put
                ok = [False] * len(keys)
        n_ok = sum(ok)
        self.metrics.written(self.names[t], n_ok, sum(p.numel() for p, o in zip(payloads, ok) if o))
        self.metrics.write_failures(self.names[t], len(keys) - n_ok)
        self._absorb_tier_evictions(t)
        return ok

    def tier_get(self, t: int, ns: str, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[bool]:
        if not keys:
            return []
        with self.metrics.timed("tier_get", self.names[t]):
            try:
                return self.tiers[t].get_many(ns, keys, buffers)
            except (InputError, CapacityError):
                raise
            except Exception:
                return [False] * len(keys)

    def tier_delete(self, t: int, ns: str, keys: Sequence[str]) -> None:
        if keys:
            try:
                self.tiers[t].delete_many(ns, keys)
            except Exception:  # best effort: a dead server keeps nothing we would serve (tree forgot it)
                pass

    def begin_write_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        """Announce puts of ``keys`` into tier ``t`` (waits for deletes of them in flight)."""
        idents = [(t, ns, k) for k in keys]
        while any(i in self._deleting for i in idents):
            self.cond.wait(0.05)
        for i in idents:
            self._writing[i] += 1

    def end_write_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        for k in keys:
            i = (t, ns, k)
            self._writing[i] -= 1
            if not self._writing[i]:
                del self._writing[i]
        self.cond.notify_all()

    def mark_deleting_locked(self, entries: Sequence[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """The entries to delete from their tiers (those not being rewritten right now), marked as
        in flight; pass the result to :meth:`delete_entries` after leaving the lock."""
        out = [e for e in dict.fromkeys(entries) if e not in self._writing]
        for e in out:
            self._deleting[e] += 1
        return out

    def delete_entries(self, entries: Sequence[tuple[int, str, str]]) -> None:
        """Delete marked ``(tier, namespace, key)`` bytes, batched per tier and namespace."""
        groups: dict[tuple[int, str], list[str]] = defaultdict(list)
        for t, ns, key in entries:
            groups[(t, ns)].append(key)
        try:
            for (t, ns), keys in groups.items():
                self.tier_delete(t, ns, keys)
        finally:
            if entries:
                with self.cond:
                    for e in entries:
                        self._deleting[e] -= 1
                        if not self._deleting[e]:
                            del self._deleting[e]
                    self.cond.notify_all()

    def _absorb_tier_evictions(self, t: int) -> None:
        """A tier that evicted on its own (disk over budget) tells us what; forget it in the tree."""
        drain = getattr(self.tiers[t], "drain_evicted", None)
        if drain is None:
            return
        gone = drain()
        if gone:
            with self.cond:
                ids = [n for ns, key in gone if (n := self.tree.lookup(ns, key)) is not None]
                entries = self.mark_deleting_locked(self.clear_locked(ids, t))
            self.delete_entries(entries)

    # ------------------------------------------------------------------ residency changes
    def clear_locked(self, node_ids: Sequence[int], t: int) -> list[tuple[int, str, str]]:
        """Clear residency in tier ``t``; returns the bytes to delete for chunks dropped as orphans
        (their data in every tier, now unreachable). Caller holds the lock."""
        tree, bit = self.tree, 1 << t
        ids = [n for n in node_ids if tree.node_tier_mask(n) & bit]
        doomed = {n for n in ids if tree.node_tier_mask(n) == bit and tree.node_children_alive(n)}
        entries: list[tuple[int, str, str]] = []
        if doomed:
            for d in _descendants(tree, doomed):
                m, ns, key = tree.node_tier_mask(d), tree.node_namespace(d), tree.node_key(d)
                entries.extend((i, ns, key) for i in range(len(self.tiers)) if m >> i & 1)
        result = tree.clear_resident(ids, self.names[t])
        self.metrics.orphans(len(result.orphaned_node_ids))
        return entries

    # ------------------------------------------------------------------ room-making
    def reserve(self, t: int, charges: Sequence[int], wait_for_transfers: bool = False) -> int:
        """Reserve room in tier ``t`` for the leading chunks of ``charges`` (bytes each, frame overhead
        included), evicting as needed. Returns how many leading chunks got room; the caller releases
        ``sum(charges[:k])`` with :meth:`release_locked` once those chunks are resident (or failed).

        With ``wait_for_transfers`` (foreground writers only, never background workers, so nothing
        waits on itself) a writer that finds every candidate pinned by a background copy waits up to
        a bound for those copies to finish instead of giving up at once."""
        cap = self.capacity(t)
        k = len(charges)
        if k == 0:
            return 0
        deadline = time.monotonic() + _ROOM_WAIT_S
        owner = self.owner("evict")
        while True:
            with self.cond:
                need = sum(charges[:k])
                used = self.used_locked(t)
                if cap == 0 or used + need <= cap:
                    self.reserved[t] += need
                    return k
                deficit = used + need - cap - self.claimed[t]
                victim, claim, freed, pending, entries = None, 0, 0, 0, []
                if deficit > 0:
                    victim, claim, freed, pending, entries = self._claim_locked(t, deficit, owner)
                if victim is None and not freed:
                    busy = self.claimed[t] > 0 or (wait_for_transfers and self.transfers_inflight > 0)
                    if busy and time.monotonic() < deadline:
                        self.cond.wait(0.05)  # another thread's eviction or copy will free room
                        continue
                    return self._shrink_locked(t, charges, k, used, cap)
            if entries:
                self.delete_entries(entries)
                with self.cond:
                    self.release_locked(t, pending)
            if victim is not None and self._evict(t, [victim], owner, claim) == 0 and not freed:
                with self.cond:  # the victim could not leave (its demotion failed): take what fits
                    return self._shrink_locked(t, charges, k, self.used_locked(t), cap)

    def _shrink_locked(self, t: int, charges: Sequence[int], k: int, used: int, cap: int) -> int:
        while k > 0 and used + sum(charges[:k]) > cap:
            k -= 1
        self.reserved[t] += sum(charges[:k])
        return k

    def end_transfer_locked(self) -> None:
        self.transfers_inflight -= 1
        self.cond.notify_all()

    def release_locked(self, t: int, nbytes: int) -> None:
        self.reserved[t] -= nbytes
        self.cond.notify_all()

    def _claim_locked(self, t: int, deficit: int, owner: str
                      ) -> tuple[ChunkRef | None, int, int, int, list[tuple[int, str, str]]]:
        """Free room in exact policy order, one candidate at a time (each eviction may expose a
        parent as the next victim). Chunks that need no copy (the next tier holds them, or ``t`` is
        the last tier) leave the tree at once; their bytes stay counted as reserved until deleted.
        Stops at the first chunk that must be demoted: it is pinned and returned as the victim.
        Returns (victim, its charge, chunks freed now, bytes pending deletion, bytes to delete)."""
        name, tree = self.names[t], self.tree
        next_bit = 1 << (t + 1) if t < self.last else 0
        freed = pending = 0
        entries: list[tuple[int, str, str]] = []
        released = dropped = 0
        try:
            while deficit > 0:
                ids = tree.evict_candidates(name, 1, drop=(t == self.last))
                if not ids:
                    return None, 0, freed, pending, entries
                ref = self.ref_locked(ids[0])
                charge = self.charge(t, ref.size_bytes)
                if next_bit and not tree.node_tier_mask(ref.node_id) & next_bit:
                    tree.pin([ref.node_id], owner, self.lease_s)
                    self.claimed[t] += charge
                    return ref, charge, freed, pending, entries
                entries += self.mark_deleting_locked([(t, ref.namespace, ref.key)]
                                                     + self.clear_locked([ref.node_id], t))
                self.reserved[t] += charge  # still on the medium until deleted outside the lock
                pending += charge
                deficit -= charge
                freed += 1
                released += bool(next_bit)
                dropped += not next_bit
            return None, 0, freed, pending, entries
        finally:
            self.metrics.evictions(name, "release", released)
            self.metrics.evictions(name, "drop", dropped)

    def _evict(self, t: int, victims: list[ChunkRef], owner: str, claim: int) -> int:
        """Demote (or drop, from the last tier) the claimed victims; returns how many left tier t."""
        name = self.names[t]
        demoted: set[int] = set()
        below: set[int] = set()
        try:
            if t < self.last:
                with self.cond:
                    move = [v for v in victims if not self.mask_locked(v) & (1 << (t + 1))]
                    below = {v.node_id for v in victims if self.mask_locked(v) & (1 << (t + 1))}
                if move:
                    ok = self.copy(t, t + 1, move)
                    demoted = {v.node_id for v, o in zip(move, ok) if o}
            with self.cond:
                out: list[ChunkRef] = []
                for v in victims:
                    mask = self.mask_locked(v)
                    if not mask & (1 << t):
                        continue
                    failed_demotion = t < self.last and v.node_id not in demoted and mask & (1 << (t + 1)) == 0
                    if failed_demotion and mask == 1 << t and self.tree.node_children_alive(v.node_id):
                        continue  # dropping it would orphan its descendants: keep it
                    out.append(v)
                entries = self.clear_locked([v.node_id for v in out], t)
                entries = self.mark_deleting_locked([(t, v.namespace, v.key) for v in out] + entries)
                self.unpin_locked(victims, owner)
            self.delete_entries(entries)
            n_demoted = sum(v.node_id in demoted for v in out)
            n_below = sum(v.node_id in below for v in out)
            self.metrics.evictions(name, "demote", n_demoted)
            self.metrics.evictions(name, "release", n_below)  # the next tier already held it
            self.metrics.evictions(name, "drop", len(out) - n_demoted - n_below)
            return len(out)
        finally:
            with self.cond:
                self.claimed[t] -= claim
                self.cond.notify_all()

    # ------------------------------------------------------------------ copies
    def copy(self, src: int, dst: int, refs: Sequence[ChunkRef]) -> list[bool]:
        """Copy pinned chunks from tier ``src`` to ``dst`` (reading once, zero-copy from a memory
        tier's leased views); True where ``dst`` now holds the chunk and the tree says so."""
        out = [False] * len(refs)
        by_ns: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(refs):
            by_ns[r.namespace].append(i)
        for ns, idx in by_ns.items():
            sub = [refs[i] for i in idx]
            with self.read_payloads(src, ns, sub) as payloads:
                good = [j for j, p in enumerate(payloads) if p is not None]
                ok = self.write(dst, [sub[j] for j in good], [payloads[j] for j in good])
            for j, o in zip(good, ok):
                out[idx[j]] = o
        return out

    def read_payloads(self, t: int, ns: str, refs: Sequence[ChunkRef]) -> _Payloads:
        return _Payloads(self, t, ns, refs)

    def write(self, t: int, refs: Sequence[ChunkRef], payloads: Sequence[torch.Tensor]) -> list[bool]:
        """Write pinned chunks (one namespace) into tier ``t``: reserve room, put, make resident.
        Chunks the tree dropped meanwhile are deleted again so the tier holds nothing untracked."""
        if not refs:
            return []
        ns = refs[0].namespace
        charges = [self.charge(t, r.size_bytes) for r in refs]
        k = self.reserve(t, charges)
        keys = [r.key for r in refs[:k]]
        with self.cond:
            self.begin_write_locked(t, ns, keys)
        try:
            ok = self.put_refit(t, ns, keys, payloads[:k], charges[:k])
        except BaseException:
            with self.cond:
                self.end_write_locked(t, ns, keys)
                self.release_locked(t, sum(charges[:k]))
            raise
        leaked: list[tuple[int, str, str]] = []
        result = [False] * len(refs)
        with self.cond:
            self.end_write_locked(t, ns, keys)
            keep = []
            for i in range(k):
                if not ok[i]:
                    continue
                if self.alive_locked(refs[i]):
                    keep.append(refs[i].node_id)
                    result[i] = True
                else:
                    leaked.append((t, ns, refs[i].key))
            if keep:
                self.tree.set_resident(keep, self.names[t])
            self.release_locked(t, sum(charges[:k]))
            leaked = self.mark_deleting_locked(leaked)
        self.delete_entries(leaked)
        return result

    def put_refit(self, t: int, ns: str, keys: Sequence[str], payloads: Sequence[torch.Tensor],
                  charges: Sequence[int]) -> list[bool]:
        """Put with room already reserved. A memory tier can refuse a put the byte count allows (slab
        slots leave a remainder per slab): then evict that many bytes more and retry once."""
        ok = self.tier_put(t, ns, keys, payloads)
        failed = [i for i, o in enumerate(ok) if not o]
        if failed and self.capacity(t) and not self._framed[t]:
            extra = sum(charges[i] for i in failed)
            if self.reserve(t, [extra]) == 1:
                with self.cond:
                    self.release_locked(t, extra)
                again = self.tier_put(t, ns, [keys[i] for i in failed], [payloads[i] for i in failed])
                for i, o in zip(failed, again):
                    ok[i] = o
        return ok

    # ------------------------------------------------------------------ reads with fallback
    def read_run(self, refs: Sequence[ChunkRef], masks: list[int], buffers: Sequence[torch.Tensor],
                 cancelled: Callable[[], bool] = lambda: False) -> tuple[int, list[int]]:
        """Fill ``buffers`` with the pinned chunks (one namespace), each from the fastest tier holding
        it, falling back down the hierarchy on a failed read. Returns (leading run read, tier that
        served each chunk or -1)."""
        n = len(refs)
        served = [-1] * n
        limit = n
        ns = refs[0].namespace if refs else ""
        while True:
            groups: dict[int, list[int]] = defaultdict(list)
            for i in range(limit):
                if served[i] >= 0:
                    continue
                if not masks[i]:
                    limit = i  # no tier can deliver chunk i: the run ends before it
                    break
                groups[(masks[i] & -masks[i]).bit_length() - 1].append(i)
            if not groups or cancelled():
                break
            failed: list[tuple[int, int]] = []
            for t in sorted(groups):
                idx = groups[t]
                ok = self.tier_get(t, ns, [refs[i].key for i in idx], [buffers[i] for i in idx])
                for i, o in zip(idx, ok):
                    if o:
                        served[i] = t
                    else:
                        failed.append((i, t))
            if not failed:
                continue
            self._forget_failed(refs, masks, failed)
        run = 0
        while run < limit and served[run] >= 0:
            run += 1
        return run, served

    def _forget_failed(self, refs: Sequence[ChunkRef], masks: list[int], failed: list[tuple[int, int]]) -> None:
        by_tier: dict[int, list[int]] = defaultdict(list)
        for i, t in failed:
            by_tier[t].append(i)
            masks[i] &= ~(1 << t)
            self.metrics.read_failures(self.names[t], 1)
        entries: list[tuple[int, str, str]] = []
        with self.cond:
            for t, idx in by_tier.items():
                ids = [refs[i].node_id for i in idx if self.mask_locked(refs[i]) & (1 << t)]
                entries += [(t, refs[i].namespace, refs[i].key) for i in idx]
                entries += self.clear_locked(ids, t)
            for i, _t in failed:  # what the tree still knows (another thread may have added a tier)
                masks[i] &= self.mask_locked(refs[i])
            entries = self.mark_deleting_locked(entries)
        self.delete_entries(entries)


class _Payloads:
    """Context manager: the chunks' bytes from tier ``t`` (None where the read failed). Zero-copy
    leased views for a memory tier, scratch tensors otherwise. Failed reads are forgotten in the tree."""

    def __init__(self, stack: TierStack, t: int, ns: str, refs: Sequence[ChunkRef]) -> None:
        self._stack, self._t, self._ns, self._refs = stack, t, ns, refs
        self._lease: Any = None

    def __enter__(self) -> list[torch.Tensor | None]:
        s, t, refs = self._stack, self._t, self._refs
        keys = [r.key for r in refs]
        tier = s.tiers[t]
        if hasattr(tier, "lease"):
            self._lease = tier.lease(self._ns, keys)
            views = list(self._lease.views)
        else:
            bufs = [torch.empty(r.size_bytes, dtype=torch.uint8) for r in refs]
            ok = s.tier_get(t, self._ns, keys, bufs)
            views = [b if o else None for b, o in zip(bufs, ok)]
        bad = [(i, t) for i, v in enumerate(views) if v is None]
        if bad:
            masks = [1 << t] * len(refs)
            s._forget_failed(refs, masks, bad)
        return views

    def __exit__(self, *exc: object) -> None:
        if self._lease is not None:
            self._lease.release()


def _descendants(tree: RadixTree, roots: set[int]) -> list[int]:
    """Live descendants of ``roots`` (the tree's public ``descendants`` when it has one)."""
    fn = getattr(tree, "descendants", None)
    if fn is not None:
        return list(fn(roots))
    return tree._descendants(roots)  # noqa: SLF001 - rare path (a lost chunk with live children)
