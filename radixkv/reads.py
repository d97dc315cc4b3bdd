"""Reads with fallback down the hierarchy, and payload access for copies between tiers.

A read goes to the fastest tier holding each chunk, one ``get_many`` per tier. A chunk a tier fails to
deliver (miss, checksum failure, server down) loses that residency in the tree; chunks below it that
no tier can reach any more are dropped as orphans and their bytes deleted (only forgotten in a tier
other processes write: a shared disk directory, Redis). The chunk is retried from
the next tier holding it; a chunk no tier delivers ends the run. Never wrong bytes. Once the store
is closing (``TierStack.closing``), a failed read is its tiers closing under it, not a lost chunk:
the read just misses and nothing is forgotten or deleted (the persistent tiers keep the chunks).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from radixkv.tiers.base import ChunkBytes, check_buffers_disjoint

if TYPE_CHECKING:
    from radixkv.transfer import ChunkRef, TierStack

__all__ = ["read_run", "forget_failed", "Payloads"]


def read_run(
    stack: TierStack,
    refs: Sequence[ChunkRef],
    masks: list[int],
    buffers: Sequence[ChunkBytes],
    cancelled: Callable[[], bool] = lambda: False,
) -> tuple[int, list[int]]:
    """Fill ``buffers`` with the pinned chunks (one namespace), each from the fastest tier holding
    it, falling back down the hierarchy on a failed read. Returns (leading run read, tier that
    served each chunk or -1)."""
    n = len(refs)
    served = [-1] * n
    limit = n
    ns = refs[0].namespace if refs else ""
    calls = 0
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
            if calls == 1:
                # Every tier refuses buffers that share bytes within its own call; a read that
                # spans calls (tiers, or a fallback round) checks them all once, before the second
                # call, or one tier could overwrite bytes another already delivered.
                check_buffers_disjoint([[b] if isinstance(b, torch.Tensor) else b for b in buffers[:limit]])
            calls += 1
            ok = stack.tier_get(t, ns, [refs[i].key for i in idx], [buffers[i] for i in idx])
            for i, o in zip(idx, ok):
                if o:
                    served[i] = t
                else:
                    failed.append((i, t))
        if not failed:
            continue
        forget_failed(stack, refs, masks, failed)
    run = 0
    while run < limit and served[run] >= 0:
        run += 1
    return run, served


def forget_failed(
    stack: TierStack, refs: Sequence[ChunkRef], masks: list[int], failed: list[tuple[int, int]]
) -> None:
    """Drop the failed chunks' residencies (``(index, tier)`` pairs) from ``masks`` and the tree,
    and delete the orphans' bytes. While the store closes only ``masks`` changes: a read overtaken
    by close() fails because the tiers closed, and its chunks, intact on a persistent tier, must
    not be deleted there."""
    by_tier: dict[int, list[int]] = defaultdict(list)
    for i, t in failed:
        by_tier[t].append(i)
        masks[i] &= ~(1 << t)
        stack.metrics.read_failures(stack.names[t], 1)
    if stack.closing:
        return
    entries: list[tuple[int, str, str]] = []
    with stack.cond:
        for t, idx in by_tier.items():
            ids = [refs[i].node_id for i in idx if stack.mask_locked(refs[i]) & (1 << t)]
            entries += [(t, refs[i].namespace, refs[i].key) for i in idx]
            entries += stack.clear_locked(ids, t)
        for i, _t in failed:  # what the tree still knows (another thread may have added a tier)
            masks[i] &= stack.mask_locked(refs[i])
        # A borrowed namespace's bytes are the owner's, and a shared tier's key may hold another
        # process's new file or value by now: forget those, never delete them (lost_entries_locked).
        entries = stack.mark_deleting_locked(stack.lost_entries_locked(entries))
    stack.delete_entries(entries)


class Payloads:
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
            forget_failed(s, refs, masks, bad)
        return views

    def __exit__(self, *exc: object) -> None:
        if self._lease is not None:
            self._lease.release()
