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
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Sequence

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

    def reserve(self, namespace: str, keys: Sequence[str], sizes_bytes: Sequence[int]) -> list[bool]:
        """Reserve room for each chunk in order; False where it does not fit (nothing reserved)."""
        granted = []
        with self._lock:
            self._purge(time.monotonic())
            for size in sizes_bytes:
                fits = self._used_bytes + self._reserved_bytes + size <= self.capacity_bytes
                if fits:
                    self._reserved_bytes += size
                granted.append(fits)
        return granted

    def settle(
        self,
        namespace: str,
        keys: Sequence[str],
        sizes_bytes: Sequence[int],
        granted: Sequence[bool],
        stored: Sequence[bool],
    ) -> None:
        """Release the reservations of one :meth:`reserve` and record the chunks that were stored."""
        with self._lock:
            now = time.monotonic()
            deadline = math.inf if self._ttl_s is None else now + self._ttl_s
            for key, size, g, ok in zip(keys, sizes_bytes, granted, stored):
                if not g:
                    continue
                self._reserved_bytes -= size
                if ok:
                    old = self._held.get((namespace, key), (0, 0.0, 0.0))[0]
                    self._held[(namespace, key)] = (size, deadline, now)
                    self._used_bytes += size - old
                    if self._ttl_s is not None:
                        self._expiry.append((deadline, namespace, key))

    def forget(self, namespace: str, keys: Sequence[str], seen_at: float) -> None:
        """Drop chunks found gone from the server (deleted, evicted, expired) by a request that
        started at ``seen_at`` (``time.monotonic()``); entries settled later are kept."""
        with self._lock:
            for key in keys:
                entry = self._held.get((namespace, key))
                if entry is not None and entry[2] <= seen_at:
                    del self._held[(namespace, key)]
                    self._used_bytes -= entry[0]

    def forget_all(self, namespace: str | None, seen_at: float) -> None:
        with self._lock:
            for ident in [i for i, e in self._held.items()
                          if (namespace is None or i[0] == namespace) and e[2] <= seen_at]:
                self._used_bytes -= self._held.pop(ident)[0]

    def used_bytes(self) -> int:
        with self._lock:
            self._purge(time.monotonic())
            return self._used_bytes

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
