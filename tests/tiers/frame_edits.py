"""Frames as a writer of another format would leave them: header fields changed, header_sum recomputed
(so only the reader's field checks can refuse them)."""

from __future__ import annotations

import struct

import xxhash

from radixkv.tiers.framing import HEADER_BYTES

_FIXED_BYTES = 28  # the header's fields before header_sum


def reframed(frame: bytes, *, version: int = 1, flags: int = 0) -> bytes:
    """``frame`` with its version and flags fields set, and a header_sum that matches them."""
    fixed = bytearray(frame[:_FIXED_BYTES])
    struct.pack_into("<HH", fixed, 4, version, flags)
    ns_len, key_len = struct.unpack_from("<HH", fixed, 8)
    ident = frame[HEADER_BYTES:HEADER_BYTES + ns_len + key_len]
    header_sum = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(fixed) + ident))
    return bytes(fixed) + header_sum + frame[HEADER_BYTES:]
