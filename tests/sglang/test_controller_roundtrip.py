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
