"""radixkv's optional C helpers (``radixkv/csrc/``, built by ``setup.py`` as the plain C library
``radixkv._native`` and loaded here with ctypes).

Each helper is a faster way to do something radixkv also does in Python, and the Python path stays
the reference: an install without a C compiler, a CPU the helpers were not built for, or
``RADIXKV_NATIVE=0`` in the environment leaves the attributes below None, and every caller then runs
its Python path, with the same results.

* :data:`stream_copy` ``(dst, src, nbytes)``: a copy with streaming (non-temporal) stores
  (:mod:`radixkv.hostcopy`; ``RADIXKV_STREAMING_COPY=0`` switches off this one alone).
* :data:`read_chunk` / :data:`write_payload`: a disk-tier chunk read (its success path) and the
  payload half of a chunk write, each in one GIL-free call (:mod:`radixkv.tiers.disk_io`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from typing import Any

__all__ = ["available", "read_chunk", "stream_copy", "write_payload"]

_OFF = ("0", "false", "no", "off")


def _switched_off(var: str) -> bool:
    return os.environ.get(var, "1").strip().lower() in _OFF


_ABI = 1  # radixkv/csrc/abi.c: the helpers' interface version this module calls


def _load() -> ctypes.CDLL | None:
    if _switched_off("RADIXKV_NATIVE"):
        return None
    spec = importlib.util.find_spec("radixkv._native")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        abi = lib.radixkv_native_abi()
    except (OSError, AttributeError):
        abi = None
    if abi != _ABI:
        # Calling a stale build's functions with this version's signatures would be undefined.
        logging.getLogger("radixkv").warning(
            "radixkv's C helpers at %s are from another version (interface %s, this radixkv needs %s): "
            "running the Python paths; reinstall radixkv (pip install -e . in a source tree) to rebuild them",
            spec.origin, abi, _ABI)
        return None
    return lib


_lib = _load()
stream_copy: Any = None
read_chunk: Any = None
write_payload: Any = None
if _lib is not None:
    if _lib.radixkv_stream_copy_streams() and not _switched_off("RADIXKV_STREAMING_COPY"):
        # (not built with streaming stores, e.g. not x86: it would only be a memcpy)
        stream_copy = _lib.radixkv_stream_copy
        stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        stream_copy.restype = None
    read_chunk = _lib.radixkv_read_chunk
    read_chunk.restype = ctypes.c_int
    read_chunk.argtypes = [
        ctypes.c_char_p,  # path
        ctypes.c_void_p, ctypes.c_size_t,  # header buffer, its bytes
        ctypes.c_void_p, ctypes.c_size_t,  # (address, bytes) pairs of the payload's parts, their count
        ctypes.c_size_t,  # hash block bytes
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # xxh3 state, reset, update, digest
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int64),  # digest out, file size out
    ]
    write_payload = _lib.radixkv_write_payload
    write_payload.restype = ctypes.c_int  # 0 or an errno
    write_payload.argtypes = [
        ctypes.c_int, ctypes.c_int64,  # fd, offset of the payload
        ctypes.c_void_p, ctypes.c_size_t,  # (address, bytes) pairs of the payload's parts, their count
        ctypes.c_size_t,  # hash block bytes
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # xxh3 state, reset, update, digest
        ctypes.POINTER(ctypes.c_uint64),  # digest out
    ]


def available() -> dict[str, bool]:
    """Which helpers are in use in this process (for tests, logs and ``radixkv`` diagnostics)."""
    return {"stream_copy": stream_copy is not None, "read_chunk": read_chunk is not None,
            "write_payload": write_payload is not None}
