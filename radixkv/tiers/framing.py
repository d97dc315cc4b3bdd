"""The on-wire/on-disk frame of a persisted chunk payload.

Every payload that leaves process memory (disk files, Redis values) is framed as::

    header (36 bytes, little-endian)
      magic         4s   b"RKV1"
      version       u16  FORMAT_VERSION
      flags         u16  reserved, 0 (a reader misses on any other value)
      ns_len        u16  length of the namespace digest (ASCII)
      key_len       u16  length of the chunk key (ASCII)
      payload_len   u64  bytes of payload
      checksum      u64  xxh3_64 of the payload
      header_sum    u64  xxh3_64 of the 28 bytes above + namespace + key
    namespace digest   ns_len bytes
    chunk key          key_len bytes
    payload            payload_len bytes

A reader checks every field against what it asked for; any mismatch (torn write, bit flip, another
namespace's bytes under a colliding name, a newer format) makes the payload a miss, never data.
Frames carry no pickled objects and are parsed with ``struct`` only.

Checksums of large payloads (>= 64 KiB) call the xxh3 C functions that the ``xxhash`` package's own
extension exports, through ``ctypes``, which releases the GIL for the call: the disk tier's I/O threads
then hash on both cores at once (the ``xxhash`` Python binding holds the GIL while it hashes). Same
code, same digests -- checked at import against the binding; any doubt falls back to the binding.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from radixkv.errors import InputError

__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "FrameHeader", "encode_header", "decode_header", "check_header",
           "payload_checksum", "Hasher", "GIL_FREE_HASH"]

FORMAT_VERSION = 1
_MAGIC = b"RKV1"
_FIXED = struct.Struct("<4sHHHHQQ")
_SUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _SUM.size  # 36: 28 fixed + the 8-byte header_sum


_RAW_MIN_BYTES = 64 << 10  # below this the ctypes call overhead is not worth the released GIL


def _load_raw() -> Any:
    """The xxhash extension's exported XXH3 functions (dispatching to AVX2/AVX-512 where the
    extension does), or None if they are missing or disagree with the binding."""
    try:
        import os

        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        # The same library again, for the calls that take nanoseconds: a PyDLL call keeps the GIL.
        # A CDLL call drops and retakes it, which on a busy machine can cost a thread switch; a
        # chunk read makes ~6 of these calls, beside the 2 hashes of 512 KiB that do release it.
        quick = ctypes.PyDLL(ext.__file__)

        def fn(names: tuple[str, ...], restype: Any, argtypes: list[Any], gil_free: bool = True) -> Any:
            for name in names:
                f = getattr(lib if gil_free else quick, name, None)
                if f is not None:
                    f.restype, f.argtypes = restype, argtypes
                    return f
            raise AttributeError(names[0])

        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        raw = {
            "oneshot": fn(("XXH3_64bits_dispatch", "XXH3_64bits"), ctypes.c_uint64, [vp, sz]),
            "create": fn(("XXH3_createState",), vp, [], gil_free=False),
            "free": fn(("XXH3_freeState",), ctypes.c_int, [vp], gil_free=False),
            "reset": fn(("XXH3_64bits_reset",), ctypes.c_int, [vp], gil_free=False),
            "update": fn(("XXH3_64bits_update_dispatch", "XXH3_64bits_update"), ctypes.c_int, [vp, vp, sz]),
            "digest": fn(("XXH3_64bits_digest",), ctypes.c_uint64, [vp], gil_free=False),
        }
        probe = bytearray(os.urandom((1 << 20) + 13))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        if raw["oneshot"](addr, len(probe)) != xxhash.xxh3_64_intdigest(probe):
            return None
        state = raw["create"]()
        if not state:
            return None
        try:
            raw["reset"](state)
            raw["update"](state, addr, 1000)
            raw["update"](state, addr + 1000, len(probe) - 1000)
            if raw["digest"](state) != xxhash.xxh3_64_intdigest(probe):
                return None
        finally:
            raw["free"](state)
        return raw
    except Exception:  # any platform oddity: the binding is always correct
        return None


_RAW = _load_raw()
GIL_FREE_HASH = _RAW is not None


def _address(mv: memoryview) -> int | None:
    """Address of a writable contiguous buffer (None for read-only ones: hashed by the binding)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):
        return None


def payload_checksum(payload: memoryview | bytes) -> int:
    """xxh3_64 of the payload bytes (runs at memory bandwidth; large payloads without the GIL)."""
    if _RAW is not None:
        mv = memoryview(payload)
        if mv.nbytes >= _RAW_MIN_BYTES:
            addr = _address(mv.cast("B") if mv.format != "B" else mv)
            if addr is not None:
                return int(_RAW["oneshot"](addr, mv.nbytes))
    return xxhash.xxh3_64_intdigest(payload)


class Hasher:
    """Streaming xxh3_64 over several buffers: ``update`` each, then ``intdigest`` once (which also
    frees the C state). Large writable buffers are hashed without the GIL, like payload_checksum."""

    __slots__ = ("_state", "_py")

    def __init__(self) -> None:
        self._state = _RAW["create"]() if _RAW is not None else None
        self._py: Any = None
        if self._state:
            _RAW["reset"](self._state)  # type: ignore[index]
        else:
            self._py = xxhash.xxh3_64()

    def update(self, buf: memoryview) -> None:
        if self._py is not None:
            self._py.update(buf)
            return
        mv = memoryview(buf)
        addr = _address(mv) if mv.nbytes else None
        if addr is None and mv.nbytes:  # read-only: copy into the C state via a bytes object
            data = bytes(mv)
            addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
            _RAW["update"](self._state, addr, len(data))  # type: ignore[index]
            return
        if mv.nbytes:
            _RAW["update"](self._state, addr, mv.nbytes)  # type: ignore[index]

    def intdigest(self) -> int:
        if self._py is not None:
            return self._py.intdigest()
        try:
            return int(_RAW["digest"](self._state))  # type: ignore[index]
        finally:
            _RAW["free"](self._state)  # type: ignore[index]
            self._state = None
            self._py = _Spent()

    def __del__(self) -> None:
        if self._state and _RAW is not None:
            _RAW["free"](self._state)
            self._state = None


class _Spent:
    def update(self, buf: Any) -> None:
        raise RuntimeError("Hasher.intdigest() was already called")

    def intdigest(self) -> int:
        raise RuntimeError("Hasher.intdigest() was already called")


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


def encode_header(
    namespace: str, key: str, payload: memoryview | bytes | int, checksum: int | None = None
) -> bytes:
    """Header + identity bytes for ``payload`` (the payload itself is written separately, uncopied).
    ``payload`` may be just its byte count when ``checksum`` is given (a payload written in parts)."""
    ns_raw = namespace.encode("ascii")
    key_raw = key.encode("ascii")
    if isinstance(payload, int):
        if checksum is None:
            raise InputError("encode_header got a byte count without a checksum; pass the payload or both")
        n = payload
    else:
        n = memoryview(payload).nbytes
    if checksum is None:
        checksum = payload_checksum(payload)  # type: ignore[arg-type]
    fixed = _FIXED.pack(_MAGIC, FORMAT_VERSION, 0, len(ns_raw), len(key_raw), n, checksum)
    ident = ns_raw + key_raw
    header_sum = xxhash.xxh3_64_intdigest(fixed + ident)
    return fixed + _SUM.pack(header_sum) + ident


def decode_header(buf: memoryview | bytes) -> FrameHeader | None:
    """Parse the header at the start of ``buf``; None if it is short, foreign or corrupted."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_BYTES:
        return None
    magic, version, flags, ns_len, key_len, n, checksum = _FIXED.unpack_from(mv, 0)
    # A flag would change what the payload means (a later format's compression, say): a frame
    # with one this version does not know is a miss, as another version is.
    if magic != _MAGIC or version != FORMAT_VERSION or flags != 0:
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


_FULL = struct.Struct("<4sHHHHQQQ")  # the fixed fields and header_sum in one unpack


def check_header(buf: bytes | bytearray, namespace: str, key: str) -> tuple[int, int] | None:
    """The fast path of a reader that knows which chunk it asked for: ``(payload_bytes, checksum)``
    if ``buf`` starts with a valid header naming exactly ``namespace`` / ``key``, else None. Same
    checks as :func:`decode_header` (magic, version, flags, identity, header checksum), no string
    decoding."""
    ident = f"{namespace}{key}".encode("ascii")
    end = HEADER_BYTES + len(ident)
    if len(buf) < end:
        return None
    magic, version, flags, ns_len, key_len, n, checksum, header_sum = _FULL.unpack_from(buf, 0)
    if (magic != _MAGIC or version != FORMAT_VERSION or flags != 0 or ns_len != len(namespace)
            or key_len != len(key) or buf[HEADER_BYTES:end] != ident):
        return None
    if xxhash.xxh3_64_intdigest(bytes(buf[: _FIXED.size]) + ident) != header_sum:
        return None
    return n, checksum
