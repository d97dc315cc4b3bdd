"""The messages between the connector's scheduler side and its workers: plain data only.

vLLM pickles the scheduler output (with :class:`RadixKVMetadata`) to every worker when it runs more
than one, and sends each worker's :class:`RadixKVWorkerMeta` back through ``ModelRunnerOutput``. So
every field here is an int, bool, str, or a list/tuple/dict of them: no tensors, no handles, no vLLM
objects. Page ids are ``[chunk][page]`` lists per KV-cache group, ``-1`` = leave this page alone
(already computed locally, or a sliding-window group's skipped block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

__all__ = ["LookupOp", "LoadOp", "SaveOp", "RadixKVMetadata", "LookupReport", "RadixKVWorkerMeta",
           "merge_reach", "reach_source", "source_reach"]

PageIds = list[list[int]]  # [chunk][page] for one KV-cache group


@dataclass(slots=True)
class LookupOp:
    """Find how many leading chunks of ``keys`` the store holds and fetch ``keys[first_chunk:hit]``
    into the worker's staging buffers (the later :class:`LoadOp` copies from there)."""

    req_id: str
    seq: int
    keys: list[str]
    first_chunk: int


@dataclass(slots=True)
class LoadOp:
    """Copy staged chunks ``first_chunk .. first_chunk + len(page_ids[g]) - 1`` into engine blocks."""

    req_id: str
    seq: int
    first_chunk: int
    page_ids: list[PageIds]  # one per KV-cache group
    is_async: bool


@dataclass(slots=True)
class SaveOp:
    """Copy the engine blocks of chunks ``keys`` (whose tokens are computed by the end of this step)
    out and store them; ``parent_key`` is the key of the chunk before ``keys[0]`` (None = first).
    A worker first skips the leading chunks its store already holds (nothing of them is copied); a
    ``-1`` page (a sliding-window group's skipped block) makes its chunk, and the rest of the chain,
    unstorable unless the store holds it."""

    req_id: str
    keys: list[str]
    parent_key: str | None
    page_ids: list[PageIds]  # one per KV-cache group


@dataclass
class RadixKVMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    lookups: list[LookupOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # req ids whose staged chunks can be dropped
    # The cache generation this step's lookups, loads and saves use: "" until vLLM first resets the
    # connector's cache (reset_cache), then a fresh random token per reset. Every worker ends each
    # namespace with it from the first step that carries it (docs/vllm.md §5).
    generation: str = ""


@dataclass(slots=True)
class LookupReport:
    """One worker's answer to a :class:`LookupOp`: ``hit_chunks`` leading chunks found (counted from
    chunk 0), and whether the staged ones were already read (``ready``: a synchronous load can use them
    in the next step; otherwise the scheduler asks for an asynchronous load). ``source``: the
    slowest tier the hit's staged chunks are read from, as a ``CacheHitSource`` value ("": none
    staged, or unknown). ``reach`` (:func:`source_reach`) lets a merge of two workers' reports name
    the source of the hit they share, which may be shorter than either's own; ``unknown_source``, in
    a merge that has a reach, is the slowest source of the merged reports that had none."""

    seq: int
    hit_chunks: int
    ready: bool
    source: str = ""
    reach: tuple[tuple[str, int], ...] = ()
    unknown_source: str = ""

    def _unreached_source(self) -> str:
        # the part of the source no reach accounts for
        return self.unknown_source if self.reach else self.source


@dataclass
class RadixKVWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step; vLLM aggregates one per TP/PP worker with :meth:`aggregate`."""

    lookups: dict[str, LookupReport] = field(default_factory=dict)
    failed_loads: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> RadixKVWorkerMeta:
        """Merge two workers' answers; the result does not depend on the merge order.

        A chunk is a hit only where every worker holds its shard: the minimum of the hit counts, AND of
        the ready flags, and as source the slowest tier the shared hit's chunks are read from (from
        the reaches; a report without one adds its own source as it is). A lookup that only one side answered, or that the two answered for different
        lookups (``seq``), is a miss: ``LookupReport(seq, 0, True)`` (nothing to read, so ready), with
        the newer ``seq`` (the scheduler numbers lookups increasingly and keeps only its latest)."""
        assert isinstance(other, RadixKVWorkerMeta), type(other)
        merged: dict[str, LookupReport] = {}
        for req_id in self.lookups.keys() | other.lookups.keys():
            mine, theirs = self.lookups.get(req_id), other.lookups.get(req_id)
            if mine is None or theirs is None or mine.seq != theirs.seq:
                # A worker that did not answer this lookup cannot serve its shard of it: a miss.
                seq = max(r.seq for r in (mine, theirs) if r is not None)
                merged[req_id] = LookupReport(seq, 0, True)
            else:
                hit = min(mine.hit_chunks, theirs.hit_chunks)
                reach = merge_reach(mine.reach, theirs.reach)
                # The source of the shared hit, from the merged reach (the slower of two workers'
                # own sources could name a tier only past the shared hit), with what reports
                # without a reach said: associative, so the merge order never matters.
                unknown = outermost_source(mine._unreached_source(), theirs._unreached_source())
                source = outermost_source(reach_source(reach, hit) if reach else "", unknown)
                merged[req_id] = LookupReport(mine.seq, hit, mine.ready and theirs.ready, source, reach,
                                              unknown if reach else "")
        return RadixKVWorkerMeta(
            lookups=merged, failed_loads=self.failed_loads | other.failed_loads
        )


def outermost_source(a: str, b: str) -> str:
    """The ``CacheHitSource`` value of ``a`` and ``b`` farthest from the accelerator ("": none)."""
    if not a or not b:
        return a or b
    return CacheHitSource.outermost([CacheHitSource(a), CacheHitSource(b)]).value


# A hit's source is the slowest tier among its chunks; a report carries, per source, how far from
# chunk 0 the chunks read from it or a nearer one reach (a few pairs, not a list per chunk), so
# that the source of any shorter hit, a merge's included, is known.
_RANK = {source.value: rank for rank, source in enumerate(CacheHitSource)}


def source_reach(chunk_sources: Sequence[str], first_chunk: int) -> tuple[tuple[str, int], ...]:
    """For staged chunks ``first_chunk, first_chunk + 1, ...`` read from ``chunk_sources`` (per
    chunk, the slowest tier's ``CacheHitSource`` value): per source among them, nearest first, the
    chunk count from chunk 0 that a hit read from that source or nearer ones reaches."""
    out = []
    for rank in sorted({_RANK[s] for s in chunk_sources}):
        n = 0
        for s in chunk_sources:
            if _RANK[s] > rank:
                break
            n += 1
        out.append((list(CacheHitSource)[rank].value, first_chunk + n))
    return tuple(out)


def reach_source(reach: Sequence[tuple[str, int]], hit_chunks: int) -> str:
    """The source of a hit of ``hit_chunks`` chunks (from chunk 0): the nearest one reaching it."""
    for source, n in reach:
        if n >= hit_chunks:
            return source
    return reach[-1][0] if reach else ""


def merge_reach(a: Sequence[tuple[str, int]], b: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The reach of chunks both workers hold (each chunk read from the slower of their two tiers):
    per source, the shorter of the two reaches. An unknown reach (``()``) is the identity."""
    if not a or not b:
        return tuple(a or b)

    def at(reach: Sequence[tuple[str, int]], rank: int) -> int:
        # reach is nearest first and grows with the rank: the last entry at or below it
        n = 0
        for source, k in reach:
            if _RANK[source] <= rank:
                n = k
        return n

    ranks = sorted({_RANK[s] for s, _ in a} | {_RANK[s] for s, _ in b})
    return tuple((list(CacheHitSource)[r].value, min(at(a, r), at(b, r))) for r in ranks)
