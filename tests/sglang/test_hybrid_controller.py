"""v2 storage path driven by SGLang's own HybridCacheController (hybrid models: KV + sidecar pools).

SGLang 0.5.23's ``HybridCacheController`` runs on CPU pools: its backup thread calls ``batch_set_v2``
for the sidecar pool (then ``batch_set_v1`` for KV), its hit query calls ``batch_exists_v2`` with the
trailing-pages policy (SWA windows, Mamba states), and its io-aux thread reads KV then the sidecar with
``batch_get_v2`` after re-aligning the sidecar keys to the hit. Every byte is checked, both pools.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from radixkv.adapters.sglang import RadixKVStore  # noqa: E402
from radixkv.adapters.sglang_cpu import HybridHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang

PS = 4  # tokens per page
WINDOW = 2  # sidecar pages kept per request: the trailing-pages policy


def _harness(tmp_path, tier: str, layout: str) -> HybridHarness:
    tiers = [mem_tier()] if tier == "mem" else [disk_tier(tmp_path / "l3")]
    return HybridHarness(
        PoolSpec(layout=layout, page_size=PS, host_tokens=256),
        {PoolName.SWA: PoolSpec(layout="layer_first", page_size=PS, layers=1, heads=1, host_tokens=128)},
        extra_config=extra_config(tiers),
    )


def _spy(h: HybridHarness, monkeypatch) -> dict[str, int]:
    """Count the backend's v2 calls (the real methods still run)."""
    backend = unwrap(h.backend)
    calls = {"batch_set_v2": 0, "batch_exists_v2": 0, "batch_get_v2": 0}
    for name in calls:
        real = getattr(backend, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(backend, name, counted)
    return calls


def _swa(host_indices, keys) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, host_indices=host_indices, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)


@pytest.mark.parametrize("tier", ["mem", "disk"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_controller_writes_queries_and_reads_kv_and_sidecar(tmp_path, monkeypatch, tier, layout):
    h = _harness(tmp_path, tier, layout)
    try:
        assert isinstance(unwrap(h.backend), RadixKVStore)
        assert set(unwrap(h.backend)._bindings) == {"kv", "swa"}  # registered by the controller
        calls = _spy(h, monkeypatch)
        toks = tokens(6 * PS, seed=81)
        keys = h.page_keys(toks)
        kv_src, swa_src = h.alloc(PoolName.KV, 6 * PS), h.alloc(PoolName.SWA, WINDOW * PS)
        h.fill_random(PoolName.KV, kv_src, seed=1)
        h.fill_random(PoolName.SWA, swa_src, seed=2)

        op = h.backup(toks, kv_src, [_swa(swa_src, keys[-WINDOW:])])
        assert op.completed_tokens == 6 * PS
        assert op.pool_storage_result.extra_pool_hit_pages == {"swa": WINDOW}

        swa_dst = h.alloc(PoolName.SWA, WINDOW * PS)
        h.fill_random(PoolName.SWA, swa_dst, seed=99)  # junk: a no-op read cannot pass
        pop, acks = h.prefetch(toks, [_swa(swa_dst, keys[-WINDOW:])])
        assert pop.storage_hit_count == 6 * PS
        assert pop.query_pool_hit_pages[PoolName.SWA] == 6
        assert max(a.completed_tokens or 0 for a in acks) == 6 * PS
        assert [a.pool_hits["swa"] for a in acks if a.pool_hits] == [WINDOW]
        assert h.page_bytes_at(PoolName.KV, pop.host_indices) == h.page_bytes_at(PoolName.KV, kv_src)
        assert h.page_bytes_at(PoolName.SWA, swa_dst) == h.page_bytes_at(PoolName.SWA, swa_src)
        assert calls["batch_set_v2"] >= 1 and calls["batch_exists_v2"] >= 1 and calls["batch_get_v2"] >= 1
        assert unwrap(h.backend).counters["failed_calls"] == 0
        unwrap(h.backend).check_integrity()
    finally:
        h.close()


def test_kv_without_its_sidecar_is_not_restorable(tmp_path):
    """KV pages stored without the sidecar state: the trailing-pages query finds nothing restorable,
    so the controller loads nothing (a hybrid model cannot resume from KV alone)."""
    h = _harness(tmp_path, "mem", "page_first")
    try:
        toks = tokens(6 * PS, seed=82)
        kv_src = h.alloc(PoolName.KV, 6 * PS)
        h.fill_random(PoolName.KV, kv_src, seed=3)
        assert h.backup(toks, kv_src, None).completed_tokens == 6 * PS
        swa_dst = h.alloc(PoolName.SWA, WINDOW * PS)
        pop, acks = h.prefetch(toks, [_swa(swa_dst, h.page_keys(toks)[-WINDOW:])])
        assert pop.storage_hit_count == 0 and acks == []
    finally:
        h.close()


def test_longer_request_resumes_at_the_stored_window(tmp_path):
    """Stored: 6 pages with the window at pages 5-6. A request for 8 pages hits 6, and the controller
    re-aligns the sidecar keys to pages 5-6 before batch_get_v2: those exact bytes come back."""
    h = _harness(tmp_path, "disk", "page_first")
    try:
        toks = tokens(8 * PS, seed=83)
        keys = h.page_keys(toks)
        kv_src, swa_src = h.alloc(PoolName.KV, 6 * PS), h.alloc(PoolName.SWA, WINDOW * PS)
        h.fill_random(PoolName.KV, kv_src, seed=4)
        h.fill_random(PoolName.SWA, swa_src, seed=5)
        h.backup(toks[: 6 * PS], kv_src, [_swa(swa_src, keys[4:6])])
        swa_dst = h.alloc(PoolName.SWA, WINDOW * PS)
        ask = _swa(swa_dst, keys[-WINDOW:])  # the window of the full 8-page request
        pop, _acks = h.prefetch(toks, [ask])
        assert pop.storage_hit_count == 6 * PS
        assert ask.keys == keys[4:6]  # re-aligned by SGLang to the hit
        assert h.page_bytes_at(PoolName.KV, pop.host_indices) == h.page_bytes_at(PoolName.KV, kv_src)
        assert h.page_bytes_at(PoolName.SWA, swa_dst) == h.page_bytes_at(PoolName.SWA, swa_src)
    finally:
        h.close()


def test_mla_model_mamba_state_is_written_by_every_tp_rank(tmp_path):
    # MLA KV is replicated across TP (only the writer rank writes it), but Mamba state is TP-sharded
    # even then: SGLang's should_backup asks every rank to write it. Rank 1 once skipped it, so its
    # namespace stayed empty and the whole TP group lost its L3 hits (SGLang takes the minimum).
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from radixkv.adapters.sglang_cpu import set_parallel_context

    tiers = [mem_tier(), {"url": f"file://{tmp_path / 'l3'}", "capacity": "256MiB", "options": {"shared": True}}]
    try:
        for rank in (0, 1):
            set_parallel_context(tp_rank=rank, tp_size=2)
            h = HybridHarness(PoolSpec(kind="mla", layout="page_first", page_size=PS, host_tokens=256),
                              {PoolName.MAMBA: PoolSpec(layout="layer_first", page_size=PS, layers=1, heads=1,
                                                        host_tokens=128)},
                              extra_config=extra_config(tiers))
            try:
                b = unwrap(h.backend)
                toks = tokens(6 * PS, seed=81)
                keys = h.page_keys(toks)
                kv, mb = h.alloc(PoolName.KV, 6 * PS), h.alloc(PoolName.MAMBA, WINDOW * PS)
                h.fill_random(PoolName.KV, kv, 1)
                h.fill_random(PoolName.MAMBA, mb, 2 + rank)
                tr = PoolTransfer(name=PoolName.MAMBA, host_indices=mb, keys=keys[-WINDOW:],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)
                h.backup(toks, kv, [tr])
                b.store.flush(timeout_s=30)
                probe = PoolTransfer(name=PoolName.MAMBA, keys=keys[-WINDOW:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
                r = b.batch_exists_v2(keys, [probe], HiCacheStorageExtraInfo(prefix_keys=None))
                assert r.kv_hit_pages == 6 and 6 in (r.restorable_prefix_pages or []), (rank, r)
            finally:
                h.close()
    finally:
        set_parallel_context()


@pytest.mark.parametrize("draft_kind", ["mha", "mla"])
def test_mha_draft_under_an_mla_target_with_tp_is_refused_not_loaded_from_rank_0(tmp_path, draft_kind):
    """Found by the SGLang draft-pool hunt: an EAGLE/EAGLE3 draft model whose KV is MHA keeps its KV
    heads split across the TP ranks, but under an MLA target radixkv took its ``draft`` pool for
    replicated MLA KV (one namespace for every rank) and SGLang backs it up from the storage-writer
    rank only (``should_backup``: per-rank drafts for its Mooncake backend alone). Rank 1 then
    loaded rank 0's draft shard into its own draft pool: wrong KV of the same size, silently. Now
    registering such a pool fails (a server with it does not start); an MLA draft, the same on
    every rank, is still stored once and read by every rank.

    The draft registers after the attach, as ``maybe_register_hicache_draft`` does in a server
    (``register_host_pool_entry``). Per-rank byte oracle: each rank's draft bytes are its own shard
    (different seeds for an MHA draft, the same for an MLA one)."""
    from sglang.srt.mem_cache.pool_host import PoolEntry

    from radixkv.adapters.sglang_cpu import build_pools, set_parallel_context
    from radixkv.errors import ConfigError

    tiers = [mem_tier(), {"url": f"file://{tmp_path / 'l3'}", "capacity": "256MiB", "options": {"shared": True}}]
    toks = tokens(6 * PS, seed=87)
    shard: dict[int, list[bytes]] = {}
    refused: dict[int, str] = {}
    try:
        for rank in (0, 1):
            set_parallel_context(tp_rank=rank, tp_size=2)
            h = HybridHarness(PoolSpec(kind="mla", layout="page_first", page_size=PS, host_tokens=256), {},
                              extra_config=extra_config(tiers))
            try:
                draft = build_pools(PoolSpec(kind=draft_kind, layout="page_first", page_size=PS, layers=1,
                                             host_tokens=256))
                try:
                    h.controller.register_host_pool_entry(PoolEntry(
                        PoolName.DRAFT, draft.host_pool, draft.device_pool, lambda layer: layer,
                        is_primary_index_anchor=False))
                except ConfigError as e:
                    refused[rank] = str(e)
                    continue
                h.pools[PoolName.DRAFT] = draft
                src = h.alloc(PoolName.KV, 6 * PS)
                assert h.alloc(PoolName.DRAFT, 6 * PS).equal(src)  # the draft follows the KV's slots
                h.fill_random(PoolName.KV, src, seed=1)  # MLA latent KV: the same on every rank
                h.fill_random(PoolName.DRAFT, src, seed=10 + rank if draft_kind == "mha" else 10)
                shard[rank] = h.page_bytes_at(PoolName.DRAFT, src)
                h.backup(toks, src, [_draft()])
                unwrap(h.backend).store.flush(timeout_s=30)
                if rank == 1:
                    junk = h.alloc(PoolName.DRAFT, 6 * PS)
                    h.fill_random(PoolName.DRAFT, junk, seed=99)  # no read cannot pass
                    pop, _acks = h.prefetch(toks, [_draft()])
                    assert pop.storage_hit_count == 6 * PS
                    got = h.page_bytes_at(PoolName.DRAFT, pop.host_indices)
                    assert got == shard[1], ("rank 1 loaded rank 0's draft shard" if got == shard[0]
                                             else "rank 1 loaded draft bytes of no rank")
            finally:
                h.close()
    finally:
        set_parallel_context()
    if draft_kind == "mha":
        assert sorted(refused) == [0, 1], shard.keys()
        assert "'draft' pool" in refused[1] and "tp_size=2" in refused[1] and "mooncake" in refused[1]
    else:
        assert refused == {}


@pytest.mark.parametrize("pool_name, is_mla, tp_size, refused", [
    (PoolName.DRAFT_SWA, True, 2, True),   # an SWA draft's MHA window: sharded the same way
    (PoolName.DRAFT, True, 1, False),      # one rank: it writes and reads its own draft
    (PoolName.DRAFT, False, 2, False),     # MHA target: every rank writes its own shard
])
def test_only_a_tp_sharded_draft_under_an_mla_target_with_non_writers_is_refused(tmp_path, pool_name, is_mla,
                                                                                 tp_size, refused):
    """The refusal above covers SGLang's other MHA draft pool (``draft_swa``, backed up on the writer
    rank only as well) and nothing else: an MLA target on one rank and an MHA target keep their drafts."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from radixkv.adapters.sglang_cpu import build_pools
    from radixkv.errors import ConfigError

    config = HiCacheStorageConfig(
        tp_rank=tp_size - 1, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
        extra_config=extra_config([disk_tier(tmp_path / "l3", shared=True)]))
    s = RadixKVStore(config, {})
    try:
        s.register_mem_pool_host(build_pools(PoolSpec(kind="mla" if is_mla else "mha", page_size=PS)).host_pool)
        draft = build_pools(PoolSpec(kind="mha", page_size=PS, layers=1)).host_pool
        if refused:
            with pytest.raises(ConfigError, match=rf"'{pool_name}' pool .* MHA draft .*tp_size={tp_size}"):
                s.register_mem_host_pool_v2(draft, pool_name)
            assert str(pool_name) not in s._bindings
        else:
            s.register_mem_host_pool_v2(draft, pool_name)
            assert str(pool_name) in s._bindings
    finally:
        s.close()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_kv_is_stored_when_a_sidecar_slab_holds_a_small_memory_tier(tmp_path, write_policy):
    """Found by a differential fuzz (hybrid controller, small memory tier): every backup wrote the
    sidecar window first, its slab took the memory tier's only unit, and the KV put that followed
    was refused although the bytes fit: making room evicted the sidecar pages (emptying their slab)
    but the reservation failed (fewer evictable bytes than the put's size), so the put was never
    retried. No KV page was ever stored; every prefetch missed."""
    h = HybridHarness(
        PoolSpec(layout="page_first", page_size=PS, host_tokens=256),
        {PoolName.SWA: PoolSpec(layout="layer_first", page_size=PS, layers=1, heads=1, host_tokens=128)},
        extra_config=extra_config([mem_tier("64KiB"), disk_tier(tmp_path / "l3")], write_policy=write_policy),
    )
    try:
        for seed in (84, 85):
            toks = tokens(6 * PS, seed=seed)
            keys = h.page_keys(toks)
            kv_src, swa_src = h.alloc(PoolName.KV, 6 * PS), h.alloc(PoolName.SWA, WINDOW * PS)
            h.fill_random(PoolName.KV, kv_src, seed=seed)
            h.fill_random(PoolName.SWA, swa_src, seed=seed + 1)
            assert h.backup(toks, kv_src, [_swa(swa_src, keys[-WINDOW:])]).completed_tokens == 6 * PS
            swa_dst = h.alloc(PoolName.SWA, WINDOW * PS)
            pop, _acks = h.prefetch(toks, [_swa(swa_dst, keys[-WINDOW:])])
            assert pop.storage_hit_count == 6 * PS
            assert h.page_bytes_at(PoolName.KV, pop.host_indices) == h.page_bytes_at(PoolName.KV, kv_src)
            assert h.page_bytes_at(PoolName.SWA, swa_dst) == h.page_bytes_at(PoolName.SWA, swa_src)
            for name, idx in ((PoolName.KV, kv_src), (PoolName.KV, pop.host_indices),
                              (PoolName.SWA, swa_src), (PoolName.SWA, swa_dst)):
                h.host_pool(name).free(idx)
        b = unwrap(h.backend)
        assert b.counters["failed_calls"] == 0
        b.store.flush(timeout_s=30)
        b.check_integrity()
    finally:
        h.close()


def _draft() -> PoolTransfer:
    # As build_full_draft_pools declares it: the draft KV pool reuses the target KV's host slots.
    return PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)


@pytest.mark.parametrize("change", [
    {"speculative_draft_kv_cache_dtype": "fp8_e5m2"},
    {"speculative_draft_model_path": "org/draft-b"},
    {"speculative_draft_model_revision": "v2"},
])
def test_draft_kv_of_another_draft_model_or_draft_kv_dtype_is_a_miss(tmp_path, monkeypatch, change):
    """Found by the SGLang server-features hunt: with speculative decoding SGLang stores the draft
    model's KV through L3 too (a ``draft`` sidecar pool; MTP packs it into the KV pages), but the
    namespace digest held only the target's arguments. A server restarted on the same disk tier
    (or a second one on shared Redis) with another draft model, draft revision or
    ``--speculative-draft-kv-cache-dtype`` (fp8_e4m3 and fp8_e5m2 are both uint8 in the host
    pool: same namespace, same size) loaded the first server's draft KV. Now the draft's identity
    is part of the digest when a speculative algorithm is set; the same arguments still hit."""
    import torch

    from sglang.srt import runtime_context

    base = {"model_path": "org/model", "dtype": "bfloat16", "kv_cache_dtype": "auto", "weight_version": "default",
            "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "org/draft-a",
            "speculative_draft_model_revision": None, "speculative_draft_kv_cache_dtype": "fp8_e4m3"}
    tiers = [mem_tier(), disk_tier(tmp_path / "l3")]

    def serve(**changes) -> HybridHarness:
        args = SimpleNamespace(**{**base, **changes})
        monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
        draft_dtype = torch.float8_e5m2 if args.speculative_draft_kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        return HybridHarness(PoolSpec(layout="page_first", page_size=PS, host_tokens=256),
                             {PoolName.DRAFT: PoolSpec(layout="page_first", page_size=PS, layers=1,
                                                       host_tokens=256, dtype=draft_dtype)},
                             extra_config=extra_config(tiers))

    toks = tokens(6 * PS, seed=86)
    a = serve()
    try:
        src = a.alloc(PoolName.KV, 6 * PS)
        assert torch.equal(a.alloc(PoolName.DRAFT, 6 * PS), src)  # the same slots in both pools
        a.fill_random(PoolName.KV, src, seed=1)
        a.fill_random(PoolName.DRAFT, src, seed=2)
        want = {name: a.page_bytes_at(name, src) for name in (PoolName.KV, PoolName.DRAFT)}
        op = a.backup(toks, src, [_draft()])
        assert op.completed_tokens == 6 * PS and op.pool_storage_result.extra_pool_hit_pages == {"draft": 6}
    finally:
        a.close()

    def load(h: HybridHarness):
        junk = h.alloc(PoolName.DRAFT, 6 * PS)  # the slots the KV prefetch gets: junk, so no read cannot pass
        h.fill_random(PoolName.DRAFT, junk, seed=99)
        pop, _acks = h.prefetch(toks, [_draft()])
        return pop

    other = serve(**change)
    try:
        pop = load(other)
        assert pop.storage_hit_count == 0, change
    finally:
        other.close()
    same = serve()  # a restart with the same arguments finds both pools' pages
    try:
        pop = load(same)
        assert pop.storage_hit_count == 6 * PS
        for name in (PoolName.KV, PoolName.DRAFT):
            assert same.page_bytes_at(name, pop.host_indices) == want[name], name
    finally:
        same.close()


def _mamba_server(tmp_path, ssm_dtype, unnamed_ssm_dtype=False):
    """An SGLang server's storage backend over SGLang's own Mamba host pool (page_first: one state
    slot per page; conv state bfloat16, SSM state ``ssm_dtype``) and a KV pool, on the disk tier
    under ``tmp_path``. ``unnamed_ssm_dtype``: name the namespaces as releases before the
    ``/ssm-<dtype>`` suffix did (the pool's SSM dtype unknown to the namespace), as an upgrade
    finds them. Returns (backend, kv pool, mamba pool)."""
    import torch

    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    from radixkv.adapters.sglang_cpu import build_pools

    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 8, dtype=ssm_dtype),
                                conv=(torch.zeros(2, 8, 3, 8, dtype=torch.bfloat16),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    kv = build_pools(PoolSpec(page_size=PS, host_tokens=64)).host_pool
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
        extra_config=extra_config([disk_tier(tmp_path / "l3")]))
    s = RadixKVStore(config, {})
    s.register_mem_pool_host(kv)
    s.register_mem_host_pool_v2(kv, PoolName.KV)
    if unnamed_ssm_dtype:  # the namespace is fixed when the pool registers
        mamba.temporal_dtype = None
    s.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    s.on_host_pools_registered()
    mamba.temporal_dtype = ssm_dtype
    return s, kv, mamba


def _mamba_state(slot, keys) -> PoolTransfer:
    return PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)


def _store_mamba_state(s, kv, mamba, keys):
    """Store 4 KV pages and the Mamba state of their last one (random bytes); returns that state."""
    import torch

    kv_idx, slot = kv.alloc(4 * PS), mamba.alloc(1)
    gen = torch.Generator().manual_seed(7)
    for buf in (kv.kv_buffer, mamba.temporal_buffer):
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    want = mamba.get_data_page(int(slot[0])).clone()
    assert s.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=kv_idx, keys=keys),
                           _mamba_state(slot, keys)]) == {"kv": [True] * 4, "mamba": [True]}
    return want


def test_mamba_state_of_another_ssm_dtype_is_a_miss(tmp_path):
    """Found by the SGLang server-features hunt: a Mamba host pool's ``dtype`` is its conv state's,
    and the namespace carried only that one. A server whose SSM state is float16 (``--mamba-ssm-dtype``,
    SGLANG_MAMBA_SSM_DTYPE) restarted on the tier of one whose state was bfloat16 (same page size)
    restored that state as float16: wrong state, no error. Now the SSM dtype is in the namespace."""
    import torch

    from sglang.srt.mem_cache.utils import get_storage_hash_str

    toks = tokens(4 * PS, seed=87)
    keys = get_storage_hash_str(toks, None, page_size=PS)
    s, kv, mamba = _mamba_server(tmp_path, torch.bfloat16)
    try:
        want = _store_mamba_state(s, kv, mamba, keys)
    finally:
        s.close()
    for ssm_dtype, hit in ((torch.float16, False), (torch.bfloat16, True)):  # the same dtype still hits
        s, kv, mamba = _mamba_server(tmp_path, ssm_dtype)
        try:
            r = s.batch_exists_v2(keys, [_mamba_state(None, keys)])
            assert (r.restorable_prefix_pages == [4]) is hit, (ssm_dtype, r)
            slot = mamba.alloc(1)
            assert s.batch_get_v2([_mamba_state(slot, keys)]) == {"mamba": [hit]}, ssm_dtype
            assert torch.equal(mamba.get_data_page(int(slot[0])), want) is hit
        finally:
            s.close()


def test_mamba_state_stored_before_the_ssm_dtype_was_named_is_a_miss_after_an_upgrade(tmp_path):
    """Found by the upgrade hunt: releases before the ``/ssm-<dtype>`` suffix stored every SSM
    dtype's state under the bare namespace, and the suffix was added only where the SSM dtype
    differs from the conv dtype, so a bfloat16-state server (conv bfloat16: no suffix) upgraded on
    the tier of a float16-state one restored the float16 state as bfloat16 (hit, wrong state). Such
    states must be misses whatever the new server's SSM dtype (upgrades move namespaces)."""
    import torch

    from sglang.srt.mem_cache.utils import get_storage_hash_str

    toks = tokens(4 * PS, seed=88)
    keys = get_storage_hash_str(toks, None, page_size=PS)
    s, kv, mamba = _mamba_server(tmp_path, torch.float16, unnamed_ssm_dtype=True)
    try:
        _store_mamba_state(s, kv, mamba, keys)
    finally:
        s.close()
    s, kv, mamba = _mamba_server(tmp_path, torch.bfloat16)
    try:
        assert s.batch_exists_v2(keys, [_mamba_state(None, keys)]).restorable_prefix_pages != [4]
        assert s.batch_get_v2([_mamba_state(mamba.alloc(1), keys)]) == {"mamba": [False]}
    finally:
        s.close()
