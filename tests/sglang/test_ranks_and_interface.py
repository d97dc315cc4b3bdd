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


@pytest.mark.parametrize("tiers", ["mem-first", "private-disk-first"])
def test_mla_tp_with_write_back_under_a_private_first_tier_fails_the_attach(tmp_path, rank, tiers):
    # Before: the attach succeeded; the writer's pages stayed in its process-local first tier
    # (write_back copies down only on eviction), the non-writer's batch_exists answered 0 for them and
    # SGLang's MIN over the ranks made every hot prefix miss.
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=256)
    first = mem_tier() if tiers == "mem-first" else disk_tier(tmp_path / "own")
    shared = disk_tier(tmp_path / "s", shared=True)
    for tp_rank in (0, 1):  # the writer refuses too: every rank gets the same config
        rank(tp_rank, 2)
        with pytest.raises(ValueError, match=r"write_policy='write_back'.*write_through") as e:
            ControllerHarness(spec, extra_config=extra_config([first, shared], write_policy="write_back"))
        assert isinstance(e.value.__cause__, ConfigError)
    # write_through over the same tiers, and TP 1 with write_back, are valid.
    rank(1, 2)
    ControllerHarness(spec, extra_config=extra_config([first, shared])).close()
    rank(0, 1)
    ControllerHarness(spec, extra_config=extra_config([first, shared], write_policy="write_back")).close()


def test_mla_tp_with_write_back_to_a_shared_first_tier_hits_on_every_rank(tmp_path, rank):
    # write_back with the shared tier first: the writer's pages land where the non-writer probes.
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([disk_tier(tmp_path / "s", shared=True), disk_tier(tmp_path / "cold", shared=True)],
                       write_policy="write_back")
    rank(1, 2)
    r1 = ControllerHarness(spec, extra_config=cfg)
    rank(0, 2)
    r0 = ControllerHarness(spec, extra_config=cfg)
    try:
        toks = tokens(32, seed=110)
        src = r0.alloc(32)
        r0.fill_random(src, seed=111)
        want = r0.page_bytes_at(src)
        assert r0.backup(toks, src) == 32
        for h in (r0, r1):
            res = h.prefetch(toks)
            assert res.hit_tokens == 32 and res.loaded_tokens == 32
            assert h.page_bytes_at(res.host_indices) == want
    finally:
        r0.close()
        r1.close()


@pytest.fixture
def dp_attention(monkeypatch):
    """SGLang with DP attention: switch a harness to attention-TP rank ``attn_tp`` of ``attn_tp_size``
    in DP group ``dp`` of ``dp_size`` (its HiCacheController then passes those, as a server's does)."""
    import contextlib

    import sglang.srt.layers.dp_attention as dp_attention
    import sglang.srt.managers.cache_controller as cache_controller
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setattr(cache_controller, "is_dp_attention_enabled", lambda: True)
    monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: True)

    @contextlib.contextmanager
    def use(attn_tp: int, attn_tp_size: int, dp: int, dp_size: int):
        with get_parallel().override(tp_rank=dp * attn_tp_size + attn_tp, tp_size=attn_tp_size * dp_size,
                                     attn_tp_rank=attn_tp, attn_tp_size=attn_tp_size, attn_dp_rank=dp,
                                     attn_dp_size=dp_size):
            yield

    return use


def test_dp_attention_groups_share_mha_pages(tmp_path, dp_attention):
    # Before: the MHA namespace carried the attention-DP rank (.dp1), so over a shared tier a DP group
    # never hit the pages another DP group stored for the same attention-TP shard (SGLang's own file
    # backend shares them), while plain-DP replicas did.
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "own"), disk_tier(tmp_path / "s", shared=True)])
    toks = tokens(32, seed=120)

    def open_rank(attn_tp: int, dp: int) -> ControllerHarness:
        with dp_attention(attn_tp, 2, dp, 2):  # 4 GPUs: attention TP 2 x DP 2
            return ControllerHarness(spec, extra_config=cfg)

    w = open_rank(0, 0)
    try:
        src = w.alloc(32)
        w.fill_random(src, seed=121)
        want = w.page_bytes_at(src)
        assert w.backup(toks, src) == 32
        unwrap(w.backend).store.flush(timeout_s=30)
    finally:
        w.close()
    r = open_rank(0, 1)  # the same attention-TP shard in the other DP group
    other = open_rank(1, 1)  # another attention-TP shard: other heads, never the same pages
    try:
        c = r.backend.storage_config
        assert (c.tp_rank, c.tp_size, c.dp_rank) == (0, 2, 1)  # what SGLang passes under DP attention
        res = r.prefetch(toks)
        assert res.hit_tokens == 32 and res.loaded_tokens == 32
        assert r.page_bytes_at(res.host_indices) == want
        assert other.prefetch(toks).hit_tokens == 0
        # The DP rank still names the rank's private directory.
        roots = {str(t.config.root) for t in unwrap(r.backend).store.tiers if type(t).__name__ == "DiskTier"}
        assert str(tmp_path / "own" / "tp0of2.pp0of1.cp0of1.dp1") in roots
    finally:
        r.close()
        other.close()
    own = [f"tp{t}of2.pp0of1.cp0of1.dp{d}" for t, d in ((0, 0), (0, 1), (1, 1))]
    assert sorted(os.listdir(tmp_path / "own")) == own


def test_rank_directories_of_another_layout_are_reported_at_attach(tmp_path, rank, caplog):
    # Before: after a restart with another TP size the old rank directories kept their pages forever,
    # never read, evicted, removed or mentioned.
    import logging

    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, host_tokens=256)
    root = tmp_path / "l3"
    cfg = extra_config([disk_tier(root)])
    toks = tokens(32, seed=130)
    h = ControllerHarness(spec, extra_config=cfg)  # TP 1
    src = h.alloc(32)
    h.fill_random(src, seed=131)
    assert h.backup(toks, src) == 32
    h.close()
    (root / "notes").mkdir()  # not a rank directory: never named
    for tp_rank in (1, 0):  # restart with TP 2: rank 1's directory is this server's own, not reported
        rank(tp_rank, 2)
        with caplog.at_level(logging.WARNING, logger="radixkv"):
            caplog.clear()
            ControllerHarness(spec, extra_config=cfg).close()
        reports = [rec.getMessage() for rec in caplog.records if "belong to no rank" in rec.getMessage()]
        if tp_rank == 1:
            (msg,) = reports
            assert f"rm -r {root / 'tp0of1.pp0of1.cp0of1.dp0'}" in msg and "tp<r>of2" in msg
            assert "tp1of2" not in msg and "notes" not in msg
        else:
            assert reports == []  # once per process for the same directories
    # The old directory is left as it was (only the operator removes it).
    assert sorted(os.listdir(root)) == ["notes", "tp0of1.pp0of1.cp0of1.dp0", "tp0of2.pp0of1.cp0of1.dp0",
                                        "tp1of2.pp0of1.cp0of1.dp0"]
