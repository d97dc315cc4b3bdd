"""Pipelined ``GET`` whose replies are read straight from the socket into the caller's buffers.

redis-py (with hiredis) copies a bulk reply three times before a caller sees it: socket -> parser
buffer -> hiredis buffer -> ``bytes``; the tier would then copy it a fourth time into the caller's
tensor. For 1-32 MiB chunks those copies dominate. Here the tier borrows an ordinary redis-py
connection (authenticated, TLS, timeouts as configured), sends ``GET`` for a batch of keys in one write
and parses the RESP2 replies itself: the small frame header is read first and checked against what
was asked for, and only then is the payload ``recv_into`` the destination buffer, which is the single
copy, made by the kernel. The payload checksum is verified on the destination afterwards.

A value that is not a frame of the chunk asked for comes back with a :class:`BadValue`: enough to
tell later, on the server, whether the key still holds that very value (the tier deletes it only
then: another process may have written the key again since this read).

Any socket error or timeout disconnects the borrowed connection and is re-raised as redis-py's
``ConnectionError``/``TimeoutError``, so the connection pool never sees a half-read reply.
"""

from __future__ import annotations

import enum
import hashlib
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from radixkv.tiers.framing import HEADER_BYTES, decode_header, payload_checksum

__all__ = ["Reply", "BadValue", "get_frames_into"]

_CHUNK_BYTES = 1 << 16


class Reply(enum.Enum):
    HIT = "hit"  # the destination holds the verified payload
    ABSENT = "absent"  # no such key
    BAD = "bad"  # a value that is not the frame asked for (corrupt, foreign, wrong size)
    ERROR = "error"  # the server answered with an error (MOVED, NOPERM, WRONGTYPE, ...)


@dataclass(frozen=True)
class BadValue:
    """The identity of a value a GET found invalid in itself: any value with the same length,
    the same first bytes (up to the frame's header and identity) and, where ``sha1`` is set, the
    same SHA-1 is invalid too. ``sha1`` is needed only when the header was valid and the payload
    failed its checksum: the same chunk written again has that same header."""

    nbytes: int
    head: bytes
    sha1: str = ""  # hex, as Redis's redis.sha1hex() writes it


class _Wire:
    """A tiny buffered reader over a socket that can hand large bodies to ``recv_into``."""

    __slots__ = ("sock", "buf", "start", "end")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray(_CHUNK_BYTES)
        self.start = self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.end -= self.start
            self.start = 0
        n = self.sock.recv_into(memoryview(self.buf)[self.end :])
        if n == 0:
            raise RedisConnectionError("Redis closed the connection mid-reply")
        self.end += n

    def readline(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > 4096:
                raise RedisConnectionError("RESP protocol error: reply line longer than 4096 bytes")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        n, done = dst.nbytes, min(dst.nbytes, self.end - self.start)
        dst[:done] = self.buf[self.start : self.start + done]
        self.start += done
        while done < n:
            got = self.sock.recv_into(dst[done:])
            if got == 0:
                raise RedisConnectionError("Redis closed the connection mid-reply")
            done += got

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        while n > 0:
            if self.start == self.end:
                self._fill()
            k = min(n, self.end - self.start)
            self.start += k
            n -= k


def _read_one(wire: _Wire, namespace: str, key: str, dst: np.ndarray) -> tuple[Reply, Any]:
    """One GET reply: (HIT, None), (ABSENT, None), (ERROR, the server's text), or (BAD, a
    :class:`BadValue`, or None for a valid frame of this chunk of another size: another reader's
    value, never this reader's to delete)."""
    line = wire.readline()
    kind = line[:1]
    if kind == b"-":
        return Reply.ERROR, line[1:].decode(errors="replace")
    if line in (b"$-1", b"_"):
        return Reply.ABSENT, None
    if kind != b"$":
        raise RedisConnectionError(f"RESP protocol error: unexpected GET reply {line[:40]!r}")
    total = int(line[1:])
    prefix = HEADER_BYTES + len(namespace) + len(key)
    head = wire.read(min(total, prefix))
    header = decode_header(head)
    ours = header is not None and header.namespace == namespace and header.key == key
    if header is None or not ours or header.frame_bytes != total:
        wire.skip(total - len(head) + 2)  # corrupt, truncated, extended or foreign
        return Reply.BAD, BadValue(total, head)
    if header.payload_bytes != dst.nbytes:  # cannot be read into this buffer: skip the rest
        wire.skip(total - len(head) + 2)
        return Reply.BAD, None
    body = memoryview(dst)
    wire.read_into(body)
    wire.skip(2)
    if payload_checksum(body) != header.checksum:
        digest = hashlib.sha1(head)
        digest.update(body)
        return Reply.BAD, BadValue(total, head, digest.hexdigest())
    return Reply.HIT, None


def get_frames_into(
    pool: Any, rkeys: Sequence[str], namespace: str, keys: Sequence[str], dsts: Sequence[np.ndarray]
) -> list[tuple[Reply, Any]]:
    """``GET`` every ``rkeys[i]`` over one connection of ``pool``; verified payloads land in ``dsts[i]``.

    Returns ``(Reply, detail)`` per key (see ``_read_one``). Raises redis-py's
    ConnectionError/TimeoutError on a transport fault (the connection is dropped, not returned
    half-read).
    """
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GET", rk) for rk in rkeys]))
        wire = _Wire(conn._sock)
        return [_read_one(wire, namespace, k, d) for k, d in zip(keys, dsts)]
    except socket.timeout as exc:
        conn.disconnect()
        raise RedisTimeoutError(f"Timeout reading from Redis: {exc}") from exc
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error reading from Redis: {exc}") from exc
    except ValueError as exc:  # a length that is not a number: not a Redis we understand
        conn.disconnect()
        raise RedisConnectionError(f"RESP protocol error: {exc}") from exc
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
