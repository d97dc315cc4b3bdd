"""Local byte accounting of a remote tier: what this process wrote, reserved before each write.

A put first *reserves* the full frame size of every chunk (refused if ``used + reserved`` would pass
the capacity), then *settles*: the reservation is released and, where the write succeeded, the chunk's
bytes replace whatever this ledger held for the same key. Because a settle never grows
``used + reserved``, the invariant ``used + reserved <= capacity`` holds at every instant, however
many threads put at once. (The price: re-putting a key already held needs room for a second copy
while in flight.)

With a TTL each entry expires locally at ``settle time + ttl``; the server expired it no later than
that (its clock started when it executed the SET, before replying), so the ledger never undercounts.
Likewise :meth:`forget` takes the time its evidence was gathered (a GET that found the key absent, an
UNLINK): an entry settled after that may be a newer write the evidence never saw, so it is kept.

A put and a delete (or clear) of one key that overlap leave only the server knowing whether the SET
or the UNLINK ran last. :meth:`forget_unlinked` and :meth:`forget_all` return the entries they kept
for that reason, and :meth:`settle` the keys an UNLINK hit while their put was in flight: the caller
that finishes second asks the server (EXISTS) and forgets the absent ones with :meth:`forget`, so
the ledger is exact once both calls returned (unless that question faults: then it overcounts, as
before, until a later get, delete, clear or TTL settles the key).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from typing import Sequence

from radixkv.forksafe import hold_across_fork

__all__ = ["ByteLedger"]


class ByteLedger:
    """Thread-safe map ``(namespace, key) -> frame bytes`` with reservations and TTL expiry."""

    def __init__(self, capacity_bytes: int, ttl_s: float | None) -> None:
        self.capacity_bytes = capacity_bytes
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        # (namespace, key) -> (bytes, local expiry deadline, settle time)
        self._held: dict[tuple[str, str], tuple[int, float, float]] = {}
        self._expiry: deque[tuple[float, str, str]] = deque()  # deadlines in settle order
        self._used_bytes = 0
        self._reserved_bytes = 0
        # Puts in flight per key, and those of the keys an UNLINK of ours hit meanwhile (the put
        # cannot know whether its SET ran before that UNLINK: it asks the server when it settles).
        self._putting: Counter[tuple[str, str]] = Counter()
        self._unlinked_while_putting: set[tuple[str, str]] = set()
        # A fork never copies the ledger mid-update; the child drops the parent's puts in flight.
        hold_across_fork(self, in_child=ByteLedger._after_fork_in_child)

    def reserve(self, namespace: str, keys: Sequence[str], sizes_bytes: Sequence[int]) -> list[bool]:
        """Reserve room for each chunk in order; False where it does not fit (nothing reserved)."""
        granted = []
        with self._lock:
            self._purge(time.monotonic())
            for key, size in zip(keys, sizes_bytes):
                fits = self._used_bytes + self._reserved_bytes + size <= self.capacity_bytes
                if fits:
                    self._reserved_bytes += size
                    self._putting[(namespace, key)] += 1
                granted.append(fits)
        return granted

    def settle(
        self,
        namespace: str,
        keys: Sequence[str],
        sizes_bytes: Sequence[int],
        granted: Sequence[bool],
        stored: Sequence[bool],
    ) -> list[str]:
        """Release the reservations of one :meth:`reserve` and record the chunks that were stored.
        Returns the stored keys an UNLINK of this process hit while they were in flight: the server
        may have run it after the SET, so the caller asks it and forgets the absent ones."""
        recheck = []
        with self._lock:
            now = time.monotonic()
            deadline = math.inf if self._ttl_s is None else now + self._ttl_s
            for key, size, g, ok in zip(keys, sizes_bytes, granted, stored):
                if not g:
                    continue
                ident = (namespace, key)
                self._reserved_bytes -= size
                if ok:
                    old = self._held.get(ident, (0, 0.0, 0.0))[0]
                    self._held[ident] = (size, deadline, now)
                    self._used_bytes += size - old
                    if self._ttl_s is not None:
                        self._expiry.append((deadline, namespace, key))
                        if len(self._expiry) > 2 * len(self._held) + 1024:
                            self._compact_expiry()
                    if ident in self._unlinked_while_putting:
                        recheck.append(key)
                self._putting[ident] -= 1
                if not self._putting[ident]:  # the mark serves every put that was in flight then
                    del self._putting[ident]
                    self._unlinked_while_putting.discard(ident)
        return recheck

    def forget(self, namespace: str, keys: Sequence[str], seen_at: float) -> int:
        """Drop chunks found gone from the server (deleted, evicted, expired) by a request that
        started at ``seen_at`` (``time.monotonic()``); entries settled later are kept (``math.inf``:
        none, for chunks the caller stops counting while they stay). Returns how many it dropped."""
        n = 0
        with self._lock:
            for key in keys:
                entry = self._held.get((namespace, key))
                if entry is not None and entry[2] <= seen_at:
                    del self._held[(namespace, key)]
                    self._used_bytes -= entry[0]
                    n += 1
        return n

    def forget_unlinked(self, namespace: str, keys: Sequence[str], seen_at: float) -> list[str]:
        """:meth:`forget` for keys this process UNLINKed in a request that started at ``seen_at``.
        A put of such a key that overlapped the request may have run its SET before or after the
        UNLINK: returns the keys whose entry settled after ``seen_at`` (kept; the caller asks the
        server and forgets the absent ones), and marks those with a put in flight (:meth:`settle`)."""
        kept = []
        with self._lock:
            for key in keys:
                ident = (namespace, key)
                entry = self._held.get(ident)
                if entry is not None and entry[2] <= seen_at:
                    del self._held[ident]
                    self._used_bytes -= entry[0]
                elif entry is not None:
                    kept.append(key)
                if ident in self._putting:
                    self._unlinked_while_putting.add(ident)
        return kept

    def forget_all(self, namespace: str | None, seen_at: float) -> list[tuple[str, str]]:
        """Drop every chunk (of ``namespace``) settled by ``seen_at``, the start of a clear that
        UNLINKed them all. Like :meth:`forget_unlinked`: returns the (namespace, key) kept because
        they settled later, and marks the keys with a put in flight."""
        with self._lock:
            kept = []
            for ident in [i for i in self._held if namespace is None or i[0] == namespace]:
                if self._held[ident][2] <= seen_at:
                    self._used_bytes -= self._held.pop(ident)[0]
                else:
                    kept.append(ident)
            self._unlinked_while_putting.update(
                i for i in self._putting if namespace is None or i[0] == namespace)
            return kept

    def _after_fork_in_child(self) -> None:
        """In a forked child (lock held): the puts in flight at the fork ran on threads the child
        does not have, so their reservations would never be released there (lost capacity)."""
        self._reserved_bytes = 0
        self._putting.clear()
        self._unlinked_while_putting.clear()

    def used_bytes(self) -> int:
        with self._lock:
            self._purge(time.monotonic())
            return self._used_bytes

    def _compact_expiry(self) -> None:
        # Deadlines stay queued for chunks forgotten, deleted or stored again (a new deadline)
        # before them: without this the queue holds every put of the last ttl_s, not the chunks
        # held. Kept in order; rebuilt once it doubled past the entries held (amortized O(1)).
        held = self._held
        self._expiry = deque(
            e for e in self._expiry
            if (entry := held.get((e[1], e[2]))) is not None and entry[1] == e[0]
        )

    def _purge(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            deadline, namespace, key = self._expiry.popleft()
            entry = self._held.get((namespace, key))
            if entry is not None and entry[1] == deadline:  # not re-put since
                del self._held[(namespace, key)]
                self._used_bytes -= entry[0]

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(entry[0] for entry in self._held.values())
            assert total == self._used_bytes, f"held entries sum to {total} bytes, counter says {self._used_bytes}"
            assert self._reserved_bytes >= 0, f"reserved_bytes={self._reserved_bytes} is negative"
            assert self._used_bytes + self._reserved_bytes <= self.capacity_bytes, (
                f"used {self._used_bytes} + reserved {self._reserved_bytes} > capacity {self.capacity_bytes}"
            )
            assert all(entry[0] > 0 for entry in self._held.values()), "a held entry has no bytes"
            assert all(n > 0 for n in self._putting.values()), f"puts in flight: {self._putting}"
            assert self._unlinked_while_putting <= set(self._putting), "an UNLINK mark outlived its puts"
            # Every reservation belongs to a put in flight (reserve counts both, settle releases
            # both; frames are never empty): bytes reserved with no put left are capacity lost for good.
            assert (self._reserved_bytes > 0) == bool(self._putting), (
                f"reserved {self._reserved_bytes} bytes for {sum(self._putting.values())} puts in flight"
            )
            # Each entry expires at its deadline: with a TTL that deadline is queued (else the
            # entry would count against the capacity forever), without one there is none.
            queued = set(self._expiry) if self._ttl_s is not None else set()
            stuck = [(ns, key) for (ns, key), (_b, deadline, _at) in self._held.items()
                     if (deadline, ns, key) not in queued
                     and (self._ttl_s is not None or deadline != math.inf)]
            assert not stuck, f"{len(stuck)} held entries whose expiry is not queued, e.g. {stuck[:2]}"
