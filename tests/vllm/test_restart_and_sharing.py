"""Chunks written by another process: a restarted instance over the same ``file://`` directory, and a
second instance sharing a Redis server, find them (the store adopts what the tier holds) and load
byte-identical KV."""

from __future__ import annotations

import uuid

import pytest
import torch
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

CHUNK = 32


def tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 53) % 30000 for i in range(n)]


def first_run(model_dir, tiers) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Instance 1 prefills 100 tokens (3 whole chunks saved), then shuts down."""
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": {"tiers": tiers}}),
                 make_kv_cache_config())
    toks = tokens(100, 3)
    eng.add("a", toks)
    eng.run_until_idle()
    assert eng.worker._worker.stats["saved_chunks"] == 3
    expected = {
        name: torch.stack([eng.expected_block(name, toks, b) for b in range(96 // BLOCK)])
        for name in eng.kv
    }
    eng.close()
    return toks, expected


def second_run(model_dir, tiers, toks, expected) -> Engine:
    """A fresh instance (new store, empty tree) gets a request sharing 96 tokens: they load."""
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": {"tiers": tiers},
                                              "sync_load_wait_s": 5.0}),
                 make_kv_cache_config())
    toks_b = toks[:96] + tokens(10, 4)
    eng.add("b", toks_b)
    eng.step()  # the lookup round trip
    log = eng.step()
    assert log.scheduled == {"b": len(toks_b) - 96}, log  # 96 tokens came from the store
    ids = eng.sched.kv_cache_manager.get_block_ids("b")[0]
    for name in eng.kv:
        for b in range(96 // BLOCK):
            got = eng.kv[name][ids[b]].contiguous().view(torch.uint8)
            want = expected[name][b].contiguous().view(torch.uint8)
            assert torch.equal(got, want), (name, b)
    w = eng.worker._worker
    ns = w.groups[0].namespace
    assert w.store.stats()["store"].get(f"{w.store.tiers[-1].name}.adopted_chunks", 0) == 3, ns
    eng.run_until_idle()
    w.check_integrity()
    return eng


def test_restart_over_the_same_disk_directory_hits(model_dir, tmp_path):
    tiers = [{"url": "mem://", "capacity_bytes": 1 << 24},
             {"url": f"file://{tmp_path / 'kv'}", "capacity_bytes": 1 << 26}]
    toks, expected = first_run(model_dir, tiers)
    second_run(model_dir, tiers, toks, expected).close()


def test_second_instance_over_one_redis_hits(model_dir, redis_url):
    prefix = f"vllm{uuid.uuid4().hex[:8]}"
    tiers = [{"url": "mem://", "capacity_bytes": 1 << 24},
             {"url": redis_url, "capacity_bytes": 1 << 26, "options": {"key_prefix": prefix}}]
    toks, expected = first_run(model_dir, tiers)
    second_run(model_dir, tiers, toks, expected).close()
