"""Frame I/O of the disk tier: write one framed chunk file, read one back verified.

Both directions touch each payload byte from DRAM once, and hash it while it is hot in cache:

* write: the payload is written block by block (``pwrite`` at its frame offset), and each block is
  hashed right after the kernel copied it (so xxh3 reads it from L2, not DRAM); the header, which
  carries the checksum, goes last at offset 0. The caller writes into a file nobody can see yet (a
  temp or recycled file, committed by rename), so the order is invisible to readers.
* read: one ``preadv`` fills the header and the first payload block (and probes one byte past the
  frame's end, so a file of the wrong size needs no ``fstat``); each block is hashed right after it
  is read. Any mismatch of identity, length or checksum is a verdict, never an exception or data.

A payload may come in *parts* (a chunk scattered over the caller's memory): they are written and
read in place with ``pwritev`` / ``preadv`` over several buffers, the frame being the same as for
their concatenation.

Hashing releases the GIL for large blocks (:func:`radixkv.tiers.framing.payload_checksum`), so the
tier's I/O threads overlap one chunk's hashing with another's system calls on separate cores.

:func:`read_chunk_fast` is the same read (open to close) in one GIL-free call of the C helper
``radixkv/csrc/chunkio.c``, where it is built; it answers only "ok" or "don't know", and the tier
runs :func:`read_frame` on the latter, so every fault is still judged here, in Python. Where built,
:func:`write_frame` writes and hashes the payload in one such call too.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from typing import Any, Sequence, Union

from radixkv import native
from radixkv.tiers import framing
from radixkv.tiers.framing import HEADER_BYTES, Hasher, check_header, encode_header, payload_checksum

__all__ = ["BLOCK_BYTES", "Parts", "as_parts", "blocks", "pwrite_all", "pread_all", "pwritev_all",
           "preadv_all", "write_frame", "read_frame", "read_chunk_fast", "FAST_READ"]

BLOCK_BYTES = 512 << 10  # fits L2 (2 MiB per core here): hashed right after the kernel touched it
# Buffers per pwritev/preadv: well under IOV_MAX (1024 on Linux), leaving room for a header and probe.
_MAX_IOV = 256
_C_INT_MAX = (1 << 31) - 1  # the C helpers take an fd as a C int

Parts = Union[memoryview, Sequence[memoryview]]


def as_parts(payload: Parts) -> list[memoryview]:
    return [payload] if isinstance(payload, memoryview) else list(payload)


def blocks(parts: Sequence[memoryview], block_bytes: int) -> list[list[memoryview]]:
    """The parts' bytes in order, cut into blocks of at most ``block_bytes`` (a large part spans
    several blocks, small parts share one, at most ``_MAX_IOV`` buffers each): one system call and
    one cache-warm hash pass per block."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = block_bytes
    for p in parts:
        n, off = p.nbytes, 0
        while off < n:
            take = min(room, n - off)
            cur.append(p if take == n else p[off : off + take])
            off += take
            room -= take
            if room == 0 or len(cur) == _MAX_IOV:
                out.append(cur)
                cur, room = [], block_bytes
    if cur:
        out.append(cur)
    return out


def _nbytes(views: Sequence[memoryview]) -> int:
    return sum(v.nbytes for v in views)


def _skip(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    out = list(views)
    while out and n >= out[0].nbytes:
        n -= out.pop(0).nbytes
    if out and n:
        out[0] = out[0][n:]
    return out


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    rest = [v for v in views if v.nbytes]
    while rest:
        n = os.pwritev(fd, rest[:_MAX_IOV], offset)  # IOV_MAX bounds the buffers of one call
        if n <= 0:  # retried, a write that moves nothing would spin forever; C says ENOSPC too
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a write to fd {fd} moved 0 bytes)")
        offset += n
        rest = _skip(rest, n)


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> bool:
    """Fill ``views`` from ``offset``; False if the file ends first."""
    rest = [v for v in views if v.nbytes]
    while rest:
        n = os.preadv(fd, rest[:_MAX_IOV], offset)
        if n <= 0:
            return False
        offset += n
        rest = _skip(rest, n)
    return True


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    pwritev_all(fd, [data], offset)


def pread_all(fd: int, data: memoryview, offset: int) -> bool:
    """Fill ``data`` from ``offset``; False if the file ends first."""
    return preadv_all(fd, [data], offset)


def write_frame(fd: int, ns: str, key: str, payload: Parts) -> None:
    """Write ``encode_header(ns, key, payload) + payload`` at offset 0 of ``fd`` (raises OSError);
    ``payload`` is one buffer or its parts in order."""
    parts = as_parts(payload)
    at = HEADER_BYTES + len(ns) + len(key)
    n = _nbytes(parts)
    fast = _write_payload_fast(fd, at, parts) if _FAST_WRITE is not None and n > BLOCK_BYTES else None
    if fast is not None:
        checksum = fast
    elif len(parts) == 1 and n <= BLOCK_BYTES:
        pwrite_all(fd, parts[0], at)
        checksum = payload_checksum(parts[0])
    else:
        hasher = Hasher()
        for block in blocks(parts, BLOCK_BYTES):
            pwritev_all(fd, block, at)
            for v in block:
                hasher.update(v)
            at += _nbytes(block)
        checksum = hasher.intdigest()
    pwrite_all(fd, memoryview(encode_header(ns, key, n, checksum)), 0)


def read_frame(fd: int, ns: str, key: str, out: Parts) -> str:
    """Read the frame of ``(ns, key)`` from ``fd`` into ``out`` (one buffer or parts, filled in
    order): "ok" (``out`` holds the verified payload), "corrupt" (torn, truncated, extended, foreign
    or flipped bytes) or "mismatch" (a valid frame of another payload size). ``out`` holds
    unspecified bytes unless "ok"."""
    parts = as_parts(out)
    header_len = HEADER_BYTES + len(ns) + len(key)
    n = _nbytes(parts)
    head = bytearray(header_len)
    cut = blocks(parts, BLOCK_BYTES)
    first = cut[0] if cut else []
    whole = len(cut) <= 1
    probe = bytearray(1)  # one byte past the frame: must read nothing
    got = os.preadv(fd, [head, *first, probe] if whole else [head, *first], 0)
    if got < header_len:
        return "corrupt"
    header = check_header(head, ns, key)
    if header is None:
        return "corrupt"
    payload_bytes, checksum = header
    if payload_bytes != n:
        return "mismatch"
    frame_bytes = header_len + n
    if whole:
        if got != frame_bytes:
            if got > frame_bytes or not preadv_all(fd, _skip(first, got - header_len), got):
                return "corrupt"  # extended, or truncated
            if os.fstat(fd).st_size != frame_bytes:  # a short read: check the size the slow way
                return "corrupt"
        if len(parts) == 1:
            return "ok" if payload_checksum(parts[0]) == checksum else "corrupt"
        hasher = Hasher()
        for v in first:
            hasher.update(v)
        return "ok" if hasher.intdigest() == checksum else "corrupt"
    if os.fstat(fd).st_size != frame_bytes:
        return "corrupt"
    done = got - header_len
    at = _nbytes(first)
    if done < at and not preadv_all(fd, _skip(first, done), header_len + done):
        return "corrupt"
    hasher = Hasher()
    for v in first:
        hasher.update(v)
    for block in cut[1:]:
        if not preadv_all(fd, block, header_len + at):
            return "corrupt"
        for v in block:
            hasher.update(v)
        at += _nbytes(block)
    return "ok" if hasher.intdigest() == checksum else "corrupt"


class _HashState:
    """One xxh3 state per I/O thread, reused chunk after chunk, freed when the thread ends."""

    __slots__ = ("ptr",)

    def __init__(self) -> None:
        self.ptr = framing._RAW["create"]()  # type: ignore[index]
        if not self.ptr:
            raise MemoryError("XXH3_createState failed")

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, None
        try:
            raw = framing._RAW
            if ptr and raw is not None:
                raw["free"](ptr)
        except Exception:  # interpreter shutdown: the process is ending anyway
            pass


def _fast_setup(fn: Any) -> tuple[Any, ...] | None:
    if fn is None or framing._RAW is None:
        return None
    addr = [ctypes.cast(framing._RAW[k], ctypes.c_void_p).value for k in ("reset", "update", "digest")]
    return (fn, *addr)


_FAST = _fast_setup(native.read_chunk)
_FAST_WRITE = _fast_setup(native.write_payload)
_local = threading.local()
FAST_READ = _FAST is not None  # whether read_chunk_fast can answer "ok" at all


def _hash_state() -> _HashState:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _HashState()
    return state


def _write_payload_fast(fd: int, at: int, parts: Sequence[memoryview]) -> int | None:
    """Write ``parts`` from offset ``at`` and return their xxh3, in one GIL-free call; raises OSError
    like pwritev. None, before writing anything, if a part's address cannot be taken (read-only
    buffers) or ``fd`` is no C int: the caller writes them in Python (which raises what pwritev
    raises for such an fd)."""
    if not 0 <= fd <= _C_INT_MAX:
        return None  # ctypes would pass fd's low 32 bits: another open file
    write, reset, update, digest = _FAST_WRITE  # type: ignore[misc]
    # Each part stays exported (``pins``) until the call returns, as pwritev holds its buffers: the
    # C code reads them without the GIL, and another thread that released a caller's memoryview
    # could otherwise free or resize the bytes under it. A bytearray under a pinned part refuses a
    # resize (BufferError); an exporter with no export count (a torch tensor) is the caller's to keep.
    pins = []
    spans = []
    for v in parts:
        if v.nbytes:
            try:
                pin = ctypes.c_char.from_buffer(v)
            except (TypeError, ValueError):  # read-only or not C-contiguous: no address to hand out
                return None
            pins.append(pin)
            spans.append((ctypes.addressof(pin), v.nbytes))
    flat = (ctypes.c_uint64 * (2 * len(spans)))(*itertools.chain.from_iterable(spans))
    dig = ctypes.c_uint64()
    state = _hash_state()  # held here: the call runs without the GIL
    err = write(fd, at, flat, len(spans), BLOCK_BYTES, state.ptr, reset, update, digest, ctypes.byref(dig))
    del pins  # (after the call: the exports end here)
    if err:
        raise OSError(err, os.strerror(err))
    return dig.value


def read_chunk_fast(path: str, ns: str, key: str, spans: Sequence[tuple[int, int]], nbytes: int) -> int | None:
    """Read the frame of ``(ns, key)`` at ``path`` into the memory at ``spans`` ((address, bytes) of
    the payload's parts in order, ``nbytes`` in all; the caller keeps it alive) in one call of the C
    helper, without the GIL. Returns the file's size if the payload is verified (identity, header
    checksum, size, payload checksum: everything :func:`read_frame` checks), else None: "don't know",
    run the Python path (:func:`read_frame`) to tell a miss from a corrupt or mismatched file. The
    memory at ``spans`` holds unspecified bytes after None."""
    fast = _FAST
    if fast is None:
        return None
    read, reset, update, digest = fast
    raw_path = os.fsencode(path)
    if b"\0" in raw_path:  # C would open the path up to the NUL: another file
        raise ValueError(f"path={path!r} has an embedded null byte; pass a file path")
    state = _hash_state()
    header_len = HEADER_BYTES + len(ns) + len(key)
    head = ctypes.create_string_buffer(header_len)
    flat = (ctypes.c_uint64 * (2 * len(spans)))(*itertools.chain.from_iterable(spans))
    dig, size = ctypes.c_uint64(), ctypes.c_int64()
    rc = read(raw_path, head, header_len, flat, len(spans), BLOCK_BYTES, state.ptr, reset, update,
              digest, ctypes.byref(dig), ctypes.byref(size))
    if rc != 0:
        return None
    header = check_header(head.raw, ns, key)
    if header is None or header[0] != nbytes or header[1] != dig.value:
        return None
    return size.value
