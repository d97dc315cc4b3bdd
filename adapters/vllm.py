"""radixkv behind vLLM 0.33's KV connector API (``radixkv.adapters.vllm.RadixKVConnector``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "RadixKVConnector",
        "kv_connector_module_path": "radixkv.adapters.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_tokens": 256}}'

vLLM imports this module in its API-server/config process, in the EngineCore (scheduler role) and in
every worker (worker role). Importing it loads vLLM's connector base classes only: torch's CUDA state,
radixkv.kernels and the store are touched first in ``register_kv_caches`` of a worker. The class is a
thin switchboard: the scheduler half is :mod:`radixkv.adapters.vllm_scheduler`, the worker half
:mod:`radixkv.adapters.vllm_worker`, the messages between them :mod:`radixkv.adapters.vllm_meta`.
``reset_cache`` (vLLM's connector cache reset, which weight updates go through) makes every chunk
stored before it a miss for this engine.
See docs/vllm.md for the design, every option and the limits.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from radixkv.adapters.vllm_meta import RadixKVMetadata
from radixkv.adapters.vllm_options import (
    VllmConnectorOptions,
    geometries_from_kv_cache_config,
    model_identity_digest,
    resolve_chunk_tokens,
    resolve_hash_block_size,
)
from radixkv.adapters.vllm_scheduler import SchedulerSide
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from radixkv.adapters.vllm_worker import WorkerSide

__all__ = ["RadixKVConnector"]

logger = logging.getLogger(__name__)


def _parallel_ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int, int, int, int]:
    """(TP rank, TP size, PP rank, PP size, PCP rank, PCP size, DP index) of this worker.

    The DP index is ``data_parallel_index``, not ``data_parallel_rank``: vLLM runs the DP ranks of a
    dense (non-MoE) model as independent engines and resets their ``data_parallel_rank`` to 0
    (``ParallelConfig.reconfigure_for_independent_dp_rank``), keeping the index distinct. The PCP
    rank tells apart the prefill-context-parallel workers of one TP/PP rank, which are separate
    processes with the same TP/PP ranks."""
    pc = vllm_config.parallel_config
    tp_size, pp_size = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    tp_rank = pp_rank = pcp_rank = 0
    if tp_size > 1 or pp_size > 1:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    if pcp_size > 1:
        from vllm.distributed.parallel_state import get_pcp_group

        pcp_rank = get_pcp_group().rank_in_group
    dp = getattr(pc, "data_parallel_index", None)
    if dp is None:
        dp = getattr(pc, "data_parallel_rank", 0)
    return tp_rank, tp_size, pp_rank, pp_size, pcp_rank, pcp_size, int(dp or 0)


def _refuse_context_parallel_kv(vllm_config: VllmConfig) -> None:
    """Raise :class:`ConfigError` under decode context parallelism (DCP > 1).

    With DCP vLLM shards every attention block across the DCP ranks: one scheduler block id stands
    for ``block_size x DCP`` tokens, each rank holding its interleaved share. radixkv maps a chunk to
    ``chunk_tokens / block_size`` blocks of ``block_size`` tokens and names the shard by TP/PP rank
    only, so a chunk's key would be stored with the bytes of later tokens (not yet computed, or of
    another prefix) and a load would serve them as its own."""
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        raise ConfigError(
            f"radixkv's vLLM connector does not support decode_context_parallel_size={dcp}: each "
            "block then holds a DCP shard of block_size x DCP tokens, which its chunks cannot name; "
            "run with decode_context_parallel_size=1 or without the RadixKVConnector"
        )


class RadixKVConnector(KVConnectorBase_V1, SupportsHMA):
    """A best-effort hierarchical KV cache: a miss is never an error (``requires_kv_delivery`` False)."""

    # Where a hit came from is known per lookup (get_external_cache_hit_sources); this is vLLM's
    # fallback label only.
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = VllmConnectorOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        cache = vllm_config.cache_config
        _refuse_context_parallel_kv(vllm_config)
        self.groups = geometries_from_kv_cache_config(kv_cache_config)
        self.hash_block_size = resolve_hash_block_size(
            kv_cache_config, cache, [g.block_size for g in self.groups]
        )
        self.chunk_tokens = resolve_chunk_tokens(
            self.options.chunk_tokens, [g.block_size for g in self.groups], self.hash_block_size
        )
        algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
        if algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
            logger.warning(
                "radixkv: prefix_caching_hash_algo=%s seeds block hashes per process; chunks stored by "
                "another vLLM process will not be found. Set PYTHONHASHSEED or use sha256.",
                algo,
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            kvt = self._kv_transfer_config
            self._scheduler = SchedulerSide(
                self.options,
                self.groups,
                self.chunk_tokens,
                self.hash_block_size,
                loads=bool(kvt.is_kv_consumer),
                saves=bool(kvt.is_kv_producer),
                num_kv_cache_groups=len(kv_cache_config.kv_cache_groups),
            )
        else:
            from radixkv.adapters.vllm_worker import WorkerSide

            tp_rank, tp_size, pp_rank, pp_size, pcp_rank, pcp_size, dp_rank = _parallel_ranks(vllm_config)
            model = self.options.model_name or str(vllm_config.model_config.model)
            # The name alone does not fix the KV (revision, quantization, RoPE overrides...): the digest
            # of the rest goes into every namespace, with an explicit model_name too.
            # With speculative decoding the drafter's layers are among the KV caches stored, so the
            # drafter's identity counts too (the draft path only without an explicit model_name).
            model_digest = model_identity_digest(
                vllm_config.model_config,
                cache,
                getattr(vllm_config, "speculative_config", None),
                draft_path=not self.options.model_name,
            )
            layout = str(getattr(cache, "kv_cache_layout", None) or "default")
            self._worker = WorkerSide(
                self.options,
                self.groups,
                self.chunk_tokens,
                model,
                layout,
                tp_rank,
                tp_size,
                pp_rank,
                pp_size,
                dp_rank=dp_rank,
                pcp_rank=pcp_rank,
                pcp_size=pcp_size,
                model_digest=model_digest,
                num_kv_cache_groups=len(kv_cache_config.kv_cache_groups),
                # A kv_consumer only reads: it borrows the shared tiers (never writes or deletes).
                writes=bool(self._kv_transfer_config.is_kv_producer),
                loads=bool(self._kv_transfer_config.is_kv_consumer),
            )

    # ---- class-level hooks ---------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a preempted request never waits for a save

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads need the per-layer hooks, which full CUDA graphs skip.
        return bool((extra_config or {}).get("layerwise", False))

    # ==== scheduler side ========================================================================
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's per-source hit metrics: the whole load under the slowest tier its chunks were
        staged from (the worker's memory tier: ``host``; a disk tier: ``disk``; Redis or a tier the
        workers did not name: ``external_unspecified``)."""
        if num_external_tokens == 0:
            return {}
        assert self._scheduler is not None
        source = self._scheduler.hit_source(request)
        return {CacheHitSource(source) if source else self._cache_hit_source: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM resets the connector's cache (``reset_prefix_cache(reset_connector=True)``, which
        ``pause_generation(clear_cache=True)``, ``sleep(level>=1)`` and ``release_kv_cache_memory``
        call, as weight updates do): from the next step no chunk stored before is loaded by this
        engine (a fresh cache generation in every namespace; :meth:`SchedulerSide.reset_cache`).
        True when done; vLLM calls it on the scheduler-side connector only (a worker follows the
        generation in the step metadata), and a worker-side one answers False."""
        if self._scheduler is None:
            logger.warning("radixkv: reset_cache called on a worker-side connector: nothing reset")
            return False
        return self._scheduler.reset_cache()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ==== worker side ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, RadixKVMetadata), type(connector_metadata)
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.get_transfer_results(finished_req_ids).finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        recving, failed = self._worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def check_integrity(self) -> None:
        if self._scheduler is not None:
            self._scheduler.check_integrity()
        if self._worker is not None:
            self._worker.check_integrity()
