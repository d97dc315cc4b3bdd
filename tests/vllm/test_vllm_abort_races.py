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


def test_a_released_request_whose_read_still_runs_stays_counted_until_it_ends(tmp_path, model_dir):
    # Before: the staging bytes were given back at the release, while the running read still filled
    # its buffers, so staging memory could exceed max_staging_bytes by the reads in flight.
    eng, toks, gated = _warm_then_gate(tmp_path, model_dir)
    gated.running = True
    eng.add("r2", toks[:64] + prompt(20, seed=7))
    eng.step()  # lookup sent; the read runs (held back)
    w = eng.worker._worker
    held = w._staged_bytes
    assert held > 0
    eng.sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    eng.step()
    assert w._staged == {} and w._staged_bytes == held  # released, but its read still runs
    eng.worker.check_integrity()
    gated.open()
    eng.step()
    assert w._staged_bytes == 0 and w._draining == []
    eng.worker.check_integrity()
