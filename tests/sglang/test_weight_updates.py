"""In-place weight updates (RL loops: verl, slime, OpenRLHF) through SGLang 0.5.23's own weight
updater: its flush resets L1/L2 and never calls the L3 backend, so radixkv must see the change."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, tokens, unwrap  # noqa: E402


@pytest.fixture
def published_server_config():
    """A published server config, as a launched server has (SGLang keeps the served weight version
    in it); restored after the test."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args()
    args = override.install()
    yield args
    override.restore()


def _weight_updater(h: ControllerHarness):
    """SGLang's SchedulerWeightUpdaterManager with a model runner whose load succeeds, and the
    scheduler parts it calls: the version record (``Scheduler.record_weight_version_change``'s
    config override; the scheduler module itself needs a GPU stack to import) and ``flush_cache``
    (``UnifiedRadixCache.reset``'s HiCache part: controller reset, host pool cleared)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.runtime_context import get_context, get_parallel, get_serving

    def record_weight_version_change(new_version):
        if new_version is not None and new_version != get_serving().weight_version:
            get_context().override("scheduler.weight_version", weight_version=new_version)

    def flush_cache(empty_cache=True):
        h.controller.reset()
        h.controller.mem_pool_host.clear()
        return True

    runner = types.SimpleNamespace(weight_updater=types.SimpleNamespace(
        update_weights_from_disk=lambda *a, **k: (True, "Succeeded to update model weights.")))
    tp_worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", runner)])
    scheduler = types.SimpleNamespace(record_weight_version_change=record_weight_version_change)
    with get_parallel().override(tp_group=types.SimpleNamespace(cpu_group=None)):
        return SchedulerWeightUpdaterManager(
            tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None, flush_cache=flush_cache,
            is_fully_idle=lambda **k: True, scheduler=scheduler)


def test_weight_update_with_a_version_never_serves_the_old_weights_kv(tmp_path, published_server_config):
    """Found by the weight-update hunt: after ``update_weights_from_disk(weight_version=...)`` SGLang
    flushed L1/L2 but radixkv's namespace was fixed at attach, so the prefetch of a prompt served
    before the update hit the KV the old weights computed (silently wrong outputs). The namespaces
    now follow the served weight version: that prompt misses, the new weights' pages hit, and
    ``clear()`` drops the old version's pages too."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path / "l3")]))
    try:
        toks = tokens(32, seed=41)
        src = h.alloc(32)
        h.fill_random(src, seed=1)
        assert h.backup(toks, src) == 32
        assert h.prefetch(toks).hit_tokens == 32
        out = _weight_updater(h).update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path="/ckpt/step-1", weight_version="step-1"))
        assert out.success, out.message
        assert h.prefetch(toks).hit_tokens == 0  # the old weights' KV
        src2 = h.alloc(32)
        h.fill_random(src2, seed=2)
        want = h.page_bytes_at(src2)
        assert h.backup(toks, src2) == 32  # the new weights' KV of the same prompt
        res = h.prefetch(toks)
        assert res.hit_tokens == 32 and h.page_bytes_at(res.host_indices) == want
        store = unwrap(h.backend).store
        assert len(store.tree) > 8  # both versions' pages are in the books until cleared or evicted
        assert unwrap(h.backend).clear()
        assert len(store.tree) == 0 and h.prefetch(toks).hit_tokens == 0
        unwrap(h.backend).check_integrity()
    finally:
        h.close()


def test_weight_version_survives_a_restart_and_an_update_without_a_version_is_invisible(
        tmp_path, published_server_config):
    """The namespace is a function of the served version: a server restarted with
    ``--weight-version step-1`` on the same disk finds the pages stored under step-1, and the startup
    version's namespace is what it was before (pages stored before this change still hit). An update
    that names no version changes nothing the backend can see (documented: pass a version or call
    ``/clear_hicache_storage``)."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
    from sglang.srt.runtime_context import get_context

    spec = PoolSpec(layout="page_first", page_size=4, host_tokens=256)
    cfg = extra_config([mem_tier(), disk_tier(tmp_path / "l3")])
    toks = tokens(32, seed=43)
    h = ControllerHarness(spec, extra_config=cfg)
    try:
        startup_ns = unwrap(h.backend)._bindings["kv"].ns
        src = h.alloc(32)
        h.fill_random(src, seed=3)
        updater = _weight_updater(h)
        assert updater.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="/ckpt/x")).success
        assert h.prefetch(toks).hit_tokens == 0
        assert h.backup(toks, src) == 32
        assert h.prefetch(toks).hit_tokens == 32  # no version named: radixkv cannot tell
        assert updater.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path="/ckpt/y", weight_version="step-1")).success
        assert h.prefetch(toks).hit_tokens == 0
        src2 = h.alloc(32)
        h.fill_random(src2, seed=4)
        want = h.page_bytes_at(src2)
        assert h.backup(toks, src2) == 32
    finally:
        h.close()
    get_context().override("test.restart", weight_version="step-1")
    again = ControllerHarness(spec, extra_config=cfg)
    try:
        assert unwrap(again.backend)._bindings["kv"].ns != startup_ns
        res = again.prefetch(toks)
        assert res.hit_tokens == 32 and again.page_bytes_at(res.host_indices) == want
    finally:
        again.close()
