"""Persisting a store at close: chunks only memory tiers hold are copied down.

With ``write_back`` a chunk reaches a lower tier only when it is evicted from the one above, so at
``close()`` the chunks that only memory tiers hold would die with the process. A graceful close
(``flush_on_close``) copies each of them, parents first, from the fastest memory tier holding it to
the first tier below that outlives the process (disk, Redis), as a write-back cache flushes its dirty
lines on shutdown. The copy is the eviction path's own (:meth:`TierStack.copy`: reserve room,
which may evict down there, write, mark resident), in batches, until ``deadline``; what is left is
counted, and logged by the caller. A ``write_through`` store copies every chunk down as it is put;
at close it persists only the chunks whose copy failed (``TierStack.failed_copies``), not those a
lower tier evicted by its own policy (copying those back would evict that tier's newer chunks).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Container

if TYPE_CHECKING:
    from radixkv.transfer import ChunkRef, TierStack

__all__ = ["FlushResult", "persist_volatile"]

_BATCH_CHUNKS = 64  # one tier put per batch: big enough to amortize, small enough to meet a deadline


@dataclass(frozen=True, slots=True)
class FlushResult:
    """Chunks only memory tiers held at the start: copied down, and not (deadline, failed put, no
    tier below that outlives the process)."""

    written_chunks: int = 0
    left_chunks: int = 0


def persist_volatile(
    stack: TierStack, deadline: float, owner: str = "close-flush",
    only: Container[tuple[str, str]] | None = None,
) -> FlushResult:
    """Copy every chunk held only by memory tiers to the first persistent tier below its fastest
    holder, parents before children, until ``deadline`` (``time.monotonic()``); with ``only``, just
    the chunks whose ``(namespace digest, key)`` it holds. Thread-safe: the chunks are pinned while
    copied, so a racing eviction cannot take them mid-copy."""
    volatile_mask = sum(1 << t for t in range(len(stack.tiers)) if not stack.persists(t))
    groups: dict[tuple[int, int], list[tuple[int, ChunkRef]]] = defaultdict(list)
    stranded = 0
    with stack.cond:
        tree = stack.tree
        for ns in tree.namespaces():
            for key, n in tree.items(ns):
                if only is not None and (ns, key) not in only:
                    continue
                mask = tree.node_tier_mask(n)
                if mask & ~volatile_mask:
                    continue  # a persistent tier holds it already
                src = (mask & -mask).bit_length() - 1
                below = [t for t in range(src + 1, len(stack.tiers)) if stack.persists(t)]
                # not into a tier where another process owns the namespace (store.borrow): its
                # copies there are skipped on purpose, so neither written nor left
                dst = next((t for t in below if not stack.is_borrowed_locked(t, ns)), None)
                if dst is None:
                    if not below:
                        stranded += 1
                    continue
                groups[(src, dst)].append((tree.node_depth(n), stack.ref_locked(n)))
        for refs in groups.values():
            refs.sort(key=lambda dr: dr[0])  # parents first: a partial flush keeps whole prefixes
            stack.pin_locked([r for _, r in refs], owner)
    written = 0
    todo = sum(len(v) for v in groups.values())
    try:
        for (src, dst), items in groups.items():
            refs = [r for _, r in items]
            for i in range(0, len(refs), _BATCH_CHUNKS):
                if time.monotonic() >= deadline:
                    break
                batch = []
                with stack.cond:
                    for r in refs[i : i + _BATCH_CHUNKS]:
                        mask = stack.mask_locked(r)
                        if mask & ~volatile_mask:
                            written += 1  # an eviction meanwhile demoted it to a persistent tier
                        elif mask & (1 << src):
                            batch.append(r)
                try:
                    written += sum(stack.copy(src, dst, batch))
                except Exception:  # a tier must fail a put, not raise: count the batch as left
                    pass
    finally:
        with stack.cond:
            for items in groups.values():
                stack.unpin_locked([r for _, r in items], owner)
    return FlushResult(written, todo - written + stranded)
