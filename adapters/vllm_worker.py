"""Worker side of the vLLM connector: owns the store and moves bytes between it and vLLM's KV blocks.

One instance per vLLM worker process (one per TP/PP/PCP rank). Per step, with the bound
:class:`RadixKVMetadata`:

* lookups: one ``store.lookup`` per KV-cache group over the request's chunk keys (with the store's
  ``probe_tiers``, chunks a disk/Redis tier holds from a previous run or another instance are adopted
  here), then ``prefetch`` of the hit chunks beyond the local hit into staging buffers (background
  reads from slow tiers);
* loads: staged chunks -> blocks with ``radixkv.kernels.scatter_chunks``; synchronous loads run in
  ``start_load_kv`` through a :class:`LayerPipeline` per group, so on GPU layer ``i`` is copied on a
  side stream while layer ``i - 1`` computes and ``wait_for_layer_load`` only orders the streams;
  asynchronous loads (chunks still coming from a slow tier) are copied once their reads finish, polled
  in ``get_finished``, which then reports them in ``finished_recving``;
* saves: the leading chunks of a save that the store already holds are skipped first (one tree-only
  ``store.lookup`` per group), then blocks -> fresh chunk buffers with ``gather_chunks``, layer by
  layer in ``save_kv_layer`` (overlapping the forward on GPU); ``wait_for_save`` gathers the layers
  whose hook did not run (full CUDA graphs skip the per-layer hooks), waits for the copies and
  ``put`` s the chunks. A save whose parent chunk the store does not hold is dropped (the store
  would refuse it) and counted in ``orphaned_chunks``.

A chunk that cannot be read (evicted between lookup and load, checksum mismatch, tier down) is a failed
load: its block ids go to ``get_block_ids_with_load_errors`` (vLLM's ``kv_load_failure_policy``
recomputes them) and the request id goes back to the scheduler side, which stops offering hits for it.

Cache generations: after vLLM resets the connector's cache (weight updates do), the metadata carries
a new ``generation``. From the first step that carries it, every group's namespace ends with it (so
no chunk stored before is read again), staged reads of the old generation are dropped (an async load
still waiting for one fails; vLLM recomputes it) and no save of the old generation is stored.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.adapters.vllm_meta import (
    LoadOp,
    LookupOp,
    LookupReport,
    RadixKVMetadata,
    RadixKVWorkerMeta,
    SaveOp,
    reach_source,
    source_reach,
)
from radixkv.adapters.vllm_options import (
    GroupGeometry,
    VllmConnectorOptions,
    group_namespace,
    worker_dir,
)
from radixkv.errors import ConfigError

__all__ = ["WorkerSide", "open_store"]

logger = logging.getLogger(__name__)


def _tier_sources(store: Any) -> list[str]:
    """Per tier of ``store``: the ``CacheHitSource`` value vLLM's metrics report for a hit read
    there (memory: host; disk: disk; Redis and anything else: external_unspecified)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from radixkv.tiers.disk import DiskTier
    from radixkv.tiers.memory import MemoryTier

    def source(tier: Any) -> CacheHitSource:
        if isinstance(tier, MemoryTier):
            return CacheHitSource.HOST
        if isinstance(tier, DiskTier):
            return CacheHitSource.DISK
        return CacheHitSource.EXTERNAL_UNSPECIFIED  # vLLM's label for a remote store

    return [source(t).value for t in getattr(store, "tiers", ())]


def open_store(options: VllmConnectorOptions, rank: int = 0, directory: str | None = None) -> Any:
    """The worker's :class:`radixkv.store.HierarchicalStore` for ``options`` (see VllmConnectorOptions):
    the ``store`` mapping, else ``store_config_file``, each over the non-tier ``RADIXKV_*``
    variables (the mapping's keys win; the variables override the file), else the ``RADIXKV_*``
    environment. ``rank`` (the worker's rank on its host: TP, PCP, PP and DP) moves
    ``metrics_port`` up so each worker serves its own. ``directory`` (:func:`worker_dir`; None: a
    single worker's, ``worker_dir()``) is the worker's own directory under each disk tier that is
    not ``shared``: ``<root>/<directory>``, the tier's capacity being the worker's."""
    import dataclasses
    import os

    from radixkv.config import StoreConfig, metrics_port_for_rank, private_disk_dirs
    from radixkv.config_env import env_overrides
    from radixkv.store import HierarchicalStore

    if options.store is not None:
        cfg = StoreConfig.from_dict({**env_overrides(StoreConfig, os.environ), **options.store})
    elif options.store_config_file is not None:
        cfg = StoreConfig.from_yaml(options.store_config_file)
        cfg = dataclasses.replace(cfg, **env_overrides(
            StoreConfig, os.environ, base=cfg, base_name=f"store_config_file={options.store_config_file}"))
    else:  # the RADIXKV_* environment, with one 4 GiB memory tier unless it names tiers
        cfg = StoreConfig.from_env(default_tiers=[{"url": "mem://", "capacity_bytes": 4 << 30}])
    # Every worker of every engine on the host reads the same config: a private disk directory each.
    cfg = private_disk_dirs(cfg, worker_dir() if directory is None else directory, "vLLM worker")
    return HierarchicalStore(metrics_port_for_rank(cfg, rank))


@dataclass(slots=True)
class _Staged:
    """Chunks ``first_chunk .. first_chunk + len(buffers[g]) - 1`` of one request, being read."""

    seq: int
    first_chunk: int
    hit_chunks: int
    buffers: list[list[torch.Tensor] | None]  # [group][chunk] 1-D uint8 payloads (None: not here)
    handles: list[Any]  # one prefetch handle per group (None: nothing to read)
    nbytes: int
    # per staged chunk, the slowest tier it is read from (a CacheHitSource value; empty: unknown)
    chunk_sources: list[str] = field(default_factory=list)

    def done(self) -> bool:
        return all(h is None or h.done() for h in self.handles)

    def readable_chunks(self) -> int:
        """Chunks actually read (blocks until every read finished): the leading run over all groups."""
        counts = [
            len(b) if h is None else int(h.wait())
            for h, b in zip(self.handles, self.buffers)
            if b is not None  # None: a group another pipeline stage holds
        ]
        return min(counts) if counts else 0


@dataclass(slots=True)
class _Group:
    geometry: GroupGeometry
    layout: Any  # radixkv.kernels.PagedLayout over the group's distinct layer tensors
    layer_index: dict[str, int]  # layer name -> index in layout (shared-KV layers share an index)
    namespace: Any
    pipeline: Any
    pages_per_chunk: int
    chunk_bytes: int


@dataclass(slots=True)
class _PendingSave:
    op: SaveOp
    buffers: list[list[torch.Tensor]]  # [group][chunk]
    layers_done: list[set[int]] = field(default_factory=list)
    # Leading chunks of op the first held group's store already held (another group lacked them):
    # its put reports them stored, but they do not count as saved.
    held_first: int = 0


class WorkerSide:
    """The worker half. Driven from the model-runner thread only (not thread-safe)."""

    def __init__(
        self,
        options: VllmConnectorOptions,
        groups: list[GroupGeometry],
        chunk_tokens: int,
        model: str,
        kv_cache_layout: str,
        tp_rank: int,
        tp_size: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        store: Any = None,
        dp_rank: int = 0,
        model_digest: str = "",
        num_kv_cache_groups: int | None = None,
        pcp_rank: int = 0,
        pcp_size: int = 1,
        writes: bool = True,
        loads: bool = True,
    ) -> None:
        """``model_digest``: :func:`~radixkv.adapters.vllm_options.model_identity_digest` of the
        deployment, part of every group's namespace (``""`` only for tools without a vLLM config).
        ``groups`` are the KV-cache groups radixkv stores; ``num_kv_cache_groups`` is vLLM's total
        (None: ``len(groups)``), which decides how a failed load is reported. ``pcp_rank`` /
        ``pcp_size``: the worker's prefill-context-parallel rank (it moves the metrics port only:
        PCP alone replicates the KV on every PCP rank, so the namespace stays the TP/PP rank's).
        ``writes``: whether this engine stores chunks (``kv_role`` kv_both or kv_producer). A
        kv_consumer (False) only reads the shared tiers: it borrows its namespaces there
        (:meth:`~radixkv.store.HierarchicalStore.borrow`), so it never writes into them nor
        deletes the chunks another engine stored there. ``loads``: whether it loads chunks (kv_both
        or kv_consumer); only a loading worker's ``max_staging_bytes`` must hold a chunk."""
        self.options = options
        self.geometries = groups
        self.chunk_tokens = chunk_tokens
        self.model = model
        self.model_digest = model_digest
        self.num_kv_cache_groups = len(groups) if num_kv_cache_groups is None else num_kv_cache_groups
        self.kv_cache_layout = kv_cache_layout
        self.ranks = (tp_rank, tp_size, pp_rank, pp_size)
        # This worker among all of the host's: its metrics port offset, in vLLM's rank order (DP,
        # PP, PCP, TP). Data-parallel ranks are separate engines with the same TP/PP ranks, and PCP
        # ranks separate workers with the same TP/PP ranks, so both count too (their namespaces do
        # not differ: DP replicas and PCP ranks hold the same KV and share it).
        self.metrics_rank = tp_rank + tp_size * (pcp_rank + pcp_size * (pp_rank + pp_size * dp_rank))
        # Its own directory under each private disk tier, named by the same coordinates.
        self.worker_dir = worker_dir(tp_rank, tp_size, pp_rank, pp_size, pcp_rank, pcp_size, dp_rank)
        self.store = store
        self.writes = writes
        self.loads = loads
        # The cache generation of the namespaces in use: "" until the scheduler side's first
        # reset_cache reaches this worker in a step's metadata (then that reset's token).
        self.generation = ""
        self.groups: list[_Group | None] = []  # per KV-cache group; None: another stage's
        self._meta: RadixKVMetadata | None = None
        self._staged: dict[str, _Staged] = {}
        self._staged_bytes = 0  # buffers of self._staged and of self._draining
        self._draining: list[_Staged] = []  # dropped, but a read may still be filling them
        self._reports: dict[str, LookupReport] = {}
        self._new_lookups: list[str] = []
        self._sync_loads_started = False
        self._sync_load_keepalive: list[Any] = []
        self._async_loads: list[LoadOp] = []
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._saves: list[_PendingSave] = []
        # A copy of this step raised: its saves are dropped and not rebuilt from the metadata by a
        # later hook of the step (vLLM calls wait_for_save in a `finally` after a failed forward).
        self._step_failed = False
        self._saves_built = False  # this step's saves were built from the metadata
        # Per group: (the pending saves it covers, their prepared gather); reset with the saves.
        self._gather_preps: dict[int, tuple[tuple[Any, ...], Any]] = {}
        self._tier_sources: list[str] = []  # per store tier: its CacheHitSource value
        self._orphans_logged = False
        self.stats = {
            "lookups": 0,
            "loaded_chunks": 0,
            "failed_chunks": 0,
            "saved_chunks": 0,  # chunks this worker stored (not those its store already held)
            "put_failures": 0,
            # Chunks of saves dropped because the store does not hold the chunk before them
            # (evicted since the lookup or the save that stored it): they stay unstored.
            "orphaned_chunks": 0,
            "generation_switches": 0,
        }

    # ---- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from radixkv.kernels import LayerPipeline, PagedLayout

        if self.store is None:
            self.store = open_store(self.options, self.metrics_rank, self.worker_dir)
        self.groups = []
        for g in self.geometries:
            names = [n for n in g.layer_names if n in kv_caches]
            if not names and not g.layer_names:
                # A pipeline stage holds none of this group's layers (vLLM projects every group onto
                # every stage and empties the layer lists of the other stages' groups): nothing to
                # load or store here; the group puts no limit on this stage's hits.
                self.groups.append(None)
                continue
            if not names:
                raise ConfigError(
                    f"none of KV-cache group {g.group_id}'s layers {list(g.layer_names)[:4]}... were "
                    f"registered (got {list(kv_caches)[:4]}...); pass the KV caches of this worker's layers"
                )
            distinct: list[torch.Tensor] = []
            index: dict[str, int] = {}
            for n in names:
                t = kv_caches[n]
                for i, d in enumerate(distinct):  # KV-sharing layers alias one tensor: copy it once
                    if (
                        d.data_ptr() == t.data_ptr()
                        and d.shape == t.shape
                        and d.stride() == t.stride()
                    ):
                        index[n] = i
                        break
                else:
                    index[n] = len(distinct)
                    distinct.append(t)
            width = int(distinct[0].shape[-1]) if distinct[0].dim() == 4 else 2 * g.head_size
            if not g.mla and width != 2 * g.head_size:
                # The chunk layout splits a page's content into K and V of head_size each. A
                # head_size_v other than head_size, or a packed KV dtype whose pages carry inline
                # scales (vLLM's int8/fp8/int4_per_token_head), gives another width: refuse at
                # start, naming the group, rather than with the kernels' bare shape error.
                raise ConfigError(
                    f"KV-cache group {g.group_id} ({g.kind}, layers {list(names)[:4]}): its blocks "
                    f"hold {width} values per token and head, not K and V of head_size={g.head_size} "
                    f"each ({2 * g.head_size}); radixkv's vLLM connector stores K||V pages of equal "
                    "widths only. A model whose V head size differs from its K head size, or a packed "
                    "kv_cache_dtype (int8/fp8/int4_per_token_head) is not supported: serve it with "
                    "kv_cache_dtype auto or fp8, or without the RadixKVConnector"
                )
            layout = PagedLayout.from_vllm(
                distinct, head_size=None if g.mla else g.head_size, mla=g.mla
            )
            if layout.page_tokens != g.block_size:
                raise ConfigError(
                    f"group {g.group_id}: registered KV views hold {layout.page_tokens} tokens per block, "
                    f"the KV-cache config says {g.block_size}"
                )
            ns = self._namespace(g, self.generation)
            ppc = g.blocks_per_chunk(self.chunk_tokens)
            self.groups.append(
                _Group(
                    g, layout, index, ns, LayerPipeline(layout.device), ppc, layout.chunk_bytes(ppc)
                )
            )
        if not self.present:
            raise ConfigError("this worker holds no layer of any KV-cache group; nothing to store")
        self._borrow_if_reader()
        self._tier_sources = _tier_sources(self.store)
        self._pin = self.present[0].layout.device.type == "cuda"
        per_chunk = sum(g.chunk_bytes for g in self.present)
        if self.loads and self.options.max_staging_bytes < per_chunk:
            # Every lookup would offer no chunk: a silent write-only engine.
            logger.warning(
                "radixkv: max_staging_bytes=%d is below one chunk (%d bytes over this worker's KV "
                "groups): no chunk will ever be loaded; raise it to at least %d, or use kv_role "
                "kv_producer for an engine that only stores", self.options.max_staging_bytes, per_chunk,
                per_chunk)

    def _borrow_if_reader(self) -> None:
        """A kv_consumer reads what other engines (kv_producer, kv_both) store in the shared tiers
        (a ``shared`` disk directory, Redis) and owns none of it. Without borrowing, its store
        treats the chunks it adopted there as its own: making room in its own books (a promotion
        into a full memory tier demotes into the shared directory, which then evicts) deletes the
        producer's chunks there, and the demotion writes into a tier a reader should leave alone.
        Borrowed, every implicit removal only forgets them and no copy is written there. Called for
        the namespaces in use: at start and at each cache-generation switch."""
        if self.writes:
            return
        for grp in self.present:
            tiers = self.store.borrow(grp.namespace)
            if tiers and grp is self.present[0]:
                logger.info(
                    "radixkv: kv_consumer: reading tiers %s without writing or deleting there",
                    tiers,
                )

    def _namespace(self, geometry: GroupGeometry, generation: str) -> Any:
        tp_rank, tp_size, pp_rank, pp_size = self.ranks
        return group_namespace(
            self.model,
            geometry,
            self.chunk_tokens,
            self.kv_cache_layout,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            model_digest=self.model_digest,
            generation=generation,
        )

    @property
    def present(self) -> list[_Group]:
        """The groups this worker (pipeline stage) holds layers of."""
        return [g for g in self.groups if g is not None]

    @property
    def _first_held(self) -> int:
        """Index of the first group this worker holds (its chunks are the ones counted in stats)."""
        return next((i for i, g in enumerate(self.groups) if g is not None), 0)

    def _alloc_payload(self, group: _Group) -> torch.Tensor:
        return torch.empty(group.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin)

    # ---- per step: metadata, lookups, loads ----------------------------------------------------
    def bind(self, meta: RadixKVMetadata) -> None:
        self._meta = meta
        self._sync_loads_started = False
        self._step_failed = False
        self._saves_built = False
        if meta.generation != self.generation:
            self._switch_generation(meta.generation)
        self._reap_draining()
        for req_id in meta.releases:
            self._drop_staged(req_id)
        for op in meta.lookups:
            self._lookup(op)

    def _switch_generation(self, generation: str) -> None:
        """The scheduler side reset the cache (vLLM's ``reset_cache``): from this step, before its
        lookups, loads and saves, every namespace ends with ``generation``, so no chunk stored
        before is read again. What belongs to the old generation goes: staged reads (cancelled; an
        async load still waiting for one then fails in ``get_finished``, its blocks reported as
        load errors, and vLLM recomputes them) and saves not yet stored (under the new namespaces
        they would pass old-weight KV off as new). Every TP/PP worker gets the same metadata, so all
        switch at the same step."""
        # Built first: a malformed generation raises before anything is dropped.
        namespaces = [
            None if grp is None else self._namespace(grp.geometry, generation)
            for grp in self.groups
        ]
        for grp in self.present:
            # A previous step's copies ended in its wait_for_save; this only guards one that did
            # not (a step whose forward raised before it) from landing in dropped buffers.
            try:
                grp.pipeline.wait_all()
            except Exception:  # that step has failed already: its error was raised then
                logger.warning("radixkv: a copy of an earlier step failed", exc_info=True)
        self._sync_load_keepalive.clear()
        self._saves = []
        self._gather_preps = {}
        for req_id in list(self._staged):
            self._drop_staged(req_id)
        for grp, ns in zip(self.groups, namespaces):
            if grp is not None:
                grp.namespace = ns
        logger.info(
            "radixkv: cache generation %r -> %r (vLLM reset the connector cache): chunks stored "
            "before are no longer read; %d async loads of the old generation will be recomputed",
            self.generation,
            generation,
            len(self._async_loads),
        )
        self.generation = generation
        self.stats["generation_switches"] += 1
        self._borrow_if_reader()

    def _drop_staged(self, req_id: str) -> None:
        st = self._staged.pop(req_id, None)
        if st is not None:
            for h in st.handles:
                if h is not None and not h.done():
                    h.cancel()
            if st.done():
                self._staged_bytes -= st.nbytes
            else:
                # A read already running fills its buffers until it stops (cancel is checked
                # between tier batches): they stay counted until then (_reap_draining).
                self._draining.append(st)

    def _reap_draining(self) -> None:
        """Stop counting the buffers of dropped requests whose reads have ended."""
        if self._draining:
            still = [st for st in self._draining if not st.done()]
            self._staged_bytes -= sum(st.nbytes for st in self._draining) - sum(st.nbytes for st in still)
            self._draining = still

    def _lookup(self, op: LookupOp) -> None:
        self._drop_staged(op.req_id)
        self.stats["lookups"] += 1
        hit = len(op.keys)
        for grp in self.present:
            # Probing adopts chunks a disk/Redis tier holds that this process never wrote (a
            # restart, another instance); the group's chunk size sizes them.
            n = self.store.lookup(grp.namespace, op.keys, chunk_bytes=grp.chunk_bytes, record=False)
            hit = min(hit, int(n))
            if hit <= op.first_chunk:
                break
        # One engine lookup counts once in the metrics, with the hit every group holds (what vLLM
        # uses), over the chunks beyond vLLM's local hit (as vLLM's own connector hit stats).
        asked = len(op.keys) - op.first_chunk
        if asked > 0:
            self.store.record_lookup(
                self.present[0].namespace, max(0, hit - op.first_chunk), asked
            )
        to_read = max(0, hit - op.first_chunk)
        per_chunk_bytes = sum(g.chunk_bytes for g in self.present)
        budget = self.options.max_staging_bytes - self._staged_bytes
        if to_read * per_chunk_bytes > budget:
            to_read = max(0, budget // per_chunk_bytes)
            hit = op.first_chunk + to_read
        buffers: list[list[torch.Tensor] | None] = [[] if g is not None else None for g in self.groups]
        handles: list[Any] = [None] * len(self.groups)
        sources: list[str] = []
        if to_read:
            keys = op.keys[op.first_chunk : hit]
            sources = self._chunk_sources(keys)
            for gi, grp in enumerate(self.groups):
                if grp is None:
                    continue
                buffers[gi] = [self._alloc_payload(grp) for _ in range(to_read)]
                handles[gi] = self.store.prefetch(grp.namespace, keys, buffers[gi])
        nbytes = to_read * per_chunk_bytes
        self._staged[op.req_id] = _Staged(
            op.seq, op.first_chunk, hit, buffers, handles, nbytes, sources
        )
        self._staged_bytes += nbytes
        self._new_lookups.append(op.req_id)

    def _chunk_sources(self, keys: list[str]) -> list[str]:
        """Per chunk of ``keys``, the slowest tier a read takes it from over every group (each group's
        chunk is read from the fastest tier holding it), as a ``CacheHitSource`` value; [] if
        unknown. Only the leading run every group holds."""
        if not self._tier_sources:
            return []
        worst: list[int] | None = None
        with self.store.lock:
            tree = self.store.tree
            for grp in self.present:
                masks = tree.match(grp.namespace.digest, keys, touch=False).tier_masks
                tiers = [(m & -m).bit_length() - 1 for m in masks]  # the fastest tier holding it
                worst = tiers if worst is None else [max(a, b) for a, b in zip(worst, tiers)]
        if not worst or any(not 0 <= w < len(self._tier_sources) for w in worst):
            return []
        return [self._tier_sources[w] for w in worst]

    def start_load_kv(self) -> None:
        """Start this step's synchronous loads (layer-wise on GPU) and register its async loads."""
        if self._meta is None or self._sync_loads_started:
            return
        self._sync_loads_started = True
        sync_loads = [op for op in self._meta.loads if not op.is_async]
        self._async_loads.extend(op for op in self._meta.loads if op.is_async)
        if sync_loads:
            self._run_loads(sync_loads, layerwise=self.options.layerwise)

    def _plan_copies(self, ops: list[LoadOp]) -> list[tuple[list[list[int]], list[torch.Tensor]]]:
        """Per group, the (page_ids, chunk buffers) of every chunk that can be loaded; the blocks of
        chunks that cannot be are recorded as load errors."""
        plan: list[tuple[list[list[int]], list[torch.Tensor]]] = [([], []) for _ in self.groups]
        first = self._first_held
        for op in ops:
            st = self._staged.get(op.req_id)
            readable_end = -1
            if st is not None and st.seq == op.seq:
                readable_end = st.first_chunk + st.readable_chunks()
            failed = False
            for gi, rows in enumerate(op.page_ids):
                if self.groups[gi] is None:
                    continue  # another pipeline stage's group
                for k, row in enumerate(rows):
                    c = op.first_chunk + k
                    if st is not None and st.first_chunk <= c < readable_end:
                        plan[gi][0].append(row)
                        plan[gi][1].append(st.buffers[gi][c - st.first_chunk])
                        self.stats["loaded_chunks"] += gi == first
                    else:
                        failed = True
                        if self.num_kv_cache_groups == 1:
                            self._load_errors.update(b for b in row if b >= 0)
                        self.stats["failed_chunks"] += gi == first
            if failed:
                self._failed_loads.add(op.req_id)
                if self.num_kv_cache_groups > 1:
                    # Block ids are unique only within a group (vLLM counts every group, stored by
                    # radixkv or not): vLLM 0.33 takes hybrid-layout failures by request
                    # (failed_recving; every such load is asynchronous, see SchedulerSide).
                    self._failed_recving.add(op.req_id)
                logger.warning(
                    "radixkv: load of request %s failed for some chunks; vLLM recomputes them",
                    op.req_id,
                )
        return plan

    def _run_loads(self, ops: list[LoadOp], layerwise: bool) -> None:
        from radixkv.kernels import prepare_scatter

        try:
            plan = self._plan_copies(ops)
            for grp, (page_ids, bufs) in zip(self.groups, plan):
                if grp is None or not page_ids:
                    continue
                self._sync_load_keepalive.append(bufs)
                # Checked once for the batch; each layer's job is then one launch (no per-layer
                # validation of every chunk buffer, one upload of the page ids).
                prep = prepare_scatter(grp.layout, page_ids, bufs)
                jobs = [lambda prep=prep, i=i: prep.run(layers=i)
                        for i in range(grp.layout.num_layers)]
                if grp.pipeline.loads_pending:
                    # Async loads polled while this step's layer-wise load still holds unissued
                    # layers: under speculative decoding vLLM defers wait_for_save past the
                    # drafter, so get_finished runs before the drafter's layers call their hooks.
                    # Finish that batch first (the compute stream waits for every layer now,
                    # before the drafter reads them); start_loads refuses a new batch otherwise.
                    for i in range(grp.layout.num_layers):
                        grp.pipeline.wait_layer(i)
                grp.pipeline.start_loads(jobs)
                if not layerwise:
                    # Whole-step load: the compute stream waits for every layer now, so the result
                    # is right even when vLLM skips the per-layer hooks (full CUDA graphs).
                    for i in range(len(jobs)):
                        grp.pipeline.wait_layer(i)
        except Exception:
            # A copy raised: end the batch now (a later step's wait_layer/wait_all would otherwise
            # run its remaining layers into blocks vLLM has given to other requests by then).
            self._abort_saves()
            raise
        finally:  # the staged buffers are the batch's (kept alive above) or no one's: uncount them
            for op in ops:
                self._drop_staged(op.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._meta is not None and not self._sync_loads_started:
            # Model Runner V2 without sync loads starts loads after the forward; with sync loads both
            # runners start them before it. Starting lazily here keeps either order correct.
            self.start_load_kv()
        for grp in self.present:
            i = grp.layer_index.get(layer_name)
            if i is not None:
                try:
                    grp.pipeline.wait_layer(i)
                except Exception:  # a look-ahead load raised: the forward stops before this layer
                    self._abort_saves()
                    raise

    def _poll_async_loads(self) -> None:
        still: list[LoadOp] = []
        ready: list[LoadOp] = []
        for op in self._async_loads:
            st = self._staged.get(op.req_id)
            (ready if st is None or st.done() else still).append(op)
        self._async_loads = still
        if ready:
            self._run_loads(ready, layerwise=False)
            self._finished_recving.update(op.req_id for op in ready)

    # ---- saves ---------------------------------------------------------------------------------
    def _ensure_saves(self) -> None:
        if self._saves_built or self._step_failed or self._meta is None or not self._meta.saves:
            return
        self._saves_built = True  # once per step, whichever hook comes first
        for op in self._meta.saves:
            try:
                held = self._held_chunks(op)
            except Exception:  # a store fault must not fail the step: the chunks are just not cached
                self.stats["put_failures"] += 1
                logger.exception("radixkv: looking up the %d chunks to save of %s failed",
                                 len(op.keys), op.req_id)
                continue
            if held is None:  # the chunk before it is gone: the store would refuse the chain
                self._orphaned(op, len(op.keys))
                continue
            skip = min(held)
            if skip:  # already stored (vLLM's local hit, an exact-multiple prompt's last chunk)
                op = SaveOp(op.req_id, op.keys[skip:], op.keys[skip - 1],
                            [rows[skip:] for rows in op.page_ids])
            if not op.keys:
                continue
            n = self._storable_chunks(op)
            if n < len(op.keys):
                # A buffer is put only if a gather fills it: a chunk without its pages in some group
                # (rows missing, short or skipped) would store uninitialised bytes that a later hit
                # loads into the blocks. Chunks form a chain: keep the leading run every group has.
                # A sliding-window group's skipped block (-1) is expected; anything else is not.
                skipped = any(p < 0 for rows in op.page_ids for row in rows[n : n + 1] for p in row)
                (logger.debug if skipped else logger.warning)(
                    "radixkv: save of %s names pages for %d of its %d chunks in every group; "
                    "storing those", op.req_id, n, len(op.keys)
                )
                if n == 0:
                    continue
                op = SaveOp(op.req_id, op.keys[:n], op.parent_key,
                            [rows[:n] for rows in op.page_ids])
            bufs = [[self._alloc_payload(grp) for _ in op.keys] if grp is not None else []
                    for grp in self.groups]
            held_first = held[0] - skip  # held[0]: the first group held here, the one counted
            self._saves.append(
                _PendingSave(op, bufs, [set() for _ in self.groups], min(held_first, len(op.keys)))
            )

    def _held_chunks(self, op: SaveOp) -> list[int] | None:
        """Per group held here: how many leading chunks of ``op`` the store holds (any tier; a
        tree-only lookup, not counted in the lookup metrics). None: it lacks ``op.parent_key``."""
        keys = op.keys if op.parent_key is None else [op.parent_key, *op.keys]
        held = []
        for grp in self.present:
            n = int(self.store.lookup(grp.namespace, keys, probe=False, record=False))
            if op.parent_key is not None:
                if n == 0:
                    return None
                n -= 1
            held.append(n)
        return held

    def _orphaned(self, op: SaveOp, chunks: int) -> None:
        self.stats["orphaned_chunks"] += chunks
        (logger.debug if self._orphans_logged else logger.info)(
            "radixkv: %d chunks of %s not stored: the store does not hold the chunk before them "
            "(evicted since it was looked up or stored, or a sliding-window chunk vLLM's local hit "
            "skipped that was never stored)%s", chunks, op.req_id,
            "" if self._orphans_logged else "; further such saves are logged at DEBUG",
        )
        self._orphans_logged = True

    def _storable_chunks(self, op: SaveOp) -> int:
        """Leading chunks of ``op`` whose row holds all of its pages in every group held here."""
        n = len(op.keys)
        for gi, grp in enumerate(self.groups):
            if grp is None:
                continue
            rows = op.page_ids[gi] if gi < len(op.page_ids) else []
            k = 0
            while k < min(n, len(rows)) and len(rows[k]) == grp.pages_per_chunk and all(
                p >= 0 for p in rows[k]
            ):
                k += 1
            n = k
        return n

    def save_kv_layer(self, layer_name: str) -> None:
        self._ensure_saves()
        if not self._saves:
            return
        try:
            for gi, grp in enumerate(self.groups):
                i = grp.layer_index.get(layer_name) if grp is not None else None
                if i is not None:
                    self._gather_layer(gi, i)
        except Exception:
            self._abort_saves()
            raise

    def _abort_saves(self) -> None:
        """A copy of this step failed: drop the step's saves. Their buffers may be partly gathered,
        and a later step must neither store them nor finish gathering them from blocks that hold
        other requests' KV by then; the next step's saves start afresh. Nor may this step rebuild
        them: vLLM still calls wait_for_save after the failed forward, whose later layers never
        computed this step's KV. Every pipeline is drained, so no load of this step runs later."""
        self._step_failed = True
        for grp in self.present:  # each wait_all blocks until its side stream is done
            try:
                grp.pipeline.wait_all()
            except Exception:  # the error being raised is the first; later ones are only logged
                logger.warning("radixkv: another copy failed while dropping a step's saves",
                               exc_info=True)
        self._sync_load_keepalive.clear()
        self._saves = []
        self._gather_preps = {}

    def _gather_layer(self, gi: int, layer: int) -> None:
        from radixkv.kernels import prepare_gather

        grp = self.groups[gi]
        members: list[_PendingSave] = []  # the pending saves still missing this layer
        for ps in self._saves:
            if layer not in ps.layers_done[gi]:
                ps.layers_done[gi].add(layer)
                if ps.op.page_ids[gi]:
                    members.append(ps)
        if not members:
            return
        # The same saves miss every layer in the usual step: one prepared gather serves them all.
        # Matched by identity (the cache holds the saves, so no other save can take their ids).
        cached = self._gather_preps.get(gi)
        if cached is None or len(cached[0]) != len(members) or any(
            a is not b for a, b in zip(cached[0], members)
        ):
            page_ids: list[list[int]] = []
            bufs: list[torch.Tensor] = []
            for ps in members:
                page_ids.extend(ps.op.page_ids[gi])
                bufs.extend(ps.buffers[gi])
            cached = (tuple(members), prepare_gather(grp.layout, page_ids, bufs))
            self._gather_preps[gi] = cached
        prep = cached[1]
        grp.pipeline.save_layer(layer, lambda: prep.run(layers=layer))

    def wait_for_save(self) -> None:
        try:
            self._ensure_saves()
            if self._saves:
                for gi, grp in enumerate(self.groups):
                    for layer in range(grp.layout.num_layers if grp is not None else 0):
                        self._gather_layer(gi, layer)  # layers whose save_kv_layer hook did not run
            for grp in self.present:
                grp.pipeline.wait_all()
        except Exception:
            self._abort_saves()
            raise
        self._sync_load_keepalive.clear()
        first = self._first_held
        for ps in self._saves:
            for gi, grp in enumerate(self.groups):
                if grp is None:
                    continue
                try:
                    ok = self.store.put(
                        grp.namespace, ps.op.keys, ps.buffers[gi], parent_key=ps.op.parent_key
                    )
                    if gi == first:
                        stored = sum(bool(x) for x in ok)
                        self.stats["saved_chunks"] += max(0, stored - ps.held_first)
                        if ok and not ok[0] and ps.op.parent_key is not None and not int(
                            self.store.lookup(grp.namespace, [ps.op.parent_key], probe=False,
                                              record=False)
                        ):  # the parent went between _ensure_saves and this put
                            self._orphaned(ps.op, len(ps.op.keys))
                except (
                    Exception
                ):  # a store fault must not fail the step: the chunks are just not cached
                    self.stats["put_failures"] += 1
                    logger.exception(
                        "radixkv: storing %d chunks of %s failed", len(ps.op.keys), ps.op.req_id
                    )
        self._saves = []
        self._gather_preps = {}

    # ---- results back to vLLM ------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; failed ones are in both."""
        self._poll_async_loads()
        out, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return out, failed

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_worker_meta(self) -> RadixKVWorkerMeta | None:
        if self._new_lookups:
            deadline = time.monotonic() + self.options.sync_load_wait_s
            for req_id in self._new_lookups:
                st = self._staged.get(req_id)
                if st is None:
                    continue
                for h in st.handles:
                    if h is not None and not h.done():
                        try:
                            h.wait(timeout_s=max(0.0, deadline - time.monotonic()))
                        except TimeoutError:
                            break  # still reading from a slow tier: an asynchronous load
                ready = st.done()
                # Once read, report what was really read (a chunk can fail its checksum).
                hit = (
                    st.first_chunk + st.readable_chunks()
                    if ready and st.hit_chunks > st.first_chunk
                    else st.hit_chunks
                )
                reach = source_reach(st.chunk_sources, st.first_chunk)
                self._reports[req_id] = LookupReport(st.seq, hit, ready, reach_source(reach, hit), reach)
            self._new_lookups = []
        if not self._reports and not self._failed_loads:
            return None
        meta = RadixKVWorkerMeta(lookups=self._reports, failed_loads=self._failed_loads)
        self._reports, self._failed_loads = {}, set()
        return meta

    def clear(self) -> None:
        self._meta = None

    def shutdown(self) -> None:
        for req_id in list(self._staged):
            self._drop_staged(req_id)
        if self.store is not None and hasattr(self.store, "close"):
            self.store.close()

    def check_integrity(self) -> None:
        total = sum(st.nbytes for st in self._staged.values()) + sum(st.nbytes for st in self._draining)
        assert total == self._staged_bytes, (total, self._staged_bytes)
        # Each entry counts the buffers it holds (max_staging_bytes bounds them through nbytes), one
        # list of hit_chunks - first_chunk per group it reads, and is staged or draining, not both.
        staged = {id(st) for st in self._staged.values()}
        for st in [*self._staged.values(), *self._draining]:
            held = sum(b.numel() for bufs in st.buffers if bufs is not None for b in bufs)
            assert held == st.nbytes, f"a staged read holds {held} buffer bytes but counts {st.nbytes}"
            want = max(0, st.hit_chunks - st.first_chunk)
            assert all(len(bufs) == want for bufs in st.buffers if bufs is not None), (
                f"staged chunks {st.first_chunk}..{st.hit_chunks} but buffers "
                f"{[None if b is None else len(b) for b in st.buffers]}"
            )
        assert not any(id(st) in staged for st in self._draining), "a staged read is also draining"
        assert self._staged_bytes <= max(self.options.max_staging_bytes, 0), self._staged_bytes
        for grp in self.present:
            grp.pipeline.check_integrity()
            grp.layout.check_integrity()
        if self.store is not None and hasattr(self.store, "check_integrity"):
            self.store.check_integrity()
