"""The stack a launched SGLang 0.5.23 server builds for a plain (KV-only) model, which is not the
``HiCacheController`` most of these tests drive: ``UnifiedRadixCache.init_hicache`` parses the extra
config (popping SGLang's own keys) and ``build_kv_only_stack`` attaches the backend through a
``HybridCacheController`` over a one-pool ``HostPoolGroup`` (``ServerStackHarness``). That controller
registers the KV pool twice, asks ``batch_exists`` about a request's whole chain in one call (not in
batches of 128), and the tree, not the backend's config, decides whether prefix keys are passed."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import PoolSpec, ServerStackHarness  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang

PS = 4


def _trace(backend, calls):
    """Record (method, pages, prefix_keys length or None) of every storage call on ``backend``."""
    def wrap(name, info_at):
        fn = getattr(backend, name)

        def traced(*args, **kwargs):
            info = kwargs.get("extra_info", args[info_at] if info_at is not None and len(args) > info_at else None)
            prefix = getattr(info, "prefix_keys", None)
            calls.append((name, len(args[0]), None if prefix is None else len(prefix)))
            return fn(*args, **kwargs)

        setattr(backend, name, traced)

    for name, info_at in (("batch_exists", 1), ("batch_get_v1", 2), ("batch_set_v1", 2),
                          ("batch_get", None), ("batch_set", None)):
        wrap(name, info_at)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("interface_v1", [1, 0])
def test_server_stack_round_trips_a_long_chain_backed_up_child_first(kind, interface_v1, caplog):
    """Two tree nodes of 150 pages each (over SGLang's 128-page storage batches), the child node
    backed up before its parent (write_back's leaf-first order): every page comes back byte for
    byte through one whole-chain ``batch_exists``; with ``interface_v1`` the child run, which waited
    for its parent page, is grafted under it, so the tree holds one chain."""
    cfg = extra_config([mem_tier()], interface_v1=interface_v1, prefetch_threshold=PS,
                       prefetch_timeout_base=2, prefetch_timeout_per_ki_token=0.5)
    with caplog.at_level(logging.WARNING, logger="radixkv"):
        h = ServerStackHarness(PoolSpec(kind=kind, layout="page_first", page_size=PS, host_tokens=4096), cfg)
    try:
        be = unwrap(h.backend)
        # The server's parse popped SGLang's own keys: radixkv neither sees them nor reports them.
        assert h.pass_prefix_keys and h.prefetch_threshold == PS
        assert "hicache_storage_pass_prefix_keys" not in be.storage_config.extra_config
        assert "prefetch_timeout_base" not in be.storage_config.extra_config
        assert be.interface_v1 == bool(interface_v1)
        assert not [r for r in caplog.records if r.name.startswith("radixkv")], caplog.text
        calls = []
        _trace(be, calls)
        toks = tokens(300 * PS, seed=1)
        keys = h.page_keys(toks)
        src = h.alloc(len(toks))
        h.fill_random(src, seed=2)
        want = h.page_bytes_at(src)
        assert h.backup(toks[150 * PS:], src[150 * PS:], ancestor_keys=keys[:150]) == 150 * PS
        assert h.backup(toks[:150 * PS], src[:150 * PS]) == 150 * PS
        r = h.prefetch(toks)
        assert r.hit_tokens == r.loaded_tokens == 300 * PS and h.page_bytes_at(r.host_indices) == want
        h.host_pool.free(r.host_indices)
        # A request whose first 100 pages matched on the host: the tree passes their chain.
        r = h.prefetch(toks[100 * PS:], ancestor_keys=keys[:100])
        assert r.hit_tokens == r.loaded_tokens == 200 * PS and h.page_bytes_at(r.host_indices) == want[100:]
        exists = [c for c in calls if c[0] == "batch_exists"]
        assert exists == [("batch_exists", 300, None), ("batch_exists", 200, 100)]  # whole chains
        if interface_v1:
            sets = [c for c in calls if c[0] == "batch_set_v1"]
            assert sets == [("batch_set_v1", 128, 150), ("batch_set_v1", 22, 278),
                            ("batch_set_v1", 128, 0), ("batch_set_v1", 22, 128)]
            s = be.store
            with s.lock:
                tree = s.tree
                ns = be._bindings["kv"].ns.digest
                assert tree.node_parent(tree.lookup(ns, keys[150])) == tree.lookup(ns, keys[149])
        assert be.counters["failed_calls"] == 0
        be.check_integrity()
    finally:
        h.close()


def test_server_stack_without_prefix_keys_passes_none_and_still_round_trips():
    """SGLang's default (``hicache_storage_pass_prefix_keys`` off): the tree passes no prefix keys,
    each node's run starts at the namespace root, and reads still continue across the splits."""
    cfg = extra_config([mem_tier()], prefetch_threshold=PS)
    cfg.pop("hicache_storage_pass_prefix_keys")
    h = ServerStackHarness(PoolSpec(layout="page_first", page_size=PS, host_tokens=1024), cfg)
    try:
        be = unwrap(h.backend)
        assert not h.pass_prefix_keys
        calls = []
        _trace(be, calls)
        toks = tokens(40 * PS, seed=3)
        keys = h.page_keys(toks)
        src = h.alloc(len(toks))
        h.fill_random(src, seed=4)
        want = h.page_bytes_at(src)
        assert h.backup(toks[:20 * PS], src[:20 * PS]) == 20 * PS
        assert h.backup(toks[20 * PS:], src[20 * PS:], ancestor_keys=keys[:20]) == 20 * PS
        assert {c[2] for c in calls} == {None}
        r = h.prefetch(toks)
        assert r.hit_tokens == r.loaded_tokens == 40 * PS and h.page_bytes_at(r.host_indices) == want
        assert be.counters["failed_calls"] == 0
        be.check_integrity()
    finally:
        h.close()


def test_server_stack_mla_non_writer_acks_without_writing_and_reads_the_writers_pages(tmp_path, rank):
    """MLA with TP 2: the hybrid controller runs its backup thread on every rank (the plain one skips
    non-writers); on the non-writer it reaches no backend write, and that rank reads the writer's
    pages from the shared tier (found by probing, adopted)."""
    spec = PoolSpec(kind="mla", layout="page_first", page_size=PS, host_tokens=512)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "shared", shared=True)], prefetch_threshold=PS)
    toks = tokens(32 * PS, seed=5)
    rank(0, 2)
    w = ServerStackHarness(spec, cfg)
    rank(1, 2)
    r = ServerStackHarness(spec, cfg)
    try:
        assert unwrap(w.backend).is_writer and not unwrap(r.backend).is_writer
        src = w.alloc(len(toks))
        w.fill_random(src, seed=6)
        want = w.page_bytes_at(src)
        assert w.backup(toks, src) == len(toks)
        assert unwrap(w.backend).store.flush(timeout_s=30)
        calls = []
        _trace(unwrap(r.backend), calls)
        rsrc = r.alloc(len(toks))
        r.fill_random(rsrc, seed=7)  # whatever the non-writer holds is never written
        assert r.backup(toks, rsrc) == 0  # SGLang's hybrid controller acks 0 tokens there
        assert calls == []
        for h in (w, r):
            res = h.prefetch(toks)
            assert res.hit_tokens == res.loaded_tokens == len(toks)
            assert h.page_bytes_at(res.host_indices) == want
        assert unwrap(r.backend).counters["adopted_chunks"] == 32
    finally:
        w.close()
        r.close()


def test_server_stack_takes_the_cli_json_text():
    """The extra config arrives as the CLI's JSON text, parsed by SGLang's own parser."""
    cfg = extra_config([mem_tier()], prefetch_threshold=2 * PS)
    h = ServerStackHarness(PoolSpec(page_size=PS), json.dumps(cfg))
    try:
        assert h.prefetch_threshold == 2 * PS and h.controller.prefetch_threshold == 2 * PS
        assert sorted(unwrap(h.backend).storage_config.extra_config) == sorted(
            k for k in cfg if k not in ("prefetch_threshold", "hicache_storage_pass_prefix_keys"))
    finally:
        h.close()


@pytest.fixture
def unified_tree(monkeypatch):
    """Build SGLang's own ``UnifiedRadixCache`` with HiCache as a server does (``init_hicache``:
    the config parse, ``_PlainKvStrategy``, ``build_kv_only_stack``) from a published server config,
    on CPU: the host pool is left unpinned (``cudaHostRegister`` and pinned tensors need CUDA), the
    only change. Its L1<->L2 writes need CUDA streams, so L3 is filled through the backend; the
    prefetch path (``prefetch_from_storage``, the storage queues, ``check_prefetch_progress`` with
    the stop policy, host-node insert) is the tree's own."""
    import sglang.srt.mem_cache.pool_host.base as host_base
    import sglang.srt.mem_cache.pool_host.common as host_common
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context

    from radixkv.adapters.sglang_cpu import build_pools

    unpinned = host_base.HostKVCache.__init__
    monkeypatch.setattr(host_common, "_cuda_host_register", lambda *a, **k: None)
    monkeypatch.setattr(host_base.HostKVCache, "__init__",
                        lambda self, *a, **k: unpinned(self, *a, **{**k, "pin_memory": False}))
    built = []

    def build(policy, cfg):
        override = get_context().override_server_args(
            enable_hierarchical_cache=True, hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(cfg), hicache_mem_layout="layer_first",
            hicache_io_backend="direct", hicache_write_policy="write_through", page_size=PS,
            hicache_storage_prefetch_policy=policy)
        args = override.install()
        pools = build_pools(PoolSpec(page_size=PS, device_tokens=256))
        params = CacheInitParams(disable=False, req_to_token_pool=None, page_size=PS,
                                 token_to_kv_pool_allocator=pools.allocator, tree_components=(ComponentType.FULL,))
        cache = UnifiedRadixCache(params)
        built.append((cache, override))
        cache.init_hicache(args, params)
        return cache

    yield build
    for cache, override in built:
        if cache.cache_controller is not None:
            cache.cache_controller.detach_storage_backend()
        override.restore()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_unified_radix_cache_prefetch_policies_load_radixkv_pages(unified_tree, policy):
    """The real server's tree over radixkv: ``wait_complete`` and ``timeout`` (well inside its
    budget) load every stored page into host nodes byte for byte; ``best_effort`` polled at once
    loads a leading part (possibly none), never other bytes."""
    import time
    import types
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from radixkv.adapters.sglang_cpu import ControllerHarness

    cache = unified_tree(policy, extra_config([mem_tier()], prefetch_threshold=PS, prefetch_timeout_base=30))
    cc = cache.cache_controller
    be = unwrap(cc.storage_backend)
    assert type(cc).__name__ == "HybridCacheController" and cache.prefetch_stop_policy == policy
    assert cache.hicache_storage_pass_prefix_keys and "hicache_storage_pass_prefix_keys" not in be.storage_config.extra_config
    host = cc.storage_host_pool
    toks = tokens(16 * PS, seed=11)
    keys = get_storage_hash_str(toks, None, page_size=PS)
    src = host.alloc(len(toks))
    view = types.SimpleNamespace(host_pool=host, spec=PoolSpec(page_size=PS))  # for the harness's page helpers
    ControllerHarness.fill_random(view, src, 12)
    want = ControllerHarness.page_bytes_at(view, src)
    assert all(be.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=[])))
    host.free(src)

    reads = []
    get_v1 = be.batch_get_v1
    be.batch_get_v1 = lambda k, idx, info=None: reads.append(idx.clone()) or get_v1(k, idx, info)
    key = RadixKey(array("q", toks))
    req = CacheRequestHandle("r1", 0)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    cache.prefetch_from_storage(req, match.last_host_node, array("q", toks), None,
                                cache.get_prefix_hash_values(match.last_host_node))
    deadline = time.monotonic() + 30
    while True:
        cache.drain_storage_control_queues()
        if cache.check_prefetch_progress(req):
            break
        assert time.monotonic() < deadline, "prefetch never completed"
        time.sleep(0.02)
    loaded = cache.prefetch_loaded_tokens_by_reqid.get(req, 0)
    host_hit = cache.match_prefix(MatchPrefixParams(key=key)).host_hit_length
    assert host_hit == loaded
    if policy != "best_effort":
        assert loaded == len(toks)
    if loaded:
        (idx,) = reads
        assert ControllerHarness.page_bytes_at(view, idx[:loaded]) == want[: loaded // PS]
    assert be.counters["failed_calls"] == 0
    be.check_integrity()
