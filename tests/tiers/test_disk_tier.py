"""Disk-tier specifics: file format and permissions, corruption, restart, eviction, faults, sharing."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from radixkv.errors import CapacityError, ConfigError, InputError
from radixkv.tiers import disk as disk_mod
from radixkv.tiers import disk_io
from radixkv.tiers import disk_layout as disk_layout_mod
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.disk_layout import DiskLayout
from radixkv.tiers.framing import HEADER_BYTES, decode_header, payload_checksum
from radixkv.tiers.registry import make_tier

from frame_edits import reframed

KiB = 1 << 10
NS = "0123456789abcdef0123456789abcdef"


def pl(seed: int, nbytes: int = 8 * KiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def frame_bytes(key: str, nbytes: int = 8 * KiB) -> int:
    return HEADER_BYTES + len(NS) + len(key) + nbytes


def buf(nbytes: int = 8 * KiB) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


@pytest.fixture(autouse=True, params=["native", "python"])
def read_path(request, monkeypatch) -> str:
    """Every test here runs with the C helper's chunk I/O (where built) and with the Python I/O
    alone: the fast read answers only "ok", so faults must be judged alike on both."""
    if request.param == "native" and not disk_mod.FAST_READ:
        pytest.skip("the C helper (radixkv/csrc/chunkio.c) is not built here")
    if request.param == "python":
        monkeypatch.setattr(disk_mod, "FAST_READ", False)
        monkeypatch.setattr(disk_io, "_FAST_WRITE", None)
    return request.param


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "disk")


@pytest.fixture
def tier(root) -> DiskTier:
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    yield t
    t.check_integrity()
    t.close()


def _mount_tmpfs(path: str, opts: str) -> bool:
    """Mount a tmpfs (needs root and CAP_SYS_ADMIN); False where that is not possible."""
    os.makedirs(path, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True)


class TestFormat:
    def test_layout_permissions_and_header(self, tier, root):
        """root/<ns>/<2 hex>/<key>.kv, file 0600, dirs 0700, a valid header before the payload."""
        p = pl(1)
        tier.put_many(NS, ["abc"], [p])
        path = tier._layout.path(NS, "abc")
        rel = os.path.relpath(path, root).split(os.sep)
        assert len(rel) == 3 and rel[0] == NS and len(rel[1]) == 2 and rel[2] == "abc.kv"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        for d in (root, os.path.join(root, NS), os.path.dirname(path)):
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        raw = open(path, "rb").read()
        h = decode_header(raw)
        assert (h.namespace, h.key, h.payload_bytes) == (NS, "abc", 8 * KiB)
        assert h.checksum == payload_checksum(p.numpy())
        assert raw[h.payload_offset :] == p.numpy().tobytes()
        assert tier.usage_bytes() == len(raw) == frame_bytes("abc")
        assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]

    def test_fsync_option_round_trips(self, root):
        t = make_tier(f"file://{root}?capacity=1MiB&fsync=1&io_threads=2")
        assert t.config.fsync and t.config.io_threads == 2
        assert t.put_many(NS, ["a", "b"], [pl(1), pl(2)]) == [True, True]
        out = [buf(), buf()]
        assert t.get_many(NS, ["a", "b"], out) == [True, True] and torch.equal(out[1], pl(2))
        t.check_integrity()
        t.close()

    def test_fsync_syncs_the_commit_rename(self, root, monkeypatch):
        """Found by an audit: fsync=True synced the file but not its directory, so a crash could lose
        the rename of a put reported done. Now the chunk's directory (and each directory made) is synced."""
        synced: list[str] = []
        real = os.fsync

        def spy(fd):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            return real(fd)

        monkeypatch.setattr(os, "fsync", spy)
        t = make_tier(f"file://{root}?capacity=1MiB&fsync=1")
        assert t.put_many(NS, ["a"], [pl(1)]) == [True]
        path = t._layout.path(NS, "a")
        assert os.path.dirname(path) in synced  # the rename into the chunk's directory
        assert os.path.join(os.path.realpath(str(root)), NS) in synced  # the directories made in it
        assert synced[-2].endswith(".tmp") and synced[-1] == os.path.dirname(path)  # file, rename after
        t.close()
        synced.clear()
        t = make_tier(f"file://{root}2?capacity=1MiB")
        assert t.put_many(NS, ["a"], [pl(1)]) == [True] and synced == []  # off by default
        t.close()

    def test_failed_directory_sync_keeps_the_put(self, root, monkeypatch, caplog):
        t = make_tier(f"file://{root}?capacity=1MiB&fsync=1")
        t._layout.make_ns_dirs(NS)

        def broken(d):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(disk_mod, "fsync_dir", broken)
        with caplog.at_level(logging.WARNING):
            assert t.put_many(NS, ["a"], [pl(1)]) == [True]
        out = [buf()]
        assert t.get_many(NS, ["a"], out) == [True] and torch.equal(out[0], pl(1))
        assert "may not survive a crash" in caplog.text
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("key", ["../x", "a/b", "", "k.kv", "\u00e9"])
    def test_unsafe_keys_rejected(self, tier, key):
        """Keys become file names: anything outside [A-Za-z0-9_-] is an InputError."""
        with pytest.raises(InputError, match="key"):
            tier.put_many(NS, [key], [pl(1)])

    def test_namespace_size_fixed(self, tier):
        tier.put_many(NS, ["a"], [pl(1)])
        with pytest.raises(InputError, match=r"4096 bytes.*8192-byte"):
            tier.put_many(NS, ["b"], [pl(2, 4 * KiB)])
        with pytest.raises(InputError, match=r"4096 bytes.*8192-byte"):
            tier.get_many(NS, ["a"], [buf(4 * KiB)])

    def test_a_namespace_holding_nothing_takes_a_new_size(self, tier):
        # Found by a review: a put overlapping a store's clear fixed the old size again after the
        # tier's clear; the store deleted what it wrote, yet every later get of the new size raised
        # InputError through the store (and puts of it failed) instead of missing.
        tier.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        assert tier.delete_many(NS, ["a", "b"]) == 2
        assert tier.get_many(NS, ["a"], [buf(4 * KiB)]) == [False]  # a miss, not an InputError
        assert tier.put_many(NS, ["c"], [pl(3, 4 * KiB)]) == [True]
        out = buf(4 * KiB)
        assert tier.get_many(NS, ["c"], [out]) == [True] and torch.equal(out, pl(3, 4 * KiB))
        with pytest.raises(InputError, match=r"8192 bytes.*4096-byte"):  # held again: fixed
            tier.put_many(NS, ["d"], [pl(4)])
        tier.check_integrity()


class TestCorruption:
    @pytest.mark.parametrize("where", ["payload", "header", "identity"])
    def test_flipped_byte_is_a_miss_and_removed(self, tier, where):
        """One flipped bit anywhere: miss, checksum_failures counted, file removed, never served."""
        tier.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        path = tier._layout.path(NS, "a")
        offset = {"payload": HEADER_BYTES + len(NS) + 1 + 1000, "header": 20, "identity": HEADER_BYTES + 3}[where]
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x10]))
        out = [buf(), buf()]
        assert tier.get_many(NS, ["a", "b"], out) == [False, True]
        assert torch.equal(out[1], pl(2))
        assert tier.stats().checksum_failures == 1
        assert not os.path.exists(path)
        assert tier.contains_many(NS, ["a"]) == 0

    @pytest.mark.parametrize("version, flags", [(1, 1), (2, 0)])
    def test_a_frame_of_unknown_flags_or_version_is_a_miss(self, tier, version, flags):
        """A file whose header (its checksum intact) sets a flag this reader does not know is a miss
        on every read path, as one of another version is: its payload may mean something else."""
        tier.put_many(NS, ["a"], [pl(1)])
        path = tier._layout.path(NS, "a")
        with open(path, "rb") as f:
            frame = f.read()
        with open(path, "wb") as f:
            f.write(reframed(frame, version=version, flags=flags))
        assert tier.get_many(NS, ["a"], [buf()]) == [False]
        assert tier.put_many(NS, ["a"], [pl(1)]) == [True]  # rewritten as this version's frame
        out = buf()
        assert tier.get_many(NS, ["a"], [out]) == [True] and torch.equal(out, pl(1))
        tier.check_integrity()

    @pytest.mark.parametrize("cut", [1, 8 * KiB, 8 * KiB + 60])
    def test_truncated_file_is_a_miss(self, tier, cut):
        tier.put_many(NS, ["a"], [pl(1)])
        path = tier._layout.path(NS, "a")
        os.truncate(path, os.path.getsize(path) - cut)
        assert tier.get_many(NS, ["a"], [buf()]) == [False]
        assert tier.stats().checksum_failures == 1 and not os.path.exists(path)

    def test_extended_file_is_a_miss(self, tier):
        tier.put_many(NS, ["a"], [pl(1)])
        with open(tier._layout.path(NS, "a"), "ab") as f:
            f.write(b"junk")
        assert tier.get_many(NS, ["a"], [buf()]) == [False]

    def test_file_swapped_for_another_key_is_a_miss(self, tier):
        """A well-formed frame of key b copied over key a is rejected by the identity check."""
        tier.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        with open(tier._layout.path(NS, "b"), "rb") as f:
            data = f.read()
        with open(tier._layout.path(NS, "a"), "wb") as f:
            f.write(data)
        assert tier.get_many(NS, ["a"], [buf()]) == [False]

    def test_deleted_behind_our_back_is_a_miss(self, tier):
        tier.put_many(NS, ["a"], [pl(1)])
        os.unlink(tier._layout.path(NS, "a"))
        assert tier.get_many(NS, ["a"], [buf()]) == [False]
        assert tier.usage_bytes() == 0


    def test_file_replaced_by_a_directory_is_a_miss_never_a_spare(self, tier):
        # Once recycled into the spare list as a "file", which later broke check_integrity.
        tier.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        p = tier._layout.path(NS, "a")
        os.unlink(p)
        os.mkdir(p)
        assert tier.get_many(NS, ["a"], [buf()]) == [False]
        assert tier.contains_many(NS, ["a"]) == 0
        tier.delete_many(NS, ["a", "b"])  # "b" is recycled, the directory is not
        tier.put_many(NS, ["c"], [pl(3)])
        out = buf()
        assert tier.get_many(NS, ["c"], [out]) == [True] and torch.equal(out, pl(3))
        os.rmdir(p)  # the tier never removes what is not its file; the fixture checks integrity

    def test_undeletable_file_stays_indexed(self, tier, monkeypatch):
        # On a read-only filesystem delete/clear cannot remove the file: the index must keep it
        # (it is still there and still serves its verified bytes), not forget it.
        tier.put_many(NS, ["a", "b"], [pl(1), pl(2)])

        def refuse(*_a, **_k):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(os, "unlink", refuse)
        monkeypatch.setattr(os, "rename", refuse)
        assert tier.delete_many(NS, ["a"]) == 0
        tier.clear(NS)
        tier.check_integrity()
        out = buf()
        assert tier.get_many(NS, ["a"], [out]) == [True] and torch.equal(out, pl(1))
        monkeypatch.undo()
        tier.clear(NS)
        assert tier.contains_many(NS, ["a", "b"]) == 0


class TestRecyclingRace:
    @pytest.mark.parametrize("read_path", ["python"], indirect=True)  # injected into the Python read
    def test_a_read_racing_recycling_keeps_the_keys_new_file(self, root, monkeypatch, read_path):
        # Found by a review: a get that opened K's file just before it was recycled for J (and K
        # was written again) saw J's header, and the quarantine unindexed K's new, valid file.
        t = DiskTier(root=root, capacity_bytes=1 << 20, io_threads=1, recycle=True)
        assert t.put_many(NS, ["K"], [pl(1)]) == [True]
        real = disk_mod.read_frame
        fired: list[int] = []

        def racing(fd, ns, key, out):
            if not fired:
                fired.append(1)
                t.delete_many(NS, ["K"])  # K's file becomes a spare...
                t.put_many(NS, ["J"], [pl(2)])  # ...J is written into it...
                t.put_many(NS, ["K"], [pl(3)])  # ...and K is written again, to a new file
            return real(fd, ns, key, out)

        monkeypatch.setattr(disk_mod, "read_frame", racing)
        assert t.get_many(NS, ["K"], [buf()]) == [False]  # the racing read is a miss
        monkeypatch.setattr(disk_mod, "read_frame", real)
        out = buf()
        assert t.get_many(NS, ["K"], [out]) == [True] and torch.equal(out, pl(3))
        assert t.stats().checksum_failures == 0
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("read_path", ["python"], indirect=True)  # injected into the Python read
    def test_a_read_racing_a_double_recycle_back_to_its_key_keeps_the_new_file(self, root, monkeypatch,
                                                                               read_path):
        # Found by a fifth race hunt (by reasoning): a get opened K's file; K was deleted (file ->
        # spare), J written into it; the get read J's header ("corrupt"); then J was deleted (same
        # file -> spare again) and K written into it, so K's path held the very inode the get had
        # open, with K's valid bytes. The quarantine's inode check passed and deleted K's good file.
        t = DiskTier(root=root, capacity_bytes=1 << 20, io_threads=1, recycle=True)
        assert t.put_many(NS, ["K"], [pl(1)]) == [True]
        inode = os.stat(t._layout.path(NS, "K")).st_ino
        real = disk_mod.read_frame
        fired: list[str] = []

        def racing(fd, ns, key, out):
            if fired:
                return real(fd, ns, key, out)
            fired.append("read")
            assert t.delete_many(NS, ["K"]) == 1  # K's file becomes a spare...
            assert t.put_many(NS, ["J"], [pl(2)]) == [True]  # ...J is written into it...
            verdict = real(fd, ns, key, out)  # ...and the get reads J's frame under K's name
            assert t.delete_many(NS, ["J"]) == 1  # the same file becomes a spare again...
            assert t.put_many(NS, ["K"], [pl(3)]) == [True]  # ...and K is written into it
            assert os.fstat(fd).st_ino == os.stat(t._layout.path(NS, "K")).st_ino == inode
            return verdict

        monkeypatch.setattr(disk_mod, "read_frame", racing)
        assert t.get_many(NS, ["K"], [buf()]) == [False]  # the racing read is a miss
        assert fired == ["read"]
        monkeypatch.setattr(disk_mod, "read_frame", real)
        out = buf()
        assert t.get_many(NS, ["K"], [out]) == [True] and torch.equal(out, pl(3))
        assert t.stats().checksum_failures == 0
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("read_path", ["native"], indirect=True)  # the fast path's own fallback
    def test_a_fast_read_racing_recycling_falls_back_and_never_serves_the_other_chunk(self, root, monkeypatch,
                                                                                    read_path):
        # The fast path read J's bytes under K's name: its header check says "don't know", and the
        # Python read that follows judges whatever the path holds now (K's new file).
        t = DiskTier(root=root, capacity_bytes=1 << 20, io_threads=1, recycle=True)
        assert t.put_many(NS, ["K"], [pl(1)]) == [True]
        path = t._layout.path(NS, "K")
        real = disk_mod.read_chunk_fast
        fell_back: list[str] = []

        def racing(p, ns, key, spans, nbytes):
            t.delete_many(NS, ["K"])  # K's file becomes a spare...
            t.put_many(NS, ["J"], [pl(2)])  # ...J is written into it...
            os.link(t._layout.path(NS, "J"), path + ".j")
            os.rename(path + ".j", path)  # ...and, worst case, J's file now sits at K's path
            got = real(p, ns, key, spans, nbytes)
            assert got is None  # J's header does not name K
            os.unlink(path)
            t.put_many(NS, ["K"], [pl(3)])  # K is written again before the fallback reads
            fell_back.append(key)
            return got

        monkeypatch.setattr(disk_mod, "read_chunk_fast", racing)
        out = buf()
        assert t.get_many(NS, ["K"], [out]) == [True] and torch.equal(out, pl(3))
        assert fell_back == ["K"]
        assert t.stats().checksum_failures == 0
        monkeypatch.setattr(disk_mod, "read_chunk_fast", real)
        out2 = buf()
        assert t.get_many(NS, ["J"], [out2]) == [True] and torch.equal(out2, pl(2))
        t.check_integrity()
        t.close()


class TestDeleteRace:
    def test_a_read_racing_delete_and_reput_keeps_the_new_entry(self, root):
        # Found by a flaky 8-thread store test: a read that passed the index check found the file
        # gone (deleted or recycled); before it unindexed the key, a new put of the key committed,
        # and the read then unindexed that put's file ("files not indexed" in check_integrity).
        t = DiskTier(root=root, capacity_bytes=1 << 20, io_threads=1, recycle=True)
        assert t.put_many(NS, ["K"], [pl(1)]) == [True]
        real_path, real_forget = t._layout.path, t._forget
        armed = [True]

        def path(ns, key):  # runs between the read's index check and its open
            if armed and key == "K":
                armed.clear()
                assert t.delete_many(NS, ["K"]) == 1
            return real_path(ns, key)

        def forget(ident, p):  # the new put lands between the failed open and the unindexing
            assert t.put_many(NS, ["K"], [pl(3)]) == [True]
            return real_forget(ident, p)

        t._layout.path, t._forget = path, forget
        assert t.get_many(NS, ["K"], [buf()]) == [False]
        t._layout.path, t._forget = real_path, real_forget
        out = buf()
        assert t.get_many(NS, ["K"], [out]) == [True] and torch.equal(out, pl(3))
        t.check_integrity()
        t.close()


class TestRestart:
    def test_index_rebuilt_by_scan(self, root):
        """A new tier on the same directory sees the old chunks; bad files and stale temps are removed."""
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        keys = [f"k{i}" for i in range(5)]
        t.put_many(NS, keys, [pl(i) for i in range(5)])
        usage = t.usage_bytes()
        t.close()
        with open(t._layout.path(NS, "k4"), "r+b") as f:  # corrupt k4's header
            f.write(b"XXXX")
        d = os.path.dirname(t._layout.path(NS, "k0"))
        stale, fresh = os.path.join(d, ".k0.1.2.dead.tmp"), os.path.join(d, ".k0.1.3.live.tmp")
        for p in (stale, fresh):
            open(p, "wb").write(b"partial")
        os.utime(stale, (time.time() - 3600, time.time() - 3600))
        shared = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        # shared: another process may be writing the young temp file right now
        assert not os.path.exists(stale) and os.path.exists(fresh)
        assert shared.stats().extra["temp_removed"] == 1
        shared.close()
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        assert not os.path.exists(fresh)  # not shared: no writer but this process's can exist
        assert t2.contains_many(NS, keys) == 4
        assert t2.usage_bytes() == usage - frame_bytes("k4")
        st = t2.stats().extra
        assert (st["scan_indexed"], st["scan_skipped"], st["temp_removed"]) == (4, 1, 1)
        out = [buf() for _ in range(4)]
        assert t2.get_many(NS, keys[:4], out) == [True] * 4
        assert all(torch.equal(o, pl(i)) for i, o in enumerate(out))
        t2.check_integrity()
        t2.close()

    @pytest.mark.parametrize("host_ahead_s", [3600.0, -3 * 3600.0])
    def test_temp_ages_are_measured_on_the_filesystems_clock(self, root, monkeypatch, host_ahead_s):
        # Found by a clock hunt: a shared tier's start compared temp files' mtimes (stamped by the
        # file server's clock on a network filesystem) with its own host's clock. A host an hour
        # ahead removed another host's live temp mid-write (its put failed); one three hours
        # behind kept a crashed writer's temp. The local filesystem plays the server here.
        writer = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        writer.put_many(NS, ["k0"], [pl(0)])
        d = os.path.dirname(writer._layout.path(NS, "k0"))
        dead = os.path.join(d, ".k0.999.1.dead.tmp")
        open(dead, "wb").write(b"partial")
        os.utime(dead, (time.time() - 7200, time.time() - 7200))  # crashed two hours ago
        real_write_frame, started, release = disk_mod.write_frame, threading.Event(), threading.Event()

        def slow_write_frame(*args, **kwargs):  # another host's put, between its write and commit
            real_write_frame(*args, **kwargs)
            started.set()
            release.wait(10)

        monkeypatch.setattr(disk_mod, "write_frame", slow_write_frame)
        result: list = []
        put = threading.Thread(target=lambda: result.append(writer.put_many(NS, ["k1"], [pl(1)])))
        put.start()
        assert started.wait(10)
        now = time.time
        monkeypatch.setattr(disk_layout_mod.time, "time", lambda: now() + host_ahead_s)
        other = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)  # this host's clock is off
        release.set()
        put.join(10)
        assert result == [[True]], "a live writer's temp file was taken for a crashed one's"
        assert not os.path.exists(dead), "a crashed writer's temp file was kept"
        assert other.stats().extra["temp_removed"] == 1
        out = buf()
        assert other.get_many(NS, ["k1"], [out]) == [True] and torch.equal(out, pl(1))
        assert not [f for _d, _s, fs in os.walk(root) for f in fs if f.endswith(".tmp")]  # no probe left
        other.close()
        writer.close()

    def test_a_killed_writers_temp_files_go_at_the_next_start(self, root):
        # Found by a review: a writer killed mid-put leaves its temp file; a restart within
        # stale_temp_s kept it, unindexed and uncounted, for the whole life of the new process.
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["k0"], [pl(0)])
        t.close()
        d = os.path.dirname(t._layout.path(NS, "k0"))
        young = os.path.join(d, ".k0.999.1.abc.tmp")
        open(young, "wb").write(b"partial")
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)  # not shared: no other writer exists
        assert not os.path.exists(young) and t2.stats().extra["temp_removed"] == 1
        t2.check_integrity()
        t2.close()

    def test_a_size_only_old_files_had_is_replaced_not_an_error(self, root):
        # Found by a review: the scan fixed the namespace's chunk size from an earlier process's
        # files, so a get of another size raised into the store instead of missing, and
        # write-through copies of the new size failed silently.
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        t.close()
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        small = [buf(4 * KiB), buf(4 * KiB)]
        assert t2.get_many(NS, ["a", "b"], small) == [False, False]  # a miss, not an InputError
        assert t2.stats().extra["size_mismatches"] == 2
        assert t2.put_many(NS, ["c"], [pl(3, 4 * KiB)]) == [True]  # this process's size wins
        out = buf(4 * KiB)
        assert t2.get_many(NS, ["c"], [out]) == [True] and torch.equal(out, pl(3, 4 * KiB))
        with pytest.raises(InputError, match="4096"):  # from now on the size is fixed
            t2.put_many(NS, ["d"], [pl(4)])
        assert t2.get_many(NS, ["a"], [buf(4 * KiB)]) == [False]
        t2.check_integrity()
        t2.close()

    def test_a_key_the_scan_kept_at_an_older_size_is_overwritten(self, root):
        # Found by a review: a put of the new size skipped a key whose old-size file the scan had
        # indexed ("present means the same bytes"), so the key missed forever while puts said True.
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["a", "b"], [pl(1, 4 * KiB), pl(2, 4 * KiB)])
        t.close()
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        assert t2.put_many(NS, ["a"], [pl(3)]) == [True]
        out = buf()
        assert t2.get_many(NS, ["a"], [out]) == [True] and torch.equal(out, pl(3))
        assert t2.usage_bytes() == frame_bytes("a") + frame_bytes("b", 4 * KiB)  # the new frame, once
        assert t2.get_many(NS, ["b"], [buf()]) == [False]  # not rewritten yet: a miss, never bytes
        t2.check_integrity()
        t2.close()

    @pytest.mark.parametrize("old_first", [True, False], ids=["old-size-walked-first", "new-size-walked-first"])
    def test_the_scan_keeps_valid_files_of_every_size_in_any_directory_order(self, root, monkeypatch, old_first):
        # Found by a hostile-data hunt: the scan kept only the payload size of the first file it
        # walked and deleted every other valid file of the namespace, so after a process of a new
        # size had rewritten some keys, the directory order decided whether a restart deleted that
        # process's files or the older ones.
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["old0", "old1"], [pl(1, 4 * KiB), pl(2, 4 * KiB)])
        t.close()
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        assert t2.put_many(NS, ["new0", "new1"], [pl(3), pl(4)]) == [True, True]  # this process's size
        t2.close()
        walk = DiskLayout.walk
        first = "old" if old_first else "new"
        monkeypatch.setattr(DiskLayout, "walk",
                            lambda self, ns, *more: iter(sorted(walk(self, ns, *more),
                                                                    key=lambda e: not e[1].startswith(first))))
        t3 = DiskTier(root=root, capacity_bytes=1 << 20)
        st = t3.stats().extra
        assert (st["scan_indexed"], st["scan_skipped"]) == (4, 0)
        out = [buf(), buf()]
        assert t3.get_many(NS, ["new0", "new1"], out) == [True, True]
        assert torch.equal(out[0], pl(3)) and torch.equal(out[1], pl(4))
        small = [buf(4 * KiB), buf(4 * KiB)]
        assert t3.get_many(NS, ["old0", "old1"], small) == [True, True]  # no put yet: either size reads
        assert torch.equal(small[0], pl(1, 4 * KiB)) and torch.equal(small[1], pl(2, 4 * KiB))
        assert t3.put_many(NS, ["new2"], [pl(5)]) == [True]  # fixes 8 KiB: the old files now miss
        assert t3.get_many(NS, ["old0"], [buf()]) == [False]
        t3.check_integrity()
        t3.close()

    @staticmethod
    def _outside(tmp_path) -> list:
        """Files beside a tier's root that are not the tier's (two of them named like chunks)."""
        (tmp_path / "outside" / "sub").mkdir(parents=True)
        files = [tmp_path / "outside" / "precious.txt", tmp_path / "outside" / "notes.kv",
                 tmp_path / "outside" / "sub" / "data.kv"]
        for p in files:
            p.write_bytes(b"not a chunk")
        return files

    def test_a_link_in_place_of_the_spare_directory_is_removed_never_emptied(self, tmp_path):
        # Found by a hostile-data hunt: the start-up emptied root/.spare through a symbolic link,
        # deleting every file of its target, and recycling then moved chunk files there.
        outside = self._outside(tmp_path)
        root = tmp_path / "disk"
        t = DiskTier(root=str(root), capacity_bytes=1 << 20)
        t.put_many(NS, ["a"], [pl(1)])
        t.close()
        os.rmdir(root / ".spare")  # close() removed its files
        os.symlink(tmp_path / "outside", root / ".spare")
        t2 = DiskTier(root=str(root), capacity_bytes=1 << 20)
        assert all(p.read_bytes() == b"not a chunk" for p in outside)
        assert (root / ".spare").is_dir() and not (root / ".spare").is_symlink()
        assert t2.put_many(NS, ["b"], [pl(2)]) == [True]
        assert t2.delete_many(NS, ["a", "b"]) == 2  # recycled into the real spare directory
        assert t2.stats().extra["spare_files"] == 2
        assert sorted(os.listdir(tmp_path / "outside")) == ["notes.kv", "precious.txt", "sub"]
        t2.check_integrity()
        t2.close()

    @pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
    def test_a_namespace_directory_that_is_a_link_is_never_walked(self, tmp_path, shared):
        # Found by a hostile-data hunt: os.walk follows a top directory that is a symbolic link, so
        # with root/<namespace> linked elsewhere the scan deleted the target's *.kv files (they fail
        # its checks) and clear() every one of them, recursively: files outside the root.
        outside = self._outside(tmp_path)
        root = tmp_path / "disk"
        t = DiskTier(root=str(root), capacity_bytes=1 << 20, shared=shared)
        t.put_many(NS, ["a"], [pl(1)])
        t.close()
        linked = "f" * 32
        os.symlink(tmp_path / "outside", root / linked)
        t2 = DiskTier(root=str(root), capacity_bytes=1 << 20, shared=shared)
        assert all(p.read_bytes() == b"not a chunk" for p in outside)
        # A start removes no link: one no put names is not the tier's (a misconfigured root of "/"
        # has bin -> usr/bin). A private tier's first put of the namespace replaces it (below).
        assert (root / linked).is_symlink()
        t2.clear(linked)
        t2.clear()
        assert all(p.read_bytes() == b"not a chunk" for p in outside)
        if not shared:  # a real directory now: the namespace's files stay under the root
            assert t2.put_many(linked, ["c"], [pl(3)]) == [True]
            assert os.path.isfile(t2._layout.path(linked, "c")) and not (root / linked).is_symlink()
            assert sorted(os.listdir(tmp_path / "outside")) == ["notes.kv", "precious.txt", "sub"]
        t2.check_integrity()
        t2.close()

    def test_a_closed_tier_removes_no_file(self, root):
        # Found by a review: a store's get still running at close() found the closed tiers failing
        # and deleted its chunks from the persistent directory through delete_many.
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        t.close()
        with pytest.raises(RuntimeError, match="closed"):
            t.delete_many(NS, ["a"])
        with pytest.raises(RuntimeError, match="closed"):
            t.clear(NS)
        with pytest.raises(RuntimeError, match="closed"):
            t.clear()
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        out = [buf(), buf()]
        assert t2.get_many(NS, ["a", "b"], out) == [True, True] and torch.equal(out[1], pl(2))
        t2.check_integrity()
        t2.close()

    def test_a_fifo_named_like_a_chunk_neither_hangs_the_scan_nor_a_read(self, root):
        import threading

        t = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        t.put_many(NS, ["k0"], [pl(0)])
        t.close()
        path = t._layout.path(NS, "fifo")
        os.mkfifo(path)
        made: list[DiskTier] = []
        th = threading.Thread(target=lambda: made.append(DiskTier(root=root, capacity_bytes=1 << 20, shared=True)),
                              daemon=True)
        th.start()
        th.join(10)
        assert made, "the start-up scan hung on a FIFO"
        t2 = made[0]
        got: list[list[bool]] = []
        th = threading.Thread(target=lambda: got.append(t2.get_many(NS, ["fifo"], [buf()])), daemon=True)
        th.start()
        th.join(10)
        assert got == [[False]], "a shared tier's read hung on a FIFO"
        assert t2.contains_many(NS, ["k0"]) == 1
        t2.close()

    def test_scan_over_capacity_evicts_oldest(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["old"], [pl(1)])
        os.utime(t._layout.path(NS, "old"), (time.time() - 100, time.time() - 100))
        t.put_many(NS, ["new"], [pl(2)])
        t.close()
        t2 = DiskTier(root=root, capacity_bytes=frame_bytes("new") + 10)
        assert t2.contains_many(NS, ["new"]) == 1 and t2.contains_many(NS, ["old"]) == 0
        assert t2.drain_evicted() == [(NS, "old")]
        t2.check_integrity()
        t2.close()


class TestCapacity:
    def test_lru_eviction_and_drain(self, root):
        """Room for 3 frames: a hit refreshes recency; the least recently used file is evicted."""
        t = DiskTier(root=root, capacity_bytes=3 * frame_bytes("a"))
        t.put_many(NS, ["a", "b", "c"], [pl(1), pl(2), pl(3)])
        assert t.get_many(NS, ["a"], [buf()]) == [True]
        assert t.put_many(NS, ["d"], [pl(4)]) == [True]
        assert t.contains_many(NS, ["a"]) == 1 and t.contains_many(NS, ["b"]) == 0
        assert t.drain_evicted() == [(NS, "b")] and t.drain_evicted() == []
        st = t.stats().extra
        assert st["evictions"] == 1 and st["evicted_bytes"] == frame_bytes("b")
        assert not os.path.exists(t._layout.path(NS, "b"))
        assert t.usage_bytes() <= t.capacity_bytes
        t.check_integrity()
        t.close()

    def test_capacity_smaller_than_one_chunk(self, root):
        t = DiskTier(root=root, capacity_bytes=4 * KiB)
        with pytest.raises(CapacityError, match=r"8192-byte chunk.*4096"):
            t.put_many(NS, ["a"], [pl(1)])
        t.check_integrity()
        t.close()


class TestConstructionErrors:
    def test_a_root_has_one_private_owner(self, root):
        """Found by an audit: two private tiers on one root (one process or two) evicted, recycled and
        cleaned up each other's files (their spare files even shared names). The root is now locked:
        the second is a ConfigError until the first closes or its process ends."""
        first = DiskTier(root=root, capacity_bytes=1 << 20)
        with pytest.raises(ConfigError, match="in use by another .*shared=True"):
            DiskTier(root=root, capacity_bytes=1 << 20)
        with pytest.raises(ConfigError, match="in use by a private disk tier"):
            DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        probe = ("from radixkv.tiers.disk import DiskTier\n"
                 f"t = DiskTier(root={root!r}, capacity_bytes=1 << 20)\n")
        other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and "in use by another" in other.stderr
        first.close()
        holder = subprocess.Popen([sys.executable, "-c", probe + "import time; print('up', flush=True); "
                                   "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "up"  # the other process owns it now
            with pytest.raises(ConfigError, match="in use by another"):
                DiskTier(root=root, capacity_bytes=1 << 20)
        finally:
            holder.kill()  # a killed owner releases the root
            holder.wait()
        again = DiskTier(root=root, capacity_bytes=1 << 20)
        again.close()
        a, b = (DiskTier(root=root, capacity_bytes=1 << 20, shared=True) for _ in range(2))  # shared: many
        a.close()
        b.close()

    def test_a_removed_root_is_not_written_again(self, root, caplog):
        """Found by an audit: after an rm -rf of a private root, a second tier made it again and took
        the new lock, while the first tier re-created its directories in it and wrote on: two private
        tiers in one directory again. A tier whose root is gone or replaced now fails its puts."""
        import shutil

        a = DiskTier(root=root, capacity_bytes=1 << 20)
        assert a.put_many(NS, ["k1"], [pl(1)]) == [True]
        shutil.rmtree(root)
        with caplog.at_level(logging.WARNING):
            assert a.put_many(NS, ["k2"], [pl(2)]) == [False]  # gone: nothing re-created
        assert not os.path.exists(root) and "removed or replaced" in caplog.text
        b = DiskTier(root=root, capacity_bytes=1 << 20)  # the directory is b's now
        assert b.put_many(NS, ["k3"], [pl(3)]) == [True]
        assert a.put_many(NS, ["k4"], [pl(4)]) == [False]  # replaced: not a's to write
        files = sorted(f for _d, _s, fs in os.walk(root) for f in fs if f.endswith(".kv"))
        assert files == ["k3.kv"]
        b.check_integrity()
        a.close()
        b.close()

    def test_root_under_a_regular_file(self, tmp_path):
        f = tmp_path / "file"
        f.write_bytes(b"x")
        with pytest.raises(ConfigError, match="not writable"):
            DiskTier(root=str(f / "sub"), capacity_bytes=1 << 20)
        with pytest.raises(ConfigError, match="not writable"):
            DiskTier(root=str(f), capacity_bytes=1 << 20)

    def test_read_only_directory(self, tmp_path):
        """A read-only filesystem (root ignores mode bits, so mount one read-only)."""
        d = str(tmp_path / "ro")
        if os.geteuid() != 0:
            os.makedirs(d)
            os.chmod(d, 0o500)
        elif not _mount_tmpfs(d, "ro,size=1m"):
            pytest.skip("cannot mount a read-only tmpfs here")
        try:
            with pytest.raises(ConfigError, match=r"not writable \(E(ROFS|ACCES)"):
                DiskTier(root=d, capacity_bytes=1 << 20)
        finally:
            if os.geteuid() == 0:
                _umount(d)

    @pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
    def test_root_other_users_may_write_is_refused(self, tmp_path, mode):
        """A root another user may write (an existing /tmp/radixkv made 0777 by whoever came first,
        /tmp itself, a group-writable mount) was used as it was: that user could put a valid frame
        of their own bytes at a chunk's path (the checksums are no signature: served as a hit) or a
        link in place of a directory (puts wrote, deletes removed files outside the root). Sticky
        bits do not help: namespace and chunk names are predictable, so they can be made first."""
        d = tmp_path / "open"
        d.mkdir()
        os.chmod(d, mode)
        with pytest.raises(ConfigError, match=rf"writable by .*mode {stat.S_IMODE(mode):04o}.*chmod go-w"):
            DiskTier(root=str(d), capacity_bytes=1 << 20)
        assert os.listdir(d) == []  # refused before it made anything there (.spare, probes)
        os.chmod(d, 0o755)
        DiskTier(root=str(d), capacity_bytes=1 << 20).close()  # readable by others is fine

    def test_root_owned_by_another_user_is_refused(self, tmp_path):
        """Its owner can write it whatever its mode says (chmod, or the files it already holds)."""
        if os.geteuid() != 0:
            pytest.skip("making a directory another user owns needs root")
        d = tmp_path / "theirs"
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        with pytest.raises(ConfigError, match=r"belongs to uid 65534, but this process's files belong to uid 0"):
            DiskTier(root=str(d), capacity_bytes=1 << 20)
        # A root the tier makes itself is always its own, under any parent.
        t = DiskTier(root=str(d / "mine"), capacity_bytes=1 << 20)
        t.close()
        assert os.stat(d / "mine").st_uid == 0 and stat.S_IMODE(os.stat(d / "mine").st_mode) == 0o700

    @pytest.mark.parametrize("url", ["file://relative/dir?capacity=1MiB", "file:///tmp/x", "file:///tmp/x?capacity=1MiB&bogus=1"])
    def test_bad_urls(self, url):
        with pytest.raises(ConfigError):
            make_tier(url)


class TestDiskFull:
    def test_full_at_start_is_a_warning_not_a_config_error(self, root, monkeypatch, caplog):
        # A full disk is a fault (puts fail until space frees), unlike an unwritable directory.
        real_write = os.write

        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        monkeypatch.setattr(os, "write", real_write)
        try:
            assert "is full" in caplog.text
            assert t.put_many(NS, ["a"], [pl(1)]) == [True]  # space came back
            t.check_integrity()
        finally:
            t.close()

    def test_enospc_from_pwritev_degrades_to_failed_put(self, tier, monkeypatch):
        """ENOSPC mid-write: put returns False, no temp file left, accounting restored, later puts work."""
        tier.put_many(NS, ["ok"], [pl(0)])
        real = os.pwritev

        def full(fd, bufs, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "pwritev", full)
        assert tier.put_many(NS, ["a", "b"], [pl(1), pl(2)]) == [False, False]
        st = tier.stats()
        assert st.put_failures == 2 and st.errors == 2
        assert tier.usage_bytes() == frame_bytes("ok")
        tier.check_integrity()
        for dirpath, _d, files in os.walk(tier.root):
            assert not [f for f in files if f.endswith(".tmp")], files
        monkeypatch.setattr(disk_mod.os, "pwritev", real)
        assert tier.put_many(NS, ["a"], [pl(1)]) == [True]

    def test_sustained_faults_are_logged_at_once_then_once_a_minute(self, tier, monkeypatch, caplog):
        """A disk that fills mid-run and files that fail their checksum: a warning naming the tier,
        the fault and its outcome at the first, then at most one a minute with the count between
        (stats count each). Both were silent: only counters, which nobody may scrape."""
        caplog.set_level(logging.DEBUG, logger="radixkv")
        real = os.pwritev

        def full(fd, bufs, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "pwritev", full)
        for i in range(300):
            assert tier.put_many(NS, [f"f{i}"], [pl(i)]) == [False]
        monkeypatch.setattr(disk_mod.os, "pwritev", real)
        for i in range(20):  # a file corrupted again after each put
            assert tier.put_many(NS, ["c"], [pl(i)]) == [True]
            (path,) = [os.path.join(d, f) for d, _s, fs in os.walk(tier.root) for f in fs if f.endswith(".kv")]
            with open(path, "r+b") as f:
                f.seek(-4, os.SEEK_END)
                f.write(b"\xff\xfe\xfd\xfc")
            assert tier.get_many(NS, ["c"], [buf()]) == [False]
        assert tier.stats().put_failures == 300 and tier.stats().checksum_failures == 20
        lines = [r for r in caplog.records if r.name.startswith("radixkv")]
        assert len(lines) == 2, [r.getMessage() for r in lines]
        full_msg, corrupt_msg = lines[0].getMessage(), lines[1].getMessage()
        assert all(r.levelno == logging.WARNING and r.name == "radixkv.tiers.disk" for r in lines)
        assert "'disk'" in full_msg and "ENOSPC" in full_msg and "put fails" in full_msg
        assert "'disk'" in corrupt_msg and "checksum" in corrupt_msg and "miss" in corrupt_msg
        monkeypatch.setattr(disk_mod, "_FAULT_LOG_EVERY_S", 0.0)  # a minute later
        monkeypatch.setattr(disk_mod.os, "pwritev", full)
        assert tier.put_many(NS, ["late"], [pl(1)]) == [False]
        assert "(299 more since the last such line)" in caplog.records[-1].getMessage()

    def test_a_write_that_moves_no_bytes_fails_the_put_never_spins(self, tier, monkeypatch):
        """A pwritev that returns 0 (a FUSE or network filesystem can) makes no progress: retried, it
        would hold an I/O thread forever. It is ENOSPC, a failed put, as the C helper reports it."""
        calls = []

        def stuck(fd, bufs, offset):
            calls.append(offset)
            if len(calls) > 100:  # (only to end the test where every retry writes nothing again)
                raise RuntimeError("pwritev retried 100 times without progress")
            return 0

        monkeypatch.setattr(disk_mod.os, "pwritev", stuck)
        assert tier.put_many(NS, ["a"], [pl(1)]) == [False]
        assert len(calls) == 1
        assert tier.stats().put_failures == 1 and tier.usage_bytes() == 0

    def test_real_enospc_on_tiny_tmpfs(self, tmp_path):
        """A 1 MiB tmpfs under a 64 MiB capacity: the filesystem fills first; puts fail, data stays exact."""
        d = str(tmp_path / "tiny")
        if os.geteuid() != 0 or not _mount_tmpfs(d, "size=1m,mode=0700"):  # (a tmpfs is 1777)
            pytest.skip("cannot mount a tmpfs here (needs root)")
        try:
            t = DiskTier(root=d, capacity_bytes=64 << 20)
            keys = [f"k{i}" for i in range(8)]
            ok = [t.put_many(NS, [k], [pl(i, 256 * KiB)])[0] for i, k in enumerate(keys)]
            assert 1 <= sum(ok) < 8, ok
            assert t.stats().put_failures == 8 - sum(ok)
            out = [buf(256 * KiB) for _ in keys]
            hits = t.get_many(NS, keys, out)
            assert hits == ok
            assert all(torch.equal(o, pl(i, 256 * KiB)) for i, (o, h) in enumerate(zip(out, hits)) if h)
            t.check_integrity()
            t.close()
        finally:
            _umount(d)


class TestShared:
    def test_shared_tier_reads_files_other_writers_made(self, root):
        """shared=True: a chunk written through another tier object is found, verified and adopted."""
        writer = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        reader = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        writer.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        assert reader.contains_many(NS, ["a", "b", "c"]) == 2
        out = [buf()]
        assert reader.get_many(NS, ["b"], out) == [True] and torch.equal(out[0], pl(2))
        assert reader.stats().extra["adopted"] == 1
        with pytest.raises(ConfigError, match="in use by a shared disk tier|shared=True on every tier"):
            DiskTier(root=root, capacity_bytes=1 << 20)  # it would evict and recycle their files
        for t in (writer, reader):
            t.check_integrity()
            t.close()
        private = DiskTier(root=root, capacity_bytes=1 << 20)  # non-shared scans at open only
        assert private.contains_many(NS, ["a"]) == 1
        private.check_integrity()
        private.close()

    def test_contains_answers_from_the_file(self, root):
        """shared=True: a file another process deleted is absent even where our index holds it, and
        the stale entry stops counting against our capacity."""
        ours = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        other = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        assert ours.put_many(NS, ["a", "b"], [pl(1), pl(2)]) == [True, True]
        assert other.delete_many(NS, ["a"]) == 1
        assert ours.contains_many(NS, ["a", "b"]) == 0
        assert ours.contains_many(NS, ["b"]) == 1
        assert ours.usage_bytes() == frame_bytes("b") and ours.stats().extra["chunks"] == 1
        for t in (ours, other):
            t.check_integrity()
            t.close()

    def test_put_of_a_key_another_process_deleted_writes_it_again(self, root):
        """shared=True: our index entry may outlive its file. Before: a put of that key found the
        entry and reported success without writing ("present means the same bytes"), so a store
        placed the chunk on a disk that lacked it. Now the put writes the file again."""
        ours = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        other = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        assert ours.put_many(NS, ["a"], [pl(1)]) == [True]
        assert other.delete_many(NS, ["a"]) == 1
        assert ours.put_many(NS, ["a"], [pl(1)]) == [True]
        out = [buf()]
        assert other.get_many(NS, ["a"], out) == [True] and torch.equal(out[0], pl(1))
        assert ours.usage_bytes() == frame_bytes("a")
        for t in (ours, other):
            t.check_integrity()
            t.close()

    def test_two_processes_writing_one_key(self, root):
        """Two processes rewrite one key with different bytes while this one reads: every hit is one of
        the two payloads, whole and verified."""
        DiskTier(root=root, capacity_bytes=64 << 20, shared=True).close()
        # fork: the children only do file I/O and numpy (no torch thread pools), and start in ms
        ctx = mp.get_context("fork")
        start = ctx.Event()
        procs = [ctx.Process(target=_writer, args=(root, seed, start, 1.5)) for seed in (11, 22)]
        for p in procs:
            p.start()
        reader = DiskTier(root=root, capacity_bytes=64 << 20, shared=True)
        expected = {s: _np_payload(s) for s in (11, 22)}
        start.set()
        hits, seen, bad = 0, set(), 0
        deadline = time.time() + 60
        while any(p.is_alive() for p in procs) and time.time() < deadline:
            out = buf(1 << 20)
            if reader.get_many(NS, ["shared"], [out]) == [True]:
                hits += 1
                match = [s for s, e in expected.items() if torch.equal(out, e)]
                seen.update(match)
                bad += not match
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert bad == 0
        assert hits > 0, "the reader never saw the key"
        assert seen, "no hit matched a writer's payload"
        out = buf(1 << 20)
        assert reader.get_many(NS, ["shared"], [out]) == [True]
        assert any(torch.equal(out, e) for e in expected.values())
        reader.check_integrity()
        reader.close()


def _np_payload(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8))


def _writer(root: str, seed: int, start, seconds: float) -> None:
    t = DiskTier(root=root, capacity_bytes=64 << 20, shared=True, io_threads=1)
    p = _np_payload(seed)
    start.wait(30)
    end = time.time() + seconds
    while time.time() < end:
        t.delete_many(NS, ["shared"])
        t.put_many(NS, ["shared"], [p])
    t.put_many(NS, ["shared"], [p])
    t.close()


class TestOverlappedPaths:
    """Large payloads: hashing overlaps the payload write / the next block's read (thresholds shrunk)."""

    @pytest.fixture
    def tier(self, root, monkeypatch):
        monkeypatch.setattr(disk_mod, "_OVERLAP_BLOCK_BYTES", 16 * KiB)
        t = make_tier(f"file://{root}?capacity=1MiB&overlap_min_bytes=64KiB")
        assert t.config.overlap_min_bytes == 64 * KiB
        yield t
        t.check_integrity()
        t.close()

    N = 100 * KiB + 7  # not a multiple of the block

    def test_round_trip_and_file_identical_to_plain_path(self, tier, monkeypatch):
        """Overlapped writes produce the same bytes on disk as the plain writev path."""
        assert tier.put_many(NS, ["a", "b"], [pl(1, self.N), pl(2, self.N)]) == [True, True]
        out = [buf(self.N), buf(self.N)]
        assert tier.get_many(NS, ["a", "b"], out) == [True, True]
        assert torch.equal(out[0], pl(1, self.N)) and torch.equal(out[1], pl(2, self.N))
        overlapped = open(tier._layout.path(NS, "a"), "rb").read()
        plain = DiskTier(root=tier.root + "-plain", capacity_bytes=1 << 20, overlap_min_bytes=None)
        plain.put_many(NS, ["a"], [pl(1, self.N)])
        assert open(plain._layout.path(NS, "a"), "rb").read() == overlapped
        plain.close()

    @pytest.mark.parametrize("where", ["first", "last"])
    def test_flipped_byte_in_a_block_is_a_miss(self, tier, where):
        tier.put_many(NS, ["a"], [pl(1, self.N)])
        path = tier._layout.path(NS, "a")
        offset = HEADER_BYTES + len(NS) + 1 + (5 if where == "first" else self.N - 2)
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([b ^ 1]))
        assert tier.get_many(NS, ["a"], [buf(self.N)]) == [False]
        assert tier.stats().checksum_failures == 1

    def test_truncated_mid_block_is_a_miss(self, tier):
        tier.put_many(NS, ["a"], [pl(1, self.N)])
        os.truncate(tier._layout.path(NS, "a"), 40 * KiB)
        assert tier.get_many(NS, ["a"], [buf(self.N)]) == [False]

    def test_enospc_in_helper_write_fails_the_put(self, tier, monkeypatch):
        def full(fd, bufs, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "pwritev", full)
        assert tier.put_many(NS, ["a", "b"], [pl(1, self.N), pl(2, self.N)]) == [False, False]
        assert tier.usage_bytes() == 0 and tier.stats().put_failures == 2
        for dirpath, _d, files in os.walk(tier.root):
            assert not [f for f in files if f != ".lock"], files


class TestParts:
    """A chunk in parts (e.g. an SGLang page's K and V blocks) is written with pwritev and read with
    preadv straight from/into the parts: the file is the one its concatenation makes."""

    N = 1 << 20  # two 512 KiB blocks of the plain path

    @staticmethod
    def parts_of(t: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
        out, at = [], 0
        for n in sizes:
            out.append(t[at : at + n])
            at += n
        return (*out, t[at:])

    @pytest.mark.parametrize("overlap", [None, 64 * KiB], ids=["plain", "overlapped"])
    def test_parts_across_blocks_file_identical_to_whole(self, root, monkeypatch, overlap):
        monkeypatch.setattr(disk_mod, "_OVERLAP_BLOCK_BYTES", 16 * KiB)
        t = DiskTier(root=root, capacity_bytes=8 << 20, overlap_min_bytes=overlap)
        p = pl(3, self.N)
        # parts straddling the block boundary, one empty, one tiny
        assert t.put_many(NS, ["a"], [self.parts_of(p, 300 * KiB, 0, 1, 400 * KiB)]) == [True]
        assert t.put_many(NS, ["b"], [p]) == [True]
        fa = open(t._layout.path(NS, "a"), "rb").read()
        fb = open(t._layout.path(NS, "b"), "rb").read()
        at = HEADER_BYTES + len(NS) + 1
        assert len(fa) == len(fb) and fa[at:] == fb[at:] == p.numpy().tobytes()
        want = payload_checksum(memoryview(p.numpy()))
        assert decode_header(fa).checksum == decode_header(fb).checksum == want
        out = buf(self.N)
        assert t.get_many(NS, ["b"], [self.parts_of(out, 5, 600 * KiB, 3)]) == [True]
        assert torch.equal(out, p)
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("overlap", [None, 1], ids=["plain", "overlapped"])
    def test_more_parts_than_one_system_call_takes(self, root, overlap):
        """1,500 parts (over IOV_MAX's 1024) round-trip on both paths: each call takes a bounded
        number (the overlapped write once passed them all to one pwritev: EINVAL, a failed put)."""
        t = DiskTier(root=root, capacity_bytes=1 << 20, overlap_min_bytes=overlap)
        p = pl(4, 6000)
        parts = tuple(p[i : i + 4] for i in range(0, 6000, 4))
        assert t.put_many(NS, ["a"], [parts]) == [True]
        out = buf(6000)
        assert t.get_many(NS, ["a"], [tuple(out[i : i + 4] for i in range(0, 6000, 4))]) == [True]
        assert torch.equal(out, p)
        assert t.stats().errors == 0
        t.check_integrity()
        t.close()

    def test_an_overlapped_put_whose_helper_pool_is_gone_gives_back_its_room(self, root):
        """A close() racing an overlapped put shuts the helper pool down under it: the put raises,
        and (before) kept its reservation and left its temp file behind."""
        t = DiskTier(root=root, capacity_bytes=1 << 20, overlap_min_bytes=1)

        def gone(*_a, **_k):
            raise RuntimeError("cannot schedule new futures after shutdown")

        t._aux.submit = gone
        with pytest.raises(RuntimeError, match="after shutdown"):
            t.put_many(NS, ["a"], [pl(5, 4096)])
        assert t.usage_bytes() == 0
        assert not [f for _d, _s, fs in os.walk(root) for f in fs if f.endswith(".tmp")]  # no temp left
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("where", ["first", "last"])
    def test_flipped_byte_read_into_parts_is_a_miss(self, tier, where):
        p = pl(5, 8 * KiB)
        tier.put_many(NS, ["a"], [p])
        path = tier._layout.path(NS, "a")
        offset = HEADER_BYTES + len(NS) + 1 + (5 if where == "first" else 8 * KiB - 2)
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([b ^ 1]))
        out = buf()
        assert tier.get_many(NS, ["a"], [self.parts_of(out, 4 * KiB)]) == [False]
        assert tier.stats().checksum_failures == 1

    def test_truncated_file_read_into_parts_is_a_miss(self, tier):
        tier.put_many(NS, ["a"], [pl(6)])
        os.truncate(tier._layout.path(NS, "a"), HEADER_BYTES + len(NS) + 1 + 5 * KiB)
        assert tier.get_many(NS, ["a"], [self.parts_of(buf(), 4 * KiB)]) == [False]


def test_directory_removed_behind_the_tiers_back(tier):
    """Someone wipes the tree (e.g. a cleanup job): misses, then puts recreate the directories."""
    import shutil

    tier.put_many(NS, ["a"], [pl(1)])
    shutil.rmtree(os.path.join(tier.root, NS))
    assert tier.get_many(NS, ["a"], [buf()]) == [False]
    assert tier.put_many(NS, ["a"], [pl(1)]) == [True]
    out = [buf()]
    assert tier.get_many(NS, ["a"], out) == [True] and torch.equal(out[0], pl(1))


def test_namespace_directories_an_earlier_process_left_are_bounded_at_start(root):
    """Found by the upgrade hunt: the bound on emptied namespaces' directories held within one
    process only. A start never counted the directories already under the root: the 16 an earlier
    process kept, every one an earlier release kept (it removed none: 20 namespaces, 5,141
    directories stayed through clear() and restarts), and a namespace holding only files of the
    older two-level layout (the scan removes the files, not their 65,536 possible directories). A
    private start now treats namespace directories without a valid file as emptied, oldest first,
    and removes directories below a namespace's 256 that its layout never makes."""
    kept = disk_mod._EMPTY_NAMESPACES_KEPT
    live = NS
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    assert t.put_many(live, ["a", "b"], [pl(1), pl(2)]) == [True, True]
    t.close()
    # An earlier layout's file: root/<ns>/<h[0:2]>/<h[2:4]>/<key>.kv (valid frame, deeper path).
    path_b = DiskLayout(root, "disk").path(live, "b")
    deeper = os.path.join(os.path.dirname(path_b), "ab")
    os.mkdir(deeper)
    os.rename(path_b, os.path.join(deeper, "b.kv"))
    empties = [f"{i:032x}" for i in range(kept + 4)]  # oldest first
    for i, ns in enumerate(empties):
        for j in range(256):
            os.makedirs(os.path.join(root, ns, f"{j:02x}"))
        os.utime(os.path.join(root, ns), (1000 + i, 1000 + i))
    expected = {live, *empties[-kept:]}
    for restart in range(2):
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        try:
            on_disk = {n for n in os.listdir(root) if not n.startswith(".")}
            assert on_disk == expected, f"{len(on_disk) - 1} empty namespace directories"
            assert not os.path.exists(deeper)
            out = [buf(), buf()]
            assert t.get_many(live, ["a", "b"], out) == [True, False] and torch.equal(out[0], pl(1))
            if restart == 0:
                assert t.put_many(empties[0], ["c"], [pl(3)]) == [True]  # a removed one comes back
                out = [buf()]
                assert t.get_many(empties[0], ["c"], out) == [True] and torch.equal(out[0], pl(3))
                assert t.delete_many(empties[0], ["c"]) == 1  # emptied again: the oldest kept goes
                expected = {live, empties[0], *empties[-kept + 1:]}
            t.check_integrity()
        finally:
            t.close()


def test_a_start_never_retires_a_directory_the_layout_did_not_make(root):
    """Found by the change review: the start-time bound above took every directory under the root
    whose name a namespace could have (``models``, ``hub``) and no valid chunk file for an emptied
    namespace, and removed the oldest past the 16 kept with ``shutil.rmtree``, or later, once 16 of
    the tier's own namespaces emptied: a directory of someone's files under a private root was
    deleted. Only a directory holding nothing but empty directories of the layout's shape (two hex
    digits, one or two levels) is the tier's emptied namespace."""
    kept = disk_mod._EMPTY_NAMESPACES_KEPT
    foreign = {"models": "weights.bin", "hub": os.path.join("models--x", "config.json")}
    for name, rel in foreign.items():
        os.makedirs(os.path.join(root, name, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, name, rel), "w") as f:
            f.write("not a chunk")
        os.utime(os.path.join(root, name), (10, 10))  # older than every namespace below
    os.makedirs(os.path.join(root, "odd", "zz"))  # no file, but no directory the layout makes
    os.utime(os.path.join(root, "odd"), (10, 10))
    empties = [f"{i:032x}" for i in range(kept + 2)]
    for i, ns in enumerate(empties):
        for j in range(256):
            os.makedirs(os.path.join(root, ns, f"{j:02x}"))
        os.utime(os.path.join(root, ns), (1000 + i, 1000 + i))
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    try:
        on_disk = {n for n in os.listdir(root) if not n.startswith(".")}
        assert on_disk == {"models", "hub", "odd", *empties[-kept:]}
        # Namespaces of the tier's own that empty later retire the oldest emptied: never these.
        for i in range(kept + 2):
            ns = f"{i + 100:032x}"
            assert t.put_many(ns, ["c"], [pl(i)]) == [True]
            assert t.delete_many(ns, ["c"]) == 1
        for name, rel in foreign.items():
            with open(os.path.join(root, name, rel)) as f:
                assert f.read() == "not a chunk"
        assert os.path.isdir(os.path.join(root, "odd", "zz"))
        t.check_integrity()
    finally:
        t.close()


def test_a_namespace_whose_last_file_left_keeps_no_directories(root):
    """A long-lived engine moves to fresh namespaces (vLLM's reset_cache after every weight update
    draws a new cache generation; SGLang's weight versions), and the old ones' files age out. A
    private tier keeps the directories of the last ``_EMPTY_NAMESPACES_KEPT`` emptied namespaces
    only and removes the older ones' 257: before, every namespace ever written kept them on disk
    and in memory (``DiskLayout._dirs``), growing with the number of namespaces served while the
    tier's contents stayed bounded."""
    kept = disk_mod._EMPTY_NAMESPACES_KEPT  # emptied namespaces kept, so one that refills is cheap
    t = DiskTier(root=root, capacity_bytes=4 * frame_bytes("k0", 1 * KiB))
    try:
        namespaces = [f"{i:032x}" for i in range(kept + 40)]
        for ns in namespaces:  # each namespace's files evict the oldest ones (LRU across namespaces)
            keys = [f"k{j}" for j in range(2)]
            assert all(t.put_many(ns, keys, [pl(j, 1 * KiB) for j in range(2)]))
        live = {ns for ns, _key in t._index}
        assert live == set(namespaces[-2:])
        on_disk = {n for n in os.listdir(root) if not n.startswith(".")}
        assert on_disk == set(namespaces[-2 - kept:]), (
            f"{len(on_disk)} namespace directories for {len(live)} live namespaces")
        assert len(t._layout._dirs) <= 257 * (len(live) + kept), len(t._layout._dirs)
        assert len(t._ns_dirs) == len(t._ns_payload_bytes) == len(live) + kept
        # Deleting a namespace's last chunks empties it too; it is removed once enough others empty.
        t.delete_many(namespaces[-1], ["k0", "k1"])
        assert namespaces[-2 - kept] not in os.listdir(root)
        assert t.put_many(namespaces[0], ["k2"], [pl(2, 1 * KiB)]) == [True]  # a retired one comes back
        out = buf(1 * KiB)
        assert t.get_many(namespaces[0], ["k2"], [out]) == [True] and torch.equal(out, pl(2, 1 * KiB))
        assert t.put_many(namespaces[-1], ["k2"], [pl(2, 1 * KiB)]) == [True]
        out = buf(1 * KiB)
        assert t.get_many(namespaces[-1], ["k2"], [out]) == [True] and torch.equal(out, pl(2, 1 * KiB))
        t.check_integrity()
    finally:
        t.close()


def test_a_shared_tier_forgets_its_records_of_namespaces_it_no_longer_holds(root):
    """A shared directory's namespaces hold other processes' files, so a shared tier removes no
    namespace directory; but its own records of one (257 known directories, the payload size) go
    once it holds no file of it and ``_EMPTY_NAMESPACES_KEPT`` newer ones emptied too. Before, a
    shared tier kept them for every namespace it ever wrote: ~42 KB per namespace (one per weight
    version an engine served), however few chunks it held."""
    kept = disk_mod._EMPTY_NAMESPACES_KEPT
    t = DiskTier(root=root, capacity_bytes=4 * frame_bytes("k0", 1 * KiB), shared=True)
    try:
        namespaces = [f"{i:032x}" for i in range(kept + 40)]
        for ns in namespaces:  # each namespace's files evict the oldest ones (LRU across namespaces)
            assert all(t.put_many(ns, ["k0", "k1"], [pl(j, 1 * KiB) for j in range(2)]))
        live = {ns for ns, _key in t._index}
        assert live == set(namespaces[-2:])
        assert len(t._layout._dirs) <= 257 * (len(live) + kept), (
            f"{len(t._layout._dirs)} directories remembered for {len(live)} live namespaces")
        assert len(t._ns_dirs) == len(t._ns_payload_bytes) == len(live) + kept
        assert {n for n in os.listdir(root) if not n.startswith(".")} == set(namespaces)  # all stay
        for ns in (namespaces[0], namespaces[-1]):  # a forgotten one and a live one, written again
            assert t.put_many(ns, ["k2"], [pl(2, 1 * KiB)]) == [True]
            out = buf(1 * KiB)
            assert t.get_many(ns, ["k2"], [out]) == [True] and torch.equal(out, pl(2, 1 * KiB))
        t.check_integrity()
    finally:
        t.close()


@pytest.mark.parametrize("recycle", [False, True])
def test_an_eviction_that_cannot_remove_its_victim_keeps_it_counted(tmp_path, monkeypatch, recycle):
    """Found by an audit: eviction took the victim out of the index and usage, then removed its file
    quietly; a file it could not remove (EIO, immutable) stayed on disk uncounted and never evicted
    again, so the disk held more than its capacity. It stays indexed now, and the put that needed
    the room fails instead."""
    n = 4096
    t = DiskTier(root=str(tmp_path / "r"), capacity_bytes=2 * (n + 100), io_threads=1, recycle=recycle)
    assert t.put_many("ns0", ["a", "b"], [torch.full((n,), 1, dtype=torch.uint8)] * 2) == [True, True]
    held = t.usage_bytes()  # two frames: a third does not fit

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error (injected)")

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", eio)
        m.setattr(os, "rename", eio)  # (recycling first moves the victim aside)
        assert t.put_many("ns0", ["c", "d"], [torch.full((n,), 2, dtype=torch.uint8)] * 2) == [False, False]
    assert t.usage_bytes() == held and t.contains_many("ns0", ["a", "b"]) == 2
    files = [f for _dp, _dd, fs in os.walk(t.root) for f in fs if f.endswith(".kv")]
    assert sorted(files) == ["a.kv", "b.kv"]
    t.check_integrity()
    # Removable again: eviction goes on as usual.
    assert t.put_many("ns0", ["c"], [torch.full((n,), 2, dtype=torch.uint8)]) == [True]
    t.check_integrity()
    t.close()


@pytest.mark.parametrize("namespace, failing", [(None, "listdir"), ("ns0", "scandir")])
def test_clear_removes_indexed_chunks_in_directories_it_cannot_list(tmp_path, monkeypatch, namespace, failing):
    """Found by an audit: clear() dropped the index, then removed the files its directory walk
    found; a listing that failed (EMFILE, EIO) left every file there, untracked, and a restart's
    scan served the cleared chunks again. Indexed chunks the walk missed are removed by name."""
    root = str(tmp_path / "r")
    t = DiskTier(root=root, capacity_bytes=1 << 20)
    keys = ["k0", "k1", "k2"]
    assert t.put_many("ns0", keys, [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]) == [True] * 3

    def emfile(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files (injected)")

    with monkeypatch.context() as m:
        m.setattr(os, failing, emfile)
        t.clear(namespace)
    assert t.usage_bytes() == 0
    assert not [f for _dp, _dd, fs in os.walk(root) for f in fs if f.endswith(".kv")]
    t.check_integrity()
    t.close()
    again = DiskTier(root=root, capacity_bytes=1 << 20)
    assert again.contains_many("ns0", keys) == 0
    again.close()


@pytest.mark.parametrize("option", [{"shared": "false"}, {"fsync": "0"}, {"recycle": "no"}, {"fsync": 1},
                                    {"overlap_min_bytes": True}, {"stale_temp_s": "600"}, {"root": b"/tmp/x"}])
def test_disk_options_of_the_wrong_type_are_config_errors(tmp_path, option):
    # Found by an audit: shared="false" turned shared mode on (a non-empty str is true), fsync="0"
    # and recycle="no" read as True, and stale_temp_s="600" raised a bare TypeError.
    kwargs = {"root": str(tmp_path / "r"), "capacity_bytes": 1 << 20, **option}
    name = next(iter(option))
    with pytest.raises(ConfigError, match=f"DiskTierConfig.{name}="):
        DiskTier(**kwargs)


def test_contains_sees_a_file_removed_by_hand_from_a_private_tier(tmp_path):
    # Found by an audit: a private tier answered contains from its index alone, so the store's
    # reconcile() (documented to find "files removed by hand") never saw them.
    t = DiskTier(root=str(tmp_path / "r"), capacity_bytes=1 << 20)
    assert t.put_many("ns0", ["a", "b"], [torch.full((64,), 1, dtype=torch.uint8)] * 2) == [True, True]
    os.unlink(t._layout.path("ns0", "a"))
    assert t.contains_many("ns0", ["a", "b"]) == 0
    assert t.contains_many("ns0", ["b"]) == 1
    assert t.usage_bytes() > 0 and t.stats().extra["chunks"] == 1  # "a" is forgotten, "b" kept
    t.check_integrity()
    t.close()
