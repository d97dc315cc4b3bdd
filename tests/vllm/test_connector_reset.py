"""vLLM's connector cache reset (``KVConnectorBase_V1.reset_cache``), through vLLM 0.33's own
Scheduler (CPU): after ``reset_prefix_cache(..., reset_connector=True)`` (what every weight-update
flow calls: ``pause_generation(clear_cache=True)``, ``sleep``, ``release_kv_cache_memory``) no chunk
stored before it is loaded again by this engine; chunks stored after it are."""

from __future__ import annotations

import pickle

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_kv_caches, make_vllm_config

from test_connector_scheduler import mem_store, prompt
from test_vllm_lifecycle import (
    _gated_file_engine,
    assert_blocks,
    baseline_outputs,
    save_then_forget_locally,
)

pytestmark = pytest.mark.vllm

EXTRA = {"chunk_tokens": 32, "store": mem_store(), "sync_load_wait_s": 5.0}


def reset_connector(eng: Engine, reset_running_requests: bool = True) -> bool:
    """What pause_generation(clear_cache=True) runs (EngineCore._reset_caches)."""
    return eng.sched.reset_prefix_cache(
        reset_running_requests=reset_running_requests, reset_connector=True
    )


def namespaces(eng_worker) -> list:
    return [g.namespace for g in eng_worker.present]


def test_a_reset_makes_every_earlier_chunk_a_miss_and_later_chunks_hit(model_dir):
    eng = Engine(make_vllm_config(model_dir, EXTRA), make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    save_then_forget_locally(eng, toks, 2)
    before = namespaces(w)
    assert not any("-gen" in ns.extra for ns in before)  # never reset: today's namespaces

    assert reset_connector(eng) is True
    eng.clear_kv()
    r2 = eng.add("r2", toks)
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 0, "a chunk stored before the reset was loaded after it"
    assert w.stats["loaded_chunks"] == 0
    # The scheduler and the worker agree on the generation from the first step after the reset,
    # and it is in every namespace the worker uses.
    assert conn.generation and w.generation == conn.generation
    assert all(ns.extra.endswith(f"-gen{conn.generation}") for ns in namespaces(w))
    assert all(a.digest != b.digest for a, b in zip(before, namespaces(w)))
    # r2 stored its chunks again, under the new generation: the same prompt now hits.
    assert w.stats["saved_chunks"] == 2 + 2
    assert eng.sched.reset_prefix_cache()  # vLLM's own cache only
    eng.clear_kv()
    r3 = eng.add("r3", toks)
    eng.step()
    eng.step()
    assert conn.stats["hit_tokens"] == 64
    assert_blocks(eng, "r3", toks, 64 // BLOCK)
    eng.run_until_idle()
    assert list(r3.output_token_ids) == list(r2.output_token_ids)

    # Every reset draws a new generation: r3's chunks are misses after a second one.
    first_gen = conn.generation
    assert reset_connector(eng) is True
    eng.clear_kv()
    eng.add("r4", toks)
    eng.run_until_idle()
    assert conn.generation != first_gen and w.generation == conn.generation
    assert conn.stats["hit_tokens"] == 64
    conn.check_integrity()
    eng.worker.check_integrity()


def test_every_worker_switches_generation_at_the_same_step(model_dir):
    """The generation travels in the step metadata, which vLLM sends to every TP/PP worker: a second
    worker bound to the same steps uses the same namespaces from the same step on."""
    cfg = make_vllm_config(model_dir, EXTRA)
    eng = Engine(cfg, make_kv_cache_config())
    other = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, eng.kcc)
    other.register_kv_caches(make_kv_caches(eng.kcc))
    w, w2 = eng.worker._worker, other._worker
    try:
        assert reset_connector(eng) is True
        assert w.generation == "" and namespaces(w) == namespaces(w2)  # no step yet: unchanged
        out = eng.sched.schedule()
        meta = pickle.dumps(out.kv_connector_metadata)
        eng.sched.update_from_output(out, eng.execute(out)[0])
        other.bind_connector_metadata(pickle.loads(meta))
        other.clear_connector_metadata()
        gen = eng.connector._scheduler.generation
        assert w.generation == w2.generation == gen != ""
        assert namespaces(w) == namespaces(w2)
    finally:
        other.shutdown()


def test_a_lookup_answered_across_the_reset_is_not_used(model_dir):
    """Async scheduling: x's lookup is sent and answered (2 chunks) by the worker before the reset,
    but the scheduler processes the answer after it. The answer names chunks of the old weights: x
    looks up again under the new generation (a miss) and computes its prompt."""
    eng = Engine(make_vllm_config(model_dir, EXTRA), make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    save_then_forget_locally(eng, toks, 2)
    x = eng.add("x", toks[:64] + prompt(6, seed=3), max_tokens=4)
    out_n = eng.sched.schedule()  # x: lookup sent
    assert out_n.num_scheduled_tokens == {}
    mro_n, log_n = eng.execute(out_n)
    assert log_n.worker_meta.lookups["x"].hit_chunks == 2  # the old generation's answer
    assert reset_connector(eng) is True
    eng.sched.update_from_output(out_n, mro_n)  # the answer arrives after the reset
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 0 and w.stats["loaded_chunks"] == 0
    assert x.status == RequestStatus.FINISHED_LENGTH_CAPPED
    base = baseline_outputs(model_dir, {"x": x.prompt_token_ids}, 4)["x"]
    assert list(x.output_token_ids) == base
    assert w._staged == {} and w._staged_bytes == 0
    conn.check_integrity()
    eng.worker.check_integrity()


def test_an_async_load_in_flight_at_the_reset_is_failed_and_recomputed(tmp_path, model_dir):
    """r2 waits for an async load of old-generation chunks when the connector is reset (vLLM's own
    reset fails, as blocks are held, but it still resets the connector). The read then finishes:
    the load must not reach r2's blocks; vLLM's recompute policy recomputes them."""
    eng, GatedStore = _gated_file_engine(tmp_path, model_dir, 32)
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    save_then_forget_locally(eng, toks, 2)
    gated = GatedStore(w.store)
    w.store = gated
    toks2 = toks[:64] + prompt(20, seed=7)
    r2 = eng.add("r2", toks2, max_tokens=3)
    eng.step()
    eng.step()
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert reset_connector(eng, reset_running_requests=False) is False  # r2 holds blocks
    gated.open()
    eng.run_until_idle()
    assert w.stats["loaded_chunks"] == 0, "old-generation chunks were loaded after the reset"
    assert w.stats["failed_chunks"] == 2
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(r2.output_token_ids) == baseline_outputs(model_dir, {"r2": toks2}, 3)["r2"]
    assert w._staged == {} and w._staged_bytes == 0 and w._async_loads == []
    conn.check_integrity()
    eng.worker.check_integrity()


def test_a_request_preempted_by_the_reset_stores_its_chunks_again(model_dir):
    """reset_running_requests=True preempts r1 (2 chunks stored before the reset): it resumes from
    scratch, finds nothing, and stores its chunks again under the new generation."""
    eng = Engine(make_vllm_config(model_dir, EXTRA), make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    r1 = eng.add("r1", toks, max_tokens=12)
    for _ in range(4):
        eng.step()
    assert r1.status == RequestStatus.RUNNING and w.stats["saved_chunks"] == 2
    assert reset_connector(eng) is True
    assert r1.status == RequestStatus.PREEMPTED
    eng.clear_kv()
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 0
    assert w.stats["saved_chunks"] == 2 + 2
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    eng.add("r3", toks)
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 64


def test_a_request_running_through_the_reset_stores_nothing_after_it(model_dir):
    """reset_running_requests=False leaves r1 running on KV computed before the reset: the chunks
    it completes afterwards attend to that KV, so none is stored under the new generation."""
    cfg = make_vllm_config(model_dir, EXTRA)
    cfg.scheduler_config.max_num_batched_tokens = 40
    cfg.scheduler_config.enable_chunked_prefill = True
    eng = Engine(cfg, make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(130)
    r1 = eng.add("r1", toks, max_tokens=3)
    eng.step()  # lookup (nothing stored)
    eng.step()  # 40 tokens: chunk 0 stored
    assert w.stats["saved_chunks"] == 1
    assert reset_connector(eng, reset_running_requests=False) is False  # r1 holds blocks
    assert r1.status == RequestStatus.RUNNING
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 1, "old-weight KV was stored under the new generation"
    assert r1.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # A request computed entirely after the reset stores its chunks.
    eng.clear_kv()
    assert eng.sched.reset_prefix_cache()
    eng.add("r2", toks, max_tokens=3)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 1 + 4 and conn.stats["hit_tokens"] == 0
    conn.check_integrity()
    eng.worker.check_integrity()
