"""Frame I/O of the disk tier: write one framed chunk file, read one back verified.

Both directions touch each payload byte from DRAM once, and hash it while it is hot in cache:

* write: the payload is written block by block (``pwrite`` at its frame offset), and each block is
  hashed right after the kernel copied it (so xxh3 reads it from L2, not DRAM); the header, which
  carries the checksum, goes last at offset 0. The caller writes into a file nobody can see yet (a
  temp or recycled file, committed by rename), so the order is invisible to readers.
* read: one ``preadv`` fills the header and the first payload block (and probes one byte past the
  frame's end, so a file of the wrong size needs no ``fstat``); each block is hashed right after it
  is read. Any mismatch of identity, length or checksum is a verdict, never an exception or data.

Hashing releases the GIL for large blocks (:func:`radixkv.tiers.framing.payload_checksum`), so the
tier's I/O threads overlap one chunk's hashing with another's system calls on separate cores.
"""

from __future__ import annotations

import os

from radixkv.tiers.framing import HEADER_BYTES, Hasher, check_header, encode_header, payload_checksum

__all__ = ["BLOCK_BYTES", "pwrite_all", "pread_all", "write_frame", "read_frame"]

BLOCK_BYTES = 512 << 10  # fits L2 (2 MiB per core here): hashed right after the kernel touched it


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwritev(fd, [data[done:]], offset + done)


def pread_all(fd: int, data: memoryview, offset: int) -> bool:
    """Fill ``data`` from ``offset``; False if the file ends first."""
    done = 0
    while done < data.nbytes:
        n = os.preadv(fd, [data[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def write_frame(fd: int, ns: str, key: str, payload: memoryview) -> None:
    """Write ``encode_header(ns, key, payload) + payload`` at offset 0 of ``fd`` (raises OSError)."""
    at = HEADER_BYTES + len(ns) + len(key)
    n = payload.nbytes
    if n <= BLOCK_BYTES:
        pwrite_all(fd, payload, at)
        checksum = payload_checksum(payload)
    else:
        hasher = Hasher()
        for off in range(0, n, BLOCK_BYTES):
            block = payload[off : off + BLOCK_BYTES]
            pwrite_all(fd, block, at + off)
            hasher.update(block)
        checksum = hasher.intdigest()
    pwrite_all(fd, memoryview(encode_header(ns, key, payload, checksum)), 0)


def read_frame(fd: int, ns: str, key: str, out: memoryview) -> str:
    """Read the frame of ``(ns, key)`` from ``fd`` into ``out``: "ok" (``out`` holds the verified
    payload), "corrupt" (torn, truncated, extended, foreign or flipped bytes) or "mismatch" (a valid
    frame of another payload size). ``out`` holds unspecified bytes unless "ok"."""
    header_len = HEADER_BYTES + len(ns) + len(key)
    n = out.nbytes
    head = bytearray(header_len)
    first = out[:BLOCK_BYTES]
    whole = first.nbytes == n
    probe = bytearray(1)  # one byte past the frame: must read nothing
    got = os.preadv(fd, [head, first, probe] if whole else [head, first], 0)
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
            if got > frame_bytes or not pread_all(fd, first[got - header_len :], got):
                return "corrupt"  # extended, or truncated
            if os.fstat(fd).st_size != frame_bytes:  # a short read: check the size the slow way
                return "corrupt"
        return "ok" if payload_checksum(out) == checksum else "corrupt"
    if os.fstat(fd).st_size != frame_bytes:
        return "corrupt"
    done = got - header_len
    if done < first.nbytes and not pread_all(fd, first[done:], header_len + done):
        return "corrupt"
    hasher = Hasher()
    hasher.update(first)
    for off in range(first.nbytes, n, BLOCK_BYTES):
        block = out[off : off + BLOCK_BYTES]
        if not pread_all(fd, block, header_len + off):
            return "corrupt"
        hasher.update(block)
    return "ok" if hasher.intdigest() == checksum else "corrupt"
