"""Request lifecycle through vLLM 0.33's own Scheduler (CPU): hits overlapping vLLM's prefix cache,
chunk sizes above the block size, chunked prefill past a partial hit, failed and aborted loads."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import Request, RequestStatus
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

from test_connector_scheduler import file_store, mem_store, prompt

pytestmark = pytest.mark.vllm


def add_local(eng: Engine, req_id: str, toks: list[int], max_tokens: int = 2) -> Request:
    """A request that reads no cache (vLLM's nor radixkv's): it computes ``toks`` and so fills
    vLLM's prefix cache with them, without a lookup of its own."""
    return eng.add(req_id, toks, max_tokens=max_tokens, read_cache=False)


def save_then_forget_locally(eng: Engine, toks: list[int], saved_chunks: int) -> None:
    """Run ``toks`` once (radixkv saves ``saved_chunks`` of it), then drop vLLM's own copy (its
    prefix cache and the KV bytes), so later requests can hit only in radixkv."""
    eng.add("r1", toks)
    eng.run_until_idle()
    assert eng.worker._worker.stats["saved_chunks"] == saved_chunks
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()


def assert_blocks(eng: Engine, req_id: str, toks: list[int], n_blocks: int) -> None:
    ids = eng.sched.kv_cache_manager.get_block_ids(req_id)[0]
    for name in eng.kv:
        for b in range(n_blocks):
            want = eng.expected_block(name, toks, b).contiguous().view(torch.uint8)
            assert torch.equal(eng.block_bytes(name, ids[b]), want), (name, b, ids[b])


def baseline_outputs(model_dir, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """What each prompt generates with nothing loaded (kv_producer: saves only)."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": 32, "store": mem_store()})
    cfg.kv_transfer_config.kv_role = "kv_producer"
    eng = Engine(cfg, make_kv_cache_config())
    reqs = {rid: eng.add(rid, toks, max_tokens=max_tokens) for rid, toks in prompts.items()}
    eng.run_until_idle()
    return {rid: list(r.output_token_ids) for rid, r in reqs.items()}


def test_hit_over_a_local_hit_inside_a_chunk_of_four_blocks(model_dir):
    """chunk = 4 blocks; vLLM's prefix cache holds 3 blocks (mid-chunk) of a 2-chunk radixkv hit:
    only blocks 3..7 are loaded, the shared local blocks are left alone."""
    extra = {"chunk_tokens": 64, "store": mem_store(), "sync_load_wait_s": 5.0}
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    conn = eng.connector._scheduler
    toks = prompt(150)
    save_then_forget_locally(eng, toks, 2)
    add_local(eng, "loc", toks[:50])
    eng.run_until_idle()
    toks2 = toks[:128] + prompt(30, seed=4)
    r2 = eng.add("r2", toks2, max_tokens=3)
    assert eng.step().scheduled == {}  # lookup
    log = eng.step()
    assert log.has_sync_loads and log.scheduled == {"r2": len(toks2) - 128}
    assert conn.stats["hit_tokens"] == 128 - 48
    assert_blocks(eng, "r2", toks2, 128 // BLOCK)
    eng.run_until_idle()
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    base = baseline_outputs(model_dir, {"r2": toks2}, 3)
    assert list(r2.output_token_ids) == base["r2"]
    conn.check_integrity()
    eng.worker.check_integrity()


def test_local_hit_grows_past_the_lookups_first_chunk(model_dir):
    """The lookup is sent from chunk 0; before the hit is used another request computed the first
    two chunks locally: the load starts at chunk 2 of the staged run and writes only its blocks."""
    extra = {"chunk_tokens": 32, "store": mem_store(), "sync_load_wait_s": 5.0}
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    conn = eng.connector._scheduler
    toks = prompt(110)
    save_then_forget_locally(eng, toks, 3)
    toks2 = toks[:96] + prompt(20, seed=6)
    r2 = eng.add("r2", toks2, max_tokens=3)
    add_local(eng, "loc", toks[:70])
    log = eng.step()  # r2: lookup from chunk 0; loc computes 70 tokens (64 cached by vLLM)
    assert "r2" not in log.scheduled and log.scheduled.get("loc") == 70
    assert conn._requests["r2"].lookup_first_chunk == 0
    log = eng.step()
    assert log.scheduled.get("r2") == len(toks2) - 96
    assert conn.stats["hit_tokens"] == 32  # chunk 2 only: chunks 0-1 are vLLM's local hit
    assert_blocks(eng, "r2", toks2, 96 // BLOCK)
    eng.run_until_idle()
    assert list(r2.output_token_ids) == baseline_outputs(model_dir, {"r2": toks2}, 3)["r2"]
    w = eng.worker._worker
    assert w._staged == {} and w._staged_bytes == 0
    conn.check_integrity()
    eng.worker.check_integrity()


def test_chunked_prefill_past_a_partial_hit_saves_the_rest_not_the_last_partial_chunk(model_dir):
    extra = {"chunk_tokens": 32, "store": mem_store(), "sync_load_wait_s": 5.0}
    cfg = make_vllm_config(model_dir, extra)
    cfg.scheduler_config.max_num_batched_tokens = 40
    cfg.scheduler_config.enable_chunked_prefill = True
    eng = Engine(cfg, make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    save_then_forget_locally(eng, toks, 2)
    toks2 = toks[:64] + prompt(136, seed=8)  # 200 tokens: 6 whole chunks before the last token
    r2 = eng.add("r2", toks2, max_tokens=3)
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 64
    assert w.stats["saved_chunks"] == 2 + 4  # chunks 2..5 saved by r2; 192..199 never
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    r3 = eng.add("r3", toks2, max_tokens=3)
    eng.step()
    log = eng.step()
    assert log.scheduled == {"r3": 200 - 192}
    assert_blocks(eng, "r3", toks2, 192 // BLOCK)
    eng.run_until_idle()
    base = baseline_outputs(model_dir, {"x": toks2}, 3)["x"]
    assert list(r2.output_token_ids) == base and list(r3.output_token_ids) == base
    conn.check_integrity()
    eng.worker.check_integrity()


def _gated_file_engine(tmp_path, model_dir, chunk: int, policy: str = "recompute"):
    from vllm_harness import GatedStore

    cfg = make_vllm_config(
        model_dir, {"chunk_tokens": chunk, "store": file_store(tmp_path / "kv")}, policy=policy
    )
    eng = Engine(cfg, make_kv_cache_config())
    return eng, GatedStore


def test_failed_async_load_over_a_mid_chunk_local_hit_keeps_only_the_local_hit(
    tmp_path, model_dir
):
    """chunk = 4 blocks, vLLM holds 3 of chunk 0 locally; the async load of chunks 0-1 fails on
    chunk 0: vLLM must keep only its own 48 tokens and recompute the rest (bytes and outputs)."""
    from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes
    from test_connector_scheduler import _corrupt_chunk

    eng, GatedStore = _gated_file_engine(tmp_path, model_dir, 64)
    conn = eng.connector._scheduler
    toks = prompt(150)
    save_then_forget_locally(eng, toks, 2)
    gated = GatedStore(eng.worker._worker.store)
    eng.worker._worker.store = gated
    add_local(eng, "loc", toks[:50])
    eng.run_until_idle()
    toks2 = toks[:128] + prompt(30, seed=4)
    r2 = eng.add("r2", toks2, max_tokens=3)
    eng.step()
    eng.step()
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    keys = chunk_keys_from_block_hashes(r2.block_hashes, BLOCK, 64, 2)
    _corrupt_chunk(tmp_path / "kv", keys[0])
    gated.open()
    log = eng.step()
    assert log.finished_recving == {"r2"} and log.invalid_block_ids
    assert r2.num_computed_tokens == 48
    eng.run_until_idle()
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(r2.output_token_ids) == baseline_outputs(model_dir, {"r2": toks2}, 3)["r2"]
    # what is stored now loads back as the model wrote it
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    r3 = eng.add("r3", toks2, max_tokens=3)
    eng.run_until_idle()
    assert list(r3.output_token_ids) == list(r2.output_token_ids)
    conn.check_integrity()
    eng.worker.check_integrity()


def test_abort_while_an_async_load_fails(tmp_path, model_dir):
    """An aborted request whose async load then fails: its blocks are freed once, no error reaches
    a live request, staging is released."""
    from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes
    from test_connector_scheduler import _corrupt_chunk, _warm_then_gate

    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    other = eng.add("o", prompt(40, seed=11), max_tokens=6)
    r2 = eng.add("r2", toks[:64] + prompt(20, seed=7))
    eng.step()
    eng.step()
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    free_before = eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    eng.sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    keys = chunk_keys_from_block_hashes(r2.block_hashes, BLOCK, 32, 2)
    _corrupt_chunk(tmp_path / "kv", keys[0])
    gated.open()
    eng.run_until_idle()
    assert "r2" not in eng.sched.requests
    assert other.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    w = eng.worker._worker
    assert w._staged == {} and w._staged_bytes == 0 and w._async_loads == []
    eng.worker.check_integrity()


def _execute(eng: Engine, out):
    """The worker half of Engine.step for one scheduler output: (its ModelRunnerOutput)."""
    return eng.execute(out)[0]


def test_a_lookup_answered_after_the_local_cache_covered_the_request_releases_staging(
    model_dir,
):
    """Async scheduling (vLLM's default on GPU) schedules step N+1 before step N's output is
    processed. X's lookup is sent in step N; in N+1 vLLM's own prefix cache (filled in step N by a
    request with X's prefix) covers every chunk X could load, so X is scheduled without a hit and
    update_state_after_alloc(X, 0) runs while the lookup is still unanswered. The answer that comes
    next staged X's chunks for nothing: they must be released then, not held until X finishes."""
    extra = {"chunk_tokens": 32, "store": mem_store(), "sync_load_wait_s": 5.0}
    cfg = make_vllm_config(model_dir, extra)
    cfg.scheduler_config.max_num_batched_tokens = 64
    cfg.scheduler_config.enable_chunked_prefill = True
    eng = Engine(cfg, make_kv_cache_config())
    conn, w = eng.connector._scheduler, eng.worker._worker
    toks = prompt(70)
    save_then_forget_locally(eng, toks, 2)
    x = eng.add("x", toks[:64] + prompt(6, seed=3), max_tokens=8)
    add_local(eng, "loc", toks[:64] + prompt(6, seed=4))
    out_n = eng.sched.schedule()  # x: lookup sent; loc: 64 of its 70 tokens
    assert out_n.num_scheduled_tokens == {"loc": 64}
    mro_n = _execute(eng, out_n)
    out_n1 = eng.sched.schedule()  # before step N's output: x has a 64-token local hit
    assert out_n1.num_scheduled_tokens.get("x") == 6
    eng.sched.update_from_output(out_n, mro_n)  # the lookup's answer arrives
    eng.sched.update_from_output(out_n1, _execute(eng, out_n1))
    for _ in range(2):
        eng.step()
    assert x.status == RequestStatus.RUNNING
    assert w._staged == {} and w._staged_bytes == 0, "x's staged chunks are held while it runs"
    eng.run_until_idle()
    base = baseline_outputs(model_dir, {"x": x.prompt_token_ids}, 8)["x"]
    assert list(x.output_token_ids) == base
    conn.check_integrity()
    eng.worker.check_integrity()
