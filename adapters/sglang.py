"""radixkv as SGLang 0.5.23's L3 storage backend (``--hicache-storage-backend dynamic``).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"radixkv","module_path":"radixkv.adapters.sglang","class_name":"RadixKVStore",
        "interface_v1":1,"hicache_storage_pass_prefix_keys":true,
        "tiers":[{"url":"mem://","capacity":"8GiB"},{"url":"file:///var/cache/radixkv","capacity":"200GiB"}]}'

SGLang owns L1 (GPU) and L2 (its host pool); radixkv's :class:`~radixkv.store.HierarchicalStore`
(radix tree over memory / disk / Redis tiers) is L3. SGLang page hashes are radixkv chunk keys; with
``hicache_storage_pass_prefix_keys`` each page hangs under its parent, so the tree mirrors SGLang's
prefix tree at page granularity. Contract (docs/sglang.md):

* constructed as ``cls(storage_config, kwargs)``; host pools arrive via ``register_mem_pool_host``,
  ``register_mem_host_pool_v2`` and ``on_host_pools_registered``;
* ``batch_set_v1`` / ``batch_get_v1`` copy between the host pool and the tiers directly (see
  :mod:`radixkv.adapters.sglang_pages`); ``batch_exists`` is one tree lookup (plus one probe of the
  persistent/shared tiers on a miss, which adopts chunks written before a restart or by another
  server); the copying ``get``/``set``/``batch_*``/``exists`` path works with ``interface_v1`` off;
* ``batch_*_v2`` serve the KV pool plus sidecar pools (``all_pages`` and ``trailing_pages`` policies);
* every storage identity carries model, dtype, layout, page size and the TP/PP/CP/DP shard; with MLA
  only the storage-writer rank writes, so an MLA server with non-writer ranks must have a tier they
  share (Redis or a ``shared`` disk tier; a ConfigError at attach otherwise), and cannot store an
  MHA draft model's KV, whose shard differs per rank (a ConfigError when the draft pool registers);
* a non-shared disk tier is one directory per rank under the configured root (capacity per rank);
* a host pool radixkv cannot store (SGLang's MXFP8 KV pool) is a ConfigError when it registers, and
  so is a pool without a flat data page (asymmetric K/V, ``page_first_kv_split``) with
  ``interface_v1`` off; with it on, such pools are stored as parts of unequal sizes;
* ``interface_v1`` is read as SGLang reads it (``bool(value)``), so ``batch_exists`` answers from
  the namespace of the path SGLang's controller actually uses;
* the namespaces follow the weight version SGLang serves (``get_serving().weight_version``): after
  an in-place weight update that names a new ``weight_version`` every call uses namespaces of that
  version, so pages of the old weights are misses (an update naming no version changes nothing
  radixkv can see: docs/sglang.md, "Weight updates");
* a batch call never raises: failures are per-page ``False`` with a logged reason.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from radixkv.adapters.sglang_config import (
    RadixKVOptions,
    check_draft_sharding,
    check_mla_sharing,
    dp_rank_of,
    namespace_for,
    per_rank_config,
    runtime_weight_version,
    sglang_model_digest,
    tp_replicated,
)
from radixkv.adapters.sglang_pages import PagePlan, flat_format, plan_for
from radixkv.config import metrics_port_for_rank
from radixkv.errors import ConfigError, InputError
from radixkv.keys import Namespace
from radixkv.store import HierarchicalStore

__all__ = ["RadixKVStore"]

logger = logging.getLogger("radixkv.sglang")

try:  # SGLang's storage-metrics record (asserted by its collector)
    from sglang.srt.observability.metrics_collector import StorageMetrics as _StorageMetrics
except Exception:  # pragma: no cover - metrics module missing in a trimmed install
    _StorageMetrics = None  # type: ignore[assignment]


class _PoolBinding:
    """One registered host pool: its page plan and namespace (v1/zero-copy and flat/copying)."""

    __slots__ = ("name", "pool", "plan", "flat", "ns", "ns_flat", "replicated")

    def __init__(self, name: str, pool: Any, config: HiCacheStorageConfig, opts: RadixKVOptions,
                 model_digest: str = "") -> None:
        self.name = name
        self.pool = pool
        self.plan: PagePlan = plan_for(pool, flat=name != str(PoolName.KV))
        # A pool without a flat page (asymmetric K/V, page_first_kv_split) keeps its parts plan
        # here, which refuses the copying path's calls (interface_v1 off is refused in _bind).
        self.flat: PagePlan = (self.plan if self.plan.mode != "parts" or not self.plan.has_flat
                               else plan_for(pool, flat=True))
        self.ns: Namespace = namespace_for(config, opts, pool, name, self.plan.tag, model_digest=model_digest)
        # Flat pages are in the layout's own byte order (page_first: token-major): a flat chunk
        # written from one order must never be read into a pool of another (wrong KV, same size).
        self.ns_flat: Namespace = namespace_for(config, opts, pool, name, self.flat.tag, layout=flat_format(pool),
                                                model_digest=model_digest)
        self.replicated = tp_replicated(config, name)  # same pages on every TP rank: one rank writes


def _dp_attention() -> bool:
    """Whether SGLang runs attention data-parallel (then the storage config's TP rank is the
    attention group's). True when it cannot tell: ports then stay distinct, if not contiguous."""
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        return bool(is_dp_attention_enabled())
    except Exception:
        return True


def _host_rank(config: Any) -> int:
    """This scheduler's rank among the server's: TP rank + TP size x (PP rank + PP size x DP rank),
    the DP rank being :func:`~radixkv.adapters.sglang_config.dp_rank_of` (the replica's index under
    plain ``--dp-size``, where every replica has the same TP/PP ranks). With DP attention SGLang passes the attention group's TP rank and size plus the DP rank, and
    the attention-CP ranks of one DP rank share that TP rank (SGLang's rank layout is DP, CP, TP):
    then TP rank + TP size x (CP rank + CP size x (PP rank + PP size x DP rank)). Without DP
    attention the TP rank is the whole group's, which tells the CP ranks apart already."""
    def get(name: str, default: int) -> int:
        return int(getattr(config, name, default) or default)

    tp, tp_size, pp, pp_size = get("tp_rank", 0), get("tp_size", 1), get("pp_rank", 0), get("pp_size", 1)
    dp = dp_rank_of(config)  # plain DP: the replica's index, which the storage config lacks
    cp, cp_size = get("attn_cp_rank", 0), get("attn_cp_size", 1)
    if cp_size == 1 or not _dp_attention():
        cp, cp_size = 0, 1
    return tp + tp_size * (cp + cp_size * (pp + pp_size * dp))


class RadixKVStore(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a radixkv hierarchical store. Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self.options = RadixKVOptions.from_extra_config(storage_config.extra_config or {})
        # What SGLang's controller picked (zero-copy batch_*_v1 or the copying path), read as it
        # reads it: batch_exists must answer from that path's namespace.
        self.interface_v1 = self.options.interface_v1
        self.is_writer = bool(storage_config.is_storage_writer)
        # Every rank gets this same extra config: non-shared disk tiers become per-rank directories.
        config = per_rank_config(self.options.store_config(), storage_config)
        check_mla_sharing(config, storage_config)
        config = metrics_port_for_rank(config, _host_rank(storage_config))
        self.store = HierarchicalStore(config)
        # The served model name alone does not fix the KV (revision, quantization, overrides): every
        # namespace carries the digest of the server arguments that do.
        self.weight_version = runtime_weight_version()
        self.model_digest = sglang_model_digest(self.options, weight_version=self.weight_version)
        # Namespaces of earlier weight versions, which clear() drops as well.
        self._retired: list[Namespace] = []
        self._bindings: dict[str, _PoolBinding] = {}
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._pending = self._empty_metrics()
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.counters = {"failed_calls": 0, "skipped_non_writer_pages": 0, "adopted_chunks": 0}
        self._closed = False

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._bind(str(PoolName.KV), mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        # Raising here fails the server's start (SGLang registers a draft sidecar after the attach,
        # from the draft worker's setup) or a runtime attach (PUT /hicache/storage-backend).
        check_draft_sharding(self.storage_config, str(host_pool_name), host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._bind(str(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        logger.info("radixkv: pools %s; namespaces %s", sorted(self._bindings),
                    {n: str(b.ns) for n, b in self._bindings.items()})

    def _bind(self, name: str, pool: Any) -> None:
        with self._lock:
            b = _PoolBinding(name, pool, self.storage_config, self.options, self.model_digest)
            if not self.interface_v1 and not b.flat.has_flat:
                # SGLang's copying path (interface_v1 off) moves the KV pool's flat data pages, which
                # this pool does not have: every backup would fail in SGLang's own get_data_page.
                raise ConfigError(
                    f"SGLang's host pool {type(pool).__name__} (layout {getattr(pool, 'layout', None)!r}) has "
                    f"no flat data page, so SGLang's copying interface (interface_v1={self.options.interface_v1!r}) "
                    "cannot store it; set \"interface_v1\": 1 in --hicache-storage-backend-extra-config "
                    "(radixkv then stores its buffers' segments directly)")
            self._borrow_if_reader(b)
            self._bindings[name] = b

    def _borrow_if_reader(self, b: _PoolBinding) -> None:
        # The writer rank stores and evicts these pages; this rank only reads them, so making room
        # in its own books must forget them, never delete them from the shared tier. Borrowed before
        # the binding is published: another storage thread using it at once would adopt the writer's
        # pages into a namespace not yet borrowed, and its evictions deleted them (found by an audit).
        if not self.is_writer and b.replicated:
            self.store.borrow(b.ns)
            self.store.borrow(b.ns_flat)

    def _follow_weights(self) -> None:
        """Move every pool to the namespaces of the weight version SGLang serves now, if it changed
        since the last call (an in-place weight update named a new version). Pages of the earlier
        version stay in the tiers until evicted or cleared, and are never found again."""
        version = runtime_weight_version()
        if version == self.weight_version:
            return
        with self._lock:
            if version == self.weight_version:
                return
            digest = sglang_model_digest(self.options, weight_version=version)
            rebound = {}
            for name, old in self._bindings.items():
                self._retired += [old.ns, old.ns_flat]
                rebound[name] = _PoolBinding(name, old.pool, self.storage_config, self.options, digest)
                self._borrow_if_reader(rebound[name])  # before the fast path above can see them
            self._bindings = rebound
            self.model_digest, self.weight_version = digest, version
        logger.info("radixkv: weight version %r: namespaces %s", version,
                    {n: str(b.ns) for n, b in rebound.items()})

    def _current(self, name: str = "kv") -> Optional[_PoolBinding]:
        """The binding of pool ``name`` for the weights served now; None if never registered."""
        self._follow_weights()
        return self._bindings.get(name)

    def _binding(self, name: str = "kv") -> _PoolBinding:
        b = self._current(name)
        if b is None:
            raise RuntimeError(f"host pool {name!r} was never registered with the radixkv backend")
        return b

    # ------------------------------------------------------------------ chain helpers
    @staticmethod
    def _parent(extra_info: Any) -> Optional[str]:
        """The key of the page the batch hangs from (SGLang's prefix_keys), if passed."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return prefix[-1] if prefix else None

    def _lookup(self, ns: Namespace, keys: List[str], parent: Optional[str], chunk_bytes: int,
                record: bool = True) -> int:
        """Leading run of ``keys`` available: the tree, then (on a miss, ``probe_tiers``) the chunks
        the persistent/shared tiers hold, adopted by the store (``HierarchicalStore.adopt``).
        ``record``: count it in the store's lookup metrics (SGLang's existence checks; not the
        lookups that start a read, which SGLang makes after its own existence check)."""
        n = self._run_across_splits(ns, keys)
        # Adopt from where the split-aware run ends (adopting from the tree's own match would stop at
        # a split: the key after it is already in the tree elsewhere), as long as it makes progress.
        while n < len(keys) and self.store.config.probe_tiers:  # the final config's: extra, file or env
            got = self.store.adopt(ns, keys[n:], parent_key=keys[n - 1] if n else parent,
                                   chunk_bytes=chunk_bytes)
            if not got:
                break
            self.counters["adopted_chunks"] += got
            n = self._run_across_splits(ns, keys)
        if record:
            self.store.record_lookup(ns, n, len(keys))
        return n

    def _run_across_splits(self, ns: Namespace, keys: List[str]) -> int:
        """Leading run of ``keys`` the tree holds, continued across chain splits: SGLang may back up a
        child page before its parent (no parent-first rule; leaf-first eviction under write_back);
        the child then hangs at the namespace root. SGLang's keys are hash chains (a key names its
        whole prefix), so a run found there continues the prefix byte for byte."""
        n = self.store.lookup(ns, keys, probe=False, record=False)
        while 0 < n < len(keys):
            more = self.store.lookup(ns, keys[n:], probe=False, record=False)
            if not more:
                break
            n += more
        return n

    def _get_across_splits(self, ns: Namespace, keys: List[str], bufs: List[Any]) -> int:
        """``store.get`` of a run that may span chain splits (see :meth:`_run_across_splits`)."""
        done = 0
        while done < len(keys):
            got = self.store.get(ns, keys[done:], bufs[done:], count_misses=False)
            if not got:
                break
            done += got
        self.store.record_misses(ns, len(keys) - done)
        return done

    def _put(self, ns: Namespace, keys: List[str], payloads: List[Any], parent: Optional[str],
             moved: Optional[List[int]] = None) -> List[bool]:
        """Store a run of pages; per page, whether it is stored. ``moved[0]`` grows by the pages
        written: stored now and not held in the top tier before (SGLang's backup metrics exclude
        pages the backend already held)."""
        held = self._held_on_top(ns, keys) if moved is not None else []
        ok = self._put_run(ns, keys, payloads, parent)
        if moved is not None:
            moved[0] += sum(1 for o, h in zip(ok, held) if o and not h)
        return ok

    def _held_on_top(self, ns: Namespace, keys: List[str]) -> List[bool]:
        """Per key: whether the store's top tier holds the page (a put rewrites no such page)."""
        s = self.store
        with s.lock:
            tree = s.tree
            return [(n := tree.lookup(ns.digest, k)) is not None and bool(tree.node_tier_mask(n) & 1)
                    for k in keys]

    def _put_run(self, ns: Namespace, keys: List[str], payloads: List[Any], parent: Optional[str]) -> List[bool]:
        # A parent page this store lacks (not backed up yet: write_back backs up a child node before
        # its parent; or evicted, or its write failed): the pages still match by key, so they hang
        # at the namespace root rather than being dropped, and await the parent page, which grafts
        # them under it when it arrives (root_if_missing): one chain for eviction again.
        try:
            return self.store.put(ns, keys, payloads, parent_key=parent, root_if_missing=True)
        except InputError:
            # A split chain (a later page backed up first, at the namespace root) is grafted by the
            # tree; what still lands here contradicts the tree (a page held under another prefix):
            # store the run in pieces that each continue where their first key is.
            return self._put_pieces(ns, keys, payloads, parent)

    def _put_pieces(self, ns: Namespace, keys: List[str], payloads: List[Any],
                    parent: Optional[str]) -> List[bool]:
        """Store ``keys`` as pieces cut before every key the tree already holds (anywhere in the
        namespace: SGLang's keys are hash chains, so such a key is this prefix's page). The first
        piece hangs from ``parent``; the others continue from their first key's place."""
        held = [self.store.lookup(ns, [k], probe=False, record=False) == 1 for k in keys]
        starts = [i for i in range(len(keys)) if i == 0 or held[i]]
        ok: List[bool] = []
        for j, a in enumerate(starts):
            b = starts[j + 1] if j + 1 < len(starts) else len(keys)
            first = parent if a == 0 and not held[0] else None
            try:  # a parent that is gone: the piece hangs at the root, awaiting it
                got = self.store.put(ns, keys[a:b], payloads[a:b], parent_key=first,
                                     root_if_missing=True)
            except InputError as e:  # the tree changed meanwhile: the rest is not stored this time
                logger.info("radixkv: storing pages after a chain split failed: %s", e)
                got = [False] * (b - a)
            ok += got
            if not all(got):
                break
        return ok + [False] * (len(keys) - len(ok))

    # ------------------------------------------------------------------ page I/O (one pool)
    def _write_pages(self, b: _PoolBinding, plan: PagePlan, ns: Namespace, keys: List[str],
                     host_indices: torch.Tensor, extra_info: Any,
                     moved: Optional[List[int]] = None) -> List[bool]:
        n = len(keys)
        if not self.is_writer and b.replicated:
            # Pages replicated across TP (MLA KV and its shared sidecars): the writer rank stores
            # these exact bytes. TP-sharded pools (Mamba state, even in MLA models) are written by
            # every rank, as SGLang's should_backup asks: their namespace is per rank.
            self.counters["skipped_non_writer_pages"] += n
            return [True] * n
        starts = plan.page_starts(host_indices, n)
        payloads = plan.views(starts) if plan.mode == "parts" else plan.gather(starts)
        return self._put(ns, list(keys), payloads, self._parent(extra_info), moved)

    def _read_pages(self, b: _PoolBinding, plan: PagePlan, ns: Namespace, keys: List[str],
                    host_indices: torch.Tensor, extra_info: Any) -> List[bool]:
        n = len(keys)
        starts = plan.page_starts(host_indices, n)
        keys = list(keys)
        m = self._lookup(ns, keys, self._parent(extra_info), plan.chunk_bytes, record=False)
        # Pages SGLang asks for past the store's run (gone since its batch_exists) are misses in
        # every tier, as store.get counts them; the read below counts its own.
        self.store.record_misses(ns, n - m)
        if m == 0:
            return [False] * n
        if plan.mode == "parts":
            pages = self._get_across_splits(ns, keys[:m], plan.views(starts[:m]))
        else:
            bufs = plan.staging(m)
            pages = self._get_across_splits(ns, keys[:m], bufs)
            plan.scatter(starts[:pages], bufs[:pages])
        return [i < pages for i in range(n)]

    @staticmethod
    def _n(keys: Any) -> int:
        """len(keys), or 0 for a malformed argument (which then fails inside the guard, not here)."""
        try:
            return len(keys)
        except TypeError:
            return 0

    def _guard(self, what: str, n: int, fn: Any, *args: Any) -> List[bool]:
        try:
            return fn(*args)
        except Exception as e:  # never raise into SGLang's storage threads
            self.counters["failed_calls"] += 1
            logger.warning("radixkv: %s of %d pages failed: %s: %s", what, n, type(e).__name__, e)
            return [False] * n

    def _record(self, kind: str, pages: int, nbytes: int, t0: float) -> None:
        # SGLang drains these only through get_stats(), which it calls only with storage metrics on:
        # otherwise they would grow forever. Calls that moved nothing are not samples.
        if self._pending is None or not pages or not self._metrics_on:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:
            getattr(self._pending, f"{kind}_pgs").append(pages)
            if dt > 0 and nbytes:
                getattr(self._pending, f"{kind}_bandwidth").append(nbytes / dt / 1e9)

    # ------------------------------------------------------------------ v1 (zero-copy)
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        t0 = time.perf_counter()
        b = self._current("kv")
        if b is None:
            return [False] * self._n(keys)
        # Pages written: a non-writer's skipped pages and pages already held are not (counted only
        # for the samples, kept only with storage metrics on: the count costs a lookup per page).
        moved = [0] if self._metrics_on else None
        ok = self._guard("batch_set_v1", self._n(keys), self._write_pages, b, b.plan, b.ns, keys, host_indices,
                         extra_info, moved)
        pages = moved[0] if moved else 0
        self._record("backup", pages, pages * b.flat.page_bytes, t0)
        return ok

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        t0 = time.perf_counter()
        b = self._current("kv")
        if b is None:
            return [False] * self._n(keys)
        ok = self._guard("batch_get_v1", self._n(keys), self._read_pages, b, b.plan, b.ns, keys, host_indices, extra_info)
        self._record("prefetch", sum(ok), sum(ok) * b.flat.page_bytes, t0)
        return ok

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        try:
            b = self._binding("kv")
            plan, ns = (b.plan, b.ns) if self.interface_v1 else (b.flat, b.ns_flat)
            return self._lookup(ns, list(keys), self._parent(extra_info), plan.chunk_bytes)
        except Exception as e:
            self.counters["failed_calls"] += 1
            logger.warning("radixkv: batch_exists of %d pages failed: %s: %s", self._n(keys), type(e).__name__, e)
            return 0

    # ------------------------------------------------------------------ copying path (interface_v1 off)
    def _u8(self, t: Any) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        def run() -> List[bool]:
            b = self._binding("kv")
            if not self.is_writer:
                self.counters["skipped_non_writer_pages"] += len(keys)
                return [True] * len(keys)
            # SGLang's flat pages of a pool without bytes are empty: store its markers instead.
            payloads = b.flat.gather([0] * len(keys)) if b.flat.mode == "marker" else [self._u8(v) for v in values]
            return self._put(b.ns_flat, list(keys), payloads, None, moved)

        t0 = time.perf_counter()
        moved = [0] if self._metrics_on else None  # pages written (see batch_set_v1)
        ok = self._guard("batch_set", self._n(keys), run)
        b = self._bindings.get("kv")  # for the page size only: the same in every weight version
        pages = moved[0] if moved else 0
        self._record("backup", pages, pages * (b.flat.page_bytes if b else 0), t0)
        return all(ok) if ok or isinstance(keys, (list, tuple)) else False  # nothing to store: True

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        t0 = time.perf_counter()
        b: Optional[_PoolBinding] = None
        got, targets = 0, None
        try:
            b = self._binding("kv")
            targets = list(target_locations) if target_locations is not None else b.flat.staging(len(keys))
            n = self._lookup(b.ns_flat, list(keys), None, b.flat.chunk_bytes, record=False)
            self.store.record_misses(b.ns_flat, len(keys) - n)  # as _read_pages
            # A marker is read into scratch: the target, an empty flat page, is all there is to return.
            bufs = b.flat.staging(n) if b.flat.mode == "marker" else [self._u8(t) for t in targets[:n]]
            got = self._get_across_splits(b.ns_flat, list(keys[:n]), bufs) if n else 0
        except Exception as e:  # never raise into SGLang's storage threads
            self.counters["failed_calls"] += 1
            logger.warning("radixkv: batch_get of %d pages failed: %s: %s", self._n(keys), type(e).__name__, e)
            got = 0
        self._record("prefetch", got, got * (b.flat.page_bytes if b else 0), t0)
        return [targets[i] if i < got and targets is not None else None for i in range(self._n(keys))]

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        try:
            b = self._binding("kv")
            return self._lookup(b.ns_flat, [key], None, b.flat.chunk_bytes) == 1
        except Exception as e:
            logger.warning("radixkv: exists failed: %s: %s", type(e).__name__, e)
            return False

    # ------------------------------------------------------------------ v2 (KV + sidecar pools)
    def _io_v2(self, transfers: List[PoolTransfer], extra_info: Any, write: bool) -> dict[str, List[bool]]:
        out: dict[str, List[bool]] = {}
        try:
            items = list(transfers or [])
        except TypeError:
            items = [transfers]  # not a list: reported as one malformed transfer below
        for tr in items:
            try:
                name = str(tr.name)
                keys = list(tr.keys or [])
            except Exception as e:  # not a PoolTransfer: never raise into SGLang's storage threads
                self.counters["failed_calls"] += 1
                logger.warning("radixkv: batch_*_v2 got a malformed transfer %r: %s: %s", tr, type(e).__name__, e)
                continue
            what = f"batch_{'set' if write else 'get'}_v2[{name}]"
            # Pages written (see batch_set_v1), counted only with storage metrics on.
            moved = [0] if write and self._metrics_on else None

            def run(tr: PoolTransfer = tr, name: str = name, keys: List[str] = keys,
                    moved: Optional[List[int]] = moved) -> List[bool]:
                b = self._binding(name)
                plan, ns = (b.plan, b.ns) if name == str(PoolName.KV) else (b.flat, b.ns_flat)
                info = extra_info if name == str(PoolName.KV) else None  # sidecars: no parent chain
                if write:
                    return self._write_pages(b, plan, ns, keys, tr.host_indices, info, moved)
                return self._read_pages(b, plan, ns, keys, tr.host_indices, info)

            t0 = time.perf_counter()
            ok = out[name] = self._guard(what, len(keys), run) if keys else []
            # One sample per pool transfer, in that pool's page bytes (as SGLang's HiCacheHF3FS
            # records its v2 calls): the v2 path (hybrid models) fed SGLang's histograms nothing.
            b = self._bindings.get(name)
            pages = (moved[0] if moved else 0) if write else sum(ok)
            self._record("backup" if write else "prefetch", pages, pages * (b.flat.page_bytes if b else 0), t0)
        return out

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._io_v2(transfers, extra_info, write=True)

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._io_v2(transfers, extra_info, write=False)

    def _present(self, name: str, keys: List[str]) -> List[bool]:
        """Per-key presence of a sidecar pool's pages (they need not form a chain from the root)."""
        b = self._binding(name)
        # record=False: per-page sidecar checks are not the engine's prefix lookups (a trailing-pages
        # pool holds only the last page, so counting them would report misses for a full hit)
        return [self._lookup(b.ns_flat, [k], None, b.flat.chunk_bytes, record=False) == 1 for k in keys]

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """KV prefix, then each sidecar pool's verdict (SGLang's HiCacheFile semantics): ``all_pages``
        needs every page of the prefix, ``trailing_pages`` only the last ``len(transfer.keys)`` pages
        before a prefix end, ``block_groups`` reports its leading complete groups without gating."""
        try:
            kv_pages = self.batch_exists(keys, extra_info)
            hits: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
            restorable = set(range(1, kv_pages + 1))
            for tr in pool_transfers or []:
                if not restorable:
                    break
                name = str(tr.name)
                have = self._present(name, keys[:kv_pages])
                if tr.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = have.index(False) if False in have else kv_pages
                    pool_ok = set(range(1, boundary + 1))
                elif tr.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(tr.keys) if tr.keys else 1)
                    pool_ok = {p for p in range(1, kv_pages + 1) if all(have[max(0, p - trailing) : p])}
                    boundary = max(pool_ok, default=0)
                else:  # BLOCK_GROUPS: own verdict only
                    g = max(1, tr.group_pages or 1)
                    lead = have.index(False) if False in have else kv_pages
                    if lead // g:
                        hits[name] = (lead // g) * g
                    continue
                if boundary:
                    hits[name] = boundary
                restorable &= pool_ok
            final = max(restorable, default=0)
            return PoolTransferResult(final, hits, sorted(restorable))
        except Exception as e:
            self.counters["failed_calls"] += 1
            logger.warning("radixkv: batch_exists_v2 of %d pages failed: %s: %s", self._n(keys), type(e).__name__, e)
            return PoolTransferResult.empty()

    # ------------------------------------------------------------------ lifecycle / metrics
    def clear(self) -> bool:
        """Drop every page of this backend's namespaces from every tier (other servers' untouched),
        those of the weight versions it served before too; True on success (as HiCacheFile
        reports)."""
        try:
            self._follow_weights()
            with self._lock:
                spaces = list(self._retired) + [ns for b in self._bindings.values() for ns in (b.ns, b.ns_flat)]
            for ns in dict.fromkeys(spaces):
                self.store.clear(ns)
            with self._lock:
                self._retired = [ns for ns in self._retired if ns not in spaces]
            return True
        except Exception as e:
            logger.warning("radixkv: clear failed: %s: %s", type(e).__name__, e)
            return False

    def close(self) -> None:
        """Flush background writes and close the tiers (SGLang calls this on detach). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.store.close()
        except Exception as e:
            logger.warning("radixkv: close failed: %s: %s", type(e).__name__, e)

    def _empty_metrics(self) -> Any:
        if _StorageMetrics is None:
            return None
        m = _StorageMetrics()
        return m

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per backup/prefetch call since the last call)
        with radixkv's own numbers attached as ``.radixkv`` (per-tier stats, tree, adapter counters)."""
        with self._metrics_lock:
            m, self._pending = self._pending, self._empty_metrics()
        try:
            detail = self.store.stats()
        except Exception as e:
            detail = {"error": f"{type(e).__name__}: {e}"}
        detail["adapter"] = dict(self.counters)
        if m is None:
            return detail
        m.radixkv = detail
        return m

    def check_integrity(self) -> None:
        self.store.check_integrity()
        s = self.store._stack
        shared = [t for t, tier in enumerate(s.tiers) if getattr(tier, "shared", False)]
        for name, b in self._bindings.items():
            assert b.plan.chunk_bytes > 0, f"pool {name}: empty page plan"
            if self.is_writer or not b.replicated:
                continue
            # The writer rank owns a replicated pool's pages in the shared tiers: this rank's
            # room-making must only forget them (_bind, _follow_weights borrow both namespaces).
            with self.store.lock:
                lent = [s.names[t] for t in shared for ns in (b.ns, b.ns_flat)
                        if not s.is_borrowed_locked(t, ns.digest)]
            assert not lent, f"pool {name}: a non-writer rank's namespaces are not borrowed in tiers {lent}"
