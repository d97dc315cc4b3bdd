"""The connector driven by vLLM 0.33's own V1 Scheduler with real Requests (CPU)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import RequestStatus
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

CHUNK = 32


def mem_store() -> dict:
    return {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24}]}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 1009 + i * 37) % 40000 for i in range(n)]


def assert_blocks_match(
    eng: Engine, req_id_tokens: list[int], block_ids: list[int], blocks: range
) -> None:
    for layer in eng.kv:
        for b in blocks:
            got = eng.block_bytes(layer, block_ids[b])
            want = eng.expected_block(layer, req_id_tokens, b).contiguous().view(torch.uint8)
            assert torch.equal(got, want), (layer, b, block_ids[b])


def test_first_request_saves_second_hits(model_dir):
    extra = {
        "chunk_tokens": CHUNK,
        "store": mem_store(),
        "sync_load_wait_s": 5.0,
    }  # never async on a busy box
    eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    conn = eng.connector
    toks = prompt(70)
    eng.add("r1", toks)
    first = eng.step()  # lookup in flight: the request is skipped this step
    assert first.scheduled == {}
    eng.run_until_idle()
    w = eng.worker._worker
    assert w.stats["saved_chunks"] == 2  # (70 - 1) // 32 whole prompt chunks
    assert conn._scheduler.stats["loads"] == 0

    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()  # fresh blocks: whatever the second request finds must come from the store
    toks2 = toks[:64] + prompt(20, seed=5)
    req2 = eng.add("r2", toks2)
    eng.step()  # lookup
    log = eng.step()  # sync load + forward of the tail
    assert log.has_sync_loads
    assert log.scheduled == {"r2": len(toks2) - 64}
    assert conn._scheduler.stats["hit_tokens"] == 64
    blocks = eng.sched.kv_cache_manager.get_block_ids("r2")[0]
    assert_blocks_match(eng, toks2, blocks, range(64 // BLOCK))
    eng.run_until_idle()
    assert req2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    conn.check_integrity()
    eng.worker.check_integrity()


def file_store(path) -> dict:
    return {"tiers": [{"url": f"file://{path}", "capacity_bytes": 1 << 26}]}


def _warm_then_gate(tmp_path, model_dir, policy="recompute"):
    """r1 stores two chunks in a disk tier; then reads are gated, the local cache and KV are wiped."""
    from vllm_harness import GatedStore

    cfg = make_vllm_config(
        model_dir, {"chunk_tokens": CHUNK, "store": file_store(tmp_path / "kv")}, policy=policy
    )
    eng = Engine(cfg, make_kv_cache_config())
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    assert eng.worker._worker.stats["saved_chunks"] == 2
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    gated = GatedStore(eng.worker._worker.store)
    eng.worker._worker.store = gated
    return eng, toks, gated


def test_async_load_from_slow_tier(tmp_path, model_dir):
    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    conn = eng.connector
    toks2 = toks[:64] + prompt(20, seed=7)
    req = eng.add("r2", toks2)
    assert eng.step().scheduled == {}  # lookup round trip
    rep = eng.log[-1].worker_meta.lookups["r2"]
    assert (rep.hit_chunks, rep.ready) == (2, False)  # found, but still being read
    assert eng.step().scheduled == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn._scheduler.stats["async_loads"] == 1
    assert eng.step().finished_recving == set()  # the read is still held back
    gated.open()
    assert eng.step().finished_recving == {"r2"}
    log = eng.step()
    assert log.scheduled == {"r2": len(toks2) - 64}
    assert_blocks_match(eng, toks2, eng.sched.kv_cache_manager.get_block_ids("r2")[0], range(4))
    eng.run_until_idle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    conn.check_integrity()
    eng.worker.check_integrity()


def _corrupt_chunk(root, key: str) -> None:
    (path,) = list(root.rglob(f"{key}.kv"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a flipped payload byte: the frame checksum must catch it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load(tmp_path, model_dir, policy):
    from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes

    eng, toks, gated = _warm_then_gate(tmp_path, model_dir, policy=policy)
    conn = eng.connector
    toks2 = toks[:64] + prompt(20, seed=9)
    req = eng.add("r2", toks2)
    eng.step()
    eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    keys = chunk_keys_from_block_hashes(req.block_hashes, BLOCK, CHUNK, 2)
    _corrupt_chunk(tmp_path / "kv", keys[1])
    gated.open()
    log = eng.step()
    blocks = eng.sched.kv_cache_manager.get_block_ids("r2")[0] if policy == "recompute" else None
    assert log.finished_recving == {"r2"}
    assert log.invalid_block_ids and log.invalid_block_ids <= set(range(64))
    assert eng.worker._worker.stats["failed_chunks"] == 1
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        return
    # recompute: vLLM rolls back to the failed chunk (32 tokens kept) and recomputes the rest
    assert req.num_computed_tokens == CHUNK
    assert conn._scheduler._requests["r2"].failed
    log = eng.step()
    assert log.scheduled == {"r2": len(toks2) - CHUNK}
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # never offered again
    blocks = eng.sched.kv_cache_manager.get_block_ids("r2")[0]
    assert_blocks_match(eng, toks2, blocks, range(len(toks2) // BLOCK))
    eng.run_until_idle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    conn.check_integrity()


def test_a_hash_block_finer_than_the_block_keys_whole_chunks(model_dir):
    """Found by a contract review: with several KV-cache groups vLLM hashes in units finer than a
    block (KVCacheConfig.hash_block_size, 8 here against 16-token blocks), and with a multi-process
    executor the scheduler process's cache_config never learns it. The connector took one group's
    block size, derived a chunk's key from a hash in its middle, and loaded prompt A's KV into a
    prompt B that shares only half of A's first chunk."""
    kcc = make_kv_cache_config(sliding_window=32)
    extra = {"chunk_tokens": CHUNK, "store": mem_store(), "sync_load_wait_s": 5.0}
    eng = Engine(make_vllm_config(model_dir, extra), kcc, hash_block=8)
    assert eng.cfg.cache_config.hash_block_size is None  # as in a TP>1 EngineCore process
    conn = eng.connector._scheduler
    assert conn.hash_block_size == 8
    a = prompt(70)
    eng.add("A", a)
    eng.run_until_idle()
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    b = a[:16] + prompt(54, seed=5)  # agrees with A on half of the first chunk only
    req = eng.add("B", b)
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] == 0
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    again = eng.add("A2", a)  # A itself still hits (so the keys do name A's chunks)
    eng.run_until_idle()
    assert conn.stats["hit_tokens"] > 0 and again.status == RequestStatus.FINISHED_LENGTH_CAPPED
    eng.worker.check_integrity()


def test_hma_sliding_window_groups(model_dir):
    """Two KV-cache groups (full + sliding window), as vLLM builds them with HMA on (GPU): both groups'
    chunks are stored; a hit is loaded asynchronously (vLLM 0.33 recovers hybrid failures by request)
    into the full group's blocks and the sliding-window group's in-window blocks."""
    kcc = make_kv_cache_config(sliding_window=32)
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()}), kcc)
    conn = eng.connector
    assert len(conn._scheduler.groups) == 2
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    w = eng.worker._worker
    assert w.stats["saved_chunks"] == 2
    ns_full, ns_sw = (g.namespace for g in w.groups)
    assert ns_full.digest != ns_sw.digest and "sliding_window32" in ns_sw.extra
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    toks2 = toks[:64] + prompt(20, seed=3)
    req = eng.add("r2", toks2)
    eng.step()
    log = eng.step()
    assert (
        req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )  # async even though the bytes are staged
    assert log.scheduled == {} and log.finished_recving == {"r2"}  # copied in the same step
    log = eng.step()
    assert log.scheduled == {"r2": len(toks2) - 64}
    full_ids, sw_ids = eng.sched.kv_cache_manager.get_block_ids("r2")
    for b in range(4):
        assert torch.equal(
            eng.block_bytes("layers.0", full_ids[b]),
            eng.expected_block("layers.0", toks2, b).contiguous().view(torch.uint8),
        )
    in_window = [b for b in range(4) if sw_ids[b] != 0]
    assert in_window and in_window[-1] == 3  # the window before token 64 is loaded
    for b in in_window:
        assert torch.equal(
            eng.block_bytes("layers.1", sw_ids[b]),
            eng.expected_block("layers.1", toks2, b).contiguous().view(torch.uint8),
        )
    eng.run_until_idle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "r2" not in conn._scheduler._requests  # request_finished_all_groups ran
    conn.check_integrity()
    eng.worker.check_integrity()


@pytest.mark.parametrize("save_generated", [False, True])
def test_chunked_prefill_saves_each_completed_chunk(model_dir, save_generated):
    """A prompt prefilled over several steps saves each chunk in the step that completes it; generated
    tokens' chunks are saved only with save_generated."""
    extra = {"chunk_tokens": CHUNK, "store": mem_store(), "save_generated": save_generated}
    cfg = make_vllm_config(model_dir, extra)
    cfg.scheduler_config.max_num_batched_tokens = 40
    cfg.scheduler_config.enable_chunked_prefill = True
    eng = Engine(cfg, make_kv_cache_config())
    toks = prompt(100)
    eng.add("r1", toks, max_tokens=40)
    eng.step()  # lookup
    w = eng.worker._worker
    saved_after_step = []
    while eng.sched.has_requests():
        eng.step()
        saved_after_step.append(w.stats["saved_chunks"])
    assert saved_after_step[:3] == [
        1,
        2,
        3,
    ]  # 40 tokens a step: one prompt chunk completes per step
    # 100 prompt tokens -> 3 whole chunks; + 40 generated -> 139 tokens known -> 4 chunks
    assert w.stats["saved_chunks"] == (4 if save_generated else 3)
    assert eng.connector._scheduler.stats["planned_save_chunks"] == w.stats["saved_chunks"]


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_role_limits_direction(model_dir, role):
    """kv_producer only saves (no lookups), kv_consumer only loads (nothing saved)."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()})
    cfg.kv_transfer_config.kv_role = role
    eng = Engine(cfg, make_kv_cache_config())
    eng.add("r1", prompt(70))
    eng.run_until_idle()
    sched, w = eng.connector._scheduler, eng.worker._worker
    if role == "kv_producer":
        assert (sched.stats["lookups"], w.stats["saved_chunks"]) == (0, 2)
    else:
        assert (sched.stats["lookups"], w.stats["saved_chunks"]) == (1, 0)


def _run_workload(model_dir, role: str) -> tuple[list[list[int]], int, Engine]:
    extra = {"chunk_tokens": CHUNK, "store": mem_store(), "save_generated": True}
    cfg = make_vllm_config(model_dir, extra)
    cfg.kv_transfer_config.kv_role = role
    eng = Engine(cfg, make_kv_cache_config(num_blocks=20))
    reqs = [eng.add(f"r{i}", prompt(70, seed=i), max_tokens=40) for i in range(3)]
    eng.run_until_idle(max_steps=400)
    return [list(r.output_token_ids) for r in reqs], sum(r.num_preemptions for r in reqs), eng


def test_preempted_requests_generate_what_recomputation_generates(model_dir):
    """A KV pool too small for three requests forces preemptions; resumed requests may load their
    chunks back from the store. Generated tokens depend on every KV byte read (the harness's
    attention), and must equal a run that never loads (kv_producer)."""
    base, _, _ = _run_workload(model_dir, "kv_producer")
    got, preemptions, eng = _run_workload(model_dir, "kv_both")
    assert preemptions > 0
    assert got == base and all(len(out) == 40 for out in got)
    stats = eng.connector._scheduler.stats
    assert stats["hit_tokens"] > 0, stats  # at least one resumed request loaded from the store


def test_one_engine_lookup_counts_once_whatever_the_groups(model_dir):
    # Found by a review: with two KV-cache groups each worker lookup was counted once per group.
    kcc = make_kv_cache_config(sliding_window=32)
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()}), kcc)
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    eng.add("r2", toks[:64] + prompt(20, seed=3))
    eng.run_until_idle()
    st = eng.worker._worker.store.stats()["store"]
    assert st.get("lookup_hit_chunks", 0) == 2, st


def test_groups_vllm_does_not_prefix_cache_are_left_alone(model_dir, caplog, monkeypatch):
    """Found by review: every attention group was stored and loaded, including groups vLLM keeps out
    of hash-addressed stores (``prefix_cacheable_group_ids``: ``enable_kv_transfer=False`` replicas,
    ``CircularBufferSpec`` rings), whose blocks vLLM zeroes and rebuilds itself after a load. Such
    groups are now skipped (logged once), and the stored groups keep vLLM's group index for block
    ids: here the skipped group is group 0, so the stored one reads vLLM's second block list."""
    import logging

    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm_harness import HEAD_SIZE, HEADS, NUM_BLOCKS, DTYPE

    from radixkv.adapters import vllm_options
    from radixkv.errors import ConfigError

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    ring = CircularBufferSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    monkeypatch.setattr(vllm_options, "_LOGGED_SKIPS", set(), raising=False)  # log once: reset
    with caplog.at_level(logging.INFO, logger=vllm_options.__name__):
        two = [KVCacheGroupSpec(["layers.0"], ring), KVCacheGroupSpec(["layers.1"], full)]
        geos = vllm_options.geometries_from_kv_cache_config(KVCacheConfig(NUM_BLOCKS, [], two))
        vllm_options.geometries_from_kv_cache_config(KVCacheConfig(NUM_BLOCKS, [], two))
    assert [g.group_id for g in geos] == [1]
    skips = [r for r in caplog.records if "CircularBufferSpec" in r.getMessage()]
    assert len(skips) == 1 and skips[0].levelno == logging.INFO
    with pytest.raises(ConfigError, match="no KV-cache group"):
        vllm_options.geometries_from_kv_cache_config(
            KVCacheConfig(NUM_BLOCKS, [], [KVCacheGroupSpec(["layers.0"], ring)]))

    # End to end through vLLM's scheduler: group 0 is excluded from KV transfer.
    kcc = KVCacheConfig(NUM_BLOCKS, [], [
        KVCacheGroupSpec(["layers.0"], full, enable_kv_transfer=False),
        KVCacheGroupSpec(["layers.1"], full),
    ])
    assert kcc.prefix_cacheable_group_ids == (1,)
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()}), kcc)
    conn = eng.connector
    assert [g.group_id for g in conn._scheduler.groups] == [1]
    w = eng.worker._worker
    assert [g.geometry.group_id for g in w.groups] == [1]
    assert w.groups[0].namespace.extra.startswith("g1-")
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 2
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    toks2 = toks[:64] + prompt(20, seed=3)
    req = eng.add("r2", toks2)
    for _ in range(5):  # lookup, async load, then the first forward past the hit
        if eng.step().scheduled.get("r2"):
            break
    assert conn._scheduler.stats["hit_tokens"] == 64 and req.num_computed_tokens == len(toks2)
    skipped_ids, stored_ids = eng.sched.kv_cache_manager.get_block_ids("r2")
    for b in range(4):  # the stored group's hit blocks hold the saved KV ...
        assert torch.equal(
            eng.block_bytes("layers.1", stored_ids[b]),
            eng.expected_block("layers.1", toks2, b).contiguous().view(torch.uint8),
        )
        # ... and the connector wrote nothing into the skipped group's (the fake model computed none).
        assert not eng.block_bytes("layers.0", skipped_ids[b]).any()
    eng.run_until_idle()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    conn.check_integrity()
    eng.worker.check_integrity()
