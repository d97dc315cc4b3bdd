"""``HierarchicalStore.borrow``: a store that reads a namespace another process writes into a shared
tier (SGLang's MLA non-writer ranks) forgets those chunks when it makes room, and leaves their bytes
for the owner; without ``borrow`` its eviction deletes them, as any store's does."""

from __future__ import annotations

import uuid

import pytest

from radixkv.config import StoreConfig, TierConfig
from radixkv.errors import InputError
from radixkv.store import HierarchicalStore
from store_helpers import CHUNK_BYTES, FRAME_SLACK, REDIS_OPTIONS, chain, new_namespace
from test_store_adoption import fill, read


@pytest.fixture(params=["disk", "redis"])
def shared_tier(request, tmp_path):
    """``make(chunks) -> TierConfig`` of one shared tier (a shared directory, or one Redis prefix)."""
    if request.param == "disk":
        return lambda chunks: TierConfig(url=f"file://{tmp_path}", capacity_bytes=chunks * (CHUNK_BYTES + FRAME_SLACK),
                                         options={"shared": True})
    url = request.getfixturevalue("redis_url")
    prefix = f"borrow{uuid.uuid4().hex[:8]}"
    return lambda chunks: TierConfig(url=url, capacity_bytes=chunks * (CHUNK_BYTES + FRAME_SLACK),
                                     options=dict(REDIS_OPTIONS, key_prefix=prefix))


def _stores(shared_tier, mem: bool):
    """The owner (room for 16 chunks) and a reader with room for 4 in the shared tier."""
    lead = [TierConfig(url="mem://", capacity_bytes=4 * CHUNK_BYTES)] if mem else []
    owner = HierarchicalStore(StoreConfig(tiers=[shared_tier(16)]))
    reader = HierarchicalStore(StoreConfig(tiers=lead + [shared_tier(4)]))
    return owner, reader


@pytest.mark.parametrize("mem", [False, True], ids=["shared-only", "mem+shared"])
@pytest.mark.parametrize("borrowed", [True, False], ids=["borrowed", "not-borrowed"])
def test_reader_making_room_keeps_or_deletes_the_owners_chunks(shared_tier, mem, borrowed):
    ns = new_namespace()
    x, y = chain(40, 4)[1], chain(41, 4)[1]
    owner, reader = _stores(shared_tier, mem)
    try:
        shared = reader.tiers[-1].name
        if borrowed:
            assert reader.borrow(ns) == [shared]
        fill(owner, ns, x)
        fill(owner, ns, y)
        assert read(reader, ns, x) == 4
        assert read(reader, ns, y) == 4  # room for 4: the reader evicts x from its books
        reader.flush(30)
        st = reader.stats()
        assert st["tiers"][shared]["tree_chunks"] <= 4
        if borrowed:
            assert st["store"]["evictions_kept_for_owner"] == 4
            assert read(owner, ns, x) == 4  # still there for the owner
            assert read(reader, ns, x) == 4  # and the reader adopts it again
        else:
            assert st["store"]["evictions_kept_for_owner"] == 0
            assert read(owner, ns, x) == 0  # the reader's eviction deleted the owner's bytes
        owner.flush(30)
        reader.flush(30)
        owner.reconcile()  # (not-borrowed: the owner's tree still places x in the tier)
        owner.check_integrity()
        reader.check_integrity()
    finally:
        owner.close()
        reader.close()


def test_explicit_delete_of_a_borrowed_namespace_still_deletes(shared_tier):
    ns = new_namespace()
    x = chain(42, 4)[1]
    owner, reader = _stores(shared_tier, mem=False)
    try:
        reader.borrow(ns)
        fill(owner, ns, x)
        assert read(reader, ns, x) == 4
        assert reader.delete(ns, x[2:]) == 2
        owner.reconcile()
        assert read(owner, ns, x) == 2
        reader.check_integrity()
    finally:
        owner.close()
        reader.close()


def test_only_shared_tiers_can_be_borrowed(tmp_path):
    ns = new_namespace()
    cfg = StoreConfig(tiers=[
        TierConfig(url="mem://", capacity_bytes=4 * CHUNK_BYTES),
        TierConfig(url=f"file://{tmp_path / 'own'}", capacity_bytes=8 * (CHUNK_BYTES + FRAME_SLACK)),
        TierConfig(url=f"file://{tmp_path / 'shared'}", capacity_bytes=8 * (CHUNK_BYTES + FRAME_SLACK),
                   options={"shared": True}),
    ])
    with HierarchicalStore(cfg) as s:
        names = [t.name for t in s.tiers]
        assert s.borrow(ns) == [names[2]]  # default: every shared tier
        assert s.borrow(ns, [names[2], names[2]]) == [names[2]]  # idempotent
        with pytest.raises(InputError, match=rf"tier {names[0]!r} is not shared.*shared=true"):
            s.borrow(ns, [names[0]])
        with pytest.raises(InputError, match=rf"tier {names[1]!r} is not shared"):
            s.borrow(ns, [names[1]])
        with pytest.raises(InputError, match=r"'nope' is not one of this store's tiers"):
            s.borrow(ns, ["nope"])
        with pytest.raises(InputError, match=r"list of tier names, not one str"):
            s.borrow(ns, names[2])
        with pytest.raises(InputError, match=r"must be a radixkv Namespace"):
            s.borrow("ns", [names[2]])  # type: ignore[arg-type]
