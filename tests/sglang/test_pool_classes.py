"""Host pool classes beyond plain MHA/MLA KV: every page state SGLang hands the backend comes back.

SGLang 0.5.23's DeepSeek-V4 stack (``build_deepseek_v4_hicache_stack``) anchors its host pools on a
``LogicalHostPool``: the KV pool holds page indices and no bytes (its flat page is empty, its
``get_page_buffer_meta`` is None) and the KV lives in compressed sidecar pools
(``DeepSeekV4PagedHostPool``: C4/C128 KV, indexer keys and scales), each gated on the KV chain by
the ``all_pages`` hit policy. Pools that keep a page in several buffers of unequal sizes
(``AsymmetricMHATokenToKVPoolHost``, the MLA ``page_first_kv_split`` layout) are stored as parts;
``MHATokenToKVPoolMXFP8Host`` exposes no storage pages and is refused. These tests drive SGLang's
own classes through its controllers on CPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from radixkv.adapters.sglang_cpu import ControllerHarness, HybridHarness, Pools, PoolSpec, build_pools  # noqa: E402

from _helpers import extra_config, mem_tier, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang

PS = 4  # tokens per page
HOST_TOKENS = 256


def _v4_harness(interface_v1: int) -> HybridHarness:
    """SGLang's V4 pool pair: a ``LogicalHostPool`` KV anchor and one compressed sidecar (C4)."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool

    spec = PoolSpec(kind="mla", page_size=PS, host_tokens=HOST_TOKENS)
    kv = build_pools(spec)  # the controller needs a device pool and allocator; the host pool is V4's
    layers, item_bytes = 2, 48
    c4 = DeepSeekV4PagedHostPool(
        pool_name=str(PoolName.DEEPSEEK_V4_C4),
        device_buffers=[torch.zeros(spec.device_tokens // PS + 1, item_bytes, dtype=torch.uint8) for _ in range(layers)],
        item_bytes=item_bytes, num_host_pages=HOST_TOKENS // PS, slot_page_size=PS, layout="page_first",
        device="cpu", pin_memory=False,
    )
    pools = {
        PoolName.KV: Pools(kv.allocator, kv.device_pool, LogicalHostPool(HOST_TOKENS, PS, layout="page_first")),
        PoolName.DEEPSEEK_V4_C4: Pools(None, None, c4),
    }
    return HybridHarness(spec, {}, extra_config=extra_config([mem_tier()], interface_v1=interface_v1), pools=pools)


def _c4() -> PoolTransfer:
    # KV-derived (indices and keys follow the KV anchor), gating the KV hit as V4 declares it
    return PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, indices_from_pool=PoolName.KV,
                        hit_policy=PoolHitPolicy.ALL_PAGES)


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_deepseek_v4_logical_kv_anchor_restores_its_compressed_pages(interface_v1):
    """The KV anchor's pages have no bytes; before, every hit query failed (``chunk_bytes=0``) and
    its backups too, so a V4 server never hit L3. Now each anchor page is a one-byte marker (as
    SGLang's NIXL backend writes): the chain exists, the C4 sidecar gates it, and the C4 pages come
    back byte for byte into fresh slots; anchor pages stored without their C4 pages are no hit."""
    h = _v4_harness(interface_v1)
    try:
        c4 = h.host_pool(PoolName.DEEPSEEK_V4_C4)
        # Junk in every C4 slot first: a read that restores nothing cannot pass.
        c4.kv_buffer.copy_(torch.randint(0, 256, c4.kv_buffer.shape, dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(7)))

        bare = tokens(6 * PS, seed=90)  # anchor pages only: KV without its compressed state
        assert h.backup(bare, h.alloc(PoolName.KV, 6 * PS), None).completed_tokens == 6 * PS
        pop, acks = h.prefetch(bare, [_c4()])
        assert pop.storage_hit_count == 0 and acks == []

        toks = tokens(6 * PS, seed=91)
        src = h.alloc(PoolName.KV, 6 * PS)
        h.fill_random(PoolName.DEEPSEEK_V4_C4, src, seed=2)
        op = h.backup(toks, src, [_c4()])
        assert op.completed_tokens == 6 * PS
        assert op.pool_storage_result.extra_pool_hit_pages == {str(PoolName.DEEPSEEK_V4_C4): 6}
        unwrap(h.backend).store.flush()
        pop, acks = h.prefetch(toks, [_c4()])
        assert pop.storage_hit_count == 6 * PS
        assert max(a.completed_tokens or 0 for a in acks) == 6 * PS
        assert h.page_bytes_at(PoolName.DEEPSEEK_V4_C4, pop.host_indices) == h.page_bytes_at(PoolName.DEEPSEEK_V4_C4, src)
        assert unwrap(h.backend).counters["failed_calls"] == 0
        unwrap(h.backend).check_integrity()
    finally:
        h.close()


# ---------------------------------------------------------------------------- pools of several buffers
# SGLang host pools whose page is not one kv_buffer region of equal segments: the asymmetric MHA
# pool (head_dim != v_head_dim, e.g. MiMo-V2: K and V in two buffers of unequal page sizes) and the
# MLA pool's page_first_kv_split layout (Ascend: latent K, RoPE V, indexer keys and FP32 scales,
# up to four buffers). Neither has a flat data page, so the copying interface cannot store them.

DEVICE_TOKENS = 64


def _asymmetric_pools(layout: str) -> tuple[PoolSpec, Pools]:
    """SGLang's own asymmetric-K/V host pool (``get_mha_host_pool_cls`` picks it for a device pool
    with ``v_head_dim != head_dim``)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, get_mha_host_pool_cls

    spec = PoolSpec(kind="mha", layout=layout, page_size=PS, host_tokens=HOST_TOKENS, device_tokens=DEVICE_TOKENS)
    device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PS, dtype=spec.dtype, layer_num=spec.layers,
                              device="cpu", enable_memory_saver=False, head_num=spec.heads,
                              head_dim=spec.head_dim, v_head_dim=spec.head_dim // 2, enable_alt_stream=False)
    info = device._mha_buffer_info()
    cls = get_mha_host_pool_cls(info)
    assert cls is AsymmetricMHATokenToKVPoolHost
    host = cls(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS,
               start_layer=0, end_layer=spec.layers, host_token_capacity=HOST_TOKENS)
    return spec, Pools(TokenToKVPoolAllocator(DEVICE_TOKENS, spec.dtype, "cpu", device, False), device, host)


def _kv_split_pools(variant: str, k_width: int | None = None) -> tuple[PoolSpec, Pools]:
    """SGLang's MLA host pool in ``page_first_kv_split`` over native split buffers (as the Ascend
    device pool hands them over): ``"indexer"`` (an indexer on one of the two layers), ``"plain"``
    (none), ``"fp8"`` (FP8 DSA: latent, RoPE and scale packed into K, ``k_width`` bytes wide (the
    KV row by default); SGLang never transfers its V mirror, so its metadata leaves V out)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo, MLASplitBuffers
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    fp8 = variant == "fp8"
    spec = PoolSpec(kind="mla", page_size=PS, host_tokens=HOST_TOKENS, device_tokens=DEVICE_TOKENS,
                    dtype=torch.uint8 if fp8 else torch.bfloat16)
    base = build_pools(spec)  # the controller's device pool and allocator
    layers, index_width, indexer = spec.layers, 12, variant != "plain"
    kv_dim = spec.kv_lora_rank + spec.rope_dim
    k_width = k_width or (kv_dim if fp8 else spec.kv_lora_rank)

    def dev(n_layers: int, width: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
        return torch.zeros(n_layers, DEVICE_TOKENS, 1, width, dtype=dtype)

    native = MLASplitBuffers(
        k=dev(layers, k_width), v=dev(layers, spec.rope_dim),
        index_k=dev(1, index_width) if indexer else None,
        index_scales=dev(1, 1, torch.float32) if indexer else None,
        index_layer_indices=(1,) if indexer else (), k_width=k_width, v_width=spec.rope_dim,
        index_width=index_width,
    )
    info = MLABufferInfo(buffers=native, data_ptrs=None, layer_indices=tuple(range(layers)),
                         device_layer_num=layers, page_size=PS, kv_lora_rank=spec.kv_lora_rank,
                         qk_rope_head_dim=spec.rope_dim, kv_cache_dim=kv_dim, dtype=spec.dtype,
                         device=torch.device("cpu"), packed_fp8=fp8)
    host = MLATokenToKVPoolHost(info, 2.0, 0, PS, "page_first_kv_split", pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers,
                                target_layer_num=layers, host_token_capacity=HOST_TOKENS)
    return spec, Pools(base.allocator, base.device_pool, host)


def _page_buffers(host) -> list[torch.Tensor]:
    if isinstance(host.kv_buffer, tuple):  # asymmetric: (K, V)
        return list(host.kv_buffer)
    v = None if host.dsa_kv_cache_store_fp8 else host.v_buffer  # FP8 DSA: V is packed into K
    return [b for b in (host.k_buffer, v, host.index_k_buffer, host.index_k_scale_buffer) if b is not None]


def _token_rows(host, idx: torch.Tensor) -> list[bytes]:
    """Per token at ``idx``: its bytes in every buffer of the pool, read by the dims SGLang's
    ``init_kv_buffer`` gives each (token-major ``page_first``; page-major with the token in page
    on axis 2 otherwise), independent of any page plan."""
    rows = []
    for b in _page_buffers(host):
        if host.layout == "page_first":          # (token, layer, head, dim)
            per_token = b.reshape(b.shape[0], -1)
        else:                                    # (page, layer, token in page, ...)
            per_token = b.transpose(1, 2).reshape(b.shape[0] * b.shape[2], -1)
        rows.append(per_token[idx.to(torch.int64)].contiguous().view(torch.uint8))
    return [b"".join(r[i].numpy().tobytes() for r in rows) for i in range(len(idx))]


def _cases():
    return ([pytest.param("asym", lay, id=f"asymmetric-{lay}") for lay in ("page_first", "page_first_direct")]
            + [pytest.param("kv_split", v, id=f"kv_split-{v}") for v in ("indexer", "plain", "fp8")])


def _pools(kind: str, arg) -> tuple[PoolSpec, Pools]:
    return _asymmetric_pools(arg) if kind == "asym" else _kv_split_pools(arg)


@pytest.mark.parametrize("controller,tier", [("v1", "mem"), ("v1", "disk"), ("hybrid", "mem")])
@pytest.mark.parametrize("kind,arg", _cases())
def test_pools_of_unequal_buffers_restore_every_token(kind, arg, controller, tier, tmp_path):
    """Before, radixkv could not store these pools: the asymmetric pool's registration raised
    SGLang's NotImplementedError ("use mooncake, simm"), and a page_first_kv_split pool got the flat
    plan, whose every backup then failed with a logged warning forever. Now a page is one chunk of
    its segments in every buffer (unequal sizes), read back through SGLang's controller
    (``HiCacheController``, and the ``HybridCacheController`` a server builds) into fresh host
    slots: every token's bytes in every buffer come back exactly."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from _helpers import disk_tier

    spec, pools = _pools(kind, arg)
    cfg = extra_config([mem_tier()] if tier == "mem" else [disk_tier(tmp_path / "l3")])
    if controller == "v1":
        h = ControllerHarness(spec, extra_config=cfg, pools=pools)
        alloc, backup = h.alloc, h.backup

        def prefetch(toks):
            r = h.prefetch(toks)
            return r.hit_tokens, r.loaded_tokens, r.host_indices
    else:
        h = HybridHarness(spec, {}, extra_config=cfg, pools={PoolName.KV: pools})

        def alloc(n):
            return h.alloc(PoolName.KV, n)

        def backup(toks, idx):
            return h.backup(toks, idx, None).completed_tokens

        def prefetch(toks):
            op, acks = h.prefetch(toks, None)
            return (op.storage_hit_count, max((a.completed_tokens or 0 for a in acks), default=0),
                    op.host_indices)
    try:
        be = unwrap(h.backend)
        host = pools.host_pool
        # Junk in every slot first: a read that restores nothing (or a part of a page) cannot pass.
        gen = torch.Generator().manual_seed(11)
        for b in _page_buffers(host):
            u8 = b.view(-1).view(torch.uint8)
            u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=gen))
        toks = tokens(12 * PS, seed=5)
        src = alloc(12 * PS)
        want = _token_rows(host, src)
        assert backup(toks, src) == 12 * PS
        be.store.flush()
        hit, loaded, dst = prefetch(toks)
        assert hit == loaded == 12 * PS
        assert not set(dst.tolist()) & set(src.tolist())  # fresh slots
        assert _token_rows(host, dst) == want
        hit, loaded, dst = prefetch(toks[: 5 * PS] + tokens(2 * PS, seed=6))  # a prefix of it
        assert loaded == 5 * PS and _token_rows(host, dst[:loaded]) == want[: 5 * PS]
        assert be.counters["failed_calls"] == 0
        # one chunk per page: a segment per buffer, the whole page
        plan = be._binding("kv").plan
        assert (plan.mode, plan.n_segments, plan.has_flat) == ("parts", len(_page_buffers(host)), False), plan
        assert plan.chunk_bytes == PS * host.get_size_per_token()
        be.check_integrity()
    finally:
        h.close()


@pytest.mark.parametrize("kind,arg", _cases())
def test_pools_without_flat_page_refuse_the_copying_interface(kind, arg):
    """SGLang's copying interface (``interface_v1`` off) backs up flat data pages, which these pools
    lack (SGLang's own get_data_page raises): the attach is refused with a radixkv ConfigError that
    says to turn ``interface_v1`` on. Before, the asymmetric pool raised SGLang's NotImplementedError
    naming other backends, and the page_first_kv_split pool attached and failed every backup."""
    from radixkv.errors import ConfigError

    spec, pools = _pools(kind, arg)
    with pytest.raises(ValueError, match=r"no flat data page.*\"interface_v1\": 1") as e:
        ControllerHarness(spec, extra_config=extra_config([mem_tier()], interface_v1=0), pools=pools)
    assert isinstance(e.value.__cause__, ConfigError)  # SGLang's controller wraps it in a ValueError


def test_kv_split_pool_whose_metadata_misses_part_of_the_page_is_refused():
    """A ``page_first_kv_split`` pool whose buffer metadata covers less than its page (here an FP8
    DSA pool whose packed K row is narrower than its KV row, so its RoPE part would be in the V
    mirror SGLang leaves out) has no flat page to fall back on either: the attach is refused with a
    ConfigError naming both sizes, never a plan that restores part of each page. Before, it got the
    flat plan and failed every backup with a logged warning."""
    from radixkv.errors import ConfigError

    spec, pools = _kv_split_pools("fp8", k_width=PoolSpec(kind="mla").kv_lora_rank)  # the latent alone
    with pytest.raises(ValueError, match=r"page_first_kv_split.*covers 192 bytes of a 256-byte page") as e:
        ControllerHarness(spec, extra_config=extra_config([mem_tier()]), pools=pools)
    assert isinstance(e.value.__cause__, ConfigError)


def test_mxfp8_kv_pool_is_refused_with_the_way_out():
    """SGLang's MXFP8 host pool (``--kv-cache-dtype mxfp8``) exposes no storage pages: every
    storage method raises NotImplementedError (its page scales live outside kv_buffer). Before, that
    raw error escaped the registration; now the attach fails with a radixkv ConfigError that names
    the setting and what to do instead. (The pool needs CUDA to build, so SGLang's class is put on
    a CPU MHA pool: the storage methods radixkv calls are all the MXFP8 class's own.)"""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    from radixkv.errors import ConfigError

    spec = PoolSpec(kind="mha", page_size=PS, host_tokens=HOST_TOKENS)
    pools = build_pools(spec)
    pools.host_pool.__class__ = MHATokenToKVPoolMXFP8Host
    with pytest.raises(ValueError, match=r"mxfp8.*another --kv-cache-dtype.*without an L3 storage backend") as e:
        ControllerHarness(spec, extra_config=extra_config([mem_tier()]), pools=pools)
    assert isinstance(e.value.__cause__, ConfigError)


def test_a_pool_whose_pages_move_is_stored_through_its_flat_page(monkeypatch):
    """Found by an audit (a suspicion, made concrete here): SGLang's unified host pool translates
    logical pages to physical ones per call and moves them when it compacts. Attached while its
    probe pages happened to map affinely, radixkv would have cached a zero-copy address plan that
    names other pages after the next compaction. A pool with a page format of its own (or a shared
    backing) is now always stored through its own flat page calls, which translate."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from radixkv.adapters.sglang_pages import plan_for

    host = build_pools(PoolSpec(layout="page_first", page_size=PS, host_tokens=HOST_TOKENS)).host_pool
    assert plan_for(host).mode == "parts"  # fixed addresses: the zero-copy plan
    monkeypatch.setattr(MHATokenToKVPoolHost, "storage_format_tag", "unified-token-major")
    assert plan_for(host).mode == "flat"
    monkeypatch.undo()
    host._shared_backing = object()
    assert plan_for(host).mode == "flat"
