"""MLA storage-writer rank, TP shards in the namespace, and SGLang's failure injector."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


def test_mla_only_the_writer_rank_writes_and_every_rank_reads(tmp_path, rank):
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3", shared=True)])
    toks = tokens(32, seed=31)

    rank(1, 2)
    r1 = ControllerHarness(spec, extra_config=cfg)
    rank(0, 2)
    r0 = ControllerHarness(spec, extra_config=cfg)
    try:
        assert unwrap(r0.backend).is_writer and not unwrap(r1.backend).is_writer
        # Same MLA bytes on both ranks (replicated KV).
        src0, src1 = r0.alloc(32), r1.alloc(32)
        r0.fill_random(src0, seed=4)
        r1.fill_random(src1, seed=4)
        want = r0.page_bytes_at(src0)
        assert r1.page_bytes_at(src1) == want
        # The non-writer's backup is skipped by SGLang (backup_skip) and writes nothing.
        assert r1.backup(toks, src1) == 0
        assert unwrap(r1.backend).store.stats()["tree"]["chunks"] == 0
        # A direct call on the non-writer is accepted without writing (the writer stores it).
        keys = r1.page_keys(toks)
        assert unwrap(r1.backend).batch_set_v1(keys, src1) == [True] * 8
        assert unwrap(r1.backend).store.stats()["tree"]["chunks"] == 0
        assert unwrap(r1.backend).counters["skipped_non_writer_pages"] == 8
        # The writer writes; the non-writer reads the writer's pages through the shared tier.
        assert r0.backup(toks, src0) == 32
        assert unwrap(r0.backend).store.flush(timeout_s=30)
        res = r1.prefetch(toks)
        assert res.hit_tokens == 32 and res.loaded_tokens == 32
        assert r1.page_bytes_at(res.host_indices) == want
        # MLA namespaces do not depend on the TP rank.
        assert unwrap(r0.backend)._bindings["kv"].ns == unwrap(r1.backend)._bindings["kv"].ns
    finally:
        r0.close()
        r1.close()


def test_mha_tp_ranks_never_read_each_others_pages(tmp_path, rank):
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3", shared=True)])
    toks = tokens(16, seed=41)
    rank(0, 2)
    r0 = ControllerHarness(spec, extra_config=cfg)
    rank(1, 2)
    r1 = ControllerHarness(spec, extra_config=cfg)
    try:
        src = r0.alloc(16)
        r0.fill_random(src, seed=1)
        assert r0.backup(toks, src) == 16
        assert unwrap(r0.backend).store.flush(timeout_s=30)
        assert r0.prefetch(toks).hit_tokens == 16
        assert r1.prefetch(toks).hit_tokens == 0  # other heads: another namespace
        assert unwrap(r0.backend)._bindings["kv"].ns.shard.startswith("tp0of2")
        assert unwrap(r1.backend)._bindings["kv"].ns.shard.startswith("tp1of2")
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "copy"])
def test_failure_injector_no_exception_no_wrong_bytes(tmp_path, monkeypatch, interface_v1):
    """SGLang's own HiCacheStorageFailureInjector wraps the backend: calls fail or stall at random.
    Whatever the backend reports as loaded must be byte-identical; nothing may raise."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=1024)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path)], interface_v1))
    try:
        assert type(h.backend).__name__ == "HiCacheStorageFailureInjector"
        prompts = []
        for i in range(12):
            toks = tokens(24, seed=100 + i)
            src = h.alloc(24)
            h.fill_random(src, seed=200 + i)
            prompts.append((toks, h.page_bytes_at(src)))
            done = h.backup(toks, src)
            assert done % 4 == 0 and 0 <= done <= 24
            h.host_pool.free(src)
        loaded_pages = 0
        for toks, want in prompts * 2:
            res = h.prefetch(toks)
            assert 0 <= res.loaded_tokens <= res.hit_tokens <= 24
            if res.host_indices is not None:
                n = res.loaded_tokens // 4
                assert h.page_bytes_at(res.host_indices)[:n] == want[:n]
                loaded_pages += n
                h.host_pool.free(res.host_indices)
        backend = unwrap(h.backend)
        assert backend.counters["failed_calls"] == 0  # injected failures never reach our code
        assert loaded_pages > 0  # the test exercised real hits, not only failures
        backend.check_integrity()
    finally:
        h.close()


@pytest.mark.parametrize("bad", [None, 7, ["not a key"]])
def test_malformed_batch_arguments_never_raise(bad):
    # SGLang's storage threads must never see an exception: a malformed call is a logged failure.
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=64),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        idx = h.alloc(4)
        assert be.batch_set_v1(bad, idx) in ([], [False])
        assert be.batch_get_v1(bad, idx) in ([], [False])
        assert be.batch_exists(bad) == 0
        assert be.batch_set(bad, [idx]) is False
        assert all(x is None for x in be.batch_get(bad))
        assert be.batch_set_v2(bad) == {} and be.batch_get_v2(bad) == {}
        be.check_integrity()
    finally:
        h.close()


def test_float_or_misaligned_host_indices_are_refused():
    # Slots that are not SGLang's page-aligned integer token indices would address the wrong bytes.
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=64),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        idx = h.alloc(8)
        keys = ["ab" * 32, "cd" * 32]
        assert be.batch_set_v1(keys, idx.double()) == [False, False]
        assert be.batch_set_v1(keys, idx + 1) == [False, False]
        assert be.counters["failed_calls"] == 2
        assert be.batch_set_v1(keys, idx) == [True, True]
        be.check_integrity()
    finally:
        h.close()


def test_metrics_off_keeps_no_samples_and_empty_or_clear_report_like_hicachefile():
    # SGLang drains the per-call samples only through get_stats(), which it calls only with storage
    # metrics on: with them off (its default) they once grew by one entry per call, forever.
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=64),
                          extra_config=extra_config([mem_tier()]), storage_metrics=False)
    try:
        be = unwrap(h.backend)
        idx = h.alloc(8)
        keys = ["ab" * 32, "cd" * 32]
        for _ in range(50):
            be.batch_set_v1(keys, idx)
            be.batch_get_v1(keys, idx)
        assert be._pending is None or (not be._pending.backup_pgs and not be._pending.prefetch_pgs)
        assert be.batch_set([], []) is True  # nothing to store, as HiCacheFile answers
        assert be.clear() is True
    finally:
        h.close()


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "copy"])
def test_backup_samples_count_only_pages_written(interface_v1):
    # SGLang's backup histograms count the pages a call transferred, "excluding pages the backend
    # already held" (its metrics collector): a backup of pages radixkv already held (a prefix
    # recomputed after the host evicted it) was a sample of every page, its GB/s the page bytes over
    # the microseconds a lookup took.
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()], interface_v1))
    try:
        be = unwrap(h.backend)
        toks = tokens(6 * 4, seed=81)
        src = h.alloc(24)
        h.fill_random(src, seed=3)
        assert h.backup(toks[:16], src[:16]) == 16
        st = be.get_stats()
        assert sum(st.backup_pgs) == 4 and len(st.backup_bandwidth) == len(st.backup_pgs)
        assert h.backup(toks, src) == 24  # 4 pages held already, 2 new
        st = be.get_stats()
        assert sum(st.backup_pgs) == 2, st.backup_pgs
        assert h.backup(toks, src) == 24  # all held: nothing transferred, no sample
        st = be.get_stats()
        assert (st.backup_pgs, st.backup_bandwidth) == ([], [])
        assert be.store.stats()["store"]["mem.put_chunks"] == 6
    finally:
        h.close()


def test_a_non_writer_borrows_the_new_version_before_any_thread_can_use_it(tmp_path, rank):
    """Found by an audit: after a weight update naming a version, the non-writer rank published the
    new namespaces, then borrowed them. A storage thread using them in between adopted the writer's
    pages into a namespace not yet borrowed, and its evictions deleted them from the shared tier
    (the writer's next prefetch loaded half of what its hit query promised)."""
    import threading
    import time

    from sglang.srt.runtime_context import get_context

    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=512)
    frame = spec.page_bytes + 200
    rank(1, 2)
    r1 = ControllerHarness(spec, extra_config=extra_config([disk_tier(tmp_path / "l3", capacity=8 * frame, shared=True)]))
    rank(0, 2)
    r0 = ControllerHarness(spec, extra_config=extra_config([disk_tier(tmp_path / "l3", capacity=12 * frame, shared=True)]))
    override = get_context().override_server_args()
    override.install()
    try:
        b0, b1 = unwrap(r0.backend), unwrap(r1.backend)
        get_context().override("test.borrow", weight_version="step-1")
        x, y = tokens(24, seed=1), tokens(24, seed=2)  # 6 pages each: the writer holds both
        for toks, seed in ((x, 11), (y, 12)):
            src = r0.alloc(24)
            r0.fill_random(src, seed=seed)
            assert r0.backup(toks, src) == 24
            r0.host_pool.free(src)
        assert b0.store.flush(timeout_s=30)
        borrowing, real_borrow = threading.Event(), b1.store.borrow

        def slow_borrow(ns, *a, **k):  # widens the window between publishing and borrowing
            borrowing.set()
            time.sleep(0.5)
            return real_borrow(ns, *a, **k)

        b1.store.borrow = slow_borrow
        first = threading.Thread(target=lambda: b1.batch_exists(["0" * 64]))  # sees the new version
        first.start()
        assert borrowing.wait(10)
        # another storage thread of the rank, meanwhile: the hit queries of x then y (8 pages of room)
        assert (b1.batch_exists(r1.page_keys(x)), b1.batch_exists(r1.page_keys(y))) == (6, 6)
        first.join(10)
        res = r0.prefetch(x)
        assert res.hit_tokens == 24 and res.loaded_tokens == 24  # loaded 12: 3 pages were deleted
    finally:
        override.restore()
        r0.close()
        r1.close()
