"""The on-wire/on-disk frame of a persisted chunk payload.

Every payload that leaves process memory (disk files, Redis values) is framed as::

    header (40 bytes, little-endian)
      magic         4s   b"RKV1"
      version       u16  FORMAT_VERSION
      flags         u16  reserved, 0
      ns_len        u16  length of the namespace digest (ASCII)
      key_len       u16  length of the chunk key (ASCII)
      payload_len   u64  bytes of payload
      checksum      u64  xxh3_64 of the payload
      header_sum    u64  xxh3_64 of the 32 bytes above + namespace + key
    namespace digest   ns_len bytes
    chunk key          key_len bytes
    payload            payload_len bytes

A reader checks every field against what it asked for; any mismatch (torn write, bit flip, another
namespace's bytes under a colliding name, a newer format) makes the payload a miss, never data.
Frames carry no pickled objects and are parsed with ``struct`` only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "FrameHeader", "encode_header", "decode_header", "payload_checksum"]

FORMAT_VERSION = 1
_MAGIC = b"RKV1"
_FIXED = struct.Struct("<4sHHHHQQ")
_SUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _SUM.size  # 40


def payload_checksum(payload: memoryview | bytes) -> int:
    """xxh3_64 of the payload bytes (runs at memory bandwidth, so framing costs ~nothing)."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    namespace: str
    key: str
    payload_bytes: int
    checksum: int

    @property
    def frame_bytes(self) -> int:
        """Header + identity + payload: the full size of the frame."""
        return HEADER_BYTES + len(self.namespace) + len(self.key) + self.payload_bytes

    @property
    def payload_offset(self) -> int:
        return HEADER_BYTES + len(self.namespace) + len(self.key)


def encode_header(namespace: str, key: str, payload: memoryview | bytes, checksum: int | None = None) -> bytes:
    """Header + identity bytes for ``payload`` (the payload itself is written separately, uncopied)."""
    ns_raw = namespace.encode("ascii")
    key_raw = key.encode("ascii")
    n = memoryview(payload).nbytes
    if checksum is None:
        checksum = payload_checksum(payload)
    fixed = _FIXED.pack(_MAGIC, FORMAT_VERSION, 0, len(ns_raw), len(key_raw), n, checksum)
    ident = ns_raw + key_raw
    header_sum = xxhash.xxh3_64_intdigest(fixed + ident)
    return fixed + _SUM.pack(header_sum) + ident


def decode_header(buf: memoryview | bytes) -> FrameHeader | None:
    """Parse the header at the start of ``buf``; None if it is short, foreign or corrupted."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_BYTES:
        return None
    magic, version, _flags, ns_len, key_len, n, checksum = _FIXED.unpack_from(mv, 0)
    if magic != _MAGIC or version != FORMAT_VERSION:
        return None
    end = HEADER_BYTES + ns_len + key_len
    if mv.nbytes < end:
        return None
    (header_sum,) = _SUM.unpack_from(mv, _FIXED.size)
    ident = bytes(mv[HEADER_BYTES:end])
    if xxhash.xxh3_64_intdigest(bytes(mv[: _FIXED.size]) + ident) != header_sum:
        return None
    try:
        namespace = ident[:ns_len].decode("ascii")
        key = ident[ns_len:].decode("ascii")
    except UnicodeDecodeError:
        return None
    return FrameHeader(namespace=namespace, key=key, payload_bytes=n, checksum=checksum)
