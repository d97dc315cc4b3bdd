"""SGLang's configuration matrix on the storage path: host layouts (``--hicache-mem-layout``, which
``--hicache-io-backend direct`` rewrites from ``page_first`` to ``page_first_direct``), page sizes,
MHA and MLA, ``interface_v1`` on and off. Bytes are compared as KV (per token, layer, head), not as
flat pages, whose byte order differs between layouts."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

import torch  # noqa: E402

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, tokens, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang

# (kind, layout written, layout read after a restart on the same disk tier)
_LAYOUT_CHANGES = [
    ("mha", "page_first", "layer_first"),
    ("mha", "layer_first", "page_first"),
    ("mha", "page_first", "page_first_direct"),  # --hicache-io-backend direct on a page_first server
    ("mha", "page_head", "layer_first"),
    ("mla", "page_first", "layer_first"),
    ("mla", "page_first", "page_first_direct"),
]


def _spec(kind: str, layout: str) -> PoolSpec:
    return PoolSpec(kind=kind, layout=layout, page_size=4, layers=3, host_tokens=256)


def _backup(kind: str, layout: str, cfg: dict, toks: list[int], seed: int) -> torch.Tensor:
    """Back up 16 tokens of random KV from a server of ``layout`` and close it; its per-token KV."""
    h = ControllerHarness(_spec(kind, layout), extra_config=cfg)
    try:
        src = h.alloc(16)
        h.fill_random(src, seed=seed)
        want = h.token_kv(src)
        assert h.backup(toks, src) == 16
        assert unwrap(h.backend).store.flush(timeout_s=30)
    finally:
        h.close()
    return want


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["v1", "copy"])
@pytest.mark.parametrize("kind,written,read", _LAYOUT_CHANGES)
def test_pages_of_one_layout_never_load_as_another_layouts_kv(tmp_path, kind, written, read, interface_v1):
    """A restart with another host layout (or a second server on the same tier) must miss or load the
    same KV, never bytes laid out for the other layout. The copying path (``interface_v1: 0``) stores
    SGLang's flat data pages, which ``page_first`` flattens token-major and ``page_head`` head-major:
    they once shared one ``flat`` namespace with the layer-major layouts, and a ``page_first`` page
    loaded into a ``layer_first`` pool with its layers and tokens transposed (16 of 16 tokens hit,
    all wrong)."""
    toks = tokens(16, seed=3)
    cfg = extra_config([disk_tier(tmp_path)], interface_v1)
    want = _backup(kind, written, cfg, toks, seed=1)
    h2 = ControllerHarness(_spec(kind, read), extra_config=cfg)
    try:
        res = h2.prefetch(toks)
        if res.hit_tokens:
            assert res.loaded_tokens == res.hit_tokens
            got = h2.token_kv(res.host_indices)
            assert torch.equal(got, want[: res.hit_tokens]), f"{written} pages loaded as {read} KV"
    finally:
        h2.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_major_layouts_still_share_flat_pages(tmp_path, kind):
    """``layer_first`` and ``page_first_direct`` flatten a page in the same (canonical) order: on the
    copying path a page written under one is a hit, with the same KV, under the other."""
    toks = tokens(16, seed=4)
    cfg = extra_config([disk_tier(tmp_path)], 0)
    want = _backup(kind, "layer_first", cfg, toks, seed=2)
    h2 = ControllerHarness(_spec(kind, "page_first_direct"), extra_config=cfg)
    try:
        res = h2.prefetch(toks)
        assert res.hit_tokens == 16 and res.loaded_tokens == 16
        assert torch.equal(h2.token_kv(res.host_indices), want)
    finally:
        h2.close()


@pytest.mark.parametrize("kind,written,read", [
    ("mha", "page_first", "layer_first"),
    ("mha", "page_first", "page_first_direct"),
    ("mha", "page_head", "layer_first"),
    ("mla", "page_first", "page_first_direct"),
])
def test_flat_pages_of_earlier_releases_never_load_into_a_canonical_layout(tmp_path, monkeypatch, kind, written,
                                                                           read):
    """Found by the upgrade hunt: releases before the flat format carried its byte order stored the
    flat pages of every layout under ``flat``, and the canonical (layer-major) layouts kept that name,
    so after an upgrade a ``layer_first`` or ``page_first_direct`` server (``--hicache-io-backend
    direct``) loaded a ``page_first`` server's flat pages with layers and tokens transposed (16 of 16
    tokens hit, all wrong). Pages under the old name must be misses."""
    import radixkv.adapters.sglang as sglang_adapter

    toks = tokens(16, seed=5)
    cfg = extra_config([disk_tier(tmp_path)], 0)
    with monkeypatch.context() as m:
        m.setattr(sglang_adapter, "flat_format", lambda pool: "flat")  # what earlier releases named them
        want = _backup(kind, written, cfg, toks, seed=1)
    h2 = ControllerHarness(_spec(kind, read), extra_config=cfg)
    try:
        res = h2.prefetch(toks)
        if res.hit_tokens:
            got = h2.token_kv(res.host_indices)
            assert torch.equal(got, want[: res.hit_tokens]), f"{written} pages loaded as {read}"
        assert res.hit_tokens == 0
    finally:
        h2.close()
