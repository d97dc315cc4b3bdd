"""``HierarchicalStore.borrow``: a store that reads a namespace another process writes into a shared
tier (SGLang's MLA non-writer ranks) forgets those chunks when it makes room, and leaves their bytes
for the owner; without ``borrow`` its eviction deletes them, as any store's does."""

from __future__ import annotations

import uuid

import pytest

from radixkv.config import StoreConfig, TierConfig
from radixkv.errors import InputError
from radixkv.store import HierarchicalStore
from store_helpers import CHUNK_BYTES, FRAME_SLACK, REDIS_OPTIONS, chain, new_namespace, payload_for
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


def _shared_disk(root, chunks: int) -> TierConfig:
    return TierConfig(url=f"file://{root}", capacity_bytes=chunks * (CHUNK_BYTES + FRAME_SLACK),
                      options={"shared": True})


def test_a_failed_read_in_a_borrowed_namespace_leaves_the_owners_chunks(tmp_path):
    """A reader's read of x[1] fails once (a transient I/O error): it forgets x[1] and its orphans
    x[2], x[3]. Before: it also deleted them from the shared tier, so the owner lost intact chunks."""
    ns = new_namespace()
    x = chain(43, 4)[1]
    owner = HierarchicalStore(StoreConfig(tiers=[_shared_disk(tmp_path, 16)]))
    reader = HierarchicalStore(StoreConfig(tiers=[_shared_disk(tmp_path, 16)]))
    try:
        reader.borrow(ns)
        fill(owner, ns, x)
        assert read(reader, ns, x) == 4  # adopted
        tier = reader.tiers[0]
        real = tier.get_many
        tier.get_many = lambda n, keys, bufs: [o and k != x[1] for k, o in zip(keys, real(n, keys, bufs))]
        assert read(reader, ns, x) == 1
        tier.get_many = real
        assert read(owner, ns, x) == 4
        assert read(reader, ns, x) == 4  # adopted again
        owner.check_integrity()
        reader.check_integrity()
    finally:
        owner.close()
        reader.close()


def test_a_borrower_never_writes_into_the_borrowed_tier(tmp_path):
    """x0 is in the reader's memory only (its disk books forgot it, the owner deleted it); a
    promotion evicts x0 from memory. Before: the demotion wrote x0 into the shared directory, and
    the reader's next eviction only forgot it: a file no store tracked or counted."""
    import os

    ns = new_namespace()
    (x0,), z, (w0,), (v0,), (u0,) = (chain(50 + i, 2 if i == 1 else 1)[1] for i in range(5))
    owner = HierarchicalStore(StoreConfig(tiers=[_shared_disk(tmp_path, 16)]))
    reader = HierarchicalStore(StoreConfig(
        tiers=[TierConfig(url="mem://", capacity_bytes=2 * CHUNK_BYTES), _shared_disk(tmp_path, 3)],
        promote_after_hits=2))
    path = owner.tiers[0]._layout.path(ns.digest, x0)
    try:
        reader.borrow(ns)
        for c in ([x0], z, [w0], [v0], [u0]):
            fill(owner, ns, c)
        read(reader, ns, [x0])
        read(reader, ns, [x0])
        reader.flush(30)  # the reader holds x0 in memory and on disk
        owner.delete(ns, [x0])  # the owner drops x0: its file is gone
        read(reader, ns, z)
        read(reader, ns, [w0])  # adopting w0 forgets x0 in the reader's disk books
        read(reader, ns, z)
        reader.flush(30)  # promoting z evicts x0 from memory: no demotion into the borrowed tier
        for c in ([w0], [v0], [u0]):
            read(reader, ns, c)
        reader.flush(30)
        with reader.lock:
            assert reader.tree.lookup(ns.digest, x0) is None
        assert not os.path.exists(path), "a file of the borrowed namespace that no store tracks"
        owner.check_integrity()
        reader.check_integrity()
    finally:
        owner.close()
        reader.close()


def test_a_borrowers_disk_budget_never_counts_the_owners_files(tmp_path):
    """A shared disk tier indexes the files it reads and evicts what it indexes when its own
    per-process budget runs out. Before: the owner's files a borrower had read were in that budget
    (so its disk tier could delete them on its own); now the tier never indexes a borrowed
    namespace, and a put into it is refused."""
    theirs, mine = new_namespace(), new_namespace()
    x, y = chain(60, 4)[1], chain(61, 4)[1]
    owner = HierarchicalStore(StoreConfig(tiers=[_shared_disk(tmp_path, 16)]))
    reader = HierarchicalStore(StoreConfig(tiers=[_shared_disk(tmp_path, 4)]))
    try:
        reader.borrow(theirs)
        fill(owner, theirs, x)
        assert read(reader, theirs, x) == 4
        assert reader.tiers[0].stats().extra["chunks"] == 0  # read, not indexed
        fill(reader, mine, y)  # its own chunks, in its own 4-chunk budget
        assert read(owner, theirs, x) == 4
        assert reader.tiers[0].stats().extra["chunks"] == 4  # only its own files count
        with pytest.raises(InputError, match=r"borrowed from tier .* put it from the owner"):
            reader.put(theirs, x, [payload_for(k) for k in x])
        owner.check_integrity()
        reader.check_integrity()
    finally:
        owner.close()
        reader.close()

