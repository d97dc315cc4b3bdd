"""A CPU stand-in for vLLM's engine loop around the real V1 Scheduler and the real connector.

Everything vLLM-side is vLLM 0.33's own code: VllmConfig, Scheduler, Request, block hashing, the
connector factory, KV-cache views (``create_kv_cache_views``), ModelRunnerOutput / KVConnectorOutput.
What is simulated is only what needs a GPU: the model. ``Engine.step`` replays the worker's connector
call order (bind -> start_load_kv [before the forward for sync loads, after it otherwise] -> per layer
wait_for_layer_load / write KV / save_kv_layer -> wait_for_save -> transfer results -> load errors ->
worker metadata -> clear) and the "model" writes a deterministic KV value per (token id, position,
layer, head, channel), so any block's expected bytes can be recomputed independently.
Scheduler -> worker metadata and worker -> scheduler metadata are pickled, as between processes.
"""

from __future__ import annotations

import copy

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

OPEN_ENGINES: list[Engine] = []  # closed after each test by conftest.py

BLOCK = 16
NUM_BLOCKS = 64
HEADS = 2
HEAD_SIZE = 4
EOS = 2
DTYPE = torch.float32  # integer-valued payloads below 2**24 are exact: byte equality is meaningful

OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "eos_token_id": EOS,
    "bos_token_id": EOS,
    "pad_token_id": 1,
}


def make_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(OPT_CONFIG))
    return path


def make_vllm_config(
    model_dir: Path, extra: dict[str, Any], policy: str = "recompute"
) -> VllmConfig:
    cfg = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), dtype="float16", seed=42, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RadixKVConnector",
            kv_connector_module_path="radixkv.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=policy,
        ),
    )
    cfg.cache_config.kv_cache_layout = "LBNHC"
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cfg


def make_kv_cache_config(
    sliding_window: int | None = None, num_blocks: int = NUM_BLOCKS, layers: int = 2
) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(layers)], full)]
    if sliding_window is not None:
        sw = SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_SIZE,
            dtype=DTYPE,
            sliding_window=sliding_window,
        )
        groups = [KVCacheGroupSpec(["layers.0"], full), KVCacheGroupSpec(["layers.1"], sw)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_kv_caches(kcc: KVCacheConfig, layout: str = "LBNHC") -> dict[str, torch.Tensor]:
    """vLLM's own per-layer [B, H, N, 2*head] views over one int8 buffer per group, in ``layout``."""
    lay = KVCacheLayout[layout]
    out: dict[str, torch.Tensor] = {}
    for group in kcc.kv_cache_groups:
        spec, names = group.kv_cache_spec, list(group.layer_names)
        strides = compute_layout_strides(spec, NUM_BLOCKS, len(names), lay)
        size = spec.page_size_bytes * NUM_BLOCKS * len(names)
        raw = torch.zeros(size, dtype=torch.int8)
        kvt = KVCacheTensor(
            size=size, layers=names, layer_stride=strides[0], block_stride=strides[1]
        )
        for name, view in zip(names, create_kv_cache_views(raw, spec, NUM_BLOCKS, lay, kvt)):
            out[name] = view
    return out


def kv_value(token: int, pos: int, layer: int) -> torch.Tensor:
    """The fake model's KV for one token of one layer: [H, 2*head] integer-valued floats."""
    base = float(token * 7 + pos * 131 + layer * 100003)
    return base + torch.arange(HEADS * 2 * HEAD_SIZE, dtype=DTYPE).reshape(HEADS, 2 * HEAD_SIZE)


def layer_index(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


@dataclass
class StepLog:
    scheduled: dict[str, int]
    has_sync_loads: bool
    finished_recving: set[str]
    invalid_block_ids: set[int]
    failed_recving: set[str]
    worker_meta: Any


@dataclass
class Engine:
    """One scheduler + one worker (TP=1), wired the way vLLM's EngineCore and model runner wire them."""

    cfg: VllmConfig
    kcc: KVCacheConfig
    layout: str = "LBNHC"
    layer_hooks: bool = True  # False: full-CUDA-graph steps, where vLLM calls no per-layer hooks
    late_start: bool = False  # True: start_load_kv only after the forward, even with sync loads
    # vLLM's hash block size when it is finer than the block size (several KV-cache groups): set as
    # EngineCore sets it (KVCacheConfig and the Scheduler; the worker process's cache_config), with
    # the scheduler process's cache_config left unset, as with a multi-process executor.
    hash_block: int | None = None
    sched: Scheduler = field(init=False)
    worker: Any = field(init=False)
    kv: dict[str, torch.Tensor] = field(init=False)
    log: list[StepLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        extra = {}
        worker_cfg = self.cfg
        if self.hash_block is not None:
            self.kcc.hash_block_size = self.hash_block
            extra["hash_block_size"] = self.hash_block
            worker_cfg = copy.deepcopy(self.cfg)
            worker_cfg.cache_config.hash_block_size = self.hash_block
        self.sched = Scheduler(
            vllm_config=self.cfg,
            kv_cache_config=self.kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.cfg),
            block_size=BLOCK,
            **extra,
        )
        self.worker = KVConnectorFactory.create_connector(
            worker_cfg, KVConnectorRole.WORKER, self.kcc
        )
        self.kv = make_kv_caches(self.kcc, self.layout)
        self.worker.register_kv_caches(self.kv)
        OPEN_ENGINES.append(self)

    def close(self) -> None:
        """Shut the worker's store down (its background threads and tiers)."""
        self.worker.shutdown()

    @property
    def connector(self) -> Any:
        return self.sched.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2, read_cache: bool = True) -> Request:
        """Queue a request; ``read_cache=False``: it reads no cache, vLLM's nor radixkv's."""
        sp = SamplingParams(max_tokens=max_tokens, skip_reading_prefix_cache=not read_cache)
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(self.hash_block or BLOCK, sha256),
        )
        self.sched.add_request(req)
        return req

    def group_of(self, layer: str) -> int:
        for gi, g in enumerate(self.kcc.kv_cache_groups):
            if layer in g.layer_names:
                return gi
        raise KeyError(layer)

    def step(self) -> StepLog:
        out = self.sched.schedule()
        mro, entry = self.execute(out)
        self.sched.update_from_output(out, mro)
        self.log.append(entry)
        return entry

    def execute(self, out: Any) -> tuple[ModelRunnerOutput, StepLog]:
        """The worker half of a step for one scheduler output: its ModelRunnerOutput (not yet given
        back to the scheduler, so a test can schedule the next step first, as async scheduling
        does) and its log entry."""
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
        w = self.worker
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads and not self.late_start:
            w.start_load_kv(None)
        self._forward(out)
        if not out.has_sync_kv_loads or self.late_start:
            w.start_load_kv(None)  # non-synchronous loads start after the forward (both runners)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        kvo = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            kv_connector_worker_meta=pickle.loads(pickle.dumps(wmeta)),
            invalid_block_ids=invalid,
            failed_recving=results.failed_recving,
        )
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([self._attend(rid, req.num_computed_tokens)] if done_prefill else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kvo,
        )
        entry = StepLog(
            dict(out.num_scheduled_tokens),
            out.has_sync_kv_loads,
            set(results.finished_recving),
            set(invalid),
            set(results.failed_recving),
            wmeta,
        )
        return mro, entry

    def _forward(self, out: Any) -> None:
        """Write this step's KV for every scheduled token, layer by layer, with the connector hooks."""
        writes: list[tuple[int, list[int], int, int]] = []  # (group, block ids, pos, token)
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            block_ids = self.sched.kv_cache_manager.get_block_ids(rid)
            toks = req.all_token_ids
            for pos in range(start, start + n):
                for gi in range(len(block_ids)):
                    writes.append((gi, block_ids[gi], pos, toks[pos]))
        for name in sorted(self.kv, key=layer_index):
            if self.layer_hooks:
                self.worker.wait_for_layer_load(name)
            gi, li = self.group_of(name), layer_index(name)
            for g, ids, pos, tok in writes:
                if g == gi:
                    self.kv[name][ids[pos // BLOCK], :, pos % BLOCK, :] = kv_value(tok, pos, li)
            if self.layer_hooks:
                self.worker.save_kv_layer(name, self.kv[name], None)

    def _attend(self, req_id: str, num_tokens: int) -> int:
        """The next token reads the KV of every earlier position in every full-attention layer, so a
        block holding a wrong byte changes what the request generates."""
        ids = self.sched.kv_cache_manager.get_block_ids(req_id)[0]
        pos = torch.arange(num_tokens)
        blocks = torch.tensor(ids)[pos // BLOCK]
        digest = 0
        for name in self.kcc.kv_cache_groups[0].layer_names:
            rows = self.kv[name][blocks, :, pos % BLOCK, :].contiguous().view(torch.int32).long()
            weights = torch.arange(1, rows.numel() + 1, dtype=torch.long).view(rows.shape)
            digest += int((rows * weights).sum().item())
        return 100 + digest % 40000

    def run_until_idle(self, max_steps: int = 50) -> int:
        for i in range(max_steps):
            if not self.sched.has_requests():
                return i
            self.step()
        raise AssertionError(
            f"still busy after {max_steps} steps: {[r for r in self.sched.requests]}"
        )

    def expected_block(self, layer: str, tokens: list[int], block_index: int) -> torch.Tensor:
        """What the fake model writes into block ``block_index`` of ``tokens`` for ``layer``: [H, N, C]."""
        li = layer_index(layer)
        rows = [
            kv_value(tokens[p], p, li)
            for p in range(block_index * BLOCK, (block_index + 1) * BLOCK)
        ]
        return torch.stack(rows, dim=1)

    def block_bytes(self, layer: str, block_id: int) -> torch.Tensor:
        return self.kv[layer][block_id].contiguous().view(torch.uint8)

    def clear_kv(self) -> None:
        for t in self.kv.values():
            t.zero_()


class GatedStore:
    """The real store, with reads held back until :meth:`open` (a slow tier whose timing a test sets).

    Only *when* a prefetch runs is controlled; lookups, reads, checksums and puts are the real store's.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.gate_open = False
        # True: the held reads count as already running, so cancel() cannot stop them (they end,
        # filling their buffers, once the gate opens), as a real prefetch past its first batch.
        self.running = False

    def open(self) -> None:
        self.gate_open = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def prefetch(self, ns: Any, keys: Any, buffers: Any) -> Any:
        return _GatedHandle(self, ns, list(keys), list(buffers))


class _GatedHandle:
    def __init__(self, gs: GatedStore, ns: Any, keys: list[str], buffers: list[Any]) -> None:
        self.gs, self.ns, self.keys, self.buffers = gs, ns, keys, buffers
        self.result: int | None = None
        self.cancelled = False

    def _run(self) -> None:
        if self.result is None and self.gs.gate_open and not self.cancelled:
            self.result = self.gs.store.get(self.ns, self.keys, self.buffers)

    def done(self) -> bool:
        self._run()
        return self.result is not None or self.cancelled

    def wait(self, timeout_s: float | None = None) -> int:
        self._run()
        if self.cancelled:
            return 0
        if self.result is None:
            raise TimeoutError("gated read not released")
        return self.result

    def cancel(self) -> bool:
        self.cancelled = self.result is None and not self.gs.running
        return self.cancelled
