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


def assert_blocks_match(eng: Engine, req_id_tokens: list[int], block_ids: list[int], blocks: range) -> None:
    for layer in eng.kv:
        for b in blocks:
            got = eng.block_bytes(layer, block_ids[b])
            want = eng.expected_block(layer, req_id_tokens, b).contiguous().view(torch.uint8)
            assert torch.equal(got, want), (layer, b, block_ids[b])


def test_first_request_saves_second_hits(model_dir):
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()}), make_kv_cache_config())
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
