"""Host pool classes beyond plain MHA/MLA KV: every page state SGLang hands the backend comes back.

SGLang 0.5.23's DeepSeek-V4 stack (``build_deepseek_v4_hicache_stack``) anchors its host pools on a
``LogicalHostPool``: the KV pool holds page indices and no bytes (its flat page is empty, its
``get_page_buffer_meta`` is None) and the KV lives in compressed sidecar pools
(``DeepSeekV4PagedHostPool``: C4/C128 KV, indexer keys and scales), each gated on the KV chain by
the ``all_pages`` hit policy. These tests drive SGLang's own classes through its
``HybridCacheController`` on CPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

from radixkv.adapters.sglang_cpu import HybridHarness, Pools, PoolSpec, build_pools  # noqa: E402

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
