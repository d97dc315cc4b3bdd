"""Worker side on CPU tensors in vLLM's own KV layouts, and the metadata's process-boundary contract."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

from radixkv.adapters.vllm_meta import (
    LoadOp,
    LookupOp,
    LookupReport,
    RadixKVMetadata,
    RadixKVWorkerMeta,
    SaveOp,
)

pytestmark = pytest.mark.vllm

CHUNK = 32


def tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 53) % 30000 for i in range(n)]


def assert_loaded_as_written(eng: Engine, req_id: str, toks: list[int], n_tokens: int) -> None:
    """The first ``n_tokens`` of ``req_id``'s blocks hold what the model wrote for ``toks``."""
    ids = eng.sched.kv_cache_manager.get_block_ids(req_id)[0]
    for name in eng.kv:
        for b in range(n_tokens // BLOCK):
            assert torch.equal(eng.kv[name][ids[b]], eng.expected_block(name, toks, b)), (name, b)


@pytest.mark.parametrize(
    ("layout", "layer_hooks", "late_start", "layerwise"),
    [
        ("LBNHC", True, False, False),
        ("LBHNC", True, False, True),
        ("BLNHC", False, False, False),
        ("LBNHC", False, False, False),
        ("LBNHC", True, True, True),
    ],
)
def test_saved_bytes_load_back_identically(model_dir, layout, layer_hooks, late_start, layerwise):
    """Save through vLLM-layout views, wipe, load into fresh blocks: byte-identical. Without per-layer
    hooks (full CUDA graphs) saves still happen, in wait_for_save; a runner whose first call is a
    layer's wait_for_layer_load (late start_load_kv) still gets the load before that layer."""
    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]},
        "layerwise": layerwise,
        "sync_load_wait_s": 5.0,
    }  # a busy CI box must not turn it async
    eng = Engine(
        make_vllm_config(model_dir, extra),
        make_kv_cache_config(),
        layout=layout,
        layer_hooks=layer_hooks,
        late_start=late_start,
    )
    toks = tokens(100, 1)
    eng.add("a", toks)
    eng.run_until_idle()
    w = eng.worker._worker
    assert w.stats["saved_chunks"] == 3
    saved = {name: view.clone() for name, view in eng.kv.items()}
    blocks_a = list(
        range(1, 1 + 100 // BLOCK)
    )  # r1's blocks in a fresh pool (block 0 is the null block)
    for name in eng.kv:  # what was saved is what the model wrote
        for b in range(6):
            assert torch.equal(saved[name][blocks_a[b]], eng.expected_block(name, toks, b)), (
                name,
                b,
            )

    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    toks_b = toks[:96] + tokens(10, 2)
    eng.add("b", toks_b)
    eng.step()
    log = eng.step()
    assert log.scheduled == {"b": len(toks_b) - 96}
    ids = eng.sched.kv_cache_manager.get_block_ids("b")[0]
    for name in eng.kv:
        for b in range(96 // BLOCK):
            got = eng.kv[name][ids[b]].contiguous().view(torch.uint8)
            assert torch.equal(got, saved[name][blocks_a[b]].contiguous().view(torch.uint8)), (
                name,
                b,
            )
    eng.run_until_idle()
    w.check_integrity()


@pytest.mark.parametrize("layer_hooks", [True, False])
def test_saves_of_later_steps_store_their_own_bytes(model_dir, layer_hooks):
    """Saves of a later step gather into that step's buffers (the worker prepares each step's
    gathers anew): a second request's chunks load back as the model wrote them."""
    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]},
        "sync_load_wait_s": 5.0,
    }
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config(), layer_hooks=layer_hooks)
    eng.add("a", tokens(100, 1))
    eng.run_until_idle()
    toks_c = tokens(100, 3)
    eng.add("c", toks_c)
    eng.run_until_idle()
    w = eng.worker._worker
    assert w.stats["saved_chunks"] == 6
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    toks_d = toks_c[:96] + tokens(10, 4)
    eng.add("d", toks_d)
    eng.step()
    log = eng.step()
    assert log.scheduled == {"d": len(toks_d) - 96}
    assert_loaded_as_written(eng, "d", toks_c, 96)
    eng.run_until_idle()
    w.check_integrity()


@pytest.mark.parametrize("layer_hooks", [True, False])
@pytest.mark.parametrize(
    ("rows", "stored"),
    [
        ([], 0),  # no pages for the group
        ([[5, 6], [7, -1], [9, 10]], 1),  # the second chunk misses a page
        ([[5, 6]], 1),  # one row for three keys
        ([[5, 6], [7]], 1),  # a short row
    ],
)
def test_a_save_stores_only_chunks_whose_pages_it_gathered(model_dir, layer_hooks, rows, stored):
    """Found by review: the worker allocates a buffer per key and puts them all, but gathers only
    the pages a save names (the prepared gather leaves a save without rows out; a -1 page is
    skipped): such a save stored uninitialised bytes a later hit loads into the blocks, or (rows
    and keys not matching) failed the step. Only the leading chunks whose pages every group names
    are stored; another save in the step is unaffected."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import make_kv_caches

    kcc = make_kv_cache_config()
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]}}
    conn = KVConnectorFactory.create_connector(
        make_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kcc
    )
    views = make_kv_caches(kcc)
    conn.register_kv_caches(views)
    w = conn._worker
    g = torch.Generator().manual_seed(3)
    for v in views.values():
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    want = {n: v.clone() for n, v in views.items()}
    good = [f"{1:064x}", f"{2:064x}"]
    odd = [f"{k:064x}" for k in (3, 4, 5)]
    saves = [SaveOp("good", good, None, [[[1, 2], [3, 4]]]), SaveOp("odd", odd, None, [rows])]
    conn.bind_connector_metadata(RadixKVMetadata(saves=saves))
    if layer_hooks:
        conn.save_kv_layer("layers.0", views["layers.0"], None)  # wait_for_save does layers.1
    conn.wait_for_save()
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(
        RadixKVMetadata(lookups=[LookupOp("g", 1, good, 0), LookupOp("o", 1, odd, 0)])
    )
    meta = w.build_worker_meta()
    assert meta.lookups["g"].hit_chunks == 2
    assert meta.lookups["o"].hit_chunks == stored
    conn.clear_connector_metadata()
    if stored:  # what was stored is what the blocks held
        for v in views.values():
            v.zero_()
        conn.bind_connector_metadata(RadixKVMetadata(loads=[LoadOp("o", 1, 0, [[[20, 21]]], False)]))
        conn.start_load_kv(None)
        for n in views:
            conn.wait_for_layer_load(n)
        for n, v in views.items():
            assert torch.equal(v[20:22], want[n][5:7]), n
        conn.clear_connector_metadata()
    w.check_integrity()
    conn.shutdown()


@pytest.mark.parametrize("layer_hooks", [True, False])
def test_a_failed_save_copy_stores_nothing_and_the_next_step_saves(
    model_dir, tmp_path, monkeypatch, layer_hooks
):
    """A gather that raises fails the step (from save_kv_layer, or wait_for_save without per-layer
    hooks): none of its partly gathered buffers is stored, then or later, and the next step's saves
    are not lost behind the failed ones (a second engine on the same disk tier loads them back)."""
    from vllm.v1.request import RequestStatus

    from radixkv.kernels import paged_copy

    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": f"file://{tmp_path / 'kv'}", "capacity_bytes": 1 << 26}]},
        "sync_load_wait_s": 5.0,
    }
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config(), layer_hooks=layer_hooks)
    w = eng.worker._worker
    real_run = paged_copy.PreparedCopy.run

    def failing_run(self, layers=None):
        if self.to_chunk and layers == 1:
            raise RuntimeError("injected copy failure")
        return real_run(self, layers)

    monkeypatch.setattr(paged_copy.PreparedCopy, "run", failing_run)
    eng.add("a", tokens(100, 1))
    with pytest.raises(RuntimeError, match="injected"):
        eng.run_until_idle()
    assert w.stats["saved_chunks"] == 0 and not w._saves
    monkeypatch.setattr(paged_copy.PreparedCopy, "run", real_run)
    # The failed step never returned to the scheduler: end it as an engine would, by aborting it.
    eng.worker.clear_connector_metadata()
    eng.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    toks_c = tokens(100, 3)
    eng.add("c", toks_c)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 3  # c's three chunks; nothing of a's step, then or later
    w.check_integrity()
    eng.close()

    fresh = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    for req_id, toks, hit in (("d", toks_c[:96] + tokens(10, 4), True), ("e", tokens(100, 1), False)):
        fresh.add(req_id, toks)
        fresh.step()
        log = fresh.step()
        assert log.scheduled == {req_id: len(toks) - 96 if hit else len(toks)}, (req_id, log)
        if hit:
            assert_loaded_as_written(fresh, req_id, toks_c, 96)
        fresh.run_until_idle()
    fresh.close()


def test_namespace_separates_models(model_dir):
    from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes

    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]},
    }
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    req = eng.add("a", tokens(70, 1))
    eng.run_until_idle()
    w = eng.worker._worker
    ns = w.groups[0].namespace
    assert ns.model == str(model_dir) and ns.dtype == "float32" and ns.chunk_tokens == CHUNK
    assert ns.shard == "tp0of1.pp0of1" and "LBNHC" in ns.layout and "bs16" in ns.layout
    keys = chunk_keys_from_block_hashes(req.block_hashes, BLOCK, CHUNK, 2)
    assert w.store.lookup(ns, keys) == 2
    for change in (
        {"model": "another-model"},
        {"dtype": "bfloat16"},
        {"shard": "tp1of2.pp0of1"},
        {"layout": ns.layout.replace("LBNHC", "LBHNC")},
        {"extra": "g1-full"},
    ):
        fields = {
            f: getattr(ns, f)
            for f in ("model", "dtype", "layout", "chunk_tokens", "shard", "extra")
        }
        assert w.store.lookup(type(ns)(**{**fields, **change}), keys) == 0, change


def test_metadata_is_plain_data_and_aggregates():
    meta = RadixKVMetadata(
        lookups=[LookupOp("r", 3, ["a" * 64, "b" * 64], 1)],
        loads=[LoadOp("r", 3, 1, [[[5, 6]], [[-1, 7]]], True)],
        saves=[SaveOp("s", ["c" * 64], None, [[[1, 2]]])],
        releases=["x"],
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    a = RadixKVWorkerMeta({"r": LookupReport(3, 4, True), "q": LookupReport(1, 2, True)}, {"f"})
    b = RadixKVWorkerMeta({"r": LookupReport(3, 2, False), "q": LookupReport(9, 5, True)}, {"g"})
    m = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert m.lookups["r"] == LookupReport(3, 2, False)  # a chunk hits only where every rank has it
    assert m.lookups["q"].hit_chunks == 0  # ranks disagree on the lookup: no hit
    assert m.failed_loads == {"f", "g"}


def test_vllm_aggregator_merges_two_ranks():
    """vLLM's own KVOutputAggregator (TP=2): lookups take the minimum, a receive finishes only when both
    ranks report it, failed loads are the union."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    def out(meta, recv):
        kvo = KVConnectorOutput(finished_recving=recv, kv_connector_worker_meta=meta)
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kvo)

    agg = KVOutputAggregator(expected_finished_count=2)
    r0 = RadixKVWorkerMeta({"a": LookupReport(1, 5, True)}, set())
    r1 = RadixKVWorkerMeta({"a": LookupReport(1, 3, True)}, {"b"})
    merged = agg.aggregate([out(r0, {"x"}), out(r1, None)]).kv_connector_output
    assert merged.kv_connector_worker_meta.lookups["a"].hit_chunks == 3
    assert merged.kv_connector_worker_meta.failed_loads == {"b"}
    assert not merged.finished_recving  # rank 1 has not finished "x" yet
    merged = agg.aggregate([out(None, None), out(None, {"x"})]).kv_connector_output
    assert merged.finished_recving == {"x"}


def test_a_pipeline_stage_without_some_groups_stores_and_loads_its_own(model_dir):
    """Found by a contract review: with PP and the hybrid KV-cache manager vLLM projects every group
    onto every stage and empties the layer lists of groups another stage holds
    (``_project_kv_cache_groups_to_worker``); register_kv_caches raised on such a group, so the
    worker failed at start-up. The stage now saves and loads the groups it holds, and an absent
    group puts no limit on its hits."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_planning import _project_kv_cache_groups_to_worker
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm_harness import NUM_BLOCKS, make_kv_caches

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, dtype=torch.float32,
                           sliding_window=32)
    glob = [KVCacheGroupSpec(["layers.1", "layers.3"], full),
            KVCacheGroupSpec(["layers.0", "layers.2"], sw),
            KVCacheGroupSpec(["layers.4", "layers.5"], sw)]
    proj = _project_kv_cache_groups_to_worker(glob, {"layers.3": full, "layers.4": sw, "layers.5": sw})
    assert [g.layer_names for g in proj] == [["layers.3"], [], ["layers.4", "layers.5"]]
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=proj)
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]}}
    conn = KVConnectorFactory.create_connector(make_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kcc)
    views = make_kv_caches(KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                         kv_cache_groups=[g for g in proj if g.layer_names]))
    conn.register_kv_caches(views)
    w = conn._worker
    assert w.groups[1] is None and len(w.present) == 2
    g = torch.Generator().manual_seed(0)
    for v in views.values():
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    want = {n: v.clone() for n, v in views.items()}
    keys = ["%064x" % 1, "%064x" % 2]
    rows = [[[1, 2], [3, 4]]] * 3  # what the scheduler sends: ids for every group
    conn.bind_connector_metadata(RadixKVMetadata(saves=[SaveOp("r", keys, None, rows)]))
    conn.wait_for_save()
    conn.clear_connector_metadata()
    for v in views.values():
        v.zero_()
    conn.bind_connector_metadata(RadixKVMetadata(lookups=[LookupOp("r2", 1, keys, 0)]))
    meta = w.build_worker_meta()
    assert meta.lookups["r2"].hit_chunks == 2  # the absent group limits nothing
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(RadixKVMetadata(loads=[LoadOp("r2", 1, 0, rows, False)]))
    conn.start_load_kv(None)
    for n in views:
        conn.wait_for_layer_load(n)
    for n, v in views.items():
        assert torch.equal(v[1:5], want[n][1:5]), n
    conn.clear_connector_metadata()
    w.check_integrity()
    conn.shutdown()


@pytest.mark.parametrize("packing", ["head_size_v", "int8_per_token_head"])
def test_pages_that_are_not_k_and_v_of_head_size_are_refused_at_start_with_a_config_error(
    model_dir, packing
):
    """Found by the scheduler-features hunt: a group whose blocks hold another width than K and V
    of ``head_size`` each (a V head size other than K's, or vLLM's packed per-token-head KV dtypes,
    whose pages carry inline scales) failed the worker's start with the kernels' InputError
    ("pass head_size=..., or mla=True"), which names neither the group nor what to change. It is
    now a ConfigError naming the group and the supported settings."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVQuantMode,
    )
    from vllm_harness import NUM_BLOCKS, make_kv_caches

    from radixkv.errors import ConfigError

    if packing == "head_size_v":
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, head_size_v=8,
                                 dtype=torch.float32)
    else:  # what vLLM's Triton backend makes of kv_cache_dtype=int8_per_token_head
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=4, dtype=torch.int8,
                                 kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
                                 state_content_bytes=(4 + 4) * 1 + 2 * 4)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layers.0", "layers.1"], spec)])
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 20}]}}
    conn = KVConnectorFactory.create_connector(make_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kcc)
    views = make_kv_caches(kcc)
    assert views["layers.0"].shape[-1] != 2 * 4
    with pytest.raises(ConfigError, match=r"KV-cache group 0 .*head_size=4"):
        conn.register_kv_caches(views)
    conn.shutdown()


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_data_parallel_ranks_serve_metrics_on_their_own_port_and_share_the_namespace(model_dir, moe):
    """Each DP rank is an engine of its own with the same TP/PP ranks: its metrics port moves by the
    DP rank too (two DP ranks on one host used to collide), while the namespace stays the same (DP
    replicas hold the same KV and share it). The engine core stamps ``data_parallel_index``; for a
    dense model it then resets ``data_parallel_rank`` to 0 (the ranks run as independent engines):
    before, the connector read that rank and every dense DP engine asked for one port."""
    import socket
    import urllib.request

    with socket.socket() as s:  # a free base port, then base + 0..2 for the three ranks below
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    engines, namespaces = [], []
    try:
        for dp_rank in (0, 2):
            extra = {
                "chunk_tokens": CHUNK,
                "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}], "metrics_port": base,
                          "metrics_addr": "127.0.0.1"},
            }
            cfg = make_vllm_config(model_dir, extra)
            pc = cfg.parallel_config
            pc.data_parallel_size = 3
            pc.data_parallel_rank = dp_rank
            pc.data_parallel_index = dp_rank  # as vLLM's EngineCoreProc stamps it
            if not moe:
                pc.reconfigure_for_independent_dp_rank()  # vLLM's own reset for non-MoE DP ranks
                assert pc.data_parallel_rank == 0
            eng = Engine(cfg, make_kv_cache_config())
            engines.append(eng)
            w = eng.worker._worker
            assert w.metrics_rank == dp_rank  # TP 1, PP 1: the DP rank is the offset
            namespaces.append(w.groups[0].namespace)
            with urllib.request.urlopen(f"http://127.0.0.1:{base + dp_rank}/metrics", timeout=10) as r:
                assert b"radixkv_" in r.read()
        assert namespaces[0] == namespaces[1]
    finally:
        for eng in engines:
            eng.close()


def test_prefill_context_parallel_ranks_serve_metrics_on_their_own_port_and_share_the_namespace(
        model_dir, monkeypatch):
    """The PCP ranks of one TP/PP rank are separate worker processes with the same TP/PP ranks.
    Before, they all asked for one metrics port (all but one ran without their endpoint). PCP alone
    replicates the KV (vLLM's PCP cache gather keeps a complete replica on every PCP rank), so their
    namespace stays the same."""
    import socket
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import make_kv_caches

    with socket.socket() as s:  # a base port nothing listens on (the ports are only compared)
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}],
                                              "metrics_port": base, "metrics_addr": "127.0.0.1"}}
    ports, namespaces = {}, {}
    for pcp_rank in (0, 1):
        cfg = make_vllm_config(model_dir, extra)
        cfg.parallel_config.prefill_context_parallel_size = 2
        # the PCP group vLLM builds in each worker (initialize_model_parallel)
        monkeypatch.setattr(parallel_state, "get_pcp_group",
                            lambda r=pcp_rank: SimpleNamespace(rank_in_group=r, world_size=2))
        kcc = make_kv_cache_config()
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        try:
            conn.register_kv_caches(make_kv_caches(kcc))
            w = conn._worker
            ports[pcp_rank] = w.store.config.metrics_port
            namespaces[pcp_rank] = w.groups[0].namespace
        finally:
            conn.shutdown()
    assert ports == {0: base, 1: base + 1}
    assert namespaces[0] == namespaces[1]


def _namespace_of(cfg) -> Any:
    """Group 0's namespace in a worker connector built by vLLM's factory over ``cfg``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import make_kv_caches

    kcc = make_kv_cache_config()
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    try:
        conn.register_kv_caches(make_kv_caches(kcc))
        return conn._worker.groups[0].namespace
    finally:
        conn.shutdown()


def _with_model(cfg, model_dir, **model_kwargs):
    """``cfg`` with its ModelConfig rebuilt by vLLM from ``model_dir`` and ``model_kwargs``."""
    from vllm.config import ModelConfig

    kwargs = {"dtype": "float16", **model_kwargs}
    cfg.model_config = ModelConfig(model=str(model_dir), seed=42, skip_tokenizer_init=True, **kwargs)
    return cfg


def test_namespace_carries_what_else_decides_the_kv(model_dir, tmp_path):
    """Found by review: the namespace named the model by its path (or model_name) and KV dtype only,
    so another weights revision or a RoPE override (RoPE is applied to K before caching) read the
    other configuration's chunks from a shared or persistent tier. A digest of the rest of the model
    identity now ends the namespace's ``extra``, with an explicit model_name too; copies of one model
    under other paths still share with model_name."""
    import re

    store = {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]}
    extra = {"chunk_tokens": CHUNK, "store": store}
    base = _namespace_of(make_vllm_config(model_dir, extra))
    assert re.fullmatch(r"g0-full-m[0-9a-f]{16}", base.extra), base.extra  # readable, digest last
    assert base == _namespace_of(make_vllm_config(model_dir, extra))  # deterministic
    for change in ({"revision": "other-rev"}, {"hf_overrides": {"rope_theta": 1234.0}},
                   {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
                   {"dtype": "bfloat16"}):
        other = _namespace_of(_with_model(make_vllm_config(model_dir, extra), model_dir, **change))
        assert other.model == base.model and other.dtype == base.dtype  # what the namespace had
        assert other != base and other.digest != base.digest, change
    fp8 = make_vllm_config(model_dir, extra)  # fp8 variants are all uint8 in the KV spec
    fp8.cache_config.cache_dtype = "fp8_e5m2"
    assert _namespace_of(fp8) != base
    # An explicit model_name keeps the digest: same name, other RoPE base -> other namespace ...
    named = {**extra, "model_name": "my-model"}
    a = _namespace_of(make_vllm_config(model_dir, named))
    b = _namespace_of(_with_model(make_vllm_config(model_dir, named), model_dir,
                                  hf_overrides={"rope_theta": 1234.0}))
    assert a.model == b.model == "my-model" and a != b
    # ... while the same model at another path shares (the path is not in the digest).
    from vllm_harness import make_model_dir

    elsewhere = make_model_dir(tmp_path / "copy-of-opt")
    assert _namespace_of(make_vllm_config(elsewhere, named)) == a


def test_model_identity_digest_is_the_same_in_another_process(model_dir):
    """The digest is part of chunk identities shared across restarts and instances: it must not
    depend on the process (hash seeds, object addresses)."""
    import os
    import subprocess
    import sys

    from radixkv.adapters.vllm_options import model_identity_digest

    code = (
        "import sys; from vllm.config import ModelConfig, CacheConfig\n"
        "from radixkv.adapters.vllm_options import model_identity_digest\n"
        "m = ModelConfig(model=sys.argv[1], dtype='float16', seed=42, skip_tokenizer_init=True,\n"
        "                hf_overrides={'rope_scaling': {'rope_type': 'linear', 'factor': 2.0}})\n"
        "print('DIGEST', model_identity_digest(m, CacheConfig(block_size=16)))\n"
    )
    cfg = _with_model(make_vllm_config(model_dir, {}), model_dir,
                      hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    from vllm.config import CacheConfig

    here = model_identity_digest(cfg.model_config, CacheConfig(block_size=16))
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, str(model_dir)], env=env,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        seen.add(next(line.split()[1] for line in out.splitlines() if line.startswith("DIGEST")))
    assert seen == {here}


PHI3_LONGROPE_CONFIG = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
    "vocab_size": 1000, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4},
}


def test_longrope_context_length_is_part_of_the_namespace(tmp_path):
    """Found by the cache-identity hunt: vLLM rotates K with LongRoPE's long factors at *every*
    position when ``max_model_len`` exceeds ``original_max_position_embeddings`` (Phi-3-128k and kin),
    and ``max_model_len`` was left out of the model digest, so a deployment at 4k and one at 16k of
    the same model shared chunks whose K differ from the first token on. The factor choice is now in
    the digest; context lengths that choose the same factors still share."""
    import json

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    from radixkv.adapters.vllm_options import model_identity_digest

    model = tmp_path / "phi3-longrope"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PHI3_LONGROPE_CONFIG))

    def key_and_digest(max_model_len: int) -> tuple[torch.Tensor, str]:
        mc = ModelConfig(model=str(model), dtype="float16", seed=42, skip_tokenizer_init=True,
                         max_model_len=max_model_len)
        rp = mc.hf_config.rope_parameters
        with set_current_vllm_config(VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"))):
            rope = Phi3LongRoPEScaledRotaryEmbedding(  # what get_rope builds for this config
                8, 8, rp.get("max_position_embeddings", 131072), rp["original_max_position_embeddings"],
                rp["rope_theta"], True, torch.float32, rp["short_factor"], rp["long_factor"])
        positions = torch.arange(16)  # the first page of any prompt
        _, key = rope(positions, torch.ones(16, 8), torch.ones(16, 8))
        return key, model_identity_digest(mc, CacheConfig(block_size=16))

    k4, d4 = key_and_digest(4096)
    k16, d16 = key_and_digest(16384)
    assert not torch.equal(k4, k16)  # the engine's own K differs from position 0 on ...
    assert d4 != d16  # ... so the chunks must not share a namespace
    assert key_and_digest(8192)[1] == d16  # both use the long factors: they share
    # A model without LongRoPE keeps one digest for every context length.
    from vllm_harness import make_model_dir

    opt = make_model_dir(tmp_path / "opt")
    assert len({model_identity_digest(ModelConfig(model=str(opt), dtype="float16", seed=42,
                                                  skip_tokenizer_init=True, max_model_len=n))
                for n in (512, 2048)}) == 1


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
    "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
}


def test_the_drafter_is_part_of_the_namespace(tmp_path):
    """Found by the drafter hunt: vLLM 0.33 registers an EAGLE/EAGLE3/MTP drafter's attention layers
    among the KV caches the connector stores, but the namespace digest named the target model only,
    so a server with another drafter (another EAGLE3 head of the same shape, another draft revision
    or draft KV dtype) loaded the first server's drafter KV: drafts computed from wrong KV (outputs
    stay right, since the target verifies them, but acceptance drops). With a drafter that has KV
    the digest covers it; without speculative decoding, or with ngram (no drafter KV), the namespace
    is what it was."""
    import json

    from vllm.config import SpeculativeConfig

    def model_dir(name: str, config: dict) -> Any:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    target = model_dir("llama", LLAMA_CONFIG)
    eagle3 = {**LLAMA_CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"]}
    head_a, head_b = model_dir("eagle3-a", eagle3), model_dir("eagle3-b", eagle3)  # other weights
    store = {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]}

    def namespace(extra: dict | None = None, **spec: Any) -> Any:
        cfg = make_vllm_config(target, {"chunk_tokens": CHUNK, "store": store, **(extra or {})})
        if spec:
            cfg.speculative_config = SpeculativeConfig(
                num_speculative_tokens=2, target_model_config=cfg.model_config,
                target_parallel_config=cfg.parallel_config, **spec)
        return _namespace_of(cfg)

    plain = namespace()
    a = namespace(method="eagle3", model=str(head_a))
    assert a == namespace(method="eagle3", model=str(head_a))  # the same drafter shares
    for other in ({"model": str(head_b)},  # another head of the same architecture
                  {"revision": "other-rev"}, {"kv_cache_dtype": "fp8_e5m2"}):
        b = namespace(**{"method": "eagle3", "model": str(head_a), **other})
        assert b.model == a.model and b.dtype == a.dtype and b.layout == a.layout  # what it had
        assert b != a, other
    assert a != plain
    # No drafter KV (ngram): the namespace of a server without speculative decoding, chunks kept.
    assert namespace(method="ngram", prompt_lookup_max=3) == plain
    # With model_name the draft path is left out (as the target's), its revision still counts.
    named = {"model_name": "my-model"}
    n = namespace(named, method="eagle3", model=str(head_a))
    assert n == namespace(named, method="eagle3", model=str(head_b))
    assert n != namespace(named, method="eagle3", model=str(head_a), revision="other-rev")
    assert n != namespace(named)


def test_a_lookup_one_worker_did_not_answer_is_a_miss():
    """Found by review: a lookup only one worker reported passed through aggregation as that worker's
    hit, in either merge order, though the other worker cannot serve its shard of it."""
    a = RadixKVWorkerMeta({"r": LookupReport(7, 3, True), "both": LookupReport(2, 4, True)})
    b = RadixKVWorkerMeta({"both": LookupReport(2, 1, True), "q": LookupReport(5, 2, False)})
    for m in (a.aggregate(b), b.aggregate(a)):
        assert m.lookups == {
            "r": LookupReport(7, 0, True),
            "q": LookupReport(5, 0, True),
            "both": LookupReport(2, 1, True),
        }
    # Different lookups of one request: a miss, under the newer seq, whatever the order.
    c = RadixKVWorkerMeta({"r": LookupReport(8, 3, True)})
    assert a.aggregate(c).lookups["r"] == c.aggregate(a).lookups["r"] == LookupReport(8, 0, True)


def _step_as_the_mixin_does(eng: Engine) -> None:
    """One step in the order of vLLM 0.33's kv_connector_model_runner_mixin: sync loads start before
    the forward (outside its ``try``); wait_for_save and the transfer results run in a ``finally``,
    also when the forward raised. Raises what the step raised (vLLM's execute_model fails)."""
    import pickle

    out = eng.sched.schedule()
    w = eng.worker
    w.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
    if out.has_sync_kv_loads:
        w.start_load_kv(None)
    try:
        eng._forward(out)
    finally:
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        w.get_transfer_results(out.finished_req_ids)
        w.get_block_ids_with_load_errors()
        w.build_connector_worker_meta()
        w.clear_connector_metadata()


def _scatter_fails_at(monkeypatch, layer: int, calls: list) -> None:
    from radixkv.kernels import paged_copy

    real_run = paged_copy.PreparedCopy.run

    def run(self, layers=None):
        calls.append((self.to_chunk, layers))
        if not self.to_chunk and layers == layer:
            raise RuntimeError("injected load failure")
        return real_run(self, layers)

    monkeypatch.setattr(paged_copy.PreparedCopy, "run", run)


def test_a_layer_load_that_fails_mid_forward_stores_nothing_of_the_step(model_dir, monkeypatch):
    """Layer-wise load, 3 layers: the look-ahead load of layer 2 (issued in wait_for_layer_load of
    layer 1) raises, so the forward stops before layer 1 computes. vLLM still calls wait_for_save
    (in a ``finally``): the step's saves (another request's new chunks) must not be rebuilt from
    the metadata and gathered from layers this step never computed, then stored as valid chunks."""
    from vllm.v1.request import RequestStatus

    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]},
        "layerwise": True,
        "sync_load_wait_s": 5.0,
    }
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config(layers=3))
    w = eng.worker._worker
    toks = tokens(100, 1)
    eng.add("a", toks)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 3
    assert eng.sched.reset_prefix_cache()
    eng.add("b", toks[:96] + tokens(10, 2))  # a hit of 3 chunks: a synchronous layer-wise load
    eng.add("e", tokens(70, 5))  # no hit: computes two whole chunks, saved in the same step
    log = eng.step()  # the lookup round trip
    assert not log.scheduled, log
    calls: list = []
    _scatter_fails_at(monkeypatch, 2, calls)
    with pytest.raises(RuntimeError, match="injected load failure"):
        _step_as_the_mixin_does(eng)
    assert (False, 2) in calls
    assert w.stats["saved_chunks"] == 3, "chunks gathered from a forward that never ran were stored"
    monkeypatch.undo()
    for g in w.present:
        assert not g.pipeline.loads_pending
    eng.sched.finish_requests(["b", "e"], RequestStatus.FINISHED_ABORTED)
    w.check_integrity()


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_load_that_fails_before_the_forward_leaves_nothing_to_later_steps(
    model_dir, monkeypatch, layerwise
):
    """The load of layer 0 raises in start_load_kv (before the forward, so vLLM calls no
    wait_for_save for the step). The batch's other layers must not be issued by a later step's
    wait_for_layer_load or wait_for_save (into blocks vLLM has given to other requests by then), and
    the batch's staging buffers must stop counting against max_staging_bytes."""
    from vllm.v1.request import RequestStatus

    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]},
        "layerwise": layerwise,
        "sync_load_wait_s": 5.0,
    }
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    w = eng.worker._worker
    toks = tokens(100, 1)
    eng.add("a", toks)
    eng.run_until_idle()
    assert eng.sched.reset_prefix_cache()
    eng.add("b", toks[:96] + tokens(10, 2))
    eng.step()  # the lookup round trip
    calls: list = []
    _scatter_fails_at(monkeypatch, 0, calls)
    with pytest.raises(RuntimeError, match="injected load failure"):
        _step_as_the_mixin_does(eng)
    eng.worker.clear_connector_metadata()
    eng.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    monkeypatch.undo()
    _scatter_fails_at(monkeypatch, -1, calls)  # record only
    calls.clear()
    eng.add("d", tokens(70, 9))  # no hit: no load of its own
    eng.run_until_idle()
    assert not [c for c in calls if not c[0]], f"a failed step's loads ran later: {calls}"
    assert not w._staged and w._staged_bytes == 0, (list(w._staged), w._staged_bytes)
    w.check_integrity()


def test_layerwise_load_with_a_deferred_finalize_keeps_the_drafter_layers(model_dir, tmp_path):
    """With a speculative config, vLLM 0.33's model runners defer wait_for_save until after the
    drafter's forward (``defer_finalize``): the transfer results (``get_finished``, which runs the
    async loads whose reads finished) come before the drafter's layers call their hooks. A layer-wise
    load of this step then still holds the drafter's layers unissued. An async load becoming ready
    in that step must neither raise (``start_loads`` refuses a new batch while one is pending: the
    worker's step failed) nor drop those layers: every layer, the drafter's too, holds the loaded
    KV of both requests."""
    from vllm_harness import GatedStore, _GatedHandle

    from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes

    class KeyGated(GatedStore):
        """Only the reads of ``held`` keys wait for the gate (an async load); the others are done
        at once (a sync load)."""

        held: set = set()

        def prefetch(self, ns: Any, keys: Any, buffers: Any) -> Any:
            handle = _GatedHandle(self, ns, list(keys), list(buffers))
            if not set(keys) & self.held:
                handle.result = self.store.get(ns, list(keys), list(buffers))
            return handle

    extra = {
        "chunk_tokens": CHUNK,
        "store": {"tiers": [{"url": f"file://{tmp_path / 'kv'}", "capacity_bytes": 1 << 26}]},
        "layerwise": True,
        "sync_load_wait_s": 0.0,
    }
    # layers.0-1: the target model; layers.2-3: the drafter's (an MTP head of two layers), more
    # than the pipeline's look-ahead past the target's last layer.
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config(layers=4))
    w = eng.worker._worker
    toks_a, toks_b = tokens(100, 1), tokens(100, 2)
    req_a = eng.add("a0", toks_a)
    eng.add("b0", toks_b)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 6
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    gated = KeyGated(w.store)
    gated.held = set(chunk_keys_from_block_hashes(req_a.block_hashes, BLOCK, CHUNK, 3))
    w.store = gated
    eng.add("a1", toks_a[:96] + tokens(10, 3))
    eng.step()  # a1's lookup (its reads held: an async load)
    eng.step()  # a1 waits for its KV
    eng.add("b1", toks_b[:96] + tokens(10, 4))
    eng.step()  # b1's lookup (read at once: a sync load next step)
    gated.open()

    out = eng.sched.schedule()  # b1 loads layer by layer; a1's read ends at this step's poll
    assert out.has_sync_kv_loads and set(out.num_scheduled_tokens) == {"b1"}
    wk = eng.worker
    wk.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
    wk.start_load_kv(None)
    for name in ("layers.0", "layers.1"):  # the target model's forward
        wk.wait_for_layer_load(name)
        wk.save_kv_layer(name, eng.kv[name], None)
    results = wk.get_transfer_results(out.finished_req_ids)  # before the drafter (deferred)
    assert results.finished_recving == {"a1"}
    assert not wk.get_block_ids_with_load_errors()
    wk.build_connector_worker_meta()
    for name in ("layers.2", "layers.3"):  # the drafter's forward
        wk.wait_for_layer_load(name)
        wk.save_kv_layer(name, eng.kv[name], None)
    wk.wait_for_save()  # finalize_kv_connector
    wk.clear_connector_metadata()
    for req_id, toks in (("a1", toks_a), ("b1", toks_b)):
        assert_loaded_as_written(eng, req_id, toks, 96)
    w.check_integrity()
