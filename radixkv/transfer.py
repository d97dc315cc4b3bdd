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
import logging
import os
import re
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Callable, NamedTuple, Sequence

from radixkv import eviction, reads
from radixkv.intents import WriteDeleteIntents
from radixkv.errors import CapacityError, InputError, PinError
from radixkv.forksafe import SignalSafeCondition, hold_across_fork
from radixkv.metrics import StoreMetrics
from radixkv.tiers.base import ChunkBytes, capacity_limit, chunk_nbytes
from radixkv.tiers.framing import HEADER_BYTES
from radixkv.tree import RadixTree

__all__ = ["TierStack", "ChunkRef"]

_NS_DIGEST_CHARS = 32
# The pin owners the store makes (TierStack.owner; writeback's close-time flush): pins other code
# took through store.tree under other names are not the store's to account for.
STORE_PIN_OWNER_RE = re.compile(r"(?:put|get|evict|adopt|promote)-[0-9]+|close-flush")
_FAILED_COPIES_MAX = 1 << 16  # failed write-through copies remembered (see TierStack.failed_copies)
_COPY_WAIT_WARN_S = 30.0  # clear() logs while it waits longer than this for copies between tiers
logger = logging.getLogger(__name__)


class ChunkRef(NamedTuple):
    """A tree node captured under the lock (its identity survives the node's removal). A named
    tuple: a read makes one per chunk, and a tuple is made at half a frozen dataclass's cost."""

    node_id: int
    namespace: str
    key: str
    size_bytes: int
    tokens: int
    born: int  # the node's creation serial: a later node reusing the id after a delete differs


class Calls:
    """How many store calls are running now, counted without the lock (``list.append`` and
    ``list.pop`` are atomic): ``with calls:`` around a call, ``len(calls)`` to read."""

    __slots__ = ("_running",)

    def __init__(self) -> None:
        self._running: list[None] = []

    def __enter__(self) -> None:
        self._running.append(None)

    def __exit__(self, *exc: object) -> None:
        self._running.pop()

    def __len__(self) -> int:
        return len(self._running)


class TierStack(WriteDeleteIntents):
    """Tiers fastest first + the tree + the lock. Thread-safe; see the module docstring."""

    def __init__(
        self, tiers: Sequence[Any], tree: RadixTree, metrics: StoreMetrics, lease_s: float
    ) -> None:
        self.tiers = list(tiers)
        self.names = tuple(t.name for t in self.tiers)
        self.tree = tree
        self.metrics = metrics
        self.lease_s = lease_s
        self.cond = SignalSafeCondition(threading.Lock())  # an interrupt never leaves it held
        hold_across_fork(self, "cond")  # registered after the tiers: a fork takes it before theirs
        n = len(self.tiers)
        self.reserved = [0] * n
        self.claimed = [0] * n
        self.transfers_inflight = 0  # background copies holding pins (a writer may wait for them)
        # Set by the store's close() before its tiers close: a read failing after that is the tiers
        # closing under it, not a lost chunk (see reads.forget_failed).
        self.closing = False
        # store.clear() calls so far, per namespace digest (None: all namespaces); a put that a clear
        # of its namespace overtook while it wrote discards its writes.
        self.clears: Counter[str | None] = Counter()
        # clear() calls in progress per namespace digest (None: all): their tier calls run outside
        # the lock, so puts and adoptions of that namespace stand aside until they end.
        self.clearing: Counter[str | None] = Counter()
        self.init_intents(len(self.tiers))
        self.max_key_chars = 64
        # Tiers that persist frames count header + identity per chunk against their capacity.
        self._framed = [not hasattr(t, "lease") for t in self.tiers]
        # (namespace digest, key) of chunks whose write-through copy into a persistent tier failed
        # (a disk full for a moment, a Redis blip): a flushing close persists those still only in
        # memory. Insertion-ordered and bounded (the oldest forgotten first): a dead tier must not
        # grow it for good.
        self.failed_copies: dict[tuple[str, str], None] = {}
        self._owner_seq = itertools.count()
        # Copies between tiers in flight, token -> namespace. A copy writes bytes it read (or was
        # handed) earlier; clear() waits for the copies that began before it, so none of them can
        # land pre-clear bytes in a tier after the clear wiped it (see wait_copies_locked).
        self._copies: dict[int, str] = {}
        self._copy_tokens = itertools.count()
        self._pid = os.getpid()
        # Chunks puts hang their new chains from: node id -> {put owner: [ref, lease expiry, pinned
        # for it]}. The last tier's room-making pins such a chunk instead of dropping it.
        self._anchors: dict[int, dict[str, list[Any]]] = {}
        # The store's public calls running now (HierarchicalStore wraps each one): with none running
        # and no background job queued or running, every reservation, claim, pin, anchor, intent
        # and copy an operation takes must have been given back, which check_integrity verifies.
        self.calls = Calls()

    # ------------------------------------------------------------------ small helpers
    @property
    def last(self) -> int:
        return len(self.tiers) - 1

    def owner(self, kind: str) -> str:
        """A pin owner for one operation of ``kind`` (a word: ``put``, ``get``, ``evict``...)."""
        return f"{kind}-{next(self._owner_seq)}"

    def begin_copy_locked(self, ns: str) -> int:
        """Register a copy of ``ns`` chunks between tiers; pass the token to end_copy_locked."""
        self._forget_parent_copies_locked()
        token = next(self._copy_tokens)
        self._copies[token] = ns
        return token

    def _forget_parent_copies_locked(self) -> None:
        # A forked child inherits the parent's copies but not the threads that would end them.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._copies.clear()

    def end_copy_locked(self, token: int) -> None:
        del self._copies[token]
        self.cond.notify_all()

    def wait_copies_locked(self, nsd: str | None) -> None:
        """Wait (the lock released meanwhile) until every copy of namespace ``nsd`` (None: of any)
        that began before this call has ended. Copies never wait for a clear, so this ends; copies
        that begin later are not waited for (they find the cleared chunks gone, or are skipped)."""
        self._forget_parent_copies_locked()
        limit = next(self._copy_tokens)
        start = warned = time.monotonic()
        while any(tok < limit and (nsd is None or ns == nsd) for tok, ns in self._copies.items()):
            self.cond.wait(1.0)
            if time.monotonic() - warned >= _COPY_WAIT_WARN_S:  # a tier call hangs (NFS, a custom tier)
                warned = time.monotonic()
                logger.warning("radixkv: clear()/delete() has waited %.0f s for copies between tiers to end",
                               warned - start)

    def wait_copies_before_delete_locked(self, nsd: str, entries: Sequence[tuple[int, str, str]]) -> None:
        """:meth:`wait_copies_locked` for a delete of ``entries``, before it marks them deleting:
        adoption skips them meanwhile (``_delete_barrier``), and a copy that reaches its write does
        not wait for them (its write waits for *marked* deletes: marked first, the delete and the
        copy waited for each other up to the 5 s bound)."""
        barrier = list(dict.fromkeys(entries))
        self.spoil_locked(barrier)
        for e in barrier:
            self._delete_barrier[e] += 1
        try:
            self.wait_copies_locked(nsd)
        finally:
            for e in barrier:
                self._delete_barrier[e] -= 1
                if not self._delete_barrier[e]:
                    del self._delete_barrier[e]

    def clearing_locked(self, nsd: str) -> bool:
        """Whether a clear() of ``nsd`` (or of everything) is running its tier calls."""
        return bool(self.clearing[None] or self.clearing[nsd])

    def note_failed_copies_locked(self, t: int | None, refs: Sequence[ChunkRef]) -> None:
        """Record write-through copies into tier ``t`` (None: any tier below) that failed or were
        cancelled (a close that stopped waiting), for a flushing close to persist (``failed_copies``):
        persistent tiers only, and never a namespace another process owns there (its copies are
        skipped on purpose, ``store.borrow``). A later write of the chunk into a persistent tier
        forgets it (:meth:`write`)."""
        tiers = range(1, len(self.tiers)) if t is None else (t,)
        failed = self.failed_copies
        for r in refs:
            if any(self._framed[d] and not self.is_borrowed_locked(d, r.namespace) for d in tiers):
                failed[(r.namespace, r.key)] = None
                if len(failed) > _FAILED_COPIES_MAX:
                    del failed[next(iter(failed))]

    def persists(self, t: int) -> bool:
        """Whether tier ``t`` outlives the process (disk, Redis; a memory tier does not)."""
        return self._framed[t]

    def capacity(self, t: int) -> int:
        return capacity_limit(self.tiers[t])

    def overhead(self, t: int) -> int:
        return HEADER_BYTES + _NS_DIGEST_CHARS + self.max_key_chars if self._framed[t] else 0

    def charge(self, t: int, size_bytes: int) -> int:
        return size_bytes + self.overhead(t)

    def used_locked(self, t: int) -> int:
        name = self.names[t]
        return (
            self.tree.tier_bytes(name)
            + self.tree.tier_chunks(name) * self.overhead(t)
            + self.reserved[t]
        )

    def ref_locked(self, node_id: int) -> ChunkRef:
        return ChunkRef(node_id, *self.tree.node_fields(node_id))

    def refs_locked(self, node_ids: Sequence[int]) -> list[ChunkRef]:
        make = ChunkRef._make
        return [make(f) for f in self.tree.nodes_fields(node_ids)]

    def alive_locked(self, ref: ChunkRef) -> bool:
        # The id alone is not enough: the tree hands a freed id to its next new node, so after a
        # delete and a put of the same chain another thread's ref named the new nodes (a failed
        # read then forgot them and deleted their fresh bytes; found by an audit).
        n = ref.node_id
        return self.tree.lookup(ref.namespace, ref.key) == n and self.tree.node_born(n) == ref.born

    def mask_locked(self, ref: ChunkRef) -> int:
        return self.tree.node_tier_mask(ref.node_id) if self.alive_locked(ref) else 0

    def pin_locked(self, refs: Sequence[ChunkRef], owner: str) -> list[ChunkRef]:
        live = [r for r in refs if self.alive_locked(r)]
        if live:
            self.tree.pin([r.node_id for r in live], owner, self.lease_s)
        return live

    def anchor_locked(self, ref: ChunkRef, owner: str) -> None:
        """``owner`` (a put) will insert a chain under ``ref``: until :meth:`unanchor_locked` (or
        ``lease_s``, so an owner that raised or a forked child cannot keep it forever), room-making
        never drops it, nor a victim whose demotion failed (:mod:`radixkv.eviction`). It may still be
        demoted, which keeps it reachable. Without this a put whose room-making demoted its parent
        chunk out of memory and then, making room on the disk for the next victim, dropped it from
        there, stored nothing: its chain hung from a chunk that was gone."""
        self._anchors.setdefault(ref.node_id, {})[owner] = [ref, time.monotonic() + self.lease_s, False]

    def unanchor_locked(self, ref: ChunkRef | None, owner: str) -> None:
        """End :meth:`anchor_locked`, releasing the pin room-making may have taken for ``owner``."""
        held = self._anchors.get(ref.node_id) if ref is not None else None
        entry = held.pop(owner, None) if held is not None else None
        if entry is None:
            return
        if not held:
            del self._anchors[entry[0].node_id]
        if entry[2]:
            self.unpin_locked([entry[0]], owner)

    def keep_anchor_locked(self, node_id: int) -> bool:
        """Whether a put hangs its chain from ``node_id`` (see :meth:`anchor_locked`); if so, pin it for
        those puts (released by their :meth:`unanchor_locked`), so the policy's next candidate is
        offered instead."""
        held = self._anchors.get(node_id)
        if not held:
            return False
        now, kept = time.monotonic(), False
        for owner, entry in held.items():
            if entry[1] > now and self.alive_locked(entry[0]):
                self.tree.pin([node_id], owner, self.lease_s)
                entry[2] = kept = True
        return kept

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
    def tier_put(
        self, t: int, ns: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]
    ) -> list[bool]:
        if not keys:
            return []
        with self.metrics.timed("tier_put", self.names[t]):
            ok = self._put_many(t, ns, keys, payloads)
            failed = [i for i, o in enumerate(ok) if not o]
            if failed and self._retry_deletes[t] and self.retry_deletes(t):
                # Deletes that failed earlier (server down) may be what fills the tier's own books.
                again = self._put_many(
                    t, ns, [keys[i] for i in failed], [payloads[i] for i in failed]
                )
                for i, o in zip(failed, again):
                    ok[i] = o
            elif len(failed) < len(ok) and self._retry_deletes[t]:
                # The tier answers again: run the deletes it missed now (at most once a second),
                # not only when it next refuses a put, or they wait for a refusal that never comes
                # and another process (or this one after a restart) adopts the deleted bytes.
                self.retry_deletes(t)
        n_ok = sum(ok)
        self.metrics.written(self.names[t], n_ok, sum(chunk_nbytes(p) for p, o in zip(payloads, ok) if o))
        self.metrics.write_failures(self.names[t], len(keys) - n_ok)
        self._absorb_tier_evictions(t)
        return ok

    def tier_get(
        self, t: int, ns: str, keys: Sequence[str], buffers: Sequence[ChunkBytes]
    ) -> list[bool]:
        if not keys:
            return []
        with self.metrics.timed("tier_get", self.names[t]):
            try:
                return self.tiers[t].get_many(ns, keys, buffers)
            except (InputError, CapacityError):
                raise
            except Exception:
                return [False] * len(keys)

    def _put_many(
        self, t: int, ns: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]
    ) -> list[bool]:
        try:
            return list(self.tiers[t].put_many(ns, keys, payloads))
        except (InputError, CapacityError):
            raise
        except Exception:  # a tier must not raise for faults; if one does, it is a failed put
            return [False] * len(keys)

    def _absorb_tier_evictions(self, t: int) -> None:
        """A tier that evicted on its own (disk over budget) tells us what; forget it in the tree."""
        drain = getattr(self.tiers[t], "drain_evicted", None)
        if drain is None:
            return
        gone = drain()
        if gone:
            with self.cond:
                self.spoil_locked([(t, ns, key) for ns, key in gone])
                self.lose_writes_locked([(t, ns, key) for ns, key in gone])
                ids = [n for ns, key in gone
                       if (n := self.tree.lookup(ns, key)) is not None and not self._held_again_locked(t, ns, key)]
                entries = self.mark_deleting_locked(self.owned_entries_locked(self.clear_locked(ids, t)))
            self.delete_entries(entries)

    def _held_again_locked(self, t: int, ns: str, key: str) -> bool:
        """Whether tier ``t`` holds ``key`` again although it reported evicting it: a report names a
        key, not a put, and the key may have been deleted and put again (a new node) between the
        tier's eviction and this drain; clearing it then would forget a copy the tier holds. Asked
        under the lock, where residency is marked, so a put that lands later marks it itself. A key
        being written now is the writer's to judge (lose_writes_locked: it treats the write as failed)."""
        if (t, ns, key) in self._writing:
            return False
        try:
            return self.tiers[t].contains_many(ns, [key]) == 1
        except Exception:  # a fault: as before, the report is applied (a miss at worst)
            return False

    # ------------------------------------------------------------------ residency changes
    def clear_locked(self, node_ids: Sequence[int], t: int) -> list[tuple[int, str, str]]:
        """Clear residency in tier ``t``; returns the bytes to delete for chunks dropped as orphans
        (their data in every tier, now unreachable). Caller holds the lock."""
        tree, bit = self.tree, 1 << t
        ids = [n for n in node_ids if tree.node_tier_mask(n) & bit]
        doomed = {n for n in ids if tree.node_tier_mask(n) == bit and tree.node_children_alive(n)}
        entries: list[tuple[int, str, str]] = []
        if doomed:
            for d in tree.descendants(doomed):
                m, ns, key = tree.node_tier_mask(d), tree.node_namespace(d), tree.node_key(d)
                entries.extend((i, ns, key) for i in range(len(self.tiers)) if m >> i & 1)
        result = tree.clear_resident(ids, self.names[t])
        self.metrics.orphans(len(result.orphaned_node_ids))
        return entries

    # ------------------------------------------------------------------ room-making
    def reserve(self, t: int, charges: Sequence[int], wait_for_transfers: bool = False) -> int:
        """Reserve room in tier ``t`` for the leading chunks of ``charges`` (bytes each, frame overhead
        included), evicting as needed (see :mod:`radixkv.eviction`). Returns how many leading chunks
        got room; the caller releases ``sum(charges[:k])`` with :meth:`release_locked` once those
        chunks are resident (or failed). With ``wait_for_transfers`` (foreground writers only) a
        writer whose candidates are all pinned by background copies waits a bounded time for them."""
        return eviction.reserve(self, t, charges, wait_for_transfers)

    def end_transfer_locked(self) -> None:
        self.transfers_inflight -= 1
        self.cond.notify_all()

    def release_locked(self, t: int, nbytes: int) -> None:
        self.reserved[t] -= nbytes
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
            with self.cond:
                # A clear that began since the caller chose these chunks is not waiting for this
                # copy: copy only chunks still alive now (none of ns is, until that clear ended).
                idx = [i for i in idx if self.alive_locked(refs[i])]
                if self.is_borrowed_locked(dst, ns):
                    idx = []  # another process owns ns's bytes in dst: never write them there
                token = self.begin_copy_locked(ns)  # before the read: clear() waits for this copy
            sub = [refs[i] for i in idx]
            try:
                with self.read_payloads(src, ns, sub) as payloads:
                    good = [j for j, p in enumerate(payloads) if p is not None]
                    ok = self.write(dst, [sub[j] for j in good], [payloads[j] for j in good])
            finally:
                with self.cond:
                    self.end_copy_locked(token)
            for j, o in zip(good, ok):
                out[idx[j]] = o
        return out

    def read_payloads(self, t: int, ns: str, refs: Sequence[ChunkRef]) -> reads.Payloads:
        return reads.Payloads(self, t, ns, refs)

    def read_run(
        self,
        refs: Sequence[ChunkRef],
        masks: list[int],
        buffers: Sequence[ChunkBytes],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[int, list[int]]:
        """See :func:`radixkv.reads.read_run`."""
        return reads.read_run(self, refs, masks, buffers, cancelled)

    def write(
        self, t: int, refs: Sequence[ChunkRef], payloads: Sequence[ChunkBytes]
    ) -> list[bool]:
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
                lost = self.take_lost_writes_locked(t, ns, keys)
                due = self.mark_deleting_locked(
                    self.settle_writes_locked(t, ns, keys) + [(t, ns, key) for key in lost]
                )
            self.delete_entries(due)
            raise
        leaked: list[tuple[int, str, str]] = []
        result = [False] * len(refs)
        with self.cond:
            self.end_write_locked(t, ns, keys)
            lost = self.take_lost_writes_locked(t, ns, keys)  # the tier evicted them meanwhile
            keep = []
            for i in range(k):
                if not ok[i]:
                    continue
                if keys[i] in lost:
                    leaked.append((t, ns, keys[i]))
                    continue
                if self.alive_locked(refs[i]):
                    keep.append(refs[i].node_id)
                    result[i] = True
                else:
                    leaked.append((t, ns, refs[i].key))
            if keep:
                self.tree.set_resident(keep, self.names[t])
                if self._framed[t] and self.failed_copies:  # persisted now, however it got there
                    for i in range(k):
                        if ok[i]:
                            self.failed_copies.pop((ns, keys[i]), None)
            self.release_locked(t, sum(charges[:k]))
            leaked = self.mark_deleting_locked(leaked + self.settle_writes_locked(t, ns, keys))
        self.delete_entries(leaked)
        return result

    def put_refit(
        self,
        t: int,
        ns: str,
        keys: Sequence[str],
        payloads: Sequence[ChunkBytes],
        charges: Sequence[int],
        wait_for_transfers: bool = False,
        clears: tuple[int, int] | None = None,
    ) -> list[bool]:
        """Put with room already reserved (``wait_for_transfers`` as in :meth:`reserve`; ``clears``:
        the caller's snapshot of the namespace's clear counters, to tell a put lost to a clear from a
        full tier). A memory tier can refuse a put the byte count allows: its
        slab slots leave a remainder per slab, and free slots of one chunk size cannot hold another
        until their slab is empty. Then evict beyond the byte count, in policy order, and retry:
        the refused bytes first, doubling each round (a slab of another size may need many
        victims), until the put fits or nothing evictable is left."""
        ok = self.tier_put(t, ns, keys, payloads)
        failed = [i for i, o in enumerate(ok) if not o]
        if not failed or not self.capacity(t) or self._framed[t]:
            return ok
        with self.cond:  # refused because a clear of the namespace overtook the put: no room to make
            now = (self.clears[None], self.clears[ns])
            if self.clearing_locked(ns) or (clears is not None and now != clears):
                return ok
        extra = sum(charges[i] for i in failed)
        cap = self.capacity(t)
        while failed:
            with self.cond:
                # Ask for the free room plus `extra`: reserve must evict `extra` bytes to grant it.
                need = min(cap, max(0, cap - self.used_locked(t)) + extra)
            granted = self.reserve(t, [need], wait_for_transfers) == 1
            if granted:
                with self.cond:
                    self.release_locked(t, need)
            # Retry even when the reservation failed: reserve evicts what it can before giving up,
            # and those few victims may be all a slab of another size held (a sidecar pool's pages
            # sharing a small tier with the KV pool): the put fits now although the bytes did not.
            again = self.tier_put(t, ns, [keys[i] for i in failed], [payloads[i] for i in failed])
            for i, o in zip(failed, again):
                ok[i] = o
            failed = [i for i in failed if not ok[i]]
            if not granted:
                break  # everything left is pinned, or interior to this tier
            if need >= cap:
                break  # the whole tier was offered
            extra *= 2
        return ok


