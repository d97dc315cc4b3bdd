"""Requests aborted while their hit is still being read (vLLM 0.33 scheduler, CPU)."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from test_connector_scheduler import _warm_then_gate, prompt

pytestmark = pytest.mark.vllm


def test_abort_while_waiting_for_an_async_load_frees_blocks_once_read(tmp_path, model_dir):
    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    req = eng.add("r2", toks[:64] + prompt(20, seed=7))
    eng.step(); eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    free_before = eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    eng.sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    assert "r2" in eng.sched.requests  # vLLM holds its blocks until the load reports done
    gated.open()
    for _ in range(3):
        eng.step()
    assert "r2" not in eng.sched.requests, "the aborted load was never reported finished"
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    w = eng.worker._worker
    assert w._staged == {} and w._staged_bytes == 0 and w._async_loads == []
    eng.worker.check_integrity()


def test_abort_during_the_lookup_round_trip_releases_staging(tmp_path, model_dir):
    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    eng.add("r2", toks[:64] + prompt(20, seed=7))
    eng.step()  # lookup sent; the read is held back
    w = eng.worker._worker
    assert w._staged_bytes > 0
    eng.sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    eng.step()
    gated.open()
    eng.step()
    assert "r2" not in eng.sched.requests
    assert w._staged == {} and w._staged_bytes == 0 and w._async_loads == []
    eng.worker.check_integrity()
