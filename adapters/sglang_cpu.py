"""CPU harness around SGLang 0.5.23's own HiCache classes (used by tests/sglang and the benchmark).

Builds SGLang's real device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``cpu``), its real
host pool (L2, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) in a chosen layout and its real
``HiCacheController`` with the four storage threads, then drives the L2<->L3 path the way the
scheduler does: ``write_storage`` -> backup thread -> backend; ``prefetch`` -> hit query ->
host-slot allocation -> io-aux thread -> backend -> acks. Nothing here is a fake: the only code of
ours on that path is the storage backend under test. (L1<->L2 kernels need CUDA and are not used.)

:class:`HybridHarness` does the same with SGLang's ``HybridCacheController`` (KV pool plus sidecar
pools), which drives the v2 storage calls (``batch_set_v2`` / ``batch_exists_v2`` / ``batch_get_v2``).

:class:`ServerStackHarness` is the stack a launched server builds for a plain (KV-only, MHA or MLA)
model: in 0.5.23 that is *not* ``HiCacheController`` (only PD decode offload uses it) but
``UnifiedRadixCache.init_hicache`` -> ``build_kv_only_stack``: a ``HybridCacheController`` over a
one-pool ``HostPoolGroup``, with the extra config parsed (and SGLang's own keys popped) as the server
parses it, and prefix keys passed as the tree passes them.

Requires ``sglang==0.5.23``; imported only by tests and ``radixkv.bench.sglang``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import torch

__all__ = [
    "PoolSpec",
    "ControllerHarness",
    "HybridHarness",
    "ServerStackHarness",
    "PrefetchResult",
    "Pools",
    "build_pools",
    "set_parallel_context",
]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# SGLang 0.5.23 builds ``page_head`` host pools for MHA only (its MLA host pool refuses the layout).
MHA_ONLY_LAYOUTS = ("page_head",)


def _acks(q: Any, timeout_s: float, what: str):
    """Items from one of the controller's ack queues until ``timeout_s`` has passed; then
    TimeoutError naming ``what`` (the caller returns or breaks when it sees its own ack)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            yield q.get(timeout=max(0.01, deadline - time.monotonic()))
        except Empty:
            raise TimeoutError(f"{what} not completed within {timeout_s}s") from None


def set_parallel_context(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> None:
    """Publish the parallel widths HiCacheController reads (a launched server does this itself)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
    )


@dataclass(slots=True)
class PoolSpec:
    """Geometry of one model's KV cache. ``kind``: "mha" or "mla"; token counts are capacities."""

    kind: str = "mha"
    layout: str = "page_first"
    page_size: int = 4
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    kv_lora_rank: int = 16
    rope_dim: int = 8
    dtype: torch.dtype = torch.bfloat16
    device_tokens: int = 64
    host_tokens: int = 256

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"PoolSpec.kind={self.kind!r} must be 'mha' or 'mla'")
        allowed = LAYOUTS + (MHA_ONLY_LAYOUTS if self.kind == "mha" else ())
        if self.layout not in allowed:
            raise ValueError(f"PoolSpec.layout={self.layout!r} must be one of {allowed} for kind={self.kind!r}")
        if self.host_tokens % self.page_size or self.device_tokens % self.page_size:
            raise ValueError("PoolSpec token capacities must be multiples of page_size")

    @property
    def page_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if self.kind == "mha":
            return 2 * self.layers * self.page_size * self.heads * self.head_dim * itemsize
        return self.layers * self.page_size * (self.kv_lora_rank + self.rope_dim) * itemsize


@dataclass(slots=True)
class Pools:
    allocator: Any
    device_pool: Any
    host_pool: Any


def build_pools(spec: PoolSpec) -> Pools:
    """SGLang's own CPU device pool, allocator and host pool for ``spec``."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = dict(
        size=spec.device_tokens, page_size=spec.page_size, dtype=spec.dtype, layer_num=spec.layers,
        device="cpu", enable_memory_saver=False,
    )
    if spec.kind == "mha":
        device_pool = MHATokenToKVPool(
            head_num=spec.heads, head_dim=spec.head_dim, enable_alt_stream=False, **common
        )
        host_pool = MHATokenToKVPoolHost(
            device_pool._mha_buffer_info(), 2.0, 0, spec.page_size, spec.layout, pin_memory=False,
            device="cpu", device_capacity_tokens=spec.device_tokens, start_layer=0,
            end_layer=spec.layers, host_token_capacity=spec.host_tokens,
        )
    else:
        device_pool = MLATokenToKVPool(
            kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.rope_dim, **common
        )
        host_pool = MLATokenToKVPoolHost(
            device_pool._mla_buffer_info(), 2.0, 0, spec.page_size, spec.layout, pin_memory=False,
            device="cpu", device_capacity_tokens=spec.device_tokens, start_layer=0,
            end_layer=spec.layers, target_layer_num=spec.layers, host_token_capacity=spec.host_tokens,
        )
    allocator = TokenToKVPoolAllocator(spec.device_tokens, spec.dtype, "cpu", device_pool, False)
    return Pools(allocator=allocator, device_pool=device_pool, host_pool=host_pool)


@dataclass(slots=True)
class PrefetchResult:
    hit_tokens: int          # what the hit query promised (storage_hit_count)
    loaded_tokens: int       # leading tokens actually read into host_indices
    host_indices: torch.Tensor | None
    hash_values: list[str] = field(default_factory=list)


class ControllerHarness:
    """SGLang's HiCacheController with a storage backend attached, on CPU pools."""

    def __init__(
        self,
        spec: PoolSpec,
        backend: str = "dynamic",
        extra_config: dict | None = None,
        model_name: str = "test-model",
        pools: Pools | None = None,
        storage_metrics: bool = True,
    ) -> None:
        """``storage_metrics``: SGLang's ``enable_storage_metrics`` (on, as with ``--enable-metrics``;
        only then does SGLang drain the backend's per-call samples through ``get_stats``)."""
        from sglang.srt.managers.cache_controller import HiCacheController

        self.spec = spec
        self.pools = pools or build_pools(spec)
        self.host_pool = self.pools.host_pool
        self.controller = HiCacheController(
            self.pools.allocator,
            self.host_pool,
            page_size=spec.page_size,
            tp_group=None,
            load_cache_event=threading.Event(),
            write_policy="write_through",
            storage_backend=backend,
            storage_backend_extra_config=dict(extra_config or {}),
            model_name=model_name,
            prefetch_threshold=spec.page_size,
            enable_storage_metrics=storage_metrics,
        )
        self._rid = 0

    @property
    def backend(self) -> Any:
        return self.controller.storage_backend

    def page_keys(self, tokens: list[int], last_hash: str | None = None) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        return get_storage_hash_str(tokens, last_hash, page_size=self.spec.page_size)

    def alloc(self, n_tokens: int) -> torch.Tensor:
        idx = self.host_pool.alloc(n_tokens)
        if idx is None:
            raise RuntimeError(f"host pool full: cannot allocate {n_tokens} tokens")
        return idx

    def fill_random(self, host_indices: torch.Tensor, seed: int) -> None:
        """Write deterministic random bytes into the pages at ``host_indices`` (via SGLang's API)."""
        gen = torch.Generator().manual_seed(seed)
        ps = self.spec.page_size
        for i in range(0, len(host_indices), ps):
            page = self.host_pool.get_dummy_flat_data_page()
            raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
            self.host_pool.set_from_flat_data_page(int(host_indices[i]), raw.view(page.dtype))

    def page_bytes_at(self, host_indices: torch.Tensor) -> list[bytes]:
        """The flat bytes of every page at ``host_indices`` (SGLang's own flat-page view)."""
        ps = self.spec.page_size
        out = []
        for i in range(0, len(host_indices), ps):
            page = self.host_pool.get_data_page(int(host_indices[i]), flat=True).contiguous()
            out.append(page.view(torch.uint8).numpy().tobytes())
        return out

    def token_kv(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The KV of each token at ``host_indices`` in one order whatever the host layout: uint8,
        shape (tokens, K/V, layers, heads, head_dim bytes) for MHA, (tokens, layers, 1, dim bytes)
        for MLA, read from the pool's ``kv_buffer`` by the dims SGLang's ``init_kv_buffer`` gives
        each layout (the dims its L1<->L2 transfers index). Two pools of different layouts hold the
        same KV exactly when these are equal; their flat data pages need not be."""
        b = self.host_pool.kv_buffer
        layout, mha = self.host_pool.layout, self.spec.kind == "mha"
        if mha:
            two, layers, heads, dim = 2, self.spec.layers, self.spec.heads, self.spec.head_dim
            if layout == "layer_first":          # (2, layer, token, head, dim)
                v = b.permute(2, 0, 1, 3, 4)
            elif layout == "page_first":         # (2, token, layer, head, dim)
                v = b.permute(1, 0, 2, 3, 4)
            elif layout == "page_first_direct":  # (2, page, layer, token in page, head, dim)
                v = b.permute(1, 3, 0, 2, 4, 5)
            elif layout == "page_head":          # (2, page, head, token in page, layer, dim)
                v = b.permute(1, 3, 0, 4, 2, 5)
            else:
                raise ValueError(f"token_kv: layout {layout!r} has no known dims")
            v = v.reshape(-1, two, layers, heads, dim)
        else:
            layers, dim = self.spec.layers, self.spec.kv_lora_rank + self.spec.rope_dim
            if layout == "layer_first":          # (layer, token, 1, dim)
                v = b.permute(1, 0, 2, 3)
            elif layout == "page_first":         # (token, layer, 1, dim)
                v = b
            elif layout == "page_first_direct":  # (page, layer, token in page, 1, dim)
                v = b.permute(0, 2, 1, 3, 4)
            else:
                raise ValueError(f"token_kv: layout {layout!r} has no known dims")
            v = v.reshape(-1, layers, 1, dim)
        return v[host_indices.to(torch.int64)].contiguous().view(torch.uint8)

    def backup(
        self, tokens: list[int], host_indices: torch.Tensor, hashes: list[str] | None = None,
        prefix_keys: list[str] | None = None, timeout_s: float = 60.0,
    ) -> int:
        """Queue a storage write of the full pages and wait for its ack; returns completed tokens."""
        ps = self.spec.page_size
        n_pages = len(tokens) // ps
        hashes = hashes if hashes is not None else self.page_keys(tokens[: n_pages * ps])
        op_id = self.controller.write_storage(
            host_indices[: n_pages * ps], tokens[: n_pages * ps], hash_value=hashes, prefix_keys=prefix_keys
        )
        for op in _acks(self.controller.ack_backup_queue, timeout_s, f"backup op {op_id}"):
            if op.id == op_id:
                return op.completed_tokens

    def prefetch(
        self, tokens: list[int], last_hash: str | None = None, prefix_keys: list[str] | None = None,
        timeout_s: float = 60.0,
    ) -> PrefetchResult:
        """Hit query + read into freshly allocated host slots, as the scheduler drives it."""
        self._rid += 1
        rid = f"req-{self._rid}"
        c = self.controller
        op = c.prefetch(rid, tokens, last_hash, prefix_keys)
        got = c.prefetch_hit_queue.get(timeout=timeout_s)
        assert got is op, "prefetch hit queue returned another request's operation"
        hit = op.storage_hit_count
        if hit == 0:
            return PrefetchResult(0, 0, None, [])
        host_indices = self.alloc(hit)
        op.host_indices = host_indices
        c.prefetch_buffer.put(op)
        loaded = 0
        for ack in _acks(c.ack_prefetch_queue, timeout_s, f"prefetch {rid}"):
            if ack.rid != rid:
                continue
            if ack.completed_tokens is not None:
                loaded = ack.completed_tokens
            if ack.completed_req:
                break
        return PrefetchResult(hit, loaded, host_indices, list(op.hash_value))

    def close(self) -> None:
        """Detach the backend (stops the storage threads and calls the backend's close())."""
        if self.controller.enable_storage or self.controller.storage_backend is not None:
            self.controller.detach_storage_backend()


class HybridHarness:
    """SGLang's ``HybridCacheController`` (the controller of hybrid models: KV pool + sidecar pools
    such as SWA or Mamba state) on CPU pools, with a storage backend attached.

    ``sidecars`` maps a ``PoolName`` to the :class:`PoolSpec` of its host pool. The controller
    registers every pool with the backend (``register_mem_host_pool_v2``) and drives the v2 calls
    itself: ``batch_set_v2`` from its backup thread, ``batch_exists_v2`` from its hit query,
    ``batch_get_v2`` from its io-aux thread, with the sidecar keys re-aligned to the hit
    (``_sync_trailing_keys``) as in a server."""

    def __init__(self, spec: PoolSpec, sidecars: dict, backend: str = "dynamic",
                 extra_config: dict | None = None, model_name: str = "test-model",
                 pools: dict | None = None) -> None:
        """``pools``: prebuilt :class:`Pools` by ``PoolName``, replacing or adding to those built from
        the specs (SGLang host pool classes a :class:`PoolSpec` does not describe, e.g. DeepSeek-V4's
        ``LogicalHostPool`` KV anchor and its compressed sidecars; a sidecar needs only its host pool)."""
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

        self.spec = spec
        self._kv = PoolName.KV
        self.pools = {PoolName.KV: build_pools(spec)}
        self.pools.update({name: build_pools(s) for name, s in sidecars.items()})
        self.pools.update(pools or {})
        entries = [PoolEntry(name, p.host_pool, p.device_pool, lambda layer: layer,
                             is_primary_index_anchor=name == PoolName.KV) for name, p in self.pools.items()]
        kv = self.pools[PoolName.KV]
        self.controller = HybridCacheController(
            kv.allocator, HostPoolGroup(entries), page_size=spec.page_size, tp_group=None,
            load_cache_event=threading.Event(), write_policy="write_through", storage_backend=backend,
            storage_backend_extra_config=dict(extra_config or {}), model_name=model_name,
            prefetch_threshold=spec.page_size,
        )
        self._rid = 0

    @property
    def backend(self) -> Any:
        return self.controller.storage_backend

    def host_pool(self, name: Any) -> Any:
        return self.pools[name].host_pool

    def alloc(self, name: Any, n_tokens: int) -> torch.Tensor:
        idx = self.host_pool(name).alloc(n_tokens)
        if idx is None:
            raise RuntimeError(f"host pool {name} full: cannot allocate {n_tokens} tokens")
        return idx

    def fill_random(self, name: Any, host_indices: torch.Tensor, seed: int) -> None:
        pool, ps = self.host_pool(name), self.host_pool(name).page_size
        gen = torch.Generator().manual_seed(seed)
        for i in range(0, len(host_indices), ps):
            page = pool.get_dummy_flat_data_page()
            raw = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=gen)
            pool.set_from_flat_data_page(int(host_indices[i]), raw.view(page.dtype))

    def page_bytes_at(self, name: Any, host_indices: torch.Tensor) -> list[bytes]:
        pool, ps = self.host_pool(name), self.host_pool(name).page_size
        return [pool.get_data_page(int(host_indices[i]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
                for i in range(0, len(host_indices), ps)]

    def page_keys(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        return get_storage_hash_str(tokens, None, page_size=self.spec.page_size)

    def backup(self, tokens: list[int], host_indices: torch.Tensor, extra_pools: list | None,
               timeout_s: float = 60.0) -> Any:
        """``write_storage`` with sidecar transfers; returns the acked operation."""
        c = self.controller
        op_id = c.write_storage(host_indices, tokens, hash_value=self.page_keys(tokens), prefix_keys=None,
                                extra_pools=extra_pools)
        for op in _acks(c.ack_backup_queue, timeout_s, f"backup op {op_id}"):
            if op.id == op_id:
                return op

    def prefetch(self, tokens: list[int], extra_pools: list | None, timeout_s: float = 60.0) -> tuple[Any, list]:
        """Hit query (``batch_exists_v2``), fresh KV host slots for the hit, read (KV then the
        sidecars' ``batch_get_v2`` into their transfers' ``host_indices``); returns (operation, acks)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        self._rid += 1
        c = self.controller
        op = c.prefetch(CacheRequestHandle(f"req-{self._rid}", 0), tokens, None, None, extra_pools=extra_pools)
        got = c.prefetch_hit_queue.get(timeout=timeout_s)
        assert got is op, "prefetch hit queue returned another request's operation"
        acks: list = []
        if op.storage_hit_count == 0:
            return op, acks
        op.host_indices = self.alloc(self._kv, op.storage_hit_count)
        c.prefetch_buffer.put(op)
        for ack in _acks(c.ack_prefetch_queue, timeout_s, f"prefetch {op.request_id}"):
            if ack.rid != op.request_id:
                continue
            acks.append(ack)
            if ack.completed_req:
                return op, acks

    def close(self) -> None:
        if self.controller.enable_storage or self.controller.storage_backend is not None:
            self.controller.detach_storage_backend()


class ServerStackHarness:
    """The L2<->L3 stack of a launched SGLang 0.5.23 server serving a plain (KV-only) model.

    A server with ``--enable-hierarchical-cache`` builds ``UnifiedRadixCache``, whose ``init_hicache``
    parses ``--hicache-storage-backend-extra-config`` with
    ``HybridCacheController.parse_storage_backend_extra_config`` (which pops ``prefetch_threshold``,
    ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token`` and
    ``hicache_storage_pass_prefix_keys``: the backend never sees them) and, for a model whose only
    tree component is the full KV (``_PlainKvStrategy``), calls ``build_kv_only_stack``: a
    ``HybridCacheController`` over a ``HostPoolGroup`` of one anchor entry (``PoolName.KV``). That
    controller registers the KV pool twice (``register_mem_pool_host``, then
    ``register_mem_host_pool_v2(pool, PoolName.KV)``), asks ``batch_exists`` about a request's whole
    page chain in one call (``HiCacheController`` asks in batches of ``STORAGE_BATCH_SIZE``), and
    runs its backup thread on every rank (an MLA non-writer acks without writing).

    This harness builds exactly that (``build_pool_entry`` + ``HostPoolGroup`` +
    ``HybridCacheController`` with ``build_kv_only_stack``'s arguments); the one difference is the
    host pool, made by :func:`build_pools` unpinned (``build_kv_host_pool`` pins it with
    ``cudaHostRegister``, which needs CUDA). ``extra_config`` is the CLI's JSON text (a dict is
    serialised first). :meth:`backup` and :meth:`prefetch` pass ``prefix_keys`` as the tree and
    scheduler do: the hash chain of the node's ancestors when ``hicache_storage_pass_prefix_keys``
    was set, else None."""

    def __init__(self, spec: PoolSpec, extra_config: dict | str, backend: str = "dynamic",
                 model_name: str = "test-model", write_policy: str = "write_through",
                 storage_metrics: bool = True, pools: Pools | None = None) -> None:
        import json

        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host import HostPoolGroup

        self.spec = spec
        text = extra_config if isinstance(extra_config, str) else json.dumps(extra_config)
        (self.extra_config, self.prefetch_threshold, self.prefetch_timeout_base,
         self.prefetch_timeout_per_ki_token, self.pass_prefix_keys,
         ) = HybridCacheController.parse_storage_backend_extra_config(text)
        self.pools = pools or build_pools(spec)
        self.host_pool = self.pools.host_pool
        layers = {i: i for i in range(spec.layers)}
        self.group = HostPoolGroup([build_pool_entry(
            name=PoolName.KV, host_pool=self.host_pool, device_pool=self.pools.device_pool,
            layer_mapping=layers, transfer_layer_id_max=len(layers), is_anchor=True)])
        self.controller = HybridCacheController(
            self.pools.allocator, self.group, spec.page_size, None, load_cache_event=threading.Event(),
            attn_cp_group=None, attn_tp_group=None, pp_group=None, write_policy=write_policy,
            storage_backend=backend, prefetch_threshold=self.prefetch_threshold, model_name=model_name,
            storage_backend_extra_config=self.extra_config, transfer_layer_id_max=len(layers),
            enable_storage_metrics=storage_metrics,
        )
        self._rid = 0

    # The same pool, spec and controller attributes as ControllerHarness: its helpers apply as they are.
    backend = ControllerHarness.backend
    page_keys = ControllerHarness.page_keys
    alloc = ControllerHarness.alloc
    fill_random = ControllerHarness.fill_random
    page_bytes_at = ControllerHarness.page_bytes_at
    token_kv = ControllerHarness.token_kv

    def _prefix(self, ancestor_keys: list[str]) -> list[str] | None:
        return list(ancestor_keys) if self.pass_prefix_keys else None

    def backup(self, tokens: list[int], host_indices: torch.Tensor, ancestor_keys: list[str] = (),
               timeout_s: float = 60.0) -> int:
        """``write_backup_storage`` of one tree node: its full pages, keyed by the chain continuing
        ``ancestor_keys`` (the node's ancestors' page keys, root first); returns completed tokens."""
        ps = self.spec.page_size
        n = len(tokens) // ps * ps
        last = ancestor_keys[-1] if ancestor_keys else None
        op_id = self.controller.write_storage(host_indices[:n], tokens[:n], hash_value=self.page_keys(tokens[:n], last),
                                              prefix_keys=self._prefix(ancestor_keys))
        for op in _acks(self.controller.ack_backup_queue, timeout_s, f"backup op {op_id}"):
            if op.id == op_id:
                return op.completed_tokens

    def prefetch(self, tokens: list[int], ancestor_keys: list[str] = (), timeout_s: float = 60.0) -> PrefetchResult:
        """``prefetch_from_storage`` of ``tokens`` after a host match ending at the node whose chain
        is ``ancestor_keys``: hit query, fresh host slots for the hit, read, acks."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        self._rid += 1
        c = self.controller
        last = ancestor_keys[-1] if ancestor_keys else None
        op = c.prefetch(CacheRequestHandle(f"req-{self._rid}", 0), tokens, last, self._prefix(ancestor_keys))
        got = c.prefetch_hit_queue.get(timeout=timeout_s)
        assert got is op, "prefetch hit queue returned another request's operation"
        hit = op.storage_hit_count
        if hit == 0:
            return PrefetchResult(0, 0, None, [])
        op.host_indices = self.alloc(hit)
        c.prefetch_buffer.put(op)
        loaded = 0
        for ack in _acks(c.ack_prefetch_queue, timeout_s, f"prefetch {op.request_id}"):
            if ack.rid != op.request_id:
                continue
            if ack.completed_tokens is not None:
                loaded = ack.completed_tokens
            if ack.completed_req:
                break
        return PrefetchResult(hit, loaded, op.host_indices, list(op.hash_value))

    def close(self) -> None:
        if self.controller.enable_storage or self.controller.storage_backend is not None:
            self.controller.detach_storage_backend()
