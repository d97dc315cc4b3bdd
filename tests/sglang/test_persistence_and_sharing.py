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
    finally:
        b.close()
    # Another model (namespace) on the same directory sees nothing (one server at a time: a second
    # process on a non-shared directory is refused, docs/sglang.md "Ranks and disk directories").
    other = ControllerHarness(spec, extra_config=cfg, model_name="other-model")
    try:
        assert other.prefetch(toks).hit_tokens == 0
    finally:
        other.close()


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


def test_corrupted_disk_page_is_a_miss_never_wrong_bytes(tmp_path):
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([disk_tier(tmp_path / "l3")])
    toks = tokens(24, seed=51)
    a = ControllerHarness(spec, extra_config=cfg)
    try:
        src = a.alloc(24)
        a.fill_random(src, seed=6)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 24
        keys = a.page_keys(toks)
    finally:
        a.close()
    # Flip one byte of page 3's V segment (the second half of its chunk's payload) on disk.
    victim = [p for p in (tmp_path / "l3").rglob("*.kv") if p.name.startswith(keys[3])]
    assert len(victim) == 1, sorted(p.name for p in (tmp_path / "l3").rglob("*.kv"))
    raw = bytearray(victim[0].read_bytes())
    raw[-100] ^= 0xFF
    victim[0].write_bytes(bytes(raw))

    b = ControllerHarness(spec, extra_config=cfg)
    try:
        res = b.prefetch(toks)
        assert res.hit_tokens == 24  # existence cannot see the flip
        assert res.loaded_tokens == 12  # the read stops at the corrupted page: a miss, not data
        assert b.page_bytes_at(res.host_indices)[:3] == want[:3]
        assert unwrap(b.backend).get_stats().radixkv["tiers"]["disk"]["checksum_failures"] >= 1
    finally:
        b.close()


def test_clear_close_and_stats(tmp_path):
    spec = PoolSpec(layout="page_first_direct", page_size=4, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path)]))
    try:
        toks = tokens(16, seed=71)
        src = h.alloc(16)
        h.fill_random(src, seed=2)
        assert h.backup(toks, src) == 16
        assert h.prefetch(toks).loaded_tokens == 16
        backend = unwrap(h.backend)
        st = backend.get_stats()
        # a chunk per page
        assert st.radixkv["tiers"]["mem"]["hits"] >= 4 and st.radixkv["tree"]["chunks"] == 4
        assert sum(backend.get_stats().backup_pgs) == 0  # per-call metrics drain on every get_stats
        backend.clear()
        assert h.prefetch(toks).hit_tokens == 0  # gone from every tier, disk included
        assert backend.store.stats()["tree"]["chunks"] == 0
    finally:
        h.close()
    unwrap(h.controller.storage_backend or backend).close()  # idempotent after SGLang's detach


@pytest.mark.parametrize("where", ["top", "store", "env"])
def test_probe_tiers_off_is_honoured_wherever_it_is_set(tmp_path, monkeypatch, where):
    # probe_tiers is a StoreConfig field; the backend once read only the top-level key, so setting it
    # in "store" or the environment left probing on.
    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    toks = tokens(16, seed=12)
    a = ControllerHarness(spec, extra_config=extra_config([disk_tier(tmp_path / "l3")]))
    try:
        src = a.alloc(16)
        a.fill_random(src, seed=6)
        assert a.backup(toks, src) == 16
    finally:
        a.close()
    more = {"top": {"probe_tiers": False}, "store": {"store": {"probe_tiers": False}}, "env": {}}[where]
    if where == "env":
        monkeypatch.setenv("RADIXKV_PROBE_TIERS", "false")
        monkeypatch.setenv("RADIXKV_TIERS", f"file://{tmp_path / 'l3'}?capacity=256MiB")
        cfg = {k: v for k, v in extra_config([]).items() if k != "tiers"}
    else:
        cfg = extra_config([disk_tier(tmp_path / "l3")], **more)
    b = ControllerHarness(spec, extra_config=cfg)
    try:
        assert unwrap(b.backend).store.config.probe_tiers is False
        assert b.prefetch(toks).hit_tokens == 0  # on disk, but not probed: a fresh tree misses
        assert unwrap(b.backend).counters["adopted_chunks"] == 0
    finally:
        b.close()


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_child_pages_backed_up_before_their_parent_still_hit(interface_v1):
    # SGLang backs up node by node with no parent-first rule (write_back evicts leaf-first): the child
    # lands first, hangs at the namespace root, and hits once stopped at the parent.
    import time

    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=512)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier()], interface_v1))
    try:
        toks = tokens(24, seed=1)
        keys = h.page_keys(toks)
        src = h.alloc(24)
        h.fill_random(src, seed=3)
        want = h.page_bytes_at(src)
        h.controller.write_storage(src[12:24], toks[12:24], hash_value=keys[3:6], prefix_keys=keys[:3])
        deadline = time.monotonic() + 10
        while unwrap(h.backend).store.lookup(unwrap(h.backend)._bindings["kv"].ns if interface_v1 else
                                             unwrap(h.backend)._bindings["kv"].ns_flat, [keys[3]], probe=False) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert h.backup(toks[:12], src[:12]) == 12  # the parent, after its child
        res = h.prefetch(toks)
        assert res.hit_tokens == 24 and res.loaded_tokens == 24
        assert h.page_bytes_at(res.host_indices) == want
        unwrap(h.backend).check_integrity()
    finally:
        h.close()


def test_server_args_that_change_the_kv_are_part_of_the_namespace(tmp_path, monkeypatch):
    """Found by the cache-identity hunt: SGLang names a backend's pages by its served model name
    only, so a server restarted on the same disk tier (or a second one on shared Redis) with another
    ``--revision``, ``--quantization`` or ``--json-model-override-args`` under that name read the
    first one's pages: KV of other weights. A digest of the server arguments that decide the KV now
    ends every namespace; the same arguments still hit after a restart."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3")])
    toks = tokens(32, seed=31)
    base = {"model_path": "org/model", "revision": "v1", "dtype": "bfloat16", "kv_cache_dtype": "auto",
            "quantization": None, "json_model_override_args": "{}"}

    def serve(**changes):
        args = SimpleNamespace(**{**base, **changes})
        monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
        return ControllerHarness(spec, extra_config=cfg, model_name="served-name")

    a = serve()
    try:
        src = a.alloc(32)
        a.fill_random(src, seed=3)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 32
    finally:
        a.close()
    for change in ({"revision": "v2"}, {"quantization": "fp8"},
                   {"json_model_override_args": '{"rope_theta": 500000}'}, {"model_path": "/ckpt/other"}):
        other = serve(**change)
        try:
            assert other.prefetch(toks).hit_tokens == 0, change
        finally:
            other.close()
    same = serve()  # a restart with the same arguments finds its pages
    try:
        res = same.prefetch(toks)
        assert res.hit_tokens == 32 and same.page_bytes_at(res.host_indices) == want
    finally:
        same.close()


@pytest.mark.parametrize("interface_v1", [1, 0])
def test_a_pools_page_format_is_part_of_the_namespace_under_the_model_option(tmp_path, monkeypatch, interface_v1):
    """Found by an audit: SGLang tells page formats apart by appending the host pool's
    ``storage_format_tag`` (``unified-token-major``: token-major envelopes) to the model name it
    hands a backend, but radixkv's ``model`` option replaced that name, so a unified server and a
    page_first server of one served model shared a namespace: pages of one byte order loaded into
    a pool of the other. The tag now is part of the namespace whatever names the model."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([disk_tier(tmp_path / "l3", shared=True)], interface_v1, model="served-model")
    toks = tokens(32, seed=41)

    def serve(tag):
        with monkeypatch.context() as m:
            m.setattr(MHATokenToKVPoolHost, "storage_format_tag", tag)
            return ControllerHarness(spec, extra_config=cfg)

    a = serve("unified-token-major")
    try:
        src = a.alloc(32)
        a.fill_random(src, seed=7)
        want = a.page_bytes_at(src)
        assert a.backup(toks, src) == 32
    finally:
        a.close()
    plain = serve(None)  # same model option, dtype, layout and page bytes; another page format
    try:
        assert plain.prefetch(toks).hit_tokens == 0
    finally:
        plain.close()
    same = serve("unified-token-major")
    try:
        res = same.prefetch(toks)
        assert res.hit_tokens == 32 and same.page_bytes_at(res.host_indices) == want
    finally:
        same.close()
