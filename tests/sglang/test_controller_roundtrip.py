"""radixkv under SGLang's own HiCacheController storage threads, on CPU host pools (all layouts)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import LAYOUTS, ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "copy"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_bytes_identical(tmp_path, layout, kind, interface_v1):
    spec = PoolSpec(kind=kind, layout=layout, page_size=4, layers=3, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path)], interface_v1))
    try:
        toks = tokens(6 * 4 + 3, seed=1)  # 6 full pages + a partial one (never stored)
        src = h.alloc(24)
        h.fill_random(src, seed=7)
        want = h.page_bytes_at(src)
        assert h.backup(toks, src) == 24
        res = h.prefetch(toks)
        assert res.hit_tokens == 24 and res.loaded_tokens == 24
        assert not set(res.host_indices.tolist()) & set(src.tolist())  # fresh slots
        assert h.page_bytes_at(res.host_indices) == want
        # A different prompt misses; a shared prefix hits exactly its pages.
        assert h.prefetch(tokens(24, seed=2)).hit_tokens == 0
        branch = toks[:8] + tokens(16, seed=3)
        res2 = h.prefetch(branch)
        assert res2.hit_tokens == 8 and res2.loaded_tokens == 8
        assert h.page_bytes_at(res2.host_indices) == want[:2]
        backend = unwrap(h.backend)
        assert backend.store.flush(timeout_s=30)
        backend.check_integrity()
        stats = backend.get_stats()
        # Write-through reached the disk tier: each of the 6 pages (one chunk each) is resident there too.
        disk = stats.radixkv["tiers"]["disk"]
        assert disk["tree_chunks"] == 6 and disk["put_failures"] == 0 and disk["errors"] == 0
        assert sum(stats.backup_pgs) == 6 and sum(stats.prefetch_pgs) >= 8
        assert stats.radixkv["adapter"]["failed_calls"] == 0
    finally:
        h.close()


def test_plans_are_zero_copy_in_every_layout():
    """Every layout's page is one chunk made of the page's segments in place (no staging copy)."""
    segments = {("mha", "layer_first"): 6, ("mha", "page_first"): 2, ("mha", "page_first_direct"): 2,
                ("mla", "layer_first"): 3, ("mla", "page_first"): 1, ("mla", "page_first_direct"): 1}
    for (kind, layout), n_seg in segments.items():
        h = ControllerHarness(PoolSpec(kind=kind, layout=layout, layers=3), extra_config=extra_config([mem_tier()]))
        try:
            b = unwrap(h.backend)._bindings["kv"]
            assert (b.plan.mode, b.plan.n_segments) == ("parts", n_seg), (kind, layout, b.plan)
            assert b.plan.chunk_bytes == b.flat.chunk_bytes  # the whole page, as its flat copy
            page = b.plan.views([4])[0]
            parts = (page,) if n_seg == 1 else page
            base = b.pool.kv_buffer.data_ptr()
            end = base + b.pool.kv_buffer.nbytes
            # every part aliases the host pool (zero-copy), and they add up to one page
            assert all(base <= p.data_ptr() < end for p in parts)
            assert sum(p.nbytes for p in parts) == b.plan.chunk_bytes
            assert b.flat.mode == "flat"
            # Namespaces carry dtype, layout and page size; v1 and copy formats never mix, and flat
            # pages carry their byte order (page_first flattens token-major, the others layer-major).
            assert b.ns.dtype == "bfloat16" and b.ns.layout == layout and b.ns.chunk_tokens == 4
            flat_order = "flat-page_first" if layout == "page_first" else "flat-canonical"
            assert b.ns_flat.layout == flat_order and b.ns.digest != b.ns_flat.digest
        finally:
            h.close()


def test_mid_chain_runs_without_prefix_keys(tmp_path):
    """SGLang without ``hicache_storage_pass_prefix_keys`` hands over page runs that start mid-chain
    with no parent. Re-writing such a run over pages already stored must succeed (a regression: the
    tree once rejected a present first key whose parent the caller did not name)."""
    spec = PoolSpec(kind="mha", layout="page_first", page_size=4, layers=2, host_tokens=256)
    cfg = extra_config([mem_tier()], 1, hicache_storage_pass_prefix_keys=False)
    h = ControllerHarness(spec, extra_config=cfg)
    try:
        toks = tokens(6 * 4, seed=11)
        src = h.alloc(24)
        h.fill_random(src, seed=5)
        want = h.page_bytes_at(src)
        keys = h.page_keys(toks)
        assert h.backup(toks, src) == 24
        # The last four pages again, as a run of their own (no prefix keys), plus the whole chain.
        assert h.backup(toks[8:], src[8:], hashes=keys[2:]) == 16
        assert h.backup(toks, src) == 24
        res = h.prefetch(toks)
        assert res.hit_tokens == 24 and h.page_bytes_at(res.host_indices) == want
        backend = unwrap(h.backend)
        assert backend.get_stats().radixkv["adapter"]["failed_calls"] == 0
        backend.check_integrity()
    finally:
        h.close()


def test_pages_gone_since_batch_exists_count_as_misses():
    """SGLang reads what its batch_exists found; pages that left the store in between (another
    thread's eviction, a clear) were counted as neither hits nor misses by the per-tier read counters
    (store.get counts them as misses in every tier). Found by an audit."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    h = ControllerHarness(PoolSpec(layout="page_first", page_size=4, host_tokens=256),
                          extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(16, seed=1)  # 4 pages
        keys = h.page_keys(toks)
        src = h.alloc(16)
        h.fill_random(src, seed=2)
        assert h.backup(toks, src, prefix_keys=[]) == 16
        assert be.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 4
        binding = be._bindings["kv"]
        be.store.delete(binding.ns, keys[2:])
        be.store.delete(binding.ns_flat, keys[2:])  # (no-op unless flat pages were stored)

        def read_counts() -> tuple[int, int]:
            s = be.store.stats()["store"]
            return s.get("mem.hit_chunks", 0), s.get("mem.miss_chunks", 0)

        h0, m0 = read_counts()
        assert be.batch_get_v1(keys, h.alloc(16), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2 + [False] * 2
        h1, m1 = read_counts()
        assert (h1 - h0, m1 - m0) == (2, 2)
        be.store.delete(binding.ns, keys[:2])
        assert be.batch_get_v1(keys, h.alloc(16), HiCacheStorageExtraInfo(prefix_keys=[])) == [False] * 4
        h2, m2 = read_counts()
        assert (h2 - h1, m2 - m1) == (0, 4)
        # the flat-page read (batch_get) of pages it never stored: all misses
        got = be.batch_get(keys, [torch.empty(binding.flat.page_bytes, dtype=torch.uint8) for _ in keys])
        assert got == [None] * 4
        h3, m3 = read_counts()
        assert (h3 - h2, m3 - m2) == (0, 4)
    finally:
        h.close()
