"""Each worker of an engine (TP/PP/PCP ranks) and each data-parallel engine on a host has its own
directory under a disk tier that is not ``shared``: vLLM hands every worker the same
``kv_connector_extra_config``, and a private disk tier assumes that one process owns its directory."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from vllm_harness import DTYPE, HEAD_SIZE, HEADS, Engine, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.vllm

CHUNK = 32


def tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + i * 53) % 30000 for i in range(n)]


def start_worker(model_dir, monkeypatch, extra, mode: str, index: int) -> Engine:
    """An engine whose worker is worker ``index`` of two on the host: TP rank ``index`` of a TP=2
    engine, PCP rank ``index`` of a PCP=2 engine, or the worker of dense DP engine ``index``."""
    import vllm.distributed.parallel_state as parallel_state

    cfg = make_vllm_config(model_dir, extra)
    pc = cfg.parallel_config
    if mode == "tp":  # the ranks vLLM's initialize_model_parallel gives each worker process
        pc.tensor_parallel_size = 2
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: index)
        monkeypatch.setattr(parallel_state, "get_pp_group",
                            lambda: SimpleNamespace(rank_in_group=0, world_size=1))
    elif mode == "pcp":
        pc.prefill_context_parallel_size = 2
        monkeypatch.setattr(parallel_state, "get_pcp_group",
                            lambda: SimpleNamespace(rank_in_group=index, world_size=2))
    else:  # a dense model's DP ranks: independent engines, as EngineCoreProc stamps and resets them
        pc.data_parallel_size = 2
        pc.data_parallel_rank = pc.data_parallel_index = index
        pc.reconfigure_for_independent_dp_rank()
    return Engine(cfg, make_kv_cache_config())


def chunk_files(root) -> dict[str, set[str]]:
    """Committed chunk files under ``root``, by the directory that holds their namespace directory."""
    out: dict[str, set[str]] = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(".kv") and not f.startswith("."):
                owner = os.path.dirname(os.path.dirname(os.path.dirname(os.path.join(dirpath, f))))
                out.setdefault(os.path.relpath(owner, root), set()).add(f)
    return out


@pytest.mark.parametrize("mode", ["tp", "pcp", "dp"])
def test_workers_of_a_host_keep_their_own_disk_chunks(model_dir, tmp_path, monkeypatch, mode):
    """Found by review: every worker opened the one private directory as its own. A starting worker's
    scan indexed the other workers' files and counted them in its capacity, its puts then evicted
    (deleted) them, and its start removed every temp file under the root: another worker's put in
    flight then failed. Each worker now has ``<root>/<its coordinates>``, with the capacity its own."""
    root = tmp_path / "kv"
    payload = 2 * CHUNK * HEADS * 2 * HEAD_SIZE * DTYPE.itemsize  # 2 layers of K and V
    frame = payload + 512  # a chunk file: the payload and its header (a few hundred bytes at most)
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [
        {"url": "mem://", "capacity_bytes": 1 << 24},
        {"url": f"file://{root}", "capacity_bytes": 4 * frame},  # room for 4 chunks of 3 + 3
    ]}}
    first = start_worker(model_dir, monkeypatch, extra, mode, 0)
    toks = tokens(100, 1)
    first.add("a", toks)
    first.run_until_idle()
    assert first.worker._worker.groups[0].chunk_bytes == payload
    assert first.worker._worker.store.flush(timeout_s=30)  # write-through to disk runs in the background
    disk0 = first.worker._worker.store.tiers[-1]
    ns0 = first.worker._worker.groups[0].namespace.digest
    keys0 = sorted(k for n, k in disk0._index if n == ns0)
    assert len(keys0) == 3
    # A put of the first worker in flight: its temp file beside its chunks.
    in_flight = disk0._layout.temp_path(disk0._layout.path(ns0, "f" * 64))
    with open(in_flight, "wb") as f:
        f.write(b"partial")
    second = start_worker(model_dir, monkeypatch, extra, mode, 1)
    second.add("b", tokens(100, 2))
    second.run_until_idle()
    assert second.worker._worker.store.flush(timeout_s=30)
    left = sum(os.path.exists(disk0._layout.path(ns0, k)) for k in keys0)
    assert left == 3, f"the second worker evicted {3 - left} of the first worker's 3 chunk files"
    assert os.path.exists(in_flight), "the second worker's start deleted the first worker's temp file"
    for eng in (first, second):
        assert eng.worker._worker.store.tiers[-1].stats().extra["chunks"] == 3
        eng.worker._worker.check_integrity()
    os.unlink(in_flight)
    dirs = {os.path.relpath(e.worker._worker.store.tiers[-1].root, root) for e in (first, second)}
    want = {"tp": {"tp0of2.pp0of1.pcp0of1.dp0", "tp1of2.pp0of1.pcp0of1.dp0"},
            "pcp": {"tp0of1.pp0of1.pcp0of2.dp0", "tp0of1.pp0of1.pcp1of2.dp0"},
            "dp": {"tp0of1.pp0of1.pcp0of1.dp0", "tp0of1.pp0of1.pcp0of1.dp1"}}[mode]
    assert dirs == want
    assert set(chunk_files(root)) == want
    first.close()
    # A restart of the first worker finds its own chunks again (its coordinates are its directory).
    again = start_worker(model_dir, monkeypatch, {**extra, "sync_load_wait_s": 5.0}, mode, 0)
    again.add("c", toks[:96] + tokens(10, 3))
    again.step()
    assert again.step().scheduled == {"c": 10}


def test_a_single_worker_engine_has_its_directory_too_and_old_files_are_named(
        model_dir, tmp_path, caplog):
    """A single-worker engine (TP, PP, PCP 1) moves to ``<root>/tp0of1.pp0of1.pcp0of1.dp0`` as well:
    it cannot tell that no other engine shares the root (vLLM resets a dense DP engine's
    ``data_parallel_size`` to 1, so DP engine 0 looks single), and a worker that kept the root would
    still delete the temp files of every worker below it at its start. Namespace directories left
    directly under the root by earlier releases are named in a warning; a shared disk tier stays where
    it is (it is made for several processes)."""
    private, shared = tmp_path / "kv", tmp_path / "shared"
    old = private / ("ab" * 16)  # a namespace directory of the one-directory layout
    (old / "00").mkdir(parents=True)
    extra = {"chunk_tokens": CHUNK, "store": {"tiers": [
        {"url": "mem://", "capacity_bytes": 1 << 24},
        {"url": f"file://{private}", "capacity_bytes": 1 << 24},
        {"url": f"file://{shared}", "capacity_bytes": 1 << 24, "options": {"shared": True}},
    ]}}
    with caplog.at_level(logging.WARNING, logger="radixkv"):
        eng = Engine(make_vllm_config(model_dir, extra), make_kv_cache_config())
    store = eng.worker._worker.store
    assert [t.root for t in store.tiers[1:]] == [str(private / "tp0of1.pp0of1.pcp0of1.dp0"), str(shared)]
    warned = [r.getMessage() for r in caplog.records if "no longer used" in r.getMessage()]
    assert len(warned) == 1 and old.name in warned[0] and str(private) in warned[0], warned
    eng.add("a", tokens(100, 1))
    eng.run_until_idle()
    assert store.flush(timeout_s=30)
    assert set(chunk_files(private)) == {"tp0of1.pp0of1.pcp0of1.dp0"}
    assert set(chunk_files(shared)) == {"."}
    assert old.is_dir()  # named, never deleted: the operator decides
