"""RadixKVStore.check_integrity() must catch a non-writer rank whose replicated pool is not
borrowed in a shared tier: that rank's room-making would then delete the writer rank's pages from
the shared tier instead of only forgetting them. Before, the check looked at the page plans only."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="needs sglang==0.5.23 (run inside .envs/sglang)")

from radixkv.adapters.sglang_cpu import ControllerHarness, PoolSpec  # noqa: E402

from _helpers import disk_tier, extra_config, mem_tier, unwrap  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("flat", [False, True])
def test_a_non_writer_namespace_not_borrowed(tmp_path, rank, flat):
    spec = PoolSpec(kind="mla", layout="page_first", page_size=4, host_tokens=64)
    rank(1, 2)
    h = ControllerHarness(spec, extra_config=extra_config([mem_tier(), disk_tier(tmp_path / "l3", shared=True)]))
    try:
        backend = unwrap(h.backend)
        assert not backend.is_writer
        backend.check_integrity()
        b = backend._bindings["kv"]
        s = backend.store._stack
        with backend.store.lock:
            s._borrowed.discard((1, (b.ns_flat if flat else b.ns).digest))
        with pytest.raises(AssertionError, match="not borrowed in tiers"):
            backend.check_integrity()
    finally:
        h.close()
