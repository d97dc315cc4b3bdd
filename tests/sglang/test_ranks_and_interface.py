"""Per-rank state of a multi-rank server (TP ranks on one disk root, MLA non-writer ranks) and
``interface_v1`` read exactly as SGLang reads it. Regression tests of a review's findings: each
fails on the code before its fix (noted per test)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402
from radixkv.errors import ConfigError  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


def _disk_root(backend) -> str:
    """The directory the backend's (only) disk tier opened."""
    (disk,) = [t for t in unwrap(backend).store.tiers if type(t).__name__ == "DiskTier"]
    return str(disk.config.root)


def test_tp_ranks_own_a_directory_each_and_keep_their_pages_across_restarts(tmp_path, rank):
    # Before: both ranks opened <root> itself as if each owned it; a restarting rank's scan indexed
    # the other's files and evicted the oldest to fit its capacity, so rank 0 lost its prefix.
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    root = tmp_path / "l3"
    # Room for 10 pages (frame overhead included): one rank's 8 fit, both ranks' 16 do not.
    cfg = extra_config([disk_tier(root, capacity=10 * (spec.page_bytes + 200))])
    toks = tokens(32, seed=51)
    want = {}
    for r in (0, 1):
        rank(r, 2)
        h = ControllerHarness(spec, extra_config=cfg)
        try:
            src = h.alloc(32)
            h.fill_random(src, seed=60 + r)  # each TP rank holds its own heads: other bytes
            want[r] = h.page_bytes_at(src)
            assert h.backup(toks, src) == 32
        finally:
            h.close()

    roots = {}
    for r in (1, 0):  # rank 1 restarts first: before the fix its scan evicted rank 0's files
        rank(r, 2)
        h = ControllerHarness(spec, extra_config=cfg)
        try:
            res = h.prefetch(toks)
            assert res.hit_tokens == 32 and res.loaded_tokens == 32, f"rank {r}"
            assert h.page_bytes_at(res.host_indices) == want[r]
            unwrap(h.backend).check_integrity()
            roots[r] = _disk_root(h.backend)
        finally:
            h.close()
    assert roots == {r: str(root / f"tp{r}of2.pp0of1.cp0of1.dp0") for r in (0, 1)}
    assert sorted(os.listdir(root)) == ["tp0of2.pp0of1.cp0of1.dp0", "tp1of2.pp0of1.cp0of1.dp0"]


def test_a_shared_disk_tier_stays_at_its_root(tmp_path, rank):
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    rank(1, 2)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path / "l3", shared=True)]))
    try:
        assert _disk_root(h.backend) == str(tmp_path / "l3")
    finally:
        h.close()


def _mla_writer_and_non_writer(tmp_path, rank):
    """TP rank 0 (the storage writer) and rank 1 of an MLA server over one shared disk tier with
    room for 12 pages per rank."""
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=512)
    cfg = extra_config([disk_tier(tmp_path / "l3", capacity=12 * (spec.page_bytes + 200), shared=True)])
    rank(1, 2)
    r1 = ControllerHarness(spec, extra_config=cfg)
    rank(0, 2)
    return ControllerHarness(spec, extra_config=cfg), r1


def test_mla_non_writer_keeps_adopting_after_its_books_fill(tmp_path, rank):
    # Before: the non-writer only adopts what the writer stores in the shared tier, and adoption
    # never evicted: once its books were full it adopted nothing more (its entries going stale as
    # the writer evicted them), batch_exists answered 0 there, and SGLang's MIN over the TP ranks
    # turned every later prefetch into a miss.
    r0, r1 = _mla_writer_and_non_writer(tmp_path, rank)
    try:
        assert unwrap(r0.backend).is_writer and not unwrap(r1.backend).is_writer
        for i in range(5):  # 5 x 8 pages through 12 pages of room
            toks = tokens(32, seed=70 + i)
            src = r0.alloc(32)
            r0.fill_random(src, seed=80 + i)
            want = r0.page_bytes_at(src)
            assert r0.backup(toks, src) == 32
            assert unwrap(r0.backend).store.flush(timeout_s=30)
            r0.host_pool.free(src)
            for h in (r0, r1):
                res = h.prefetch(toks)
                assert res.hit_tokens == 32 and res.loaded_tokens == 32, f"sequence {i}"
                assert h.page_bytes_at(res.host_indices) == want
                h.host_pool.free(res.host_indices)
            unwrap(r1.backend).check_integrity()
        # The non-writer's books stay bounded: it made room by evicting its own oldest entries.
        assert unwrap(r1.backend).store.stats()["tiers"]["disk"]["tree_chunks"] < 5 * 8
    finally:
        r0.close()
        r1.close()


def test_mla_non_writer_making_room_leaves_the_writers_pages(tmp_path, rank):
    # Before: a non-writer making room in its own books evicted through the normal path, which
    # deletes the bytes: it removed pages the writer still held (here C, which the writer keeps
    # while the non-writer's order puts it first), so the writer's next prefetch of C missed.
    r0, r1 = _mla_writer_and_non_writer(tmp_path, rank)
    seqs = {name: tokens(16, seed=90 + i) for i, name in enumerate("ABCD")}  # 4 pages each
    want = {}

    def read(h, name):
        res = h.prefetch(seqs[name])
        got = h.page_bytes_at(res.host_indices) if res.loaded_tokens else None
        h.host_pool.free(res.host_indices)
        return res.loaded_tokens, got

    def backup(name, seed):
        src = r0.alloc(16)
        r0.fill_random(src, seed=seed)
        want[name] = r0.page_bytes_at(src)
        assert r0.backup(seqs[name], src) == 16
        assert unwrap(r0.backend).store.flush(timeout_s=30)
        r0.host_pool.free(src)

    try:
        for i, name in enumerate("ABC"):
            backup(name, 100 + i)  # the writer's books are full: 12 pages
        for name in "CBA":  # the non-writer's order: C oldest
            assert read(r1, name) == (16, want[name])
        assert read(r0, "A") == (16, want["A"])  # the writer's order: B oldest, then C
        backup("D", 103)  # the writer evicts B
        assert read(r1, "D") == (16, want["D"])  # the non-writer makes room: it forgets C
        # The writer still has C; the non-writer finds it again in the shared tier.
        assert read(r0, "C") == (16, want["C"])
        assert read(r1, "C") == (16, want["C"])
        assert unwrap(r1.backend).store.stats()["store"]["evictions_kept_for_owner"] > 0
        assert read(r0, "B")[0] < 16  # the writer's own eviction did delete (part of) B
        for h in (r0, r1):
            unwrap(h.backend).check_integrity()
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("tiers", ["default", "mem", "local-disk"])
def test_mla_tp_without_a_shared_tier_fails_the_attach(tmp_path, rank, tiers):
    # Before: the attach succeeded; only the writer rank stored pages, the other ranks' batch_exists
    # answered 0 and SGLang's MIN over the ranks made L3 never hit, silently.
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=256)
    cfg = {"default": extra_config([mem_tier()]), "mem": extra_config([mem_tier()]),
           "local-disk": extra_config([mem_tier(), disk_tier(tmp_path / "l3")])}[tiers]
    if tiers == "default":
        del cfg["tiers"]  # radixkv's default: one memory tier
    rank(1, 2)
    with pytest.raises(ValueError, match=r"MLA model with tp_size=2.*Add a shared tier") as e:
        ControllerHarness(spec, extra_config=cfg)
    assert isinstance(e.value.__cause__, ConfigError)  # SGLang's factory wraps it in a ValueError
    # A shared tier (here a shared disk directory) makes the same server valid; so does TP=1.
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path / "s", shared=True)]))
    h.close()
    rank(0, 1)
    h = ControllerHarness(spec, extra_config=cfg)
    h.close()


def test_mla_tp_with_probing_off_fails_the_attach(tmp_path, rank):
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=256)
    rank(0, 2)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3", shared=True)], probe_tiers=False)
    with pytest.raises(ValueError, match="probe_tiers=false") as e:
        ControllerHarness(spec, extra_config=cfg)
    assert isinstance(e.value.__cause__, ConfigError)


@pytest.mark.parametrize("value", ["1", "0", "false", "off"])
def test_interface_v1_string_is_read_as_sglang_reads_it(tmp_path, value):
    # Before: "0"/"false" turned radixkv's interface_v1 off while SGLang (bool(value): any non-empty
    # string is on) used the zero-copy path; batch_exists then looked in the copying path's
    # namespace and every prefetch missed.
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier()], interface_v1=value))
    try:
        assert h.controller.page_get_func == h.controller._page_get_zero_copy  # SGLang's choice
        assert unwrap(h.backend).interface_v1 is True
        toks = tokens(32, seed=90)
        src = h.alloc(32)
        h.fill_random(src, seed=91)
        want = h.page_bytes_at(src)
        assert h.backup(toks, src) == 32
        res = h.prefetch(toks)
        assert res.hit_tokens == 32 and res.loaded_tokens == 32
        assert h.page_bytes_at(res.host_indices) == want
    finally:
        h.close()


def test_plain_dp_replicas_own_a_directory_and_a_metrics_port_each(tmp_path):
    # Before: with --dp-size 2 (no DP attention) HiCacheController passes dp_rank=0 to both replicas,
    # so both opened <root>/tp0of1.pp0of1.cp0of1.dp0 and asked for one metrics port; a restarting
    # replica's scan indexed the other's files and evicted them to fit its capacity.
    import socket

    from sglang.srt.runtime_context import get_parallel

    with socket.socket() as s:  # a base port nothing listens on (the ports are only compared)
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    root = tmp_path / "l3"
    # Room for 10 pages (frame overhead included): one replica's 8 fit, both replicas' 16 do not.
    cfg = extra_config([disk_tier(root, capacity=10 * (spec.page_bytes + 200))], metrics_port=base)
    toks = {r: tokens(32, seed=70 + r) for r in (0, 1)}  # each replica served its own prompts
    want, roots, ports = {}, {}, {}
    for r in (0, 1):
        with get_parallel().override(dp_rank=r):  # as SGLang's scheduler publishes SpawnRanks.dp_rank
            h = ControllerHarness(spec, extra_config=cfg)
            try:
                assert h.backend.storage_config.dp_rank == 0  # SGLang's own config cannot tell them apart
                src = h.alloc(32)
                h.fill_random(src, seed=80 + r)
                want[r] = h.page_bytes_at(src)
                assert h.backup(toks[r], src) == 32
            finally:
                h.close()
    for r in (1, 0):  # replica 1 restarts first: before the fix its scan evicted replica 0's files
        with get_parallel().override(dp_rank=r):
            h = ControllerHarness(spec, extra_config=cfg)
            try:
                res = h.prefetch(toks[r])
                assert res.hit_tokens == 32 and res.loaded_tokens == 32, f"replica {r}"
                assert h.page_bytes_at(res.host_indices) == want[r]
                roots[r] = _disk_root(h.backend)
                ports[r] = unwrap(h.backend).store.config.metrics_port
            finally:
                h.close()
    # no DP controller keeps dp0, so a server without --dp-size keeps its directory
    assert roots == {r: str(root / f"tp0of1.pp0of1.cp0of1.dp{r}") for r in (0, 1)}
    assert ports == {0: base, 1: base + 1}
