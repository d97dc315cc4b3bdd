"""Hits after a backend restart on a disk tier, and across two backends sharing a Redis tier."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_prefix_hits_after_restart_on_disk_tier(tmp_path, layout):
    spec = PoolSpec(layout=layout, page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3")])
    toks = tokens(40, seed=11)
    a = ControllerHarness(spec, extra_config=cfg)
    try:
        src = a.alloc(40)
        a.fill_random(src, seed=5)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 40
    finally:
        a.close()  # SGLang's detach: stops the threads, backend.close() flushes write-through

    b = ControllerHarness(spec, extra_config=cfg)  # a new server process would do exactly this
    try:
        res = b.prefetch(toks[:24] + tokens(8, seed=99))  # shared 6-page prefix, then new tokens
        assert res.hit_tokens == 24 and res.loaded_tokens == 24
        assert b.page_bytes_at(res.host_indices) == want[:6]
        store = unwrap(b.backend)
        assert store.counters["adopted_chunks"] > 0
        store.check_integrity()
        # Another model (namespace) on the same directory sees nothing.
        other = ControllerHarness(spec, extra_config=cfg, model_name="other-model")
        try:
            assert other.prefetch(toks).hit_tokens == 0
        finally:
            other.close()
    finally:
        b.close()


def test_two_backends_share_a_redis_tier(redis_url):
    spec = PoolSpec(layout="page_first_direct", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), {"url": redis_url}])
    toks = tokens(32, seed=21)
    a = ControllerHarness(spec, extra_config=cfg, model_name="shared-model")
    b = ControllerHarness(spec, extra_config=cfg, model_name="shared-model")
    try:
        src = a.alloc(32)
        a.fill_random(src, seed=8)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 32
        assert unwrap(a.backend).store.flush(timeout_s=30)
        res = b.prefetch(toks)
        assert res.hit_tokens == 32 and res.loaded_tokens == 32
        assert b.page_bytes_at(res.host_indices) == want
        # And the other direction, continuing the chain with SGLang's prefix keys.
        more = toks + tokens(16, seed=22)
        src2 = b.alloc(16)
        b.fill_random(src2, seed=9)
        want2 = b.page_bytes_at(src2)
        keys = b.page_keys(more)
        assert b.backup(more[32:], src2, hashes=keys[8:], prefix_keys=keys[:8]) == 16
        assert unwrap(b.backend).store.flush(timeout_s=30)
        res2 = a.prefetch(more)
        assert res2.hit_tokens == 48 and res2.loaded_tokens == 48
        assert a.page_bytes_at(res2.host_indices) == want + want2
    finally:
        a.close()
        b.close()
