"""Chains SGLang backs up child first (its write_back order: device eviction is leaf-first), so a
later page is already in radixkv's tree at the namespace root when its parents arrive. Found by an
end-to-end fuzz: such backups failed whole (every page False), and pages on disk past a split were
never adopted after a restart."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("prefix_keys", [False, True])
def test_a_backup_reaching_a_split_chain_stores_every_page(prefix_keys):
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(16, seed=1)  # pages a b c d
        keys = h.page_keys(toks)
        src = h.alloc(16)
        h.fill_random(src, seed=2)
        want = h.page_bytes_at(src)
        assert h.backup(toks[8:], src[8:], hashes=keys[2:], prefix_keys=keys[:2] if prefix_keys else None) == 8
        assert h.backup(toks, src, prefix_keys=[] if prefix_keys else None) == 16
        r = h.prefetch(toks)
        assert r.hit_tokens == 16 and h.page_bytes_at(r.host_indices) == want
        assert be.counters["failed_calls"] == 0
        be.store.check_integrity()
    finally:
        h.close()


def test_a_continuation_of_a_split_chain_under_its_parent_is_stored():
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(20, seed=1)  # pages a b c d e
        keys = h.page_keys(toks)
        src = h.alloc(20)
        h.fill_random(src, seed=2)
        want = h.page_bytes_at(src)
        assert h.backup(toks[8:16], src[8:16], hashes=keys[2:4], prefix_keys=keys[:2]) == 8
        assert h.backup(toks[:8], src[:8], hashes=keys[:2], prefix_keys=[]) == 8
        assert h.backup(toks[8:], src[8:], hashes=keys[2:], prefix_keys=keys[:2]) == 12
        r = h.prefetch(toks)
        assert r.hit_tokens == 20 and h.page_bytes_at(r.host_indices) == want
        assert be.counters["failed_calls"] == 0
    finally:
        h.close()


def test_a_child_node_backed_up_before_its_parent_node_is_one_chain_once_the_parent_arrives():
    """write_back's order: the child node's pages first (prefix_keys name the parent page, absent:
    they hang at the namespace root, awaiting it), then the parent node's pages alone (they name
    no child page). The parent's arrival grafts the child run: one chain, so after a read of the
    whole prefix (the child run touched last) eviction still takes the child's leaf first, never
    the parent's last page (which would leave the child run's bytes unreachable by prefix)."""
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(16, seed=1)  # pages a b | c d: the parent node, then the child node
        keys = h.page_keys(toks)
        src = h.alloc(16)
        h.fill_random(src, seed=2)
        want = h.page_bytes_at(src)
        assert h.backup(toks[8:], src[8:], hashes=keys[2:], prefix_keys=keys[:2]) == 8
        assert h.backup(toks[:8], src[:8], hashes=keys[:2], prefix_keys=[]) == 8
        r = h.prefetch(toks)
        assert r.hit_tokens == 16 and h.page_bytes_at(r.host_indices) == want
        s = be.store
        with s.lock:
            tree = s.tree
            (nsd,) = tree.namespaces()
            a, b, c, d = (tree.lookup(nsd, k) for k in keys)
            assert tree.node_parent(c) == b and tree.node_parent(a) is None
            assert tree.match(nsd, keys, touch=False).hit_chunks == 4
            assert tree.evict_candidates(tree.tiers[0], 4, drop=True) == [d]
        s.check_integrity()
        assert be.counters["failed_calls"] == 0
    finally:
        h.close()


def test_pages_past_a_split_are_adopted_after_a_restart(tmp_path):
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3")])
    toks = tokens(16, seed=1)
    a = ControllerHarness(spec, extra_config=cfg)
    try:
        keys = a.page_keys(toks)
        src = a.alloc(16)
        a.fill_random(src, seed=2)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 16
    finally:
        a.close()
    b = ControllerHarness(spec, extra_config=cfg)
    try:
        r = b.prefetch(toks[8:12], last_hash=keys[1])  # only page c: adopted at the root
        assert r.hit_tokens == 4
        b.host_pool.free(r.host_indices)
        r = b.prefetch(toks)
        assert r.hit_tokens == 16 and b.page_bytes_at(r.host_indices) == want
    finally:
        b.close()


def _backend(**config_kw):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from radixkv.adapters.sglang import RadixKVStore

    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
                model_name="m", extra_config=extra_config([mem_tier("64MiB")]))
    base.update(config_kw)
    return RadixKVStore(HiCacheStorageConfig(**base), {})


def test_a_backup_whose_parent_is_gone_and_reaches_a_split_chain_is_stored():
    # Found by a v2 review: the parent-gone fallback put was outside the split handling.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from radixkv.adapters.sglang_cpu import build_pools

    kv = build_pools(PoolSpec(page_size=4, host_tokens=256)).host_pool
    b = _backend()
    try:
        b.register_mem_pool_host(kv)
        k = get_storage_hash_str(tokens(16, seed=3), None, page_size=4)
        idx = kv.alloc(16)
        assert b.batch_set_v1(k[3:4], idx[12:16], HiCacheStorageExtraInfo(prefix_keys=k[:3])) == [True]
        got = b.batch_set_v1(k[1:4], idx[4:16], HiCacheStorageExtraInfo(prefix_keys=k[:1]))  # k0 absent
        assert got == [True, True, True]
        assert b.counters["failed_calls"] == 0
    finally:
        b.close()


def test_sidecar_presence_checks_are_not_counted_as_lookups():
    # Found by a v2 review: a full hybrid hit counted 7 misses of 24 chunks (0.71 hit ratio).
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from radixkv.adapters.sglang_cpu import build_pools

    kv = build_pools(PoolSpec(page_size=4, host_tokens=256)).host_pool
    mam = build_pools(PoolSpec(layout="layer_first", page_size=4, layers=1, heads=1, host_tokens=64)).host_pool
    b = _backend()
    try:
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(mam, PoolName.MAMBA)
        k = get_storage_hash_str(tokens(32, seed=4), None, page_size=4)
        idx, midx = kv.alloc(32), mam.alloc(4)
        assert all(b.batch_set_v1(k, idx))
        trailing = PoolTransfer(name=PoolName.MAMBA, host_indices=midx, keys=k[-1:],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert all(all(v) for v in b.batch_set_v2([trailing]).values())
        before = b.store.metrics.snapshot()
        r = b.batch_exists_v2(k, [PoolTransfer(name=PoolName.MAMBA, keys=k[-1:],
                                               hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        after = b.store.metrics.snapshot()
        assert r.kv_hit_pages == 8
        assert after.get("lookup_miss_chunks", 0) == before.get("lookup_miss_chunks", 0)
    finally:
        b.close()


def test_metrics_ports_differ_across_dp_ranks():
    from radixkv.adapters.sglang import _host_rank

    class C:
        tp_rank, tp_size, pp_rank, pp_size = 1, 2, 0, 1

    a, b = C(), C()
    a.dp_rank, b.dp_rank = 0, 1
    assert _host_rank(a) != _host_rank(b) and _host_rank(b) == 1 + 2 * (0 + 1 * 1)


def test_metrics_ports_differ_across_attention_cp_ranks(monkeypatch):
    """With DP attention SGLang passes the attention group's TP rank, which the attention-CP ranks
    of one DP rank share (its rank layout is DP, CP, TP): they all got one metrics port, and every
    scheduler but one ran without its HTTP endpoint (a warning in its log)."""
    import sglang.srt.layers.dp_attention as dp_attention
    from types import SimpleNamespace

    from radixkv.adapters.sglang import _host_rank

    def ranks(dp_attn: bool, tp_size: int, cp_size: int, dp_size: int, pp_size: int = 2) -> list[int]:
        monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: dp_attn)
        out = []
        for dp in range(dp_size):
            for cp in range(cp_size):
                for attn_tp in range(tp_size // cp_size // dp_size):
                    for pp in range(pp_size):
                        g = (dp * cp_size + cp) * (tp_size // cp_size // dp_size) + attn_tp  # SGLang's TP rank
                        c = SimpleNamespace(pp_rank=pp, pp_size=pp_size, attn_cp_rank=cp, attn_cp_size=cp_size)
                        if dp_attn:  # what HiCacheController passes then: the attention group's TP rank
                            c.tp_rank, c.tp_size, c.dp_rank = attn_tp, tp_size // cp_size // dp_size, dp
                        else:
                            c.tp_rank, c.tp_size, c.dp_rank = g, tp_size, 0
                        out.append(_host_rank(c))
        return sorted(out)

    # 8 GPUs, attention DP 2 x CP 2 x attention TP 2, two PP stages: 16 schedulers, 16 ports
    assert ranks(True, tp_size=8, cp_size=2, dp_size=2) == list(range(16))
    assert ranks(True, tp_size=8, cp_size=4, dp_size=2) == list(range(16))  # attention TP 1
    # without DP attention the TP rank tells the CP ranks apart: the ports stay base .. base + 15
    assert ranks(False, tp_size=8, cp_size=4, dp_size=1) == list(range(16))


def test_a_split_chain_is_one_chain_once_its_parent_arrives():
    """The child run backed up first hangs at the namespace root; the backup that reaches it grafts it
    under its parent, so eviction is leaf-first across the old split: the parent run is no victim
    while the child run stays (before: two branches, and the parent run's last page was a leaf
    that could go first, leaving the child's bytes unreachable by any prefix)."""
    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(16, seed=1)  # pages a b c d
        keys = h.page_keys(toks)
        src = h.alloc(16)
        h.fill_random(src, seed=2)
        assert h.backup(toks[8:], src[8:], hashes=keys[2:], prefix_keys=keys[:2]) == 8  # parent absent
        assert h.backup(toks, src, prefix_keys=[]) == 16
        r = h.prefetch(toks)  # reads (and touches) a b, then c d
        assert r.hit_tokens == 16
        h.host_pool.free(r.host_indices)
        s = be.store
        with s.lock:
            tree, nsd = s.tree, next(iter(s.tree.namespaces()))
            ids = [tree.lookup(nsd, k) for k in keys]
            assert [tree.node_parent(n) for n in ids] == [None] + ids[:3]  # one chain
            victims = tree.evict_candidates(tree.tiers[0], 4, drop=True)
        assert [tree.node_key(n) for n in victims[:1]] == [keys[3]]  # the child run's leaf, never b
        assert ids[1] not in victims
        s.check_integrity()
    finally:
        h.close()
