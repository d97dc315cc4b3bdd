"""radixkv.native: the optional C helpers are built where CI runs, can be switched off, and the
fast chunk read answers "ok" only for a verified frame ("don't know" for every fault)."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from radixkv import native
from radixkv.tiers import disk_io
from radixkv.tiers.disk_io import read_chunk_fast, read_frame, write_frame

NS = "0123456789abcdef0123456789abcdef"
KiB = 1 << 10

x86_linux = pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
                               reason="the helpers are built and used on x86-64 Linux")


@x86_linux
def test_helpers_are_built_on_x86_64_linux():
    """``setup.py`` builds them as an optional extension (an install without a compiler still
    succeeds, on the Python paths). On x86-64 Linux, where CI runs, they must have been built: a
    silent build failure would otherwise only show as a slower memory and disk tier."""
    assert native.available() == {"stream_copy": True, "read_chunk": True, "write_payload": True}, (
        "radixkv/csrc/*.c were not built: is a C compiler installed?")
    assert disk_io.FAST_READ


@pytest.mark.parametrize("env,want", [
    ({"RADIXKV_NATIVE": "0"}, [False, False, False]),
    ({"RADIXKV_STREAMING_COPY": "off"}, [False, None, None]),  # the fast read stays as built
])
def test_switched_off_by_the_environment(env, want):
    code = ("import json, radixkv.native as n, radixkv.hostcopy as h, radixkv.tiers.disk_io as d;"
            "print(json.dumps([h.streaming_copy_available(), n.read_chunk is not None, d.FAST_READ]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    assert [g for g, w in zip(got, want) if w is not None] == [w for w in want if w is not None]


def payload(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def spans_of(parts: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(p.data_ptr(), p.nbytes) for p in parts]


def framed(path, payload_views) -> bytes:
    """Write the frame of (NS, "k") to a new file at ``path`` with write_frame; its bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        write_frame(fd, NS, "k", payload_views)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def frame(tmp_path):
    """A valid frame of key "k": (path, payload, frame size), payload 1.5 MiB (three hash blocks)."""
    if not disk_io.FAST_READ:
        pytest.skip("the C helper is not built here")
    data = payload(1, 1536 * KiB + 7)
    path = str(tmp_path / "k.chunk")
    framed(path, memoryview(data.numpy()))
    return path, data, os.path.getsize(path)


@pytest.mark.parametrize("cuts", [[], [1], [100, 524288], [524288, 524289, 1048575]])
def test_ok_reads_every_byte_into_any_parts(frame, cuts):
    path, data, size = frame
    out = torch.zeros_like(data)
    bounds = [0, *cuts, data.numel()]
    parts = [out[a:b] for a, b in zip(bounds, bounds[1:])]
    assert read_chunk_fast(path, NS, "k", spans_of(parts), data.numel()) == size
    assert torch.equal(out, data)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("fault", ["missing", "directory", "fifo", "payload byte", "header byte",
                                   "last byte", "truncated", "extended", "other key", "other size"])
def test_every_fault_is_dont_know(frame, fault, tmp_path):
    path, data, size = frame
    n, key = data.numel(), "k"
    if fault == "missing":
        os.unlink(path)
    elif fault == "directory":
        os.unlink(path)
        os.mkdir(path)
    elif fault == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif fault == "payload byte":
        _flip(path, size - n + 600 * KiB)
    elif fault == "header byte":
        _flip(path, 9)
    elif fault == "last byte":
        _flip(path, size - 1)
    elif fault == "truncated":
        os.truncate(path, size - 1)
    elif fault == "extended":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif fault == "other key":
        key = "j"
    elif fault == "other size":
        n -= 1
    out = torch.zeros(n, dtype=torch.uint8)
    assert read_chunk_fast(path, NS, key, spans_of([out]), n) is None


@pytest.mark.parametrize("cuts", [[], [3], [524288], [1, 2, 524290, 1048575]])
def test_fast_write_makes_the_same_file_as_the_python_write(tmp_path, monkeypatch, cuts):
    if disk_io._FAST_WRITE is None:
        pytest.skip("the C helper is not built here")
    data = payload(2, 1536 * KiB + 5)
    bounds = [0, *cuts, data.numel()]
    views = [memoryview(data[a:b].numpy()) for a, b in zip(bounds, bounds[1:])]
    files = {}
    for way in ("native", "python"):
        if way == "python":
            monkeypatch.setattr(disk_io, "_FAST_WRITE", None)
        files[way] = framed(tmp_path / way, views)
    assert files["native"] == files["python"]
    out = torch.zeros_like(data)
    fd = os.open(tmp_path / "native", os.O_RDONLY)
    try:
        assert read_frame(fd, NS, "k", memoryview(out.numpy())) == "ok"
    finally:
        os.close(fd)
    assert torch.equal(out, data)


def test_fast_write_errors_are_oserrors(tmp_path):
    if disk_io._FAST_WRITE is None:
        pytest.skip("the C helper is not built here")
    data = payload(3, 1024 * KiB)
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writing to it fails with EBADF, as pwritev would
    try:
        with pytest.raises(OSError) as e:
            write_frame(fd, NS, "k", memoryview(data.numpy()))
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)


@pytest.mark.parametrize("body", ["int radixkv_native_abi(void) { return 0; }", "int other(void) { return 1; }"])
def test_a_stale_build_is_refused_with_a_warning(tmp_path, monkeypatch, caplog, body):
    """A library from another version (say, left in a source tree after a git pull without a
    reinstall) would be called with this version's signatures: it is not loaded at all."""
    import importlib.machinery
    import importlib.util
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build a stand-in library")
    src, lib = tmp_path / "stale.c", tmp_path / "stale.so"
    src.write_text(body + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    spec = importlib.machinery.ModuleSpec("radixkv._native", None, origin=str(lib))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with caplog.at_level("WARNING", logger="radixkv"):
        assert native._load() is None
    assert "from another version" in caplog.text and str(lib) in caplog.text


def test_stream_copy_is_bit_exact_at_every_alignment_and_size():
    """The helper itself (hostcopy only hands it pieces of 64 KiB or more): a head copied to the next
    64-byte line, 64-byte lines of streaming stores, a tail. Every destination/source misalignment
    and every size around those edges; bytes around the destination stay untouched."""
    if native.stream_copy is None:
        pytest.skip("the streaming copy is not built (or not x86) here")
    src = payload(5, 8 * KiB)
    dst = torch.zeros(8 * KiB, dtype=torch.uint8)
    native.stream_copy(0, 0, 0)  # 0 bytes from null pointers: a no-op, not undefined behaviour
    for n in (1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 4096 + 7):
        for d_off in (0, 1, 7, 15, 16, 33, 63, 64):
            for s_off in (0, 5, 16):
                dst.zero_()
                native.stream_copy(dst.data_ptr() + d_off, src.data_ptr() + s_off, n)
                assert torch.equal(dst[d_off:d_off + n], src[s_off:s_off + n]), (n, d_off, s_off)
                assert int(dst[:d_off].sum()) == 0 and int(dst[d_off + n:].sum()) == 0, (n, d_off)


def test_fast_write_leaves_read_only_parts_to_the_python_write(tmp_path, monkeypatch):
    """Read-only buffers have no address to hand to C: the frame is written in Python, the same bytes."""
    if disk_io._FAST_WRITE is None:
        pytest.skip("the C helper is not built here")
    data = payload(4, 1024 * KiB + 3)
    ro = memoryview(data.numpy().tobytes())  # bytes: read-only
    assert ro.readonly
    files = {}
    for way, views in (("read-only", [ro[:100], ro[100:]]), ("writable", [memoryview(data.numpy())])):
        files[way] = framed(tmp_path / way, views)
    assert files["read-only"] == files["writable"]


def test_fast_write_keeps_the_callers_buffer_exported_until_it_returns(tmp_path, monkeypatch):
    """The C write reads the parts without the GIL. Another thread releasing the caller's memoryview
    then shrinking its bytearray meanwhile must be refused (as while pwritev holds the buffer), not
    free the bytes under the helper (a use-after-free: ASan's heap-use-after-free in pwrite)."""
    if disk_io._FAST_WRITE is None:
        pytest.skip("the C helper is not built here")
    data = payload(6, 1024 * KiB + 9)
    arr = bytearray(data.numpy().tobytes())
    view = memoryview(arr)
    write, *fns = disk_io._FAST_WRITE
    seen = []

    def racing_write(*args):
        view.release()  # what another thread may do while the GIL-free call runs
        try:
            del arr[:]
        except BufferError:
            seen.append("refused")
            return write(*args)
        seen.append("freed")
        return errno.EFAULT  # (the real helper would now read freed memory)

    monkeypatch.setattr(disk_io, "_FAST_WRITE", (racing_write, *fns))
    path = tmp_path / "k.chunk"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            write_frame(fd, NS, "k", view)
        except OSError:
            pass
    finally:
        os.close(fd)
    assert seen == ["refused"]
    out = torch.zeros_like(data)
    assert read_chunk_fast(str(path), NS, "k", spans_of([out]), out.numel()) == os.path.getsize(path)
    assert torch.equal(out, data)


def test_fast_write_never_writes_to_the_fd_in_the_low_32_bits(tmp_path):
    """ctypes passes an fd as a C int without a range check: 2**32 + fd would write the payload into
    another open file (a log, a socket). Such an fd fails as it does in Python, and nothing is written."""
    if disk_io._FAST_WRITE is None:
        pytest.skip("the C helper is not built here")
    data = payload(7, 1024 * KiB + 1)
    victim = tmp_path / "other-open-file"
    fd = os.open(victim, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for bad in (2**32 + fd, -2**32 + fd, 2**31):
            with pytest.raises(OverflowError):  # what os.pwritev raises for an fd beyond a C int
                write_frame(bad, NS, "k", memoryview(data.numpy()))
            assert os.fstat(fd).st_size == 0, bad
    finally:
        os.close(fd)


def test_fast_read_refuses_a_path_with_a_null_byte(frame):
    """C would open the path up to the NUL, another file, and could report its chunk as this one."""
    path, data, _size = frame
    out = torch.zeros_like(data)
    with pytest.raises(ValueError, match="null byte"):
        read_chunk_fast(path + "\0.tmp", NS, "k", spans_of([out]), data.numel())
    with pytest.raises(ValueError):  # what the Python read's os.open raises for it
        os.open(path + "\0.tmp", os.O_RDONLY)
