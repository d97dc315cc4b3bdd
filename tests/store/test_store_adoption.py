"""Adoption: chunks a disk or Redis tier holds that this store's tree never recorded (a restart over
the same directory, a second store sharing a directory or a Redis server) become hits with verified
bytes; corrupted ones are misses; ``probe_tiers=False`` keeps the tree-only behaviour."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from radixkv.config import StoreConfig, TierConfig
from radixkv.errors import InputError
from radixkv.store import HierarchicalStore
from store_helpers import (
    CHUNK_BYTES,
    FRAME_SLACK,
    REDIS_OPTIONS,
    assert_exact,
    buffers,
    chain,
    new_namespace,
    payload_for,
)
from test_store_faults import corrupt_disk_file


def disk_config(root: Path, chunks: int = 64, shared: bool = False, **kw) -> StoreConfig:
    opts = {"shared": True} if shared else {}
    return StoreConfig(
        tiers=[
            TierConfig(url="mem://", capacity_bytes=16 * CHUNK_BYTES),
            TierConfig(
                url=f"file://{root}",
                capacity_bytes=chunks * (CHUNK_BYTES + FRAME_SLACK),
                options=opts,
            ),
        ],
        **kw,
    )


def fill(store: HierarchicalStore, ns, keys) -> None:
    assert store.put(ns, keys, [payload_for(k) for k in keys]) == [True] * len(keys)
    assert store.flush(30)


def read(store: HierarchicalStore, ns, keys, **kw) -> int:
    bufs = buffers(len(keys))
    n = store.get(ns, keys, bufs, **kw)
    assert_exact(keys, bufs, n)
    return n


class TestRestart:
    def test_lookup_and_get_hit_after_restart(self, tmp_path):
        ns = new_namespace()
        keys = chain(1, 6)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path)) as b:
            # The namespace has no chunk size in the new store yet: lookup needs chunk_bytes.
            assert b.lookup(ns, keys) == 0
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 6
            b.check_integrity()
            assert read(b, ns, keys) == 6
            assert b.stats()["store"]["disk.adopted_chunks"] == 6
            assert b.stats()["store"]["disk.hit_chunks"] == 6
            b.flush(30)
            b.check_integrity()
            assert read(b, ns, keys) == 6  # promoted: now from memory

    def test_a_get_with_buffers_of_another_size_adopts_nothing_and_deletes_nothing(self, tmp_path):
        """Found by an audit: after a restart, one get with wrong-size buffers adopted the disk's
        chunks at that size, fixing it for the namespace; the reads failed, the valid files were
        deleted, and correct puts then raised InputError until a clear()."""
        import torch

        ns = new_namespace()
        keys = chain(3, 4)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path)) as b:
            wrong = [torch.zeros(CHUNK_BYTES // 2, dtype=torch.uint8) for _ in keys]
            assert b.get(ns, keys, wrong) == 0
            assert b.tiers[1].contains_many(ns.digest, keys) == 4  # the files are still there
            assert read(b, ns, keys) == 4  # and a get of the right size adopts them
            b.flush(30)
            b.check_integrity()

    def test_get_alone_adopts_sized_by_its_buffers(self, tmp_path):
        ns = new_namespace()
        keys = chain(2, 5)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path)) as b:
            h = b.prefetch(ns, keys, buffers(5))
            assert h.wait(30) == 5
        with HierarchicalStore(disk_config(tmp_path)) as c:
            assert read(c, ns, keys) == 5
            c.check_integrity()

    def test_adopted_run_continues_the_tree_hit(self, tmp_path):
        ns = new_namespace()
        keys = chain(4, 8)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path)) as b:
            fill(b, ns, keys[:3])  # the tree knows the first three; the disk holds all eight
            assert b.lookup(ns, keys, probe=False) == 3
            assert b.adopt(ns, keys) == 5
            assert b.adopt(ns, keys) == 0  # idempotent
            assert b.lookup(ns, keys, probe=False) == 8
            with b.lock:
                ids = b.tree.match(ns.digest, keys, touch=False).node_ids
                parents = [b.tree.node_parent(n) for n in ids]
            assert parents[1:] == ids[:-1]  # one chain: prefix-closed
            b.check_integrity()
            assert read(b, ns, keys) == 8

    def test_parent_key_places_the_run(self, tmp_path):
        ns = new_namespace()
        keys = chain(5, 6)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path)) as b:
            fill(b, ns, keys[:2])
            assert b.adopt(ns, keys[2:], parent_key=keys[1]) == 4
            with b.lock:
                first = b.tree.lookup(ns.digest, keys[2])
                assert b.tree.node_parent(first) == b.tree.lookup(ns.digest, keys[1])
            assert read(b, ns, keys) == 6
            b.check_integrity()

    def test_a_run_put_or_adopted_without_its_parent_awaits_it(self, tmp_path):
        """A run put with ``root_if_missing`` (or adopted) while its ``parent_key`` is missing hangs
        at the namespace root and awaits that key: the adoption or put that creates it later, even
        of the parent alone, grafts the run under it. Three runs become one chain."""
        ns = new_namespace()
        keys = chain(5, 6)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys[2:4])
        with HierarchicalStore(disk_config(tmp_path)) as b:
            tail = [payload_for(k) for k in keys[4:]]
            assert b.put(ns, keys[4:], tail, parent_key=keys[3]) == [False, False]
            got = b.put(ns, keys[4:], tail, parent_key=keys[3], root_if_missing=True)
            assert got == [True, True]
            assert b.adopt(ns, keys[2:4], parent_key=keys[1], chunk_bytes=CHUNK_BYTES) == 2
            b.check_integrity()
            fill(b, ns, keys[:2])  # the parent run alone
            with b.lock:
                ids = [b.tree.lookup(ns.digest, k) for k in keys]
                assert [b.tree.node_parent(n) for n in ids] == [None, *ids[:-1]]
                assert b.tree.match(ns.digest, keys, touch=False).hit_chunks == 6
            b.check_integrity()
            assert read(b, ns, keys) == 6

    def test_probe_tiers_false_keeps_tree_only(self, tmp_path):
        ns = new_namespace()
        keys = chain(6, 4)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path, probe_tiers=False)) as b:
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 0
            assert read(b, ns, keys) == 0
            assert "disk.adopted_chunks" not in b.stats()["store"]
            # The explicit method still works, and a per-call probe overrides the config.
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES, probe=True) == 4
            assert read(b, ns, keys) == 4
            b.check_integrity()

    def test_corrupted_after_adoption_is_a_miss(self, tmp_path):
        ns = new_namespace()
        keys = chain(7, 5)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path, promote_on_hit=False)) as b:
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 5
            corrupt_disk_file(str(tmp_path), keys[2])
            assert read(b, ns, keys) == 2  # never the corrupted bytes
            with b.lock:
                n = b.tree.lookup(ns.digest, keys[2])
                assert n is None or not b.tree.node_tier_mask(n) & 0b10  # residency cleared
            assert b.lookup(ns, keys, probe=False) == 2
            b.check_integrity()

    def test_capacity_bounds_what_is_adopted(self, tmp_path):
        ns = new_namespace()
        keys = chain(8, 6)[1]
        with HierarchicalStore(disk_config(tmp_path, chunks=8)) as a:
            fill(a, ns, keys)
        with HierarchicalStore(disk_config(tmp_path, chunks=8)) as b:
            s = b._stack
            charge = s.charge(1, CHUNK_BYTES)
            with b.lock:  # writes in flight leave room for two chunks in the store's books
                held = s.capacity(1) - 2 * charge
                s.reserved[1] += held
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 2
            with b.lock:
                assert s.used_locked(1) <= s.capacity(1)
                s.release_locked(1, held)
            assert b.lookup(ns, keys) == 6
            assert read(b, ns, keys) == 6
            fill(b, ns, chain(9, 6)[1])  # room-making still works with adopted chunks in the books
            b.check_integrity()

    def test_wrong_chunk_bytes(self, tmp_path):
        ns = new_namespace()
        keys = chain(10, 2)[1]
        with HierarchicalStore(disk_config(tmp_path)) as a:
            fill(a, ns, keys)
            with pytest.raises(InputError, match="chunk_bytes=7"):
                a.adopt(ns, keys, chunk_bytes=7)
            with pytest.raises(InputError, match="chunk_bytes"):
                a.lookup(ns, keys, chunk_bytes=-1)

    def test_memory_tier_is_never_probed(self, tmp_path):
        ns = new_namespace()
        keys = chain(11, 3)[1]
        cfg = StoreConfig(tiers=[TierConfig(url="mem://", capacity_bytes=16 * CHUNK_BYTES)])
        with HierarchicalStore(cfg) as s:
            fill(s, ns, keys)
            mem = s.tiers[0]
            calls = []
            orig = mem.contains_many
            mem.contains_many = lambda *a: calls.append(a) or orig(*a)
            s.delete(ns, keys[1:2])
            assert s.lookup(ns, keys) == 1
            assert calls == []


    def test_write_back_close_persists_what_only_memory_held(self, tmp_path, caplog):
        """write_back copies a chunk down only on eviction; a flushing close writes the chunks only
        memory holds to disk, so a restart over the directory hits them byte for byte."""
        ns = new_namespace()
        _, keys = chain(301, 6)
        with HierarchicalStore(disk_config(tmp_path, write_policy="write_back")) as a:
            fill(a, ns, keys)
            assert a.stats()["tiers"]["disk"]["tree_chunks"] == 0  # nothing evicted: all in memory
            a.check_integrity()
        assert "not written" not in caplog.text
        with HierarchicalStore(disk_config(tmp_path)) as b:
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 6
            assert read(b, ns, keys) == 6
            b.check_integrity()

    def test_write_through_close_persists_chunks_whose_copy_failed(self, tmp_path, caplog):
        """Found by an audit: a write-through copy that failed (a disk full for a moment, a Redis
        blip) is not retried, and a flushing close persisted memory-only chunks for write_back alone:
        the chunks died with the process though the disk had room again."""
        ns = new_namespace()
        _, keys = chain(304, 4)
        a = HierarchicalStore(disk_config(tmp_path, write_policy="write_through"))
        disk = a.tiers[1]
        real = disk.put_many
        disk.put_many = lambda nsd, ks, ps: [False] * len(ks)  # the disk refuses every copy, then...
        fill(a, ns, keys)
        assert a.stats()["tiers"]["disk"]["tree_chunks"] == 0
        disk.put_many = real  # ...has room again
        a.close()
        assert "not written" not in caplog.text
        with HierarchicalStore(disk_config(tmp_path)) as b:
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4
            assert read(b, ns, keys) == 4
            b.check_integrity()

    def test_write_through_close_leaves_what_the_disk_evicted_evicted(self, tmp_path, caplog):
        """Found by the review of the fix above: a flushing close copied back every chunk only memory
        held, also those the disk had evicted by its own policy, evicting the disk's newer chunks."""
        ns = new_namespace()
        chains = [chain(310 + i, 2)[1] for i in range(6)]
        a = HierarchicalStore(disk_config(tmp_path, chunks=6, write_policy="write_through"))
        for keys in chains:
            fill(a, ns, keys)
        before = [a.tiers[1].contains_many(ns.digest, keys) for keys in chains]
        assert before == [0, 0, 0, 2, 2, 2]  # the disk kept the newest three chains
        a.close()
        assert "not written" not in caplog.text
        with HierarchicalStore(disk_config(tmp_path, chunks=6)) as b:
            assert [b.tiers[1].contains_many(ns.digest, keys) for keys in chains] == before

    def test_write_through_copies_a_close_cancelled_are_persisted(self, tmp_path, caplog):
        """Found by the second review: copies a flushing close stopped waiting for (cancelled, never
        tried) were not among the failed copies, so the close's persist step skipped them."""
        import time

        ns = new_namespace()
        chains = [chain(320 + i, 2)[1] for i in range(6)]
        a = HierarchicalStore(disk_config(tmp_path, write_policy="write_through", io_threads=1,
                                          close_timeout_s=1.0))
        disk = a.tiers[1]
        real = disk.put_many

        def slow(nsd, ks, ps):  # a slow disk: the queued copies outlast close_timeout_s
            time.sleep(0.4)
            return real(nsd, ks, ps)

        disk.put_many = slow
        for keys in chains:
            assert a.put(ns, keys, [payload_for(k) for k in keys]) == [True] * 2
        a.close()
        with HierarchicalStore(disk_config(tmp_path)) as b:
            assert [b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) for keys in chains] == [2] * 6

    def test_write_through_failed_copy_made_good_later_is_forgotten(self, tmp_path):
        """Found by the second review: a failed copy stayed recorded after a demotion wrote the chunk
        down; once the disk evicted it by its own policy, the close copied it back over a newer one."""
        ns = new_namespace()
        one = {n: chain(330 + i, 1)[1] for i, n in enumerate("KABCDEF")}

        def cfg(**kw) -> StoreConfig:
            return StoreConfig(tiers=[
                TierConfig(url="mem://", capacity_bytes=3 * CHUNK_BYTES),
                TierConfig(url=f"file://{tmp_path}", capacity_bytes=3 * (CHUNK_BYTES + FRAME_SLACK)),
            ], **kw)

        a = HierarchicalStore(cfg(write_policy="write_through"))
        disk = a.tiers[1]
        real = disk.put_many
        disk.put_many = lambda nsd, ks, ps: [False] * len(ks)  # K's copy fails
        fill(a, ns, one["K"])
        disk.put_many = real
        for n in "ABC":  # memory evicts K: demoted, so on disk after all
            fill(a, ns, one[n])
        for more in ("DE", "F"):  # K read back into memory each time; the disk evicts it meanwhile
            assert read(a, ns, one["K"]) == 1
            assert a.flush(30)
            for n in more:
                fill(a, ns, one[n])
        before = {n: a.tiers[1].contains_many(ns.digest, one[n]) for n in one}
        assert before["K"] == 0 and a.tiers[0].contains_many(ns.digest, one["K"]) == 1
        a.close()
        with HierarchicalStore(cfg()) as b:
            assert {n: b.tiers[1].contains_many(ns.digest, one[n]) for n in one} == before

    def test_write_through_close_leaves_a_borrowed_namespace_alone(self, tmp_path, caplog):
        """Found by the second review: copies into a tier where another process owns the namespace
        are skipped on purpose (store.borrow), yet counted as failed and warned about at close."""
        ns = new_namespace()
        _, keys = chain(340, 4)
        a = HierarchicalStore(disk_config(tmp_path, shared=True, write_policy="write_through"))
        assert a.borrow(ns) == ["disk"]
        fill(a, ns, keys)
        assert not a._stack.failed_copies
        a.close()
        assert "not written" not in caplog.text

    def test_write_back_close_past_its_deadline_counts_what_is_left(self, tmp_path, caplog):
        ns = new_namespace()
        _, keys = chain(302, 4)
        a = HierarchicalStore(disk_config(tmp_path, write_policy="write_back", close_timeout_s=1e-6))
        fill(a, ns, keys)
        a.close()
        assert "4 chunks held only in memory were not written to a persistent tier (0 were)" in caplog.text
        with HierarchicalStore(disk_config(tmp_path)) as b:
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 0

    def test_write_back_close_with_a_failing_disk_loses_nothing_it_had(self, tmp_path, caplog, monkeypatch):
        """A disk that refuses the flush leaves the close clean: pins released, a warning, no raise."""
        ns = new_namespace()
        _, keys = chain(303, 3)
        a = HierarchicalStore(disk_config(tmp_path, write_policy="write_back"))
        fill(a, ns, keys)
        monkeypatch.setattr(a.tiers[1], "put_many", lambda ns_, ks, ps: [False] * len(ks))
        a.close()
        assert "3 chunks held only in memory were not written" in caplog.text
        assert a.stats()["tree"]["pinned_chunks"] == 0

class TestShared:
    def test_shared_directory_second_store_sees_first(self, tmp_path):
        ns = new_namespace()
        keys = chain(20, 5)[1]
        with HierarchicalStore(disk_config(tmp_path, shared=True)) as a, HierarchicalStore(
            disk_config(tmp_path, shared=True)
        ) as b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 5
            assert read(b, ns, keys) == 5
            a.check_integrity()
            b.check_integrity()

    def test_two_stores_share_one_redis(self, redis_url):
        ns = new_namespace()
        keys = chain(21, 6)[1]
        prefix = f"adopt{uuid.uuid4().hex[:8]}"

        def cfg() -> StoreConfig:
            return StoreConfig(
                tiers=[
                    TierConfig(url="mem://", capacity_bytes=16 * CHUNK_BYTES),
                    TierConfig(
                        url=redis_url,
                        capacity_bytes=64 * (CHUNK_BYTES + FRAME_SLACK),
                        options=dict(REDIS_OPTIONS, key_prefix=prefix),
                    ),
                ]
            )

        with HierarchicalStore(cfg()) as a, HierarchicalStore(cfg()) as b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, probe=False) == 0
            assert read(b, ns, keys) == 6  # get adopts, sized by its buffers
            assert b.stats()["store"]["redis.adopted_chunks"] == 6
            b.flush(30)
            a.check_integrity()
            b.check_integrity()

    def test_reconcile_sees_files_another_store_deleted(self, tmp_path):
        # Before: a shared disk tier answered contains from its index, so reconcile() kept chunks
        # whose files the other store had deleted (reads found them missing later, lazily).
        ns = new_namespace()
        keys = chain(22, 4)[1]
        with HierarchicalStore(disk_config(tmp_path, shared=True)) as a, HierarchicalStore(
            disk_config(tmp_path, shared=True, probe_tiers=True)
        ) as b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4
            assert read(b, ns, keys) == 4  # b's disk tier indexes the files it read
            assert a.delete(ns, keys[2:3]) == 1  # and keys[3] with it
            b.flush(30)
            assert b.reconcile() == 2
            assert b.stats()["tiers"][b.tiers[1].name]["tree_chunks"] == 2  # (memory keeps its copies)
            b.check_integrity()

    def test_concurrent_writer_and_adopting_reader(self, tmp_path):
        """Store A writes (and deletes) chains in a shared directory while store B reads them:
        B returns a leading run of exact bytes every time, and both stores stay consistent."""
        import threading

        ns = new_namespace()
        chains = [chain(30 + i, 4)[1] for i in range(6)]
        a = HierarchicalStore(disk_config(tmp_path, shared=True))
        b = HierarchicalStore(disk_config(tmp_path, shared=True))
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for r in range(3):
                    for keys in chains:
                        a.put(ns, keys, [payload_for(k) for k in keys])
                    a.delete(ns, chains[r][2:3])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=writer)
        t.start()
        try:
            seen = 0
            while t.is_alive() or not seen:
                for keys in chains:
                    seen += read(b, ns, keys)
            t.join()
            assert not errors, errors
            a.flush(30)
            b.flush(30)
            for keys in chains:
                read(b, ns, keys)
            # A's deletes are invisible to B's tree until B reads those chunks (documented limit).
            b.reconcile()
            a.check_integrity()
            b.check_integrity()
            assert seen > 0
        finally:
            t.join()
            a.close()
            b.close()

    @staticmethod
    def _writer_rewrites_after(monkeypatch, tier, method, a, ns, keys, when) -> list[bool]:
        """Run the writer store's re-put of ``keys`` right after ``tier.method`` returns an answer
        ``when`` accepts: another process committing new files between what the reader saw and the
        cleanup it does next. Returns a list that holds True once it ran."""
        real, ran = getattr(tier, method), []

        def hooked(*args):
            answer = real(*args)
            if not ran and when(args, answer):
                ran.append(True)
                fill(a, ns, keys)  # write-through: the files are committed when this returns
            return answer

        monkeypatch.setattr(tier, method, hooked)
        return ran

    def test_failed_read_leaves_files_another_store_wrote_since(self, tmp_path, monkeypatch):
        """B's read misses chunks A deleted; A puts them again before B's cleanup of that read runs.
        Before: the cleanup deleted the keys by name from the shared directory, i.e. A's new files
        (the failed chunk, and its orphan below it), while A's tree placed them on disk: A's deep
        check in test_concurrent_writer_and_adopting_reader failed in ~1 of 10 switch-interval
        stress runs once contains answered from the files. Now B only forgets them: in a shared
        directory a later delete by name can only hit a file written since."""
        ns = new_namespace()
        keys = chain(24, 4)[1]
        with HierarchicalStore(disk_config(tmp_path, shared=True)) as a, HierarchicalStore(
            disk_config(tmp_path, shared=True)
        ) as b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4  # B's tree: all 4 on disk only
            assert a.delete(ns, keys[2:3]) == 1  # and keys[3] with it: both files are gone
            ran = self._writer_rewrites_after(
                monkeypatch, b.tiers[1], "get_many", a, ns, keys, lambda args, hits: not all(hits)
            )
            # keys[2] fails; keys[3] (not read) is its orphan in B's tree.
            assert read(b, ns, keys[:3]) == 2
            assert ran
            b.flush(30)
            disk = a.tiers[1]
            assert [os.path.exists(disk._layout.path(ns.digest, k)) for k in keys] == [True] * 4
            a.check_integrity()
            b.check_integrity()
            assert read(b, ns, keys) == 4  # B adopts A's new files again

    def test_reconcile_leaves_files_another_store_wrote_since(self, tmp_path, monkeypatch):
        """As above for reconcile(): A puts the chunks again after B's contains found them gone.
        Before: reconcile deleted A's new files by name."""
        ns = new_namespace()
        keys = chain(25, 4)[1]
        with HierarchicalStore(disk_config(tmp_path, shared=True)) as a, HierarchicalStore(
            disk_config(tmp_path, shared=True)
        ) as b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4
            assert a.delete(ns, keys[2:3]) == 1
            disk = b.tiers[1]
            gone: set[str] = set()

            def both_found_gone(args, n) -> bool:  # (in whatever order reconcile asks)
                if n == 0:
                    gone.update(args[1])
                return gone == set(keys[2:])

            ran = self._writer_rewrites_after(monkeypatch, disk, "contains_many", a, ns, keys, both_found_gone)
            assert b.reconcile() == 2
            assert ran
            assert [os.path.exists(a.tiers[1]._layout.path(ns.digest, k)) for k in keys] == [True] * 4
            a.check_integrity()
            b.check_integrity()
            assert read(b, ns, keys) == 4

    @staticmethod
    def _redis_pair(url: str) -> tuple[HierarchicalStore, HierarchicalStore, str]:
        """Two stores over one Redis (server or cluster), memory above, their own key prefix."""
        prefix = f"share{uuid.uuid4().hex[:8]}"

        def cfg() -> StoreConfig:
            return StoreConfig(tiers=[
                TierConfig(url="mem://", capacity_bytes=16 * CHUNK_BYTES),
                TierConfig(url=url, capacity_bytes=64 * (CHUNK_BYTES + FRAME_SLACK),
                           options=dict(REDIS_OPTIONS, key_prefix=prefix)),
            ])

        return HierarchicalStore(cfg()), HierarchicalStore(cfg()), prefix

    @pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url"])
    @pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
    def test_failed_read_leaves_values_another_store_wrote_since_in_redis(
        self, request, monkeypatch, server, damage
    ):
        """The Redis form of test_failed_read_leaves_files_another_store_wrote_since: B's read of a
        chunk fails (a flipped payload byte, a truncated value, no value), and A puts the chunks
        again before B's cleanup of that read runs. Before: the cleanup deleted the failed key and
        its orphan by name, i.e. A's new, valid values, which A's tree placed in Redis (a miss for
        every store sharing the server). Now B's read deletes only the bad value it read, by an
        atomic compare-and-delete on the server, and its cleanup only forgets the keys."""
        ns = new_namespace()
        keys = chain(27, 4)[1]
        a, b, prefix = self._redis_pair(request.getfixturevalue(server))
        with a, b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4  # B's tree: all 4 in Redis only
            r = a.tiers[1].redis_client
            names = [f"{prefix}:{ns.digest}:{k}" for k in keys]
            good = r.get(names[2])
            assert a.delete(ns, keys[2:3]) == 1  # and keys[3] with it: A puts both again below
            if damage == "flipped":
                r.set(names[2], good[:-100] + bytes([good[-100] ^ 1]) + good[-99:])
            elif damage == "truncated":
                r.set(names[2], good[:-1])
            ran = self._writer_rewrites_after(
                monkeypatch, b.tiers[1], "get_many", a, ns, keys, lambda args, hits: not all(hits)
            )
            # keys[2] fails; keys[3] (not read) is its orphan in B's tree.
            assert read(b, ns, keys[:3]) == 2
            assert ran
            b.flush(30)
            assert [r.exists(n) for n in names] == [1] * 4, "B's cleanup deleted A's new values"
            assert r.get(names[2]) == good
            a.check_integrity()
            b.check_integrity()
            assert read(b, ns, keys) == 4  # B adopts A's values again

    def test_reconcile_leaves_values_another_store_wrote_since_in_redis(self, redis_url, monkeypatch):
        """As above for reconcile(): A puts the chunks again after B's contains found them gone.
        Before: reconcile deleted A's new values by name."""
        ns = new_namespace()
        keys = chain(28, 4)[1]
        a, b, prefix = self._redis_pair(redis_url)
        with a, b:
            fill(a, ns, keys)
            assert b.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4
            assert a.delete(ns, keys[2:3]) == 1
            gone: set[str] = set()

            def both_found_gone(args, n) -> bool:  # (in whatever order reconcile asks)
                if n == 0:
                    gone.update(args[1])
                return gone == set(keys[2:])

            ran = self._writer_rewrites_after(
                monkeypatch, b.tiers[1], "contains_many", a, ns, keys, both_found_gone)
            assert b.reconcile() == 2
            assert ran
            r = a.tiers[1].redis_client
            assert [r.exists(f"{prefix}:{ns.digest}:{k}") for k in keys] == [1] * 4
            a.check_integrity()
            b.check_integrity()
            assert read(b, ns, keys) == 4

    def test_put_writes_again_a_file_another_store_deleted(self, tmp_path):
        """B's start-up scan indexes A's files; A then deletes them. Before: B's put of the same
        chunks (its write-through to disk) found them in its index and reported them written
        ("keys name content: present means the same bytes") without a file, so B's tree placed
        them on disk with nothing there. A shared index entry is checked against the file now."""
        ns = new_namespace()
        keys = chain(26, 4)[1]
        with HierarchicalStore(disk_config(tmp_path, shared=True)) as a:
            fill(a, ns, keys)
            with HierarchicalStore(disk_config(tmp_path, shared=True)) as b:
                assert b.tiers[1].stats().extra["scan_indexed"] == 4
                assert a.delete(ns, keys[:1]) == 1  # and the rest of the chain with it
                fill(b, ns, keys)
                disk = b.tiers[1]
                assert [os.path.exists(disk._layout.path(ns.digest, k)) for k in keys] == [True] * 4
                a.check_integrity()
                b.check_integrity()


class TestAdoptionAndBackgroundCopies:
    def test_adoption_waits_for_a_promotion_that_pins_its_only_victims(self, tmp_path):
        """Reading x promotes it to memory in the background, pinning x's chunks; reading y next
        must evict x from the full disk books to adopt y. Before: the adoption found every candidate
        pinned, did not wait, and adopted nothing (y read as a miss). Now it waits (bounded) for
        the promotion, as a put does for background copies."""
        import threading
        import time

        ns = new_namespace()
        x, y = chain(50, 4)[1], chain(51, 4)[1]
        with HierarchicalStore(disk_config(tmp_path, chunks=16, shared=True)) as a:
            fill(a, ns, x)
            fill(a, ns, y)
        # Shared: the reader's start-up scan neither deletes nor counts the writer's 8 files.
        with HierarchicalStore(disk_config(tmp_path, chunks=4, shared=True)) as b:
            s = b._stack
            real_write, release = s.write, threading.Event()

            def write(t, refs, payloads):
                if threading.current_thread() is not threading.main_thread():
                    assert release.wait(30)  # hold the promotion (and its pins) for a while
                return real_write(t, refs, payloads)

            s.write = write
            assert read(b, ns, x) == 4  # the 4 disk slots now hold x; x's promotion is queued
            timer = threading.Timer(0.3, release.set)
            timer.start()
            try:
                t0 = time.monotonic()
                assert read(b, ns, y) == 4
                assert time.monotonic() - t0 >= 0.2  # it waited for the promotion
            finally:
                release.set()
                timer.join()
            b.flush(30)
            b.check_integrity()


def test_reconcile_keeps_a_chunk_deleted_and_put_again_while_it_asked(tmp_path):
    """Found by the threaded store fuzz: reconcile() asks each tier about every chunk outside the
    lock. A chunk another thread deleted and put again in the meantime was answered "absent" (the
    delete had run), and reconcile then dropped the *new* node's residency and deleted its fresh
    file, with the orphans below it (in Redis, where lost chunks are only forgotten, a later put of
    the prefix then adopted those orphans back: a delete's descendants were served again). An
    answer now counts only for the node it was asked about, when nothing wrote the key since."""
    ns = new_namespace()
    keys = chain(26, 4)[1]
    with HierarchicalStore(disk_config(tmp_path)) as store:
        fill(store, ns, keys)
        disk = store.tiers[1]
        contains = disk.contains_many
        ran = []

        def racing_contains(namespace, ks):
            if not ran and list(ks) == keys[:1]:
                ran.append(True)
                answer = contains(namespace, ks)  # there, until the other thread deletes it
                assert store.delete(ns, keys) == 4
                fill(store, ns, keys)  # and puts it again: a new node, a fresh file
                return 0 if answer else answer  # the answer given while the delete ran
            return contains(namespace, ks)

        disk.contains_many = racing_contains
        assert store.reconcile() == 0
        assert ran
        assert [os.path.exists(disk._layout.path(ns.digest, k)) for k in keys] == [True] * 4
        store.check_integrity()
    with HierarchicalStore(disk_config(tmp_path, probe_tiers=True)) as again:
        assert again.lookup(ns, keys, chunk_bytes=CHUNK_BYTES) == 4
        assert read(again, ns, keys) == 4
