"""Background work of the hierarchical store: write-through copies and promotions, plus the
cascading hit/miss accounting of a read.

Both jobs run on the store's bounded write pool and hold pins (owner ``wt-*`` / ``promote-*``) on
their chunks until they finish, so the chunks cannot be evicted mid-transfer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from radixkv.background import WorkerPool
from radixkv.keys import Namespace
from radixkv.tiers.base import ChunkBytes, chunk_copy
from radixkv.transfer import ChunkRef, TierStack

__all__ = ["write_through", "cancel_write_through", "release", "account", "Promoter"]

_PROMOTE_COUNTS_MAX = 1 << 16


def write_through(stack: TierStack, refs: list[ChunkRef], owner: str) -> int:
    """Copy pinned chunks from the fastest tier holding them to every lower tier lacking them;
    releases ``owner``'s pins and the transfer count at the end. Returns chunks copied."""
    try:
        copied = 0
        for dst in range(1, len(stack.tiers)):
            by_src: dict[int, list[ChunkRef]] = defaultdict(list)
            with stack.cond:  # source: the fastest tier above dst that holds the chunk
                for r in refs:
                    m = stack.mask_locked(r)
                    src = (m & -m).bit_length() - 1
                    if m and not m & (1 << dst) and src < dst:
                        by_src[src].append(r)
            for src, group in by_src.items():
                ok = stack.copy(src, dst, group)
                copied += sum(ok)
                if not all(ok):
                    with stack.cond:
                        stack.note_failed_copies_locked(dst, [r for r, o in zip(group, ok) if not o])
        return copied
    finally:
        release(stack, refs, owner)


def cancel_write_through(stack: TierStack, refs: list[ChunkRef], owner: str) -> None:
    """A queued write-through job that never ran (a close stopped waiting for it): its chunks count
    as failed copies, for the flushing close to persist, then what it holds is released."""
    with stack.cond:
        stack.note_failed_copies_locked(None, refs)
    release(stack, refs, owner)


def release(stack: TierStack, refs: list[ChunkRef], owner: str) -> None:
    """What a queued write-through job holds: ``owner``'s pins and one transfer count."""
    with stack.cond:
        stack.unpin_locked(refs, owner)
        stack.end_transfer_locked()


def account(
    stack: TierStack, ns: Namespace, refs: list[ChunkRef], served: list[int], n: int, asked: int
) -> None:
    """Cascading per-tier counts: chunk i is a hit in the tier that served it and a miss in every
    faster tier; chunks no tier served are misses everywhere."""
    per_tier = [0] * len(stack.tiers)
    for t in served[:n]:
        per_tier[t] += 1
    size = refs[0].size_bytes if refs else 0
    missing = asked
    for t, c in enumerate(per_tier):
        name = stack.names[t]
        stack.metrics.hits(name, c, ns.tokens_in(c), c * size)
        missing -= c
        stack.metrics.misses(name, missing, ns.tokens_in(missing))


class Promoter:
    """Copies chunks served below the top tier into the top tier once they were hit
    ``after_hits`` times there (a bounded count per chunk; the counts restart when it fills)."""

    def __init__(self, stack: TierStack, pool: WorkerPool, after_hits: int) -> None:
        self._stack, self._pool, self._after_hits = stack, pool, after_hits
        self._counts: dict[tuple[str, str], int] = {}

    def promote(
        self, refs: list[ChunkRef], served: list[int], buffers: Sequence[ChunkBytes],
        read_clears: tuple[int, int] | None = None,
    ) -> None:
        """Queue the promotions due. The bytes are cloned now (the caller owns ``buffers`` once
        get returns); a full queue skips them (counted in ``dropped_jobs``)."""
        s = self._stack
        picks: list[int] = []
        with s.cond:
            for i, t in enumerate(served):
                if t <= 0:
                    continue
                ident = (refs[i].namespace, refs[i].key)
                c = self._counts.get(ident, 0) + 1
                if c >= self._after_hits:
                    self._counts.pop(ident, None)
                    picks.append(i)
                else:
                    if len(self._counts) >= _PROMOTE_COUNTS_MAX:
                        self._counts.clear()
                    self._counts[ident] = c
        if not picks:
            return
        owner = s.owner("promote")
        with s.cond:
            chosen = s.pin_locked([refs[i] for i in picks], owner)
            spaces = {r.namespace for r in chosen}
            clears = {ns: (s.clears[None], s.clears[ns]) for ns in spaces}  # to tell a clear since
            if read_clears is not None and any(c != read_clears for c in clears.values()):
                s.unpin_locked(chosen, owner)
                chosen = []  # a clear since the bytes were read: they may be stale
                spaces, clears = set(), {}
            # A background copy holding pins: a foreground writer (or adoption) whose eviction
            # candidates are all pinned by it waits for it (bounded) instead of getting no room.
            counted = bool(chosen)
            s.transfers_inflight += counted
        keep = {r.node_id for r in chosen}
        payloads = [chunk_copy(buffers[i]) for i in picks if refs[i].node_id in keep]

        def run(_job: Any) -> int:
            tokens: list[int] = []
            try:
                with s.cond:
                    # The bytes were taken when the job was queued: after a clear of their namespace
                    # they may be stale even where a later put reused the node id, so skip them.
                    fresh = {ns for ns in spaces if (s.clears[None], s.clears[ns]) == clears[ns]}
                    tokens = [s.begin_copy_locked(ns) for ns in fresh]  # a clear from now waits
                    masks = [s.mask_locked(r) if r.namespace in fresh else 0 for r in chosen]
                    todo = [(r, p) for r, p, m in zip(chosen, payloads, masks) if m and not m & 1]
                done = 0
                for ns in fresh:
                    part = [(r, p) for r, p in todo if r.namespace == ns]
                    done += sum(s.write(0, [r for r, _ in part], [p for _, p in part]))
                s.metrics.promotions(s.names[0], done)
                return done
            finally:
                with s.cond:
                    for token in tokens:
                        s.end_copy_locked(token)
                    s.unpin_locked(chosen, owner)
                    if counted:
                        s.end_transfer_locked()

        def give_up() -> None:
            with s.cond:
                s.unpin_locked(chosen, owner)
                if counted:
                    s.end_transfer_locked()

        try:  # cancelled before it ran (a non-flushing close): give_up
            job = self._pool.submit(run, 0, block=False, name=owner, on_cancel=give_up)
        except RuntimeError:  # the store is closing
            job = None
        if job is None:  # promotion is an optimisation: skip it rather than block the reader
            s.metrics.dropped_job("write")
            give_up()
