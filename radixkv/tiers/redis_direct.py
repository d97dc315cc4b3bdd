"""Pipelined ``GET`` whose replies are read straight from the socket into the caller's buffers.

redis-py (with hiredis) copies a bulk reply three times before a caller sees it: socket -> parser
buffer -> hiredis buffer -> ``bytes``; the tier would then copy it a fourth time into the caller's
tensor. For 1-32 MiB chunks those copies dominate. Here the tier borrows an ordinary redis-py
connection (authenticated, TLS, timeouts as configured), sends ``GET`` for a batch of keys in one write
and parses the RESP2 replies itself: the small frame header is read first and checked against what
was asked for, and only then is the payload ``recv_into`` the destination buffer, which is the single
copy, made by the kernel. The payload checksum is verified on the destination afterwards.

Any socket error or timeout disconnects the borrowed connection and is re-raised as redis-py's
``ConnectionError``/``TimeoutError``, so the connection pool never sees a half-read reply.
"""

from __future__ import annotations

import enum
import socket
from typing import Any, Sequence

import numpy as np
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from radixkv.tiers.framing import HEADER_BYTES, decode_header, payload_checksum

__all__ = ["Reply", "get_frames_into"]

_CHUNK_BYTES = 1 << 16


class Reply(enum.Enum):
    HIT = "hit"  # the destination holds the verified payload
    ABSENT = "absent"  # no such key
    BAD = "bad"  # a value that is not the frame asked for (corrupt, foreign, wrong size)
    ERROR = "error"  # the server answered with an error (MOVED, NOPERM, WRONGTYPE, ...)


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


def _read_one(wire: _Wire, namespace: str, key: str, dst: np.ndarray) -> tuple[Reply, str]:
    line = wire.readline()
    kind = line[:1]
    if kind == b"-":
        return Reply.ERROR, line[1:].decode(errors="replace")
    if line in (b"$-1", b"_"):
        return Reply.ABSENT, ""
    if kind != b"$":
        raise RedisConnectionError(f"RESP protocol error: unexpected GET reply {line[:40]!r}")
    total = int(line[1:])
    prefix = HEADER_BYTES + len(namespace) + len(key)
    if total != prefix + dst.nbytes:  # cannot be our frame for this buffer: skip it unread
        wire.skip(total + 2)
        return Reply.BAD, ""
    header = decode_header(wire.read(prefix))
    if header is None or header.namespace != namespace or header.key != key or header.payload_bytes != dst.nbytes:
        wire.skip(dst.nbytes + 2)
        return Reply.BAD, ""
    body = memoryview(dst)
    wire.read_into(body)
    wire.skip(2)
    if payload_checksum(body) != header.checksum:
        return Reply.BAD, ""
    return Reply.HIT, ""


def get_frames_into(
    pool: Any, rkeys: Sequence[str], namespace: str, keys: Sequence[str], dsts: Sequence[np.ndarray]
) -> list[tuple[Reply, str]]:
    """``GET`` every ``rkeys[i]`` over one connection of ``pool``; verified payloads land in ``dsts[i]``.

    Returns ``(Reply, server error text)`` per key. Raises redis-py's ConnectionError/TimeoutError on
    a transport fault (the connection is dropped, not returned half-read).
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
