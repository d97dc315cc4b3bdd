"""Scheduler side of the vLLM connector: hit accounting and the per-step load/save plan.

Runs in vLLM's EngineCore process, which holds no KV bytes and (in real deployments) no store: a worker
process owns the store. So a lookup is a round trip through vLLM's own per-step channels:

1. ``get_num_new_matched_tokens`` for a request that could hit: returns ``None`` ("ask again") and
   queues a :class:`LookupOp` (request keys = its block hashes grouped into chunks);
2. ``build_connector_meta`` sends it; each worker does one store lookup per KV-cache group, fetches the
   hit chunks into staging buffers and answers in ``build_connector_worker_meta`` (min over workers);
3. ``update_connector_output`` records the answer; the next ``get_num_new_matched_tokens`` returns the
   hit beyond the local prefix-cache hit: ``(n, False)`` when the worker already read the chunks (the
   copy into blocks is synchronous, before the forward), ``(n, True)`` when they are still coming
   from a slow tier (vLLM parks the request until the worker reports it in ``finished_recving``);
4. ``update_state_after_alloc`` turns the hit into a :class:`LoadOp` on the allocated blocks;
5. every step, chunks that become fully computed (prompt chunks; generated ones with
   ``save_generated``) and are not known to be stored become :class:`SaveOp` s. Known to be stored
   means confirmed by a lookup answer (or planned by an earlier save of the request): vLLM's local
   prefix-cache hit is no evidence (it also holds generated tokens, never stored without
   ``save_generated``), so a request that was not looked up plans its saves from chunk 0 and the
   workers skip the leading chunks their store already holds before copying anything.

A failed load is reported by the worker (block ids to vLLM, request id to us); the request is then never
offered an external hit again (vLLM's "recompute" policy recomputes it; a stale hit would loop).

``reset_cache`` (vLLM resets the connector's cache, as every weight-update flow does) moves to a
fresh random *generation*, sent in every step's metadata from then on; the workers end every
namespace with it from the first step that carries it, so no chunk stored before the reset is loaded
again.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixkv.adapters.vllm_meta import LoadOp, LookupOp, RadixKVMetadata, RadixKVWorkerMeta, SaveOp
from radixkv.adapters.vllm_options import (
    NULL_BLOCK_ID,
    GroupGeometry,
    VllmConnectorOptions,
    chunk_keys_from_block_hashes,
    new_cache_generation,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    request: Any
    keys: list[str] = field(default_factory=list)
    lookup_seq: int | None = None  # the lookup in flight or answered
    lookup_first_chunk: int = 0
    hit_chunks: int | None = None  # the answer (leading chunks found, from chunk 0)
    hit_ready: bool = False
    matched_from_tokens: int = 0  # num_computed_tokens of the call that returned the hit
    failed: bool = False  # a load failed: never offer an external hit again
    # Leading chunks known to be in the store: a lookup's answer, or planned by an earlier save of
    # this request. Never inferred from vLLM's local prefix-cache hit.
    stored_chunks: int = 0
    stored_known: bool = False  # get_num_new_matched_tokens ran since (re)start: saves may be planned
    async_inflight: bool = False
    # The slowest tier the answered lookup's staged chunks came from (a CacheHitSource value, "":
    # unknown), which vLLM's per-source hit metrics read after the load is planned.
    hit_source: str = ""


class SchedulerSide:
    """The scheduler half; one per engine. Not thread-safe (vLLM calls it from its scheduler loop)."""

    def __init__(
        self,
        options: VllmConnectorOptions,
        groups: list[GroupGeometry],
        chunk_tokens: int,
        hash_block_size: int,
        loads: bool = True,
        saves: bool = True,
        num_kv_cache_groups: int | None = None,
    ) -> None:
        """``loads`` / ``saves``: the roles enabled by ``kv_role`` (kv_both: both; kv_producer: saves
        only; kv_consumer: loads only). ``groups`` are the groups radixkv stores, each naming its vLLM
        group index; ``num_kv_cache_groups`` is vLLM's total (None: ``len(groups)``)."""
        self.options = options
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.groups = groups
        self.num_kv_cache_groups = len(groups) if num_kv_cache_groups is None else num_kv_cache_groups
        self.chunk_tokens = chunk_tokens
        self.hash_block_size = hash_block_size
        self._requests: dict[str, _RequestState] = {}
        self._seq = itertools.count(1)
        self._pending_lookups: list[LookupOp] = []
        self._pending_loads: list[LoadOp] = []
        self._pending_releases: list[str] = []
        self._kv_cache_manager: Any = None
        # "" until the first reset_cache, then that reset's random token
        # (RadixKVMetadata.generation).
        self.generation = ""
        self.stats = {
            "lookups": 0,
            "hit_tokens": 0,
            "loads": 0,
            "async_loads": 0,
            # Chunks offered to the workers for saving (a worker skips those its store already holds
            # and counts what it stored in its own saved_chunks).
            "planned_save_chunks": 0,
            "failed_loads": 0,
            "resets": 0,
        }

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    # ---- hits ----------------------------------------------------------------------------------
    def _usable_chunks(self, request: Request) -> int:
        """Whole chunks strictly before the last prompt token (vLLM must compute at least one token)
        that have block hashes."""
        by_tokens = (request.num_tokens - 1) // self.chunk_tokens
        by_hashes = len(request.block_hashes) * self.hash_block_size // self.chunk_tokens
        return max(0, min(by_tokens, by_hashes))

    def _state(self, request: Request) -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._requests[request.request_id] = _RequestState(request)
        return st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if (
            st.failed
            or not self.loads_enabled
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            # Nothing looked up: saves start at the last store-confirmed chunk (0 if none). The
            # local hit may hold chunks no one stored (generated tokens of an earlier turn); the
            # workers skip the leading ones their store holds.
            st.stored_known = True
            return 0, False
        usable = self._usable_chunks(request)
        first = num_computed_tokens // self.chunk_tokens
        if usable - first < self.options.lookup_min_chunks:
            st.stored_known = True  # as above: nothing looked up, nothing assumed stored
            return 0, False
        if (
            st.hit_chunks is not None
            and num_computed_tokens < st.lookup_first_chunk * self.chunk_tokens
            and min(st.hit_chunks, usable) * self.chunk_tokens > num_computed_tokens
        ):
            # vLLM's local hit shrank during the round trip (it evicted free cached blocks): the
            # staged chunks start after it. The store holds more: ask again from the smaller local
            # hit (the new lookup replaces the staged read).
            st.stored_chunks = max(st.stored_chunks, st.hit_chunks)
            st.hit_chunks, st.lookup_seq = None, None
        if st.hit_chunks is None:
            if st.lookup_seq is None:
                if len(st.keys) < usable:
                    st.keys = chunk_keys_from_block_hashes(
                        request.block_hashes, self.hash_block_size, self.chunk_tokens, usable
                    )
                st.lookup_seq = next(self._seq)
                st.lookup_first_chunk = first
                self._pending_lookups.append(
                    LookupOp(request.request_id, st.lookup_seq, st.keys[:usable], first)
                )
                self.stats["lookups"] += 1
            return None, False
        hit_tokens = min(st.hit_chunks, usable) * self.chunk_tokens
        if hit_tokens <= num_computed_tokens:
            return 0, False
        st.matched_from_tokens = num_computed_tokens
        return hit_tokens - num_computed_tokens, self._load_is_async(st)

    def hit_source(self, request: Request) -> str:
        """The tier the request's planned load reads from, as a ``CacheHitSource`` value: the
        slowest tier the workers staged its chunks from ("" when they did not say)."""
        st = self._requests.get(request.request_id)
        return "" if st is None else st.hit_source

    def _load_is_async(self, st: _RequestState) -> bool:
        # With several KV-cache groups (HMA), vLLM 0.33 can only recover a failed load by request
        # (failed_recving), which it honours for requests waiting on an asynchronous load.
        # vLLM's rule counts all of its groups, including those radixkv does not store.
        return not st.hit_ready or self.num_kv_cache_groups > 1

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._requests.get(request.request_id)
        if st is None:
            return
        if num_external_tokens == 0:
            if st.async_inflight:
                return  # the second call of an async load, after the worker finished it
            if st.hit_chunks is not None or st.lookup_seq is not None:
                # A hit not taken, or a lookup still unanswered (with async scheduling vLLM can
                # schedule the request on its own prefix cache before the answer arrives): drop
                # the staged chunks now, not when the request finishes. The late answer no longer
                # matches lookup_seq and is ignored.
                self._pending_releases.append(request.request_id)
                if st.hit_chunks is not None:
                    # The store's leading run: chunks past it (held by the local prefix cache)
                    # get saved.
                    st.stored_chunks, st.stored_known = max(st.stored_chunks, st.hit_chunks), True
                st.hit_chunks, st.lookup_seq = None, None  # a preempted request looks up again
            return
        start = st.matched_from_tokens
        end = start + num_external_tokens
        first_chunk = start // self.chunk_tokens
        last_chunk = -(-end // self.chunk_tokens)  # exclusive
        page_ids: list[list[list[int]]] = []
        for g in self.groups:
            # vLLM's block lists cover every KV-cache group; self.groups only those radixkv stores.
            blocks_g = blocks.blocks[g.group_id]
            bs = g.block_size
            per_chunk = self.chunk_tokens // bs
            rows = []
            for c in range(first_chunk, last_chunk):
                row = []
                for b in range(c * per_chunk, (c + 1) * per_chunk):
                    inside = start // bs <= b < end // bs and b < len(blocks_g)
                    blk = blocks_g[b] if inside else None
                    row.append(-1 if blk is None or blk.is_null else blk.block_id)
                rows.append(row)
            page_ids.append(rows)
        is_async = self._load_is_async(st)
        self._pending_loads.append(
            LoadOp(request.request_id, st.lookup_seq or 0, first_chunk, page_ids, is_async)
        )
        self.stats["loads"] += 1
        self.stats["async_loads"] += int(is_async)
        self.stats["hit_tokens"] += num_external_tokens
        st.async_inflight = is_async
        st.stored_chunks = max(st.stored_chunks, st.hit_chunks or 0)
        st.stored_known = True
        st.hit_chunks, st.lookup_seq = None, None

    # ---- per-step plan -------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RadixKVMetadata:
        meta = RadixKVMetadata(
            lookups=self._pending_lookups,
            loads=self._pending_loads,
            releases=self._pending_releases,
            generation=self.generation,
        )
        self._pending_lookups, self._pending_loads, self._pending_releases = [], [], []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if not self.saves_enabled:
            return meta
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or not st.stored_known:
                continue
            op = self._plan_save(st, n_sched, block_state)
            if op is not None:
                meta.saves.append(op)
        return meta

    def _plan_save(
        self, st: _RequestState, num_scheduled_tokens: int, block_state: Any
    ) -> SaveOp | None:
        request = st.request
        computed_after = request.num_computed_tokens + num_scheduled_tokens
        limit = request.num_tokens if self.options.save_generated else request.num_prompt_tokens
        limit = min(limit, len(request.block_hashes) * self.hash_block_size, computed_after)
        end_chunk = limit // self.chunk_tokens
        if end_chunk <= st.stored_chunks:
            return None
        block_ids = (
            block_state.get_block_ids(request.request_id) if block_state is not None else None
        )
        if block_ids is None and self._kv_cache_manager is not None:
            block_ids = self._kv_cache_manager.get_block_ids(request.request_id)
        if block_ids is None:
            return None
        first = st.stored_chunks
        per_group = [
            (block_ids[g.group_id], self.chunk_tokens // g.block_size)  # ids cover every group
            for g in self.groups
        ]
        page_ids: list[list[list[int]]] = [[] for _ in self.groups]
        live = False  # a chunk of this op whose blocks are all there in every group
        for c in range(first, end_chunk):
            rows = [list(ids[c * n : (c + 1) * n]) for ids, n in per_group]
            if any(len(row) < n for row, (_, n) in zip(rows, per_group)):
                end_chunk = c  # a missing block: nothing from here on is computed in blocks
                break
            if any(NULL_BLOCK_ID in row for row in rows):
                # A sliding-window group's skipped block (outside the window of vLLM's local hit,
                # or freed during a long prefill): this chunk cannot be gathered whole. Leading
                # ones go as -1 pages (a worker whose store holds them skips them, and stores the
                # rest only then); after a gatherable chunk, the chain ends here.
                if live:
                    end_chunk = c
                    break
                rows = [[-1 if b == NULL_BLOCK_ID else b for b in row] for row in rows]
            else:
                live = True
            for gi, row in enumerate(rows):
                page_ids[gi].append(row)
        if end_chunk <= first:
            return None
        if len(st.keys) < end_chunk:
            st.keys = chunk_keys_from_block_hashes(
                request.block_hashes, self.hash_block_size, self.chunk_tokens, end_chunk
            )
        st.stored_chunks = end_chunk
        self.stats["planned_save_chunks"] += end_chunk - first
        return SaveOp(
            request.request_id,
            st.keys[first:end_chunk],
            st.keys[first - 1] if first else None,
            page_ids,
        )

    # ---- worker feedback and request end -------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, RadixKVWorkerMeta):
            for req_id, rep in wm.lookups.items():
                st = self._requests.get(req_id)
                if st is not None and st.lookup_seq == rep.seq:
                    st.hit_chunks, st.hit_ready = rep.hit_chunks, rep.ready
                    st.hit_source = rep.source
            for req_id in wm.failed_loads:
                st = self._requests.get(req_id)
                if st is not None:
                    st.failed = True
                    # What we thought was stored may not be: plan this request's saves from chunk 0
                    # again (the workers skip what their store still holds).
                    st.stored_chunks = 0
                    self.stats["failed_loads"] += 1
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            st = self._requests.get(req_id)
            if st is not None:
                st.async_inflight = False

    def reset_cache(self) -> bool:
        """vLLM's connector cache reset (``KVConnectorBase_V1.reset_cache``, called through
        ``reset_prefix_cache(reset_connector=True)``: ``pause_generation(clear_cache=True)``,
        ``sleep(level>=1)``, ``release_kv_cache_memory``): no chunk stored before it is loaded by
        this engine again.

        Draws a fresh generation, which the next step's metadata (and every later one) carries to
        all workers; from that step on they look up, load and save under namespaces ending with it,
        and fail the loads still waiting for chunks of the old one (vLLM recomputes their blocks).
        What this side knew of the old generation is dropped: lookups queued, in flight or answered
        (a late answer no longer matches ``lookup_seq`` and is ignored; the request asks again), and
        which chunks are stored. A request holding KV computed before the reset (one running through
        it, or waiting for an asynchronous load) stores nothing more until it restarts from its
        local hit: its later chunks attend to that KV. A request preempted by the reset
        (``reset_running_requests``) restarts so, and stores its chunks under the new generation.

        Returns True: the reset is complete for vLLM's purposes (the workers switch before any
        lookup, load or save of the next step, with no round trip), and nothing here can fail.
        vLLM calls it between steps, never inside ``schedule``."""
        self.generation = new_cache_generation()
        self._pending_lookups = []
        for st in self._requests.values():
            st.lookup_seq, st.hit_chunks, st.hit_ready = None, None, False
            st.stored_chunks, st.stored_known = 0, False
        self.stats["resets"] += 1
        logger.info(
            "radixkv: connector cache reset by vLLM: cache generation %s from the next step; "
            "chunks stored before it are no longer read",
            self.generation,
        )
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Saves are copied out within the step that computed them and loads write only blocks vLLM
        already holds back for in-flight receives, so blocks can always be freed now."""
        st = self._requests.pop(request.request_id, None)
        if st is not None and (st.lookup_seq is not None or st.hit_chunks is not None):
            self._pending_releases.append(request.request_id)
        return False, None

    def check_integrity(self) -> None:
        for req_id, st in self._requests.items():
            assert st.request.request_id == req_id, (req_id, st.request.request_id)
            assert st.stored_chunks >= 0 and (st.hit_chunks is None or st.hit_chunks >= 0), (
                req_id,
                st,
            )
            assert not (st.async_inflight and st.failed and st.hit_chunks), (req_id, st)
        seqs = [op.seq for op in self._pending_lookups]
        assert len(seqs) == len(set(seqs)), seqs
