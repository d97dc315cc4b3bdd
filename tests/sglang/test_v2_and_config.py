"""v2 (KV + sidecar pools, hit policies), construction through SGLang's factory, options."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from radixkv.adapters.sglang import RadixKVStore  # noqa: E402
from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec, build_pools  # noqa: E402
from radixkv.errors import ConfigError  # noqa: E402

from _helpers import extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


def _config(extra, **kw):
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
                model_name="m", extra_config=extra)
    base.update(kw)
    return HiCacheStorageConfig(**base)


def test_factory_builds_radixkv_and_registers_the_pool():
    pools = build_pools(PoolSpec())
    backend = StorageBackendFactory.create_backend("dynamic", _config(extra_config([mem_tier()])), pools.host_pool)
    try:
        assert isinstance(unwrap(backend), RadixKVStore)
        backend.register_mem_pool_host(pools.host_pool)
        backend.on_host_pools_registered()
        assert "kv" in unwrap(backend)._bindings
    finally:
        backend.close()


def test_bad_options_fail_at_construction_with_the_fix():
    with pytest.raises(ConfigError, match="unknown"):
        RadixKVStore(_config(extra_config([mem_tier()], store={"no_such_option": 1})), {})
    with pytest.raises(ConfigError, match="tier url"):
        RadixKVStore(_config(extra_config(["not-a-url"])), {})
    with pytest.raises(ConfigError, match="probe_tiers"):
        RadixKVStore(_config(extra_config([mem_tier()], probe_tiers="maybe")), {})
    # A misspelt radixkv option is an error naming the right one, not a silent default.
    with pytest.raises(ConfigError, match="did you mean 'write_policy'"):
        RadixKVStore(_config(extra_config([mem_tier()], write_polcy="write_back")), {})


def test_foreign_extra_config_keys_are_logged_not_fatal(caplog):
    # Another backend's (or SGLang version's) keys may share the extra config: warn, keep going.
    s = RadixKVStore(_config(extra_config([mem_tier()], master_server_address="x:1", metadata_ttl=5)), {})
    s.close()
    assert "master_server_address" in caplog.text and "metadata_ttl" not in caplog.text


def test_config_file_and_defaults(tmp_path, monkeypatch):
    for k in ("RADIXKV_TIERS", "RADIXKV_CONFIG", "RADIXKV_TIER0_URL"):
        monkeypatch.delenv(k, raising=False)
    y = tmp_path / "radixkv.yaml"
    y.write_text(f"tiers:\n  - url: mem://\n    capacity: 8MiB\n  - url: file://{tmp_path}/d\n    capacity: 16MiB\npolicy: lru\n")
    s = RadixKVStore(_config({"config_file": str(y), "write_policy": "write_back"}), {})
    try:
        assert [t.name for t in s.store.tiers] == ["mem", "disk"]
        assert s.store.config.write_policy == "write_back"
    finally:
        s.close()
    d = RadixKVStore(_config({}), {})  # nothing given: one memory tier
    try:
        assert [t.name for t in d.store.tiers] == ["mem"]
    finally:
        d.close()
    monkeypatch.setenv("RADIXKV_POLICY", "s3fifo")  # refines the default tier; never silently ignored
    e = RadixKVStore(_config({}), {})
    try:
        assert [t.name for t in e.store.tiers] == ["mem"] and e.store.config.policy == "s3fifo"
    finally:
        e.close()


def test_environment_applies_under_explicit_tiers_and_config_files(tmp_path, monkeypatch):
    # Found by a review: RADIXKV_* variables were silently ignored once the extra config named
    # tiers or a config file, though docs/sglang.md says they apply either way.
    monkeypatch.setenv("RADIXKV_POLICY", "lfu")
    monkeypatch.setenv("RADIXKV_WRITE_POLICY", "write_back")
    s = RadixKVStore(_config(extra_config([mem_tier()])), {})
    try:
        assert s.store.config.policy == "lfu" and s.store.config.write_policy == "write_back"
    finally:
        s.close()
    y = tmp_path / "radixkv.yaml"
    y.write_text("tiers:\n  - url: mem://\n    capacity: 8MiB\npolicy: lru\n")
    f = RadixKVStore(_config({"config_file": str(y), "write_policy": "write_through"}), {})
    try:  # file < environment < the extra config's own keys
        assert f.store.config.policy == "lfu" and f.store.config.write_policy == "write_through"
    finally:
        f.close()
    # Found by an audit: the file's options of its own policy went along with RADIXKV_POLICY's
    # policy, which refused them as unknown options; they are dropped (RADIXKV_POLICY_OPTIONS
    # gives the new policy's).
    y.write_text("tiers:\n  - url: mem://\n    capacity: 8MiB\npolicy: s3fifo\n"
                 "policy_options:\n  small_fraction: 0.2\n")
    g = RadixKVStore(_config({"config_file": str(y)}), {})
    try:
        assert g.store.config.policy == "lfu" and g.store.config.policy_options == {}
    finally:
        g.close()


def test_lookup_metrics_and_tokens_count_pages_once():
    # Found by a review: through the adapter no miss was ever counted (SGLang reads only what
    # batch_exists found), and the plan then storing K and V of a page as two chunks doubled hit_tokens.
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256, device_tokens=64)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier()]))
    try:
        be = unwrap(h.backend)
        toks = tokens(8 * 4, seed=1)
        idx = h.alloc(len(toks))
        h.fill_random(idx, 3)
        h.backup(toks, idx)
        be.store.flush()
        assert h.prefetch(toks).loaded_tokens == 32
        h.prefetch(tokens(16, seed=99))  # 4 pages nobody stored
        st = be.store.stats()["store"]
        assert be._binding("kv").plan.n_segments == 2  # K and V apart, in one chunk per page
        assert st["mem.hit_tokens"] == 32, st  # 8 pages of 4 tokens, not 64
        assert st["lookup_miss_tokens"] >= 16 and st["lookup_hit_tokens"] >= 32, st
    finally:
        h.close()


def test_v2_kv_plus_trailing_sidecar_pool():
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier()]))
    side = build_pools(PoolSpec(layout="layer_first", page_size=4, layers=1, heads=1, host_tokens=256)).host_pool
    backend = unwrap(h.backend)
    backend.register_mem_host_pool_v2(side, PoolName.SWA)
    try:
        toks = tokens(24, seed=61)
        keys = h.page_keys(toks)  # 6 pages
        kv_src = h.alloc(24)
        h.fill_random(kv_src, seed=1)
        sw_src = side.alloc(8)  # the sidecar keeps only the last 2 pages (a window)
        gen_pages = []
        for i in range(0, 8, 4):
            page = side.get_dummy_flat_data_page()
            page.view(-1).copy_((i + 1) * 3 + page.new_zeros(page.numel()).to(page.dtype))
            side.set_from_flat_data_page(int(sw_src[i]), page)
            gen_pages.append(side.get_data_page(int(sw_src[i]), flat=True).clone())
        res = backend.batch_set_v2([
            PoolTransfer(name=PoolName.KV, host_indices=kv_src, keys=keys),
            PoolTransfer(name=PoolName.SWA, host_indices=sw_src, keys=keys[4:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])
        assert res == {"kv": [True] * 6, "swa": [True, True]}
        # Trailing window of 2: only prefix length 6 has both of its last 2 sidecar pages.
        q = [PoolTransfer(name=PoolName.SWA, keys=keys[4:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        r = backend.batch_exists_v2(keys, q)
        assert r.kv_hit_pages == 6 and r.restorable_prefix_pages == [6] and r.extra_pool_hit_pages["swa"] == 6
        # All-pages policy on the same pool: page 0 is missing, so nothing is restorable.
        r2 = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
        assert r2.kv_hit_pages == 0 and "swa" not in r2.extra_pool_hit_pages
        # Read both pools back into fresh slots.
        kv_dst, sw_dst = h.alloc(24), side.alloc(8)
        got = backend.batch_get_v2([
            PoolTransfer(name=PoolName.KV, host_indices=kv_dst, keys=keys),
            PoolTransfer(name=PoolName.SWA, host_indices=sw_dst, keys=keys[4:]),
        ])
        assert got == {"kv": [True] * 6, "swa": [True, True]}
        assert h.page_bytes_at(kv_dst) == h.page_bytes_at(kv_src)
        for j, i in enumerate(range(0, 8, 4)):
            assert side.get_data_page(int(sw_dst[i]), flat=True).equal(gen_pages[j])
        # A sidecar that was never registered fails per page, without raising.
        bad = backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=sw_dst, keys=keys[4:])])
        assert bad == {"mamba": [False, False]}
        assert backend.counters["failed_calls"] == 1
    finally:
        h.close()


def test_batch_calls_never_raise_on_bad_input():
    h = ControllerHarness(PoolSpec(), extra_config=extra_config([mem_tier()]))
    b = unwrap(h.backend)
    try:
        keys = h.page_keys(tokens(8, seed=3))
        import torch

        short = torch.arange(0, 4)  # 1 page of indices for 2 keys
        assert b.batch_set_v1(keys, short) == [False, False]
        assert b.batch_get_v1(keys, short) == [False, False]
        assert b.batch_exists(["not/ascii\u00e9"]) == 0
        assert b.batch_set(keys, [None, None]) is False
        assert b.batch_get(keys, None) == [None, None]
        assert b.counters["failed_calls"] >= 3
    finally:
        h.close()


def test_v2_calls_record_storage_metric_samples():
    # SGLang drains per-call samples through get_stats for its backup/prefetch histograms on both
    # paths (its HiCacheHF3FS records one per pool transfer of a v2 call). Before, batch_*_v2 (the
    # path of hybrid models) recorded none: a hybrid server's L3 histograms stayed empty.
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier()]))
    side = build_pools(PoolSpec(layout="layer_first", page_size=4, layers=1, heads=1, host_tokens=256)).host_pool
    backend = unwrap(h.backend)
    backend.register_mem_host_pool_v2(side, PoolName.SWA)
    try:
        keys = h.page_keys(tokens(24, seed=62))  # 6 pages
        kv_src, sw_src = h.alloc(24), side.alloc(8)
        h.fill_random(kv_src, seed=2)
        backend.get_stats()  # drain anything earlier
        transfers = [PoolTransfer(name=PoolName.KV, host_indices=kv_src, keys=keys),
                     PoolTransfer(name=PoolName.SWA, host_indices=sw_src, keys=keys[4:])]
        assert backend.batch_set_v2(transfers) == {"kv": [True] * 6, "swa": [True, True]}
        st = backend.get_stats()
        assert sorted(st.backup_pgs) == [2, 6] and len(st.backup_bandwidth) == 2
        assert backend.batch_set_v2(transfers) == {"kv": [True] * 6, "swa": [True, True]}
        st = backend.get_stats()
        assert st.backup_pgs == []  # every page held already: nothing transferred, no sample
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=h.alloc(24), keys=keys),
                                    PoolTransfer(name=PoolName.SWA, host_indices=side.alloc(8), keys=keys[4:])])
        assert got == {"kv": [True] * 6, "swa": [True, True]}
        st = backend.get_stats()
        assert sorted(st.prefetch_pgs) == [2, 6] and len(st.prefetch_bandwidth) == 2
    finally:
        h.close()


@pytest.mark.parametrize("path", ["", "  ", 0, ["radixkv.yaml"]])
def test_a_config_file_that_is_no_path_is_an_error(path, monkeypatch):
    # Found by a review: an empty (or 0) config_file was skipped as if absent, so the store came
    # from the environment or the 4 GiB default; a list failed with a TypeError.
    from radixkv.adapters.sglang_config import RadixKVOptions

    with pytest.raises(ConfigError, match="config_file=.* must be the path"):
        RadixKVOptions.from_extra_config({"config_file": path})


def test_a_store_field_given_at_the_top_and_under_store_must_agree():
    # Found by a review: the top-level value silently replaced the one under "store".
    from radixkv.adapters.sglang_config import RadixKVOptions

    with pytest.raises(ConfigError, match=r"write_policy='write_back' and store.write_policy='write_through'"):
        RadixKVOptions.from_extra_config({"write_policy": "write_back", "store": {"write_policy": "write_through"}})
    same = RadixKVOptions.from_extra_config({"policy": "lfu", "store": {"policy": "lfu", "io_threads": 3}})
    assert same.store == {"policy": "lfu", "io_threads": 3}
