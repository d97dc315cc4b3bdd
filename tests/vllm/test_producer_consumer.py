"""A kv_producer engine stores into shared tiers (a ``shared`` disk directory, Redis) and a
kv_consumer engine over the same tiers reads them: the consumer loads what the producer stored and
leaves the shared tiers exactly as it found them (docs/vllm.md §1: a read-only replica)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

CHUNK = 32
CHUNK_BYTES = 4096  # 32 tokens x 2 layers x 2 heads x (4 K + 4 V) float32


def tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 53) % 30000 for i in range(n)]


def files_of(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every chunk file under ``root``: (inode, mtime in ns, size in bytes), by relative path (the
    tiers' ``.lock`` is not a chunk)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if name == ".lock":
                continue
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def engine(model_dir: Path, role: str, tiers: list[dict]) -> Engine:
    cfg = make_vllm_config(
        model_dir, {"chunk_tokens": CHUNK, "store": {"tiers": tiers}, "sync_load_wait_s": 5.0}
    )
    cfg.kv_transfer_config.kv_role = role
    return Engine(cfg, make_kv_cache_config())


def test_a_consumer_neither_deletes_nor_writes_the_producers_chunks(model_dir, tmp_path, redis_url):
    """Found by a producer/consumer review: a kv_consumer's store took the chunks it adopted from
    the shared tiers for its own. With a small memory tier over a shared directory whose share
    (capacity) holds fewer chunks than it reads, promotions pushed chunks out of memory into the
    directory, and making room there deleted the producer's files: the next consumer (or this one
    after a restart) missed them. The consumer now borrows its namespaces there (store.borrow):
    chunks it loses are only forgotten, and it copies nothing into the shared tiers."""
    import redis

    prefix = f"vllm{uuid.uuid4().hex[:8]}"
    root = tmp_path / "kv"
    redis_tier = {"url": redis_url, "capacity_bytes": 1 << 26, "options": {"key_prefix": prefix}}
    prod = engine(
        model_dir,
        "kv_producer",
        [
            {"url": "mem://", "capacity_bytes": 1 << 24},
            {"url": f"file://{root}", "capacity_bytes": 1 << 26, "options": {"shared": True}},
            redis_tier,
        ],
    )
    prompts = [tokens(200, 3), tokens(200, 9)]  # 6 whole chunks each
    for i, toks in enumerate(prompts):
        prod.add(f"p{i}", toks)
        prod.run_until_idle()
    assert prod.worker._worker.stats["saved_chunks"] == 12
    prod.close()  # its write-through copies to the directory and Redis are done
    files_before = files_of(root)
    client = redis.Redis.from_url(redis_url)
    values_before = {k: client.get(k) for k in client.scan_iter(match=f"{prefix}:*")}
    assert len(files_before) == len(values_before) == 12

    # The consumer's share of the directory holds 2 chunks, its memory 5: it reads 12.
    cons = engine(
        model_dir,
        "kv_consumer",
        [
            {"url": "mem://", "capacity_bytes": 5 * CHUNK_BYTES + 1000},
            {"url": f"file://{root}", "capacity_bytes": 2 * CHUNK_BYTES + 1000,
             "options": {"shared": True}},
            redis_tier,
        ],
    )
    for i, toks in enumerate(prompts):
        want = toks[:192] + tokens(10, 20 + i)
        cons.add(f"c{i}", want)
        cons.step()  # the lookup round trip
        assert cons.step().scheduled == {f"c{i}": 10}  # 192 tokens loaded
        ids = cons.sched.kv_cache_manager.get_block_ids(f"c{i}")[0]
        for name in cons.kv:
            for b in range(192 // BLOCK):
                want_bytes = cons.expected_block(name, want, b).contiguous().view(torch.uint8)
                assert torch.equal(cons.block_bytes(name, ids[b]), want_bytes), (i, name, b)
        cons.run_until_idle()
    w = cons.worker._worker
    assert w.stats["loaded_chunks"] == 12
    time.sleep(0.2)  # promotions run in the background
    w.store.close()  # and its close flushes nothing into the shared tiers either
    assert files_of(root) == files_before
    assert {k: client.get(k) for k in client.scan_iter(match=f"{prefix}:*")} == values_before


@pytest.mark.parametrize("role, warned", [("kv_both", True), ("kv_consumer", True), ("kv_producer", False)])
def test_a_staging_budget_below_one_chunk_is_reported(model_dir, tmp_path, caplog, role, warned):
    """Found by an audit: max_staging_bytes below one chunk (0, say) made every lookup offer
    nothing, silently: an engine that never loads. Said at start where the engine loads."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "max_staging_bytes": CHUNK_BYTES - 1,
                                       "store": {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 20}]}})
    cfg.kv_transfer_config.kv_role = role
    with caplog.at_level("WARNING", logger="radixkv.adapters.vllm_worker"):
        eng = Engine(cfg, make_kv_cache_config())
    try:
        assert ("no chunk will ever be loaded" in caplog.text) is warned, caplog.text
    finally:
        eng.close()
