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
