"""Write and delete intents: keep the tree and the tiers' bytes consistent under concurrency.

A put announces ``(tier, namespace, key)`` before it writes; a delete (eviction, orphan cleanup,
``store.delete``) announces its keys in the same locked step that clears them from the tree. A delete
skips keys being written (the writer will make them resident again) and a writer waits (boundedly)
for deletes of its keys. Without this, a racing delete could remove bytes the tree was just told are
resident.

A delete a tier may have missed (its server was down: it answers "0 deleted" without trying) is
remembered and retried later, when a put into that tier is refused: a tier that counts the bytes it
stores (Redis) would otherwise count chunks the tree forgot against its capacity forever.

:class:`WriteDeleteIntents` is a mixin of :class:`radixkv.transfer.TierStack` (it uses the stack's
``cond``, ``tree`` and ``tiers``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Sequence

__all__ = ["WriteDeleteIntents", "AdoptionWatch"]

_RETRY_DELETES_MAX = 1 << 16  # failed deletes remembered per tier (bounded memory)
_RETRY_DELETES_FOR_S = 600.0
_DELETE_WAIT_S = 5.0  # bound on a writer's wait for a delete of its keys (a delete is one batch)
logger = logging.getLogger(__name__)


class AdoptionWatch:
    """Deletes of one namespace seen while an adoption probed its tiers (lock-protected)."""

    __slots__ = ("namespace", "spoiled", "all_gone")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.spoiled: set[tuple[int, str]] = set()  # (tier, key)
        self.all_gone = False


class WriteDeleteIntents:
    cond: Any
    tree: Any
    tiers: list[Any]

    def init_intents(self, n_tiers: int) -> None:
        # (tier, namespace, key) with a put or a delete in flight on the medium. A delete skips keys
        # being written (the writer will make them resident again) and a writer waits for deletes of
        # its keys, so the tree never says "resident" for bytes a racing delete removed.
        self._writing: dict[tuple[int, str, str], int] = defaultdict(int)
        # Sets recording the (tier, namespace, key) writes that begin while they are watched
        # (watch_writes_locked): reconcile's "absent" answers predate those writes.
        self._write_watches: list[set[tuple[int, str, str]]] = []
        self._deleting: dict[tuple[int, str, str], int] = defaultdict(int)
        # Deletes waiting at their copy barrier (store.delete): not yet marked deleting, so a copy
        # that reaches its write meanwhile does not wait for them (it waited 5 s for a delete that
        # waited for it), but adoption must not take these keys back (radixkv.adoption._busy).
        self._delete_barrier: dict[tuple[int, str, str], int] = defaultdict(int)
        # Deletes skipped because a put of the key was in flight. That put may still fail (a full
        # tier) or not make the key resident; its writer settles these (settle_writes_locked) once
        # its tree update is done, so the bytes are deleted unless the tree places them again.
        self._deferred: set[tuple[int, str, str]] = set()
        # Keys a tier evicted on its own (a disk over its budget) while a put of them was in flight,
        # or whose delete a put outwaited (begin_write_locked): that put may have committed the very
        # file evicted or deleted, so its writer must not make it resident.
        self._lost_writes: set[tuple[int, str, str]] = set()
        # Deletes a tier may have failed (server down): (namespace, key) -> first failure time.
        self._retry_deletes: list[dict[tuple[str, str], float]] = [{} for _ in range(n_tiers)]
        self._retry_after = [0.0] * n_tiers
        self.deletes_given_up = [0] * n_tiers  # per tier, cumulative: deletes never run (see retry_deletes)
        # Adoptions between their probe and their insert (radixkv.adoption): a delete meanwhile
        # spoils the keys it names, so stale bytes are never adopted.
        self._watches: list[AdoptionWatch] = []
        # (tier, namespace) whose bytes another process owns (store.borrow): evictions forget them.
        self._borrowed: set[tuple[int, str]] = set()
        # Tiers other processes write that can stop counting a chunk without deleting it (a shared
        # disk tier, Redis): the store only forgets chunks it lost there (lost_entries_locked).
        self._forgets_lost = [
            bool(getattr(t, "shared", False)) and callable(getattr(t, "forget_many", None)) for t in self.tiers
        ]
        self.kept_on_evict = 0  # evicted entries left on their tier for their owner (cumulative)

    def tier_delete(self, t: int, ns: str, keys: Sequence[str]) -> bool:
        """Delete best effort. A batch of which the tier found fewer keys than asked may have failed
        (a server down answers 0 without trying): if the tier raised, or saw a fault during the call
        (its ``fault_mark`` moved), its keys are remembered and retried later (:meth:`retry_deletes`).
        A shortfall without a fault is keys the tier does not hold (a disk that never had them, a
        value that expired): nothing to retry. (A disk tier keeps a file it failed to remove
        indexed and evicts it itself.) Returns True if the tier found every key."""
        if not keys:
            return True
        tier = self.tiers[t]
        fault_mark = getattr(tier, "fault_mark", None)
        faulted = False
        try:
            mark = fault_mark() if fault_mark is not None else 0
            ok = tier.delete_many(ns, keys) >= len(keys)
            faulted = not ok and fault_mark is not None and fault_mark() != mark
        except Exception:
            ok, faulted = False, True
        if faulted:
            now = time.monotonic()
            with self.cond:
                pending = self._retry_deletes[t]
                dropped = []
                for k in keys:
                    if len(pending) < _RETRY_DELETES_MAX or (ns, k) in pending:
                        pending.setdefault((ns, k), now)
                    else:
                        dropped.append(k)
                # Past the bound the delete is given up at once (see retry_deletes).
                self.deletes_given_up[t] += len(dropped)
                self._forget_locked(t, ns, dropped)
        return ok

    def retry_deletes(self, t: int, now_or_never: bool = False, deadline: float | None = None) -> bool:
        """Retry the deletes tier ``t`` failed earlier, for keys the tree does not place there now
        and nobody is writing. A medium that was down keeps bytes the tree forgot, and a tier that
        counts what it stores (Redis) would count them against its capacity forever. At most once
        per second per tier. A key is given up when a retry fails ``_RETRY_DELETES_FOR_S`` or more
        after its first failure: the tier then forgets it (stops counting it against its capacity,
        :meth:`_forget_locked`). Dropped and still counted, a Redis tier's books stayed full of
        chunks the store had evicted, and the tier refused every later write. Returns True if a
        retry ran. ``now_or_never`` (a closing store): retry now, whatever the rate, and keep
        nothing for later. Once one namespace's retry finds the tier unreachable, or past
        ``deadline`` (``time.monotonic()``), the rest are not tried this time (each try of an
        unreachable server costs its timeout)."""
        now = time.monotonic()
        with self.cond:
            if (now < self._retry_after[t] and not now_or_never) or not self._retry_deletes[t]:
                return False
            self._retry_after[t] = now + 1.0
            pending, self._retry_deletes[t] = self._retry_deletes[t], {}
            # (a key the tree places in the tier again was written since: it counts once, rightly)
            todo = [(t, ns, k) for ns, k in pending if not self._resident_locked(t, ns, k)]
            entries = self.mark_deleting_locked(todo)
        groups: dict[str, list[str]] = defaultdict(list)
        for _t, ns, k in entries:
            groups[ns].append(k)
        tier = self.tiers[t]
        ping = getattr(tier, "ping", None)  # a tier that can tell whether its medium is reachable
        # ping ignores a tier's fail-fast window (Redis: down_backoff_s after a fault) while
        # delete_many inside it answers 0 without trying: a delete counts as run only if the tier
        # saw no fault and refused no call meanwhile (another thread's fault just retries later).
        fault_mark = getattr(tier, "fault_mark", None)
        reachable = True
        try:
            for ns, keys in groups.items():
                try:
                    ran = reachable and (deadline is None or time.monotonic() < deadline)
                    ran = ran and (ping is None or bool(ping()))
                    if ran:
                        mark = fault_mark() if fault_mark is not None else 0
                        tier.delete_many(ns, keys)  # absent keys are fine: the delete ran
                        ran = ping is None or bool(ping())
                        ran = ran and (fault_mark is None or fault_mark() == mark)
                except Exception:
                    ran = False
                reachable = reachable and ran
                if not ran:
                    with self.cond:  # still unreachable: keep them (with their first-failure time)
                        given_up = []
                        for k in keys:
                            t0 = pending[(ns, k)]
                            if now - t0 < _RETRY_DELETES_FOR_S and not now_or_never:
                                self._retry_deletes[t].setdefault((ns, k), t0)
                            else:
                                given_up.append(k)
                        self.deletes_given_up[t] += len(given_up)
                        self._forget_locked(t, ns, given_up)
        finally:
            self._unmark_deleting(entries)
        return True

    def retry_deletes_at_close(self, deadline: float) -> list[int]:
        """:meth:`retry_deletes` of every tier once more, now (a closing store), until ``deadline``;
        per tier, the deletes that could not run and were given up."""
        failed = []
        for t in range(len(self.tiers)):
            with self.cond:
                pending, before = bool(self._retry_deletes[t]), self.deletes_given_up[t]
            if pending:
                try:
                    self.retry_deletes(t, now_or_never=True, deadline=deadline)
                except Exception:  # closing must still close the tiers
                    logger.exception("radixkv: retrying the deletes tier %r missed failed at close",
                                     self.tiers[t].name)
            with self.cond:
                failed.append(self.deletes_given_up[t] - before)
        return failed

    def _resident_locked(self, t: int, ns: str, key: str) -> bool:
        n = self.tree.lookup(ns, key)
        return n is not None and bool(self.tree.node_tier_mask(n) & (1 << t))

    def begin_write_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        """Announce puts of ``keys`` into tier ``t`` (waits for deletes of them in flight, at most
        ``_DELETE_WAIT_S``). A key whose delete is still in flight after that is written as a lost
        write (:meth:`take_lost_writes_locked`): the delete may run after the write and remove its
        bytes, so the writer must not make the key resident."""
        idents = [(t, ns, k) for k in keys]
        deadline = time.monotonic() + _DELETE_WAIT_S
        while any(i in self._deleting for i in idents) and time.monotonic() < deadline:
            self.cond.wait(0.05)
        for i in idents:
            self._writing[i] += 1
        # A delete that outlived the wait (its thread parked between marking and running it, a
        # stalled medium): before, the write went on as if it had run, the delete then removed the
        # bytes (a memory tier even reported the old copy "present") and the tree placed the key in
        # a tier that lacked it, the put reporting it stored.
        self._lost_writes.update(i for i in idents if i in self._deleting)
        for w in self._write_watches:
            w.update(idents)

    def watch_writes_locked(self) -> set[tuple[int, str, str]]:
        """Start recording the ``(tier, namespace, key)`` writes that begin from now on into the
        returned set (end with :meth:`unwatch_writes_locked`)."""
        w: set[tuple[int, str, str]] = set()
        self._write_watches.append(w)
        return w

    def unwatch_writes_locked(self, w: set[tuple[int, str, str]]) -> None:
        self._write_watches = [x for x in self._write_watches if x is not w]  # (sets compare equal)

    def end_write_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        for k in keys:
            i = (t, ns, k)
            self._writing[i] -= 1
            if not self._writing[i]:
                del self._writing[i]
        self.cond.notify_all()

    def mark_deleting_locked(
        self, entries: Sequence[tuple[int, str, str]]
    ) -> list[tuple[int, str, str]]:
        """The entries to delete from their tiers (those not being rewritten right now), marked as
        in flight; pass the result to :meth:`delete_entries` after leaving the lock."""
        self.spoil_locked(entries)
        # Never delete bytes the tree says a tier holds: a late writer's "leaked" copy of a chunk
        # that was adopted meanwhile (radixkv.adoption) is that chunk's bytes.
        out = []
        for e in dict.fromkeys(entries):
            if self._resident_locked(*e):
                continue
            if e in self._writing:
                self._deferred.add(e)  # its writer decides (settle_writes_locked)
                continue
            self._deferred.discard(e)
            out.append(e)
        for e in out:
            self._deleting[e] += 1
        return out

    def settle_writes_locked(self, t: int, ns: str, keys: Sequence[str]) -> list[tuple[int, str, str]]:
        """For a writer that ended its writes of ``keys`` into tier ``t`` and updated the tree: the
        deletes skipped meanwhile because of those writes that are now due (no other write of the
        key in flight, the tree does not place it in ``t``). Pass them to
        :meth:`mark_deleting_locked` with the writer's own leftovers. Without this, a put that
        failed after a delete deferred to it (the tier was full) left bytes nothing tracked."""
        if not self._deferred:
            return []
        due = []
        for k in keys:
            e = (t, ns, k)
            if e in self._deferred and e not in self._writing:
                self._deferred.discard(e)
                if not self._resident_locked(t, ns, k):
                    due.append(e)
        return due

    def lose_writes_locked(self, entries: Sequence[tuple[int, str, str]]) -> None:
        """A tier evicted ``entries`` on its own: remember those being written (see take_lost_writes_locked)."""
        self._lost_writes.update(e for e in entries if e in self._writing)

    def take_lost_writes_locked(self, t: int, ns: str, keys: Sequence[str]) -> set[str]:
        """For a writer that ended its writes of ``keys`` into tier ``t``: the keys the tier evicted on
        its own meanwhile (their file may be the one this writer committed), and those whose delete
        was still in flight when the write began (:meth:`begin_write_locked`). The writer treats
        them as failed and deletes what may be left. Forgotten once no write of the key is in flight."""
        if not self._lost_writes:
            return set()
        lost = set()
        for k in keys:
            e = (t, ns, k)
            if e in self._lost_writes:
                lost.add(k)
                if e not in self._writing:
                    self._lost_writes.discard(e)
        return lost

    def borrow_locked(self, t: int, namespace: str) -> None:
        """Mark ``namespace``'s bytes in tier ``t`` as another process's (see ``store.borrow``)."""
        self._borrowed.add((t, namespace))

    def is_borrowed_locked(self, t: int, namespace: str) -> bool:
        return (t, namespace) in self._borrowed

    def evicted_entries_locked(
        self, entries: Sequence[tuple[int, str, str]]
    ) -> list[tuple[int, str, str]]:
        """:meth:`mark_deleting_locked` for evictions: the entries of borrowed (tier, namespace)
        pairs are only forgotten (the tree already cleared them), their bytes stay for their owner.
        Returns the entries to delete; the kept ones are counted in ``kept_on_evict``."""
        return self.mark_deleting_locked(self.owned_entries_locked(entries, evicted=True))

    def owned_entries_locked(
        self, entries: Sequence[tuple[int, str, str]], evicted: bool = False
    ) -> list[tuple[int, str, str]]:
        """``entries`` less those of borrowed (tier, namespace) pairs, which the tree already
        forgot and whose bytes stay for their owner (a shared disk stops counting them). Every
        implicit delete (eviction, orphan cleanup, a failed read, a tier's own eviction,
        ``reconcile``) goes through this; only explicit ``delete``/``clear`` delete borrowed bytes."""
        if not self._borrowed:
            return list(entries)
        mine, theirs = [], defaultdict(list)
        for e in entries:
            if (e[0], e[1]) in self._borrowed:
                theirs[(e[0], e[1])].append(e[2])
            else:
                mine.append(e)
        for (t, ns), keys in theirs.items():
            if evicted:
                self.kept_on_evict += len(keys)
                self._forget_locked(t, ns, keys)
            else:
                self._forget_lost_locked(t, ns, keys)
        return mine

    def lost_entries_locked(self, entries: Sequence[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """:meth:`owned_entries_locked` for the chunks the store lost (a failed read, ``reconcile``)
        and their orphans, to pass to :meth:`mark_deleting_locked`: in a tier other processes write
        that can forget a chunk (a shared disk tier, Redis) they are only forgotten, never deleted.
        What the store knows of them ("absent", "bad", "unreachable") predates the delete, and
        another process may write the key again meanwhile: a delete by name then removes that new
        file or value, which the other process's tree places there. The tier's read already removed
        what it found bad, if it is still what it read (the disk tier's quarantine checks the file,
        the Redis tier compares and deletes on the server); an orphan's bytes stay for whoever
        reaches them (uncounted here, as the shared directory's other files are). Other tiers
        delete."""
        out: list[tuple[int, str, str]] = []
        forget: dict[tuple[int, str], list[str]] = defaultdict(list)
        for e in self.owned_entries_locked(entries):
            if self._forgets_lost[e[0]]:
                forget[(e[0], e[1])].append(e[2])
            else:
                out.append(e)
        for (t, ns), keys in forget.items():
            self._forget_lost_locked(t, ns, keys)
        return out

    def _forget_lost_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        # A failed read's chunk (and its orphans) may be bad on the medium: an adoption probing it
        # now must not take it (as if it were deleted), though it stays there.
        self.spoil_locked([(t, ns, k) for k in keys])
        self._forget_locked(t, ns, keys)

    def _forget_locked(self, t: int, ns: str, keys: Sequence[str]) -> None:
        # A tier that counts other processes' chunks it read (a shared disk) stops counting them;
        # its own lock only (no I/O), so calling it under ours is safe.
        forget = getattr(self.tiers[t], "forget_many", None)
        if forget is not None and keys:
            forget(ns, keys)

    def watch_locked(self, namespace: str) -> AdoptionWatch:
        """Start recording deletes of ``namespace`` (end with :meth:`unwatch_locked`)."""
        w = AdoptionWatch(namespace)
        w.spoiled.update((t, key) for t, ns, key in self._deleting if ns == namespace)
        self._watches.append(w)
        return w

    def unwatch_locked(self, w: AdoptionWatch) -> None:
        self._watches.remove(w)

    def spoil_locked(self, entries: Sequence[tuple[int, str, str]]) -> None:
        """Tell watching adoptions that these ``(tier, namespace, key)`` bytes go."""
        for w in self._watches:
            w.spoiled.update((t, key) for t, ns, key in entries if ns == w.namespace)

    def spoil_namespace_locked(self, namespace: str | None) -> None:
        """Tell watching adoptions that every chunk of ``namespace`` (None: of all) goes."""
        for w in self._watches:
            if namespace is None or namespace == w.namespace:
                w.all_gone = True

    def delete_entries(self, entries: Sequence[tuple[int, str, str]]) -> bool:
        """Delete marked ``(tier, namespace, key)`` bytes, batched per tier and namespace; False if a
        batch failed (it will be retried)."""
        groups: dict[tuple[int, str], list[str]] = defaultdict(list)
        for t, ns, key in entries:
            groups[(t, ns)].append(key)
        ok = True
        try:
            for (t, ns), keys in groups.items():
                ok = self.tier_delete(t, ns, keys) and ok
        finally:
            self._unmark_deleting(entries)
        return ok

    def _unmark_deleting(self, entries: Sequence[tuple[int, str, str]]) -> None:
        if entries:
            with self.cond:
                for e in entries:
                    self._deleting[e] -= 1
                    if not self._deleting[e]:
                        del self._deleting[e]
                self.cond.notify_all()
