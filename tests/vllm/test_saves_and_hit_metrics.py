"""What gets stored when vLLM's local prefix cache covers chunks the store lacks, and how hits are
counted, through vLLM 0.33's own Scheduler (CPU): multi-turn chats (the local hit holds the first
turn's generated tokens, never stored without ``save_generated``), a local hit that shrinks during
the lookup round trip, exact-multiple prompts, a save whose parent was evicted, radixkv's lookup
metrics and vLLM's per-source hit metrics."""

from __future__ import annotations

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus
from vllm_harness import BLOCK, Engine, make_kv_cache_config, make_vllm_config

from radixkv.adapters.vllm_meta import LookupReport, RadixKVWorkerMeta, merge_reach, reach_source, source_reach
from radixkv.adapters.vllm_options import chunk_keys_from_block_hashes
from test_connector_scheduler import CHUNK, file_store, mem_store, prompt
from test_vllm_lifecycle import assert_blocks

pytestmark = pytest.mark.vllm


def held_chunks(eng: Engine, req, n: int) -> list[int]:
    """Per group: the leading chunks of ``req``'s first ``n`` the worker's store holds."""
    w = eng.worker._worker
    keys = chunk_keys_from_block_hashes(req.block_hashes, BLOCK, CHUNK, n)
    return [int(w.store.lookup(g.namespace, keys, probe=False, record=False)) for g in w.present]


def two_turns(eng: Engine, question: int) -> tuple[list[int], object]:
    """Turn 1 (70 prompt tokens, 40 generated), then turn 2 = turn 1 + its answer + a question,
    with vLLM's local prefix cache still holding turn 1 (generated tokens included)."""
    r1 = eng.add("turn1", prompt(70), max_tokens=40)
    eng.run_until_idle()
    p2 = list(r1.all_token_ids)[:-1] + prompt(question, seed=9)
    r2 = eng.add("turn2", p2, max_tokens=2)
    eng.run_until_idle()
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return p2, r2


@pytest.mark.parametrize(
    ("role", "options", "question"),
    [
        ("kv_producer", {}, 100),  # never looks up: every turn-2 chunk hung from an unstored parent
        ("kv_both", {"lookup_min_chunks": 2}, 40),  # lookup skipped: the same
        ("kv_both", {}, 12),  # lookup skipped (nothing beyond the local hit): the straddling chunk
    ],
)
def test_a_later_turn_stores_its_prompt_chunks_beyond_the_stored_ones(
    model_dir, role, options, question
):
    """Found by audit: with no lookup the scheduler took vLLM's local hit as stored ("whoever
    computed them saved them"), but that hit holds turn 1's generated tokens, never stored without
    save_generated: turn 2 saved from the end of the local hit, hanging from a parent the store
    lacked, so store.put refused every chunk of turn 2 (a producer never stored a later turn).
    Saves now start at the last store-confirmed chunk and the worker skips what its store holds."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store(),
                                       "sync_load_wait_s": 5.0, **options})
    cfg.kv_transfer_config.kv_role = role
    eng = Engine(cfg, make_kv_cache_config())
    w = eng.worker._worker
    p2, r2 = two_turns(eng, question)
    n = len(p2) // CHUNK  # turn 2's whole prompt chunks
    assert held_chunks(eng, r2, n) == [n]
    # Turn 1 stored its 2 prompt chunks, turn 2 the rest once: nothing refused, nothing re-stored.
    assert w.stats["saved_chunks"] == n and w.stats["orphaned_chunks"] == 0
    assert w.store.stats()["tiers"]["mem"]["puts"] == n
    if role == "kv_both":  # vLLM's own copy gone: turn 3 loads all of turn 2's prompt chunks
        assert eng.sched.reset_prefix_cache()
        eng.clear_kv()
        p3 = p2 + prompt(40, seed=11)
        eng.add("turn3", p3, max_tokens=2)
        eng.step()  # lookup
        eng.step()  # load + forward
        assert eng.connector._scheduler.stats["hit_tokens"] == n * CHUNK
        assert_blocks(eng, "turn3", p3, n * CHUNK // BLOCK)
        eng.run_until_idle()
    eng.connector.check_integrity()
    eng.worker.check_integrity()


def test_a_local_hit_over_skipped_sliding_window_blocks_stores_the_rest(model_dir):
    """The local hit of a sliding-window group holds null blocks before its window: a save from
    chunk 0 sends them as -1 pages; the worker skips those chunks (its store holds them) and stores
    the later chunks of both groups."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()})
    cfg.kv_transfer_config.kv_role = "kv_producer"
    eng = Engine(cfg, make_kv_cache_config(sliding_window=32))
    w = eng.worker._worker
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    assert w.stats["saved_chunks"] == 2
    r2 = eng.add("r2", toks[:64] + prompt(100, seed=3))  # local hit: 64 tokens
    eng.run_until_idle()
    assert held_chunks(eng, r2, 5) == [5, 5]
    assert w.stats["saved_chunks"] == 2 + 3 and w.stats["orphaned_chunks"] == 0
    eng.worker.check_integrity()


def test_an_exact_multiple_prompt_stores_its_last_chunk_once(model_dir):
    """Found by audit: lookups cover the chunks before the last prompt token, saves every whole
    prompt chunk, so each repeat of a 64-token prompt re-gathered and re-put its last chunk and
    counted it as saved. The worker now skips the chunks its store holds before gathering."""
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store(),
                                              "sync_load_wait_s": 5.0}), make_kv_cache_config())
    w = eng.worker._worker
    toks = prompt(64)
    for i in range(4):
        eng.add(f"r{i}", toks, max_tokens=1)
        eng.run_until_idle()
        assert eng.sched.reset_prefix_cache()
        eng.clear_kv()
    assert w.stats["saved_chunks"] == 2
    assert w.store.stats()["tiers"]["mem"]["puts"] == 2
    assert eng.connector._scheduler.stats["hit_tokens"] == 3 * CHUNK


def test_a_save_whose_parent_was_evicted_is_counted_not_gathered(model_dir, caplog):
    """The chunk a save hangs from left the store since it was stored (evicted): store.put would
    refuse the chain, so the worker drops the save before copying anything and counts it."""
    cfg = make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()})
    cfg.scheduler_config.max_num_batched_tokens = 40
    cfg.scheduler_config.enable_chunked_prefill = True
    eng = Engine(cfg, make_kv_cache_config())
    w = eng.worker._worker
    toks = prompt(130)
    r1 = eng.add("r1", toks, max_tokens=1)
    eng.step()  # lookup
    eng.step()  # 40 tokens: chunk 0 stored
    assert w.stats["saved_chunks"] == 1
    keys = chunk_keys_from_block_hashes(r1.block_hashes, BLOCK, CHUNK, 1)
    assert w.store.delete(w.present[0].namespace, keys) == 1
    with caplog.at_level("INFO", logger="radixkv.adapters.vllm_worker"):
        eng.run_until_idle()
    assert w.stats["saved_chunks"] == 1
    assert w.stats["orphaned_chunks"] == 3  # chunks 1, 2 and 3, one save per step
    assert "does not hold the chunk before them" in caplog.text
    eng.worker.check_integrity()


def test_a_local_hit_shrunk_during_the_lookup_asks_again(model_dir):
    """Found by audit: when vLLM evicted cached blocks between the lookup (sent from a 2-chunk
    local hit) and its answer, the connector answered no hit and the request recomputed all 5
    chunks the store held. It now looks up again from the smaller local hit."""
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store(),
                                              "sync_load_wait_s": 5.0}), make_kv_cache_config())
    toks = prompt(161)
    eng.add("r1", toks, max_tokens=1)
    eng.run_until_idle()  # stores chunks 0..4
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    eng.add("warm", toks[:65], max_tokens=1, read_cache=False)
    eng.run_until_idle()  # vLLM's local cache: 64 tokens
    toks2 = toks[:160] + prompt(40, seed=3)
    eng.add("r2", toks2, max_tokens=2)
    eng.step()  # lookup from chunk 2
    assert eng.log[-1].worker_meta.lookups["r2"].hit_chunks == 5
    assert eng.sched.reset_prefix_cache()  # the local blocks are evicted meanwhile
    eng.clear_kv()
    eng.step()  # the local hit is 0 now: a new lookup from chunk 0
    assert eng.log[-1].scheduled == {}
    eng.step()
    assert eng.log[-1].scheduled == {"r2": 40}
    assert eng.connector._scheduler.stats["hit_tokens"] == 160
    assert eng.connector._scheduler.stats["lookups"] == 3  # r1, r2, r2 again
    assert_blocks(eng, "r2", toks2, 160 // BLOCK)
    eng.run_until_idle()
    eng.connector.check_integrity()
    eng.worker.check_integrity()


def test_lookup_metrics_count_only_chunks_beyond_the_local_hit(model_dir):
    """Found by audit: a lookup sent from a 10-chunk local hit whose one new chunk missed counted
    10 hits and 1 miss, though radixkv served nothing. Like vLLM's own connector hit stats, only
    the chunks beyond the local hit count."""
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": mem_store()}),
                 make_kv_cache_config())
    w = eng.worker._worker
    base = prompt(321)
    eng.add("r1", base, max_tokens=1)
    eng.run_until_idle()
    before = w.store.metrics.snapshot()
    eng.add("r2", base + prompt(40, seed=4), max_tokens=1)
    eng.run_until_idle()
    after = w.store.metrics.snapshot()
    assert eng.connector._scheduler.stats["hit_tokens"] == 0
    assert after["lookup_hit_chunks"] - before["lookup_hit_chunks"] == 0
    assert after["lookup_miss_chunks"] - before["lookup_miss_chunks"] == 1
    # A hit beyond the local one counts: r3 finds r2's chunk 10 (vLLM's copy gone, 11 chunks).
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    eng.add("r3", base + prompt(40, seed=4) + prompt(5, seed=6), max_tokens=1)
    eng.run_until_idle()
    final = w.store.metrics.snapshot()
    assert final["lookup_hit_chunks"] - after["lookup_hit_chunks"] == 11
    assert final["lookup_miss_chunks"] - after["lookup_miss_chunks"] == 0


@pytest.mark.parametrize(("tier", "source"), [("mem", CacheHitSource.HOST),
                                              ("file", CacheHitSource.DISK)])
def test_vllm_hit_metrics_name_the_tier_that_served_the_hit(model_dir, tmp_path, tier, source):
    """Found by audit: every hit was reported to vLLM's per-source metrics as ``host``, also one
    read from a disk tier. The workers now report the slowest tier they staged the chunks from."""
    store = mem_store() if tier == "mem" else file_store(tmp_path / "kv")
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": store,
                                              "sync_load_wait_s": 5.0}), make_kv_cache_config())
    toks = prompt(70)
    eng.add("r1", toks)
    eng.run_until_idle()
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    conn, recorded = eng.sched.connector, []
    orig = conn.get_external_cache_hit_sources
    conn.get_external_cache_hit_sources = lambda req, n: recorded.append(orig(req, n)) or recorded[-1]
    eng.add("r2", toks[:64] + prompt(10, seed=3))
    eng.run_until_idle()
    assert recorded == [{source: 64}]


def test_worker_hit_sources_aggregate_to_the_slowest():
    """A hit is read from every worker's tiers: vLLM is told the slowest any of them used."""
    a = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 3, True, "host")})
    b = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 2, True, "disk")})
    c = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 2, True, "")})
    assert a.aggregate(b).lookups["r"] == LookupReport(1, 2, True, "disk")
    assert b.aggregate(a).lookups["r"] == LookupReport(1, 2, True, "disk")
    assert a.aggregate(c).lookups["r"].source == "host"


def test_the_source_of_a_hit_cut_short_is_the_tiers_it_was_read_from(model_dir, tmp_path):
    """Found by an audit: the source was computed over every staged chunk, then kept for a hit a failed
    read cut short. Chunks 0-1 in memory, 2-3 only on disk, chunk 2's file corrupt: vLLM loads 64
    tokens, all read from memory, and was told they came from disk."""
    store = {"tiers": [{"url": "mem://", "capacity_bytes": 1 << 24},
                       {"url": f"file://{tmp_path / 'kv'}", "capacity_bytes": 1 << 26}],
             "write_policy": "write_through"}
    eng = Engine(make_vllm_config(model_dir, {"chunk_tokens": CHUNK, "store": store, "sync_load_wait_s": 5.0}),
                 make_kv_cache_config())
    w = eng.worker._worker
    toks = prompt(140)  # 4 whole chunks stored
    eng.add("r1", toks)
    eng.run_until_idle()
    s, grp = w.store, w.present[0]
    assert s.flush(10)
    assert eng.sched.reset_prefix_cache()
    eng.clear_kv()
    r2 = eng.add("r2", toks[:128] + prompt(10, seed=3))
    nsd = grp.namespace.digest
    keys = chunk_keys_from_block_hashes(r2.block_hashes, BLOCK, CHUNK, 4)
    with s.lock:  # chunks 2-3 leave memory (leaf-first eviction's order); the disk keeps them
        s._stack.clear_locked([s.tree.lookup(nsd, k) for k in keys[2:]], 0)
    s.tiers[0].delete_many(nsd, keys[2:])
    assert [s.tree.node_tier_mask(s.tree.lookup(nsd, k)) for k in keys] == [3, 3, 2, 2]
    path = s.tiers[1]._layout.path(nsd, keys[2])
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0xFF]))
    conn, recorded = eng.sched.connector, []
    orig = conn.get_external_cache_hit_sources
    conn.get_external_cache_hit_sources = lambda req, n: recorded.append(orig(req, n)) or recorded[-1]
    eng.run_until_idle()
    assert recorded == [{CacheHitSource.HOST: 2 * CHUNK}]
    eng.close()


def test_merged_reports_name_the_source_of_the_hit_both_workers_hold():
    """Across TP/PP workers the hit is the shorter of the two; the source must be that of the chunks
    within it (the slower of the two workers' sources could come from chunks past it)."""
    a = source_reach(["host", "host", "disk"], 0)  # worker a: chunk 2 from disk
    b = source_reach(["host", "host"], 0)  # worker b: holds 2 chunks, from memory
    assert a == (("host", 2), ("disk", 3)) and reach_source(a, 3) == "disk" and reach_source(a, 2) == "host"
    ra = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 3, True, reach_source(a, 3), a)})
    rb = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 2, True, reach_source(b, 2), b)})
    for merged in (ra.aggregate(rb), rb.aggregate(ra)):
        assert merged.lookups["r"].hit_chunks == 2 and merged.lookups["r"].source == "host"
    # a staged run after a local hit: reaches count from chunk 0
    c = source_reach(["disk", "host"], 5)
    assert c == (("host", 5), ("disk", 7)) and reach_source(c, 6) == "disk"
    assert merge_reach(a, ()) == a and merge_reach(a, c) == (("host", 2), ("disk", 3))


def test_merging_reports_is_independent_of_order_also_with_an_unknown_reach():
    """Found by the review: a worker whose chunk sources were unknown (no reach) made the merged
    source depend on the grouping of the merges."""
    import itertools

    ra, rc = source_reach(["host", "disk"], 0), source_reach(["host"], 0)
    reports = {
        "a": LookupReport(1, 2, True, reach_source(ra, 2), ra),  # chunk 1 from disk
        "b": LookupReport(1, 1, True, "", ()),  # sources unknown
        "c": LookupReport(1, 1, True, reach_source(rc, 1), rc),
    }
    metas = {k: RadixKVWorkerMeta(lookups={"r": r}) for k, r in reports.items()}
    results = set()
    for order in itertools.permutations(metas):
        left = metas[order[0]]
        for k in order[1:]:
            left = left.aggregate(metas[k])
        right = metas[order[-1]]
        for k in reversed(order[:-1]):
            right = metas[k].aggregate(right)
        results.add((left.lookups["r"].hit_chunks, left.lookups["r"].source))
        results.add((right.lookups["r"].hit_chunks, right.lookups["r"].source))
    assert results == {(1, "host")}  # the shared hit is chunk 0, read from memory everywhere known
    # a source without a reach is kept as it is, whatever the order
    d = RadixKVWorkerMeta(lookups={"r": LookupReport(1, 2, True, "disk", ())})
    for m in (metas["a"].aggregate(d).aggregate(metas["c"]), d.aggregate(metas["c"].aggregate(metas["a"]))):
        assert (m.lookups["r"].hit_chunks, m.lookups["r"].source) == (1, "disk")
