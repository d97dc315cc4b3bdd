"""Disk tier: recycled files (``recycle=True``) and the frame I/O of :mod:`radixkv.tiers.disk_io`."""

from __future__ import annotations

import os

import pytest
import torch

from radixkv.tiers import disk_io
from radixkv.tiers.disk import DiskTier
from radixkv.tiers.framing import HEADER_BYTES

from frame_edits import reframed

KiB = 1 << 10
NS = "0123456789abcdef0123456789abcdef"
NS2 = "fedcba9876543210fedcba9876543210"


def pl(seed: int, nbytes: int = 8 * KiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def frame(key: str, nbytes: int = 8 * KiB, ns: str = NS) -> int:
    return HEADER_BYTES + len(ns) + len(key) + nbytes


def spare_files(root: str) -> list[str]:
    d = os.path.join(root, ".spare")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def bytes_on_disk(root: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _d, fs in os.walk(root) for f in fs)


def get(t: DiskTier, keys: list[str], nbytes: int = 8 * KiB, ns: str = NS) -> tuple[list[bool], list[torch.Tensor]]:
    out = [torch.zeros(nbytes, dtype=torch.uint8) for _ in keys]
    return t.get_many(ns, keys, out), out


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "disk")


class TestRecycling:
    def test_cleared_files_are_overwritten_in_place_by_later_puts(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20, io_threads=2)
        keys = [f"a{i}" for i in range(8)]
        assert t.put_many(NS, keys, [pl(i) for i in range(8)]) == [True] * 8
        inodes = {os.stat(t._layout.path(NS, k)).st_ino for k in keys}
        t.clear(NS)
        assert len(spare_files(root)) == 8 and t.usage_bytes() == 0
        assert t.stats().extra["spare_files"] == 8 and t.stats().extra["spare_bytes"] == 8 * frame("a0")
        t.check_integrity()
        new = [f"b{i}" for i in range(8)]
        assert t.put_many(NS, new, [pl(100 + i) for i in range(8)]) == [True] * 8
        assert t.stats().extra["recycled_puts"] == 8 and spare_files(root) == []
        assert {os.stat(t._layout.path(NS, k)).st_ino for k in new} == inodes  # the same files, renamed
        hits, out = get(t, new)
        assert hits == [True] * 8 and all(torch.equal(o, pl(100 + i)) for i, o in enumerate(out))
        assert get(t, keys)[0] == [False] * 8
        t.check_integrity()
        t.close()

    def test_eviction_hands_the_victims_file_to_the_put(self, root):
        t = DiskTier(root=root, capacity_bytes=4 * frame("k0"), io_threads=1)
        keys = [f"k{i}" for i in range(7)]
        for i, k in enumerate(keys):
            assert t.put_many(NS, [k], [pl(i)]) == [True]
            t.check_integrity()
            assert bytes_on_disk(root) <= t.capacity_bytes
        assert t.stats().extra["recycled_puts"] == 3 and t.stats().extra["evictions"] == 3
        hits, out = get(t, keys)
        assert hits == [False] * 3 + [True] * 4
        assert all(torch.equal(out[i], pl(i)) for i in range(3, 7))

    def test_spares_of_another_size_are_truncated_or_extended(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["big0", "big1"], [pl(1, 16 * KiB), pl(2, 16 * KiB)])
        t.clear(NS)
        assert t.put_many(NS2, ["s0"], [pl(3, 4 * KiB)]) == [True]  # a 16 KiB spare becomes a 4 KiB frame
        assert os.path.getsize(t._layout.path(NS2, "s0")) == frame("s0", 4 * KiB, NS2)
        t.clear(NS2)
        assert t.put_many(NS, ["x0", "x1", "x2"], [pl(i, 32 * KiB) for i in range(3)]) == [True] * 3
        hits, out = get(t, ["x0", "x1", "x2"], 32 * KiB)
        assert hits == [True] * 3 and all(torch.equal(o, pl(i, 32 * KiB)) for i, o in enumerate(out))
        t.check_integrity()
        t.close()

    def test_deleted_files_are_recycled_and_spares_count_in_the_capacity(self, root):
        cap = 6 * frame("k0")
        t = DiskTier(root=root, capacity_bytes=cap)
        t.put_many(NS, [f"k{i}" for i in range(6)], [pl(i) for i in range(6)])
        assert t.delete_many(NS, ["k0", "k1", "k2"]) == 3
        assert len(spare_files(root)) == 3 and t.usage_bytes() == 3 * frame("k0")
        # usage + spares is the whole capacity: a new put reuses a spare, evicts nothing
        assert t.put_many(NS, ["n0"], [pl(50)]) == [True]
        assert t.stats().extra["evictions"] == 0 and len(spare_files(root)) == 2
        assert bytes_on_disk(root) <= cap
        t.check_integrity()
        t.close()

    @pytest.mark.parametrize("source", ["spare", "victim"])
    def test_a_larger_file_being_overwritten_keeps_its_bytes_reserved(self, root, monkeypatch, source):
        """Found by the SIGKILL hunt (bytes on disk above the capacity left by a killed writer): a put
        that overwrites a larger recycled file (a spare, or the LRU victim it moved aside) made room
        for the larger size but reserved only its own frame, so until its truncation other puts took
        that room: 4 + 3 x 1 MiB on disk under a ~4 MiB capacity (and so left, if killed there)."""
        import threading

        # "victim": too small for both files, so the small put evicts "big" and overwrites its file
        cap = frame("big", 4 * KiB * KiB) + (64 * KiB if source == "spare" else KiB)
        t = DiskTier(root=root, capacity_bytes=cap, io_threads=1)
        assert t.put_many(NS2, ["big"], [pl(1, 4 * KiB * KiB)]) == [True]
        if source == "spare":
            assert t.delete_many(NS2, ["big"]) == 1 and len(spare_files(root)) == 1
        in_truncate, go_on = threading.Event(), threading.Event()
        truncate = os.ftruncate

        def slow_truncate(fd: int, n: int) -> None:  # the small frame is written; the file is still 4 MiB
            in_truncate.set()
            assert go_on.wait(30)
            truncate(fd, n)

        monkeypatch.setattr(os, "ftruncate", slow_truncate)
        small = threading.Thread(target=t.put_many, args=(NS, ["small"], [pl(2, 4 * KiB)]))
        small.start()
        try:
            assert in_truncate.wait(30)
            ok = [t.put_many("ab" * 16, [f"m{i}"], [pl(10 + i, KiB * KiB)])[0] for i in range(3)]
            assert bytes_on_disk(root) <= cap, (ok, t.stats().extra)
            t.check_integrity()
        finally:
            go_on.set()
            small.join(30)
        assert get(t, ["small"], 4 * KiB)[0] == [True]
        assert bytes_on_disk(root) <= cap and t._reserved == 0
        t.check_integrity()
        t.close()

    def test_close_removes_spares_and_a_restart_ignores_leftovers(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["a", "b"], [pl(1), pl(2)])
        t.delete_many(NS, ["a"])
        assert len(spare_files(root)) == 1
        t.close()
        assert spare_files(root) == []
        with open(os.path.join(root, ".spare", "9.spare"), "wb") as f:  # a crashed process's leftover
            f.write(b"x" * 100)
        t2 = DiskTier(root=root, capacity_bytes=1 << 20)
        assert spare_files(root) == [] and t2.usage_bytes() == frame("b")
        hits, out = get(t2, ["b"])
        assert hits == [True] and torch.equal(out[0], pl(2))
        t2.check_integrity()
        t2.close()

    def test_shared_directories_do_not_recycle(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20, shared=True)
        t.put_many(NS, ["a"], [pl(1)])
        t.delete_many(NS, ["a"])
        assert spare_files(root) == [] and not os.path.exists(t._layout.path(NS, "a"))
        t.put_many(NS, ["b"], [pl(2)])
        assert t.stats().extra["recycled_puts"] == 0
        t.close()

    def test_recycle_off_unlinks(self, root):
        t = DiskTier(root=root, capacity_bytes=1 << 20, recycle=False)
        t.put_many(NS, ["a"], [pl(1)])
        t.clear()
        assert spare_files(root) == [] and bytes_on_disk(root) == 0
        t.close()

    def test_a_reader_of_a_recycled_file_gets_a_miss_not_the_new_bytes(self, root):
        """A reader opened 'a' just before it was deleted; the file now holds 'b': never b's bytes as a's."""
        t = DiskTier(root=root, capacity_bytes=1 << 20)
        t.put_many(NS, ["a"], [pl(1)])
        fd = os.open(t._layout.path(NS, "a"), os.O_RDONLY)
        try:
            t.delete_many(NS, ["a"])
            t.put_many(NS, ["b"], [pl(2)])
            assert os.fstat(fd).st_ino == os.stat(t._layout.path(NS, "b")).st_ino
            out = torch.zeros(8 * KiB, dtype=torch.uint8)
            assert disk_io.read_frame(fd, NS, "a", memoryview(out.numpy())) == "corrupt"
            assert disk_io.read_frame(fd, NS, "b", memoryview(out.numpy())) == "ok"
            assert torch.equal(out, pl(2))
        finally:
            os.close(fd)
        t.close()


class TestFrameIO:
    def _write(self, path: str, key: str, payload: torch.Tensor) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            disk_io.write_frame(fd, NS, key, memoryview(payload.numpy()))
        finally:
            os.close(fd)

    def _read(self, path: str, key: str, nbytes: int) -> tuple[str, torch.Tensor]:
        out = torch.zeros(nbytes, dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            return disk_io.read_frame(fd, NS, key, memoryview(out.numpy())), out
        finally:
            os.close(fd)

    @pytest.mark.parametrize("nbytes", [1, 8 * KiB, disk_io.BLOCK_BYTES, disk_io.BLOCK_BYTES + 1, 3 * disk_io.BLOCK_BYTES + 7])
    def test_round_trip_every_block_boundary(self, tmp_path, nbytes):
        p = str(tmp_path / "f")
        self._write(p, "k", pl(nbytes, nbytes))
        assert os.path.getsize(p) == frame("k", nbytes)
        verdict, out = self._read(p, "k", nbytes)
        assert verdict == "ok" and torch.equal(out, pl(nbytes, nbytes))

    @pytest.mark.parametrize("nbytes", [8 * KiB, 2 * disk_io.BLOCK_BYTES + 5])
    def test_every_damage_is_a_verdict(self, tmp_path, nbytes):
        p = str(tmp_path / "f")
        self._write(p, "k", pl(7, nbytes))
        good = open(p, "rb").read()
        assert self._read(p, "other", nbytes)[0] == "corrupt"  # another chunk's file
        assert self._read(p, "k", nbytes + 1)[0] == "mismatch"  # another size
        for damaged in (good[:-1], good + b"\0", good[:-1] + bytes([good[-1] ^ 1]),
                        good[:100] + bytes([good[100] ^ 1]) + good[101:], good[:HEADER_BYTES // 2]):
            with open(p, "wb") as f:
                f.write(damaged)
            assert self._read(p, "k", nbytes)[0] == "corrupt"


class TestChecksum:
    """The GIL-free xxh3 path must give exactly the binding's digests (frames written by either verify)."""

    @pytest.mark.parametrize("nbytes", [0, 1, 100, 64 * KiB - 1, 64 * KiB, 1 << 20, (3 << 20) + 5])
    def test_checksum_and_stream_equal_the_binding(self, nbytes):
        import xxhash

        from radixkv.tiers.framing import Hasher, payload_checksum

        data = pl(nbytes, nbytes) if nbytes else torch.zeros(0, dtype=torch.uint8)
        mv = memoryview(data.numpy())
        want = xxhash.xxh3_64_intdigest(mv)
        assert payload_checksum(mv) == want
        assert payload_checksum(bytes(mv)) == want  # read-only buffer: the binding
        h = Hasher()
        cut = nbytes // 3
        h.update(mv[:cut])
        h.update(bytes(mv[cut : 2 * cut]))
        h.update(mv[2 * cut :])
        assert h.intdigest() == want

    def test_gil_free_path_is_active_where_the_extension_exports_xxh3(self):
        import ctypes

        import xxhash._xxhash as ext

        from radixkv.tiers.framing import GIL_FREE_HASH

        exported = hasattr(ctypes.CDLL(ext.__file__), "XXH3_64bits")
        assert GIL_FREE_HASH == exported


def test_check_header_agrees_with_decode_header():
    """The reader's fast header check accepts exactly what decode_header accepts for that identity."""
    from radixkv.tiers.framing import check_header, decode_header, encode_header

    raw = encode_header(NS, "key-1", b"x" * 100)
    h = decode_header(raw)
    assert check_header(raw, NS, "key-1") == (h.payload_bytes, h.checksum) == (100, h.checksum)
    assert check_header(raw, NS, "key-2") is None and check_header(raw, NS2, "key-1") is None
    assert check_header(raw, NS + "0", "key-1"[1:]) is None  # same bytes, other split of the identity
    for i in range(len(raw)):  # any flipped byte: both reject
        bad = bytearray(raw)
        bad[i] ^= 0x01
        assert check_header(bytes(bad), NS, "key-1") is None
        d = decode_header(bytes(bad))
        assert d is None or (d.namespace, d.key) != (NS, "key-1")
    assert check_header(raw[:-1], NS, "key-1") is None


@pytest.mark.parametrize("version, flags", [(1, 1), (1, 0x8000), (2, 0)])
def test_a_frame_of_flags_or_a_version_this_reader_does_not_know_is_refused(version, flags):
    """A flag would change what the payload means (a later format's compression, say): both header
    readers refuse a frame with one they do not know, as they refuse another version. Flags were
    read and ignored, so such a frame's payload was served as raw KV."""
    from radixkv.tiers.framing import check_header, decode_header, encode_header

    raw = encode_header(NS, "key-1", b"x" * 100)
    assert reframed(raw) == raw and decode_header(raw) is not None  # the edit itself changes nothing
    other = reframed(raw, version=version, flags=flags)
    assert decode_header(other) is None
    assert check_header(other, NS, "key-1") is None
