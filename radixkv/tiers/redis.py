"""The Redis tier: chunk payloads in a real Redis/Valkey server or Redis Cluster, via redis-py.

URL scheme (details and TLS options in :mod:`radixkv.tiers.redis_client`)::

    redis://[[user]:password@]host[:port][/db]           one server (user = ACL user, optional)
    rediss://...?ssl_ca_certs=/path/ca.pem                 one server over TLS
    redis+cluster://host:port[,host:port...]               Redis Cluster, seed nodes
    rediss+cluster://...                                   Redis Cluster over TLS

Construct with ``RedisTier("redis://127.0.0.1:6379/0", capacity_bytes=8 << 30, ttl_s=3600)``,
``RedisTier("redis://127.0.0.1:6379/0?capacity=8GiB&ttl_s=3600")`` (URL options and keywords are the
same; given both ways they must agree) or ``RedisTier.from_config(RedisTierConfig(...))``.

Storage: one Redis string per chunk under ``<key_prefix>:<namespace>:<chunk key>`` (no ``{}`` hash
tag, so a cluster spreads chunks over all slots and nodes; each batch is split per node with the
client's slot map). A MOVED reply (a slot resharded, a failover) is a miss, a failed put or delete,
that makes the next call rediscover the slot map; an ASK (a slot mid-migration) is one too, but
keeps the map, which is still right. Either moves ``fault_mark``: such a miss means "unknown".
The value is a :mod:`radixkv.tiers.framing` frame: header, identity, payload. Every read checks
magic, version, header checksum, namespace, key, length and the payload's xxh3; any mismatch is a
miss counted in ``checksum_failures``. Nothing read from Redis is ever unpickled.

Invalid values: the read that found one deletes it, but only if the key still holds that very value:
one small Lua script per key (``EVALSHA``, then ``EVAL`` where the server lacks it) compares the
value's length, its first bytes and, when only the payload failed its checksum, its SHA-1 (computed
by the server) with what the read received, and UNLINKs it on a match, atomically. Another process may
have written the key again between the GET and the delete; its valid value stays
(``extra["bad_values_kept"]``; ``extra["bad_values_deleted"]`` counts the others). A valid frame of
this chunk of another size is a miss, never deleted (another reader's value). A store only *forgets*
the chunks it lost here (:meth:`RedisTier.forget_many`; a failed read, ``reconcile`` and their
orphans): deleting them by name could remove a value another process wrote since.

Batches: each call sends pipelines (no MULTI) of at most ``batch_bytes`` of payload, so a batch costs one
round trip per pipeline (per node in a cluster). Puts write ``SET key frame [PX ttl]`` (overwriting: a
put repairs a corrupted value) and send the payload straight from the tensor's memory (no copy in
Python). Gets parse the replies themselves (:mod:`radixkv.tiers.redis_direct`): the header is checked
first and the payload is received straight into the caller's buffer, then checksummed there.

Faults: a connection error or a timeout (``socket_timeout_s``/``socket_connect_timeout_s``, never
retried) turns the keys of that server (cluster: of that node) into misses or failed puts, counts
``errors`` and opens a ``down_backoff_s`` window in which calls fail fast as misses without touching
the network (in a cluster, for all nodes). After the window the next call tries again (a cluster
client rediscovers the topology), so the tier reconnects by itself when the server returns. Server
error replies (OOM, NOPERM, WRONGTYPE) fail only their own key and open no window. More threads than
``max_connections`` wait for a connection instead of failing: every batch, existence checks and
deletes included, takes one node's connection at a time (a cluster pipeline holding one of every
node's could deadlock threads on the pools). A cluster client dropped for rediscovery is closed only
after a grace period (other threads may still be in it), and any failure of the cluster client is a
fault, never an exception. A ``clear`` the server could not complete is retried by later calls (so
the byte ledger frees) and once more by ``close()``, which logs the namespaces it still could not
clear (a pending clear lives in this process only: their pre-clear values stay on the server for the
next process); until it ran, its namespace misses and refuses puts. ``ping`` asks every
primary of a cluster; ``fault_mark`` (unchanged across a call = no fault) lets callers tell
"unreachable" from "absent" (``store.reconcile`` forgets nothing a faulted tier could not confirm).

Capacity is accounted *locally*: the tier remembers the frame bytes it wrote per (namespace, key) and
has not deleted, and forgets them when their TTL passes or a read finds the key gone. A put that would
take this tier's bytes over ``capacity_bytes`` is refused. A put and a delete (or clear) of one key
that overlap leave only the server knowing which ran last: whichever call finishes second asks it
(EXISTS), so the ledger is exact once both returned (:mod:`radixkv.tiers.redis_accounting`). This
bounds what *this* tier object writes;
the server's own ``maxmemory`` bounds the server (a put it refuses with OOM is a failed put). Redis's
per-key overhead (~100 bytes) is not counted, nor is a chunk whose put timed out mid-pipeline (it may
have been stored; it is not reported stored, and its TTL or the next overwrite/delete settles it),
nor a chunk :meth:`RedisTier.forget_many` forgot (it stays on the server for whoever reaches it: a
store that reaches its chain again adopts it; else its TTL, an overwrite, a clear or ``maxmemory``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from dataclasses import replace
from typing import Any, Sequence

import torch
from redis.exceptions import AskError, ClusterDownError, NoScriptError, ResponseError, TryAgainError

from radixkv.errors import CapacityError, InputError
from radixkv.forksafe import hold_across_fork
from radixkv.tiers.base import (
    UNBOUNDED_BYTES,
    ChunkBytes,
    TierStats,
    byte_parts_all,
    check_buffers_disjoint,
    parts_nbytes,
)
from radixkv.tiers.framing import HEADER_BYTES, encode_header
from radixkv.tiers.redis_accounting import ByteLedger
from radixkv.tiers.redis_client import NAME_RE, FramedValue, RedisTierConfig, RedisUrl, build_config
from radixkv.tiers.redis_direct import BadValue, Reply, get_frames_into
from radixkv.tiers.redis_link import RedisLink

log = logging.getLogger("radixkv.tiers.redis")

__all__ = ["RedisTier", "RedisTierConfig", "UNBOUNDED_BYTES"]

_KEY_RE = re.compile(r"[\x21-\x7e]{1,256}")

# Delete KEYS[1] only if it still holds the invalid value a read found (a BadValue: ARGV = its
# length, first bytes, and SHA-1 or ""). One key: it runs on that key's node in a cluster. Returns
# 1 (deleted), 0 (another value now: written again since the read, kept) or -1 (gone).
_DROP_BAD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
if #ARGV[2] > 0 and redis.call('GETRANGE', KEYS[1], 0, #ARGV[2] - 1) ~= ARGV[2] then return 0 end
if #ARGV[3] > 0 and redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[3] then return 0 end
return redis.call('UNLINK', KEYS[1])
"""
_DROP_BAD_SHA1 = hashlib.sha1(_DROP_BAD_LUA.encode()).hexdigest()


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not NAME_RE.fullmatch(namespace):
        raise InputError(
            f"namespace={namespace!r} must be 1-128 characters of [A-Za-z0-9_.-] (pass Namespace.digest)"
        )


def _check_keys(keys: Sequence[str]) -> None:
    for key in keys:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise InputError(f"chunk key {key!r} must be 1-256 printable ASCII characters without spaces")


class RedisTier:
    """A :class:`~radixkv.tiers.base.Tier` over Redis/Valkey (standalone or cluster); thread-safe."""

    def __init__(self, url: str, **options: Any) -> None:
        self._init(build_config(url, options))

    @classmethod
    def from_config(cls, config: RedisTierConfig) -> RedisTier:
        """Same as the constructor; fields left at their defaults may come from the URL query."""
        fields = RedisTierConfig.__dataclass_fields__
        return cls(config.url, **{name: getattr(config, name) for name, f in fields.items()
                                  if name != "url" and getattr(config, name) != f.default})

    def _init(self, config: RedisTierConfig) -> None:
        self.config = config
        self.name = config.name
        self.capacity_bytes = config.capacity_bytes if config.capacity_bytes is not None else UNBOUNDED_BYTES
        self._link = RedisLink(config)
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._ledger = ByteLedger(self.capacity_bytes, config.ttl_s)
        self._lock = threading.Lock()
        # A leaf lock a fork must not copy mid-use (redis-py itself resets its pools in a child; the
        # ledger registers its own lock).
        hold_across_fork(self)
        self._stats = TierStats()
        self._pending_clears: set[str | None] = set()  # clears a fault interrupted (retried)
        self._clear_retry_after = 0.0  # a clear the server refused is retried no sooner (monotonic)
        self._warned_refused_clear = False
        self._clearing: set[str | None] = set()  # clears running now

    @property
    def shared(self) -> bool:
        """A Redis server is reachable by other processes: always shared."""
        return True

    @property
    def max_frame_bytes(self) -> int:
        """The largest chunk frame (payload and header) one value may hold (``max_value_bytes``)."""
        return self.config.max_value_bytes

    @property
    def redis_client(self) -> Any:
        """The underlying redis-py ``Redis``/``RedisCluster`` (for diagnostics and tests)."""
        return self._link.client()

    @property
    def parsed_url(self) -> RedisUrl:
        return self._link.url

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                if hasattr(self._stats, name):
                    setattr(self._stats, name, getattr(self._stats, name) + n)
                else:
                    self._stats.extra[name] = self._stats.extra.get(name, 0) + n

    def _rkey(self, namespace: str, key: str) -> str:
        return f"{self.config.key_prefix}:{namespace}:{key}"

    def _batches(self, sizes: Sequence[int]) -> list[range]:
        """Consecutive index ranges whose payload bytes stay within ``batch_bytes`` (>= 1 item each)."""
        out, start, acc = [], 0, 0
        for i, n in enumerate(sizes):
            if i > start and acc + n > self.config.batch_bytes:
                out.append(range(start, i))
                start, acc = i, 0
            acc += n
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out

    # ---------------------------------------------------------------- Tier protocol

    def put_many(self, namespace: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]) -> list[bool]:
        """Store each payload (overwriting); False where refused (capacity, server down or OOM)."""
        _check_namespace(namespace)
        _check_keys(keys)
        if len(keys) != len(payloads):
            raise InputError(f"put_many got {len(keys)} keys but {len(payloads)} payloads; pass one per key")
        # A chunk in parts is joined (one copy): a SET value is one buffer, and the network, not
        # this copy, bounds a remote tier.
        views = [memoryview(_joined(ps).numpy()) for ps in byte_parts_all(payloads, "payloads")]
        self._retry_clears()  # before the ledger decides what fits
        ok = [False] * len(keys)
        if self._cleared_out(namespace):
            self._count(put_failures=len(keys))
            return ok
        ident = len(namespace) + HEADER_BYTES
        frame_sizes = [ident + len(k) + v.nbytes for k, v in zip(keys, views)]
        for i, (view, frame_bytes) in enumerate(zip(views, frame_sizes)):
            if view.nbytes == 0:
                raise InputError(f"payloads[{i}] is empty; a chunk payload must have at least one byte")
            if frame_bytes > self.config.max_value_bytes:
                raise CapacityError(
                    f"payloads[{i}] needs a {frame_bytes}-byte Redis value but tier {self.name!r} has "
                    f"max_value_bytes={self.config.max_value_bytes} (the server's proto-max-bulk-len); "
                    "use smaller chunks, or raise proto-max-bulk-len on the server and max_value_bytes here"
                )
            if frame_bytes > self.capacity_bytes:
                raise CapacityError(
                    f"payloads[{i}] needs {frame_bytes} bytes (payload + {frame_bytes - view.nbytes} bytes "
                    f"of frame) but tier {self.name!r} has capacity_bytes={self.capacity_bytes}; raise it"
                )
        granted = self._ledger.reserve(namespace, keys, frame_sizes)
        refused = len(keys) - sum(granted)
        try:
            ok = self._send_frames(namespace, keys, views, granted)
        finally:  # release the reservations even if something unexpected escapes
            recheck = self._ledger.settle(namespace, keys, frame_sizes, granted, ok)
        if recheck:  # a delete's UNLINK of these keys overlapped the SETs: which ran last?
            self._forget_if_gone(namespace, recheck)
        stored = sum(ok)
        self._count(puts=stored, put_failures=len(keys) - stored, capacity_refusals=refused,
                    bytes_in=sum(v.nbytes for v, s in zip(views, ok) if s))
        return ok

    def _send_frames(self, namespace: str, keys: Sequence[str], views: list[memoryview],
                     granted: list[bool]) -> list[bool]:
        """SET the granted chunks, one pipeline per batch and node; True where the server said OK."""
        ok = [False] * len(keys)
        failed: list[Exception] = []
        for batch in self._batches([v.nbytes for v in views]):
            idx = [i for i in batch if granted[i]]
            if not idx:
                continue
            rkeys = [self._rkey(namespace, keys[i]) for i in idx]
            frames = [FramedValue(encode_header(namespace, keys[i], views[i]), views[i]) for i in idx]

            def set_frames(node: Any, sub: list[int], rkeys: list[str] = rkeys,
                           frames: list[FramedValue] = frames) -> list[Any]:
                pipe = node.pipeline(transaction=False)
                for j in sub:
                    pipe.set(rkeys[j], frames[j], px=self._ttl_ms)
                return pipe.execute(raise_on_error=False)

            replies = self._link.fan_out(rkeys, set_frames)
            for j, i in enumerate(idx):
                reply = None if replies is None else replies[j]
                ok[i] = reply is True
                if isinstance(reply, Exception):
                    self._count(errors=1)
                    failed.append(reply)
        self._link.note_error_replies(failed)
        return ok

    def get_many(self, namespace: str, keys: Sequence[str], buffers: Sequence[ChunkBytes]) -> list[bool]:
        """Read each payload into its buffer (exact size required); False is a miss. A namespace
        whose clear is pending (a node was down) misses until the clear completed."""
        _check_namespace(namespace)
        _check_keys(keys)
        if len(keys) != len(buffers):
            raise InputError(f"get_many got {len(keys)} keys but {len(buffers)} buffers; pass one per key")
        outs = byte_parts_all(buffers, "buffers")
        check_buffers_disjoint(outs)
        # A buffer in parts is read into one staging buffer, then copied into its parts (on a hit).
        staged = [o[0] if len(o) == 1 else torch.empty(parts_nbytes(o), dtype=torch.uint8) for o in outs]
        dsts = [t.numpy() for t in staged]
        started = time.monotonic()
        ok = [False] * len(keys)
        self._retry_clears()
        if self._cleared_out(namespace):  # the live nodes still hold pre-clear bytes: never serve them
            self._count(gets=len(keys), misses=len(keys))
            return ok
        gone: list[str] = []
        invalid: list[tuple[str, BadValue]] = []
        bad = 0
        failed: list[str] = []
        for batch in self._batches([d.nbytes for d in dsts]):
            rkeys = [self._rkey(namespace, keys[i]) for i in batch]

            def get_frames(node: Any, sub: list[int], batch: range = batch, rkeys: list[str] = rkeys) -> list[Any]:
                return get_frames_into(node.connection_pool, [rkeys[j] for j in sub], namespace,
                                       [keys[batch[j]] for j in sub], [dsts[batch[j]] for j in sub])

            replies = self._link.fan_out(rkeys, get_frames)
            for i, reply in zip(batch, replies or ()):
                if reply is None:  # its node faulted (counted once in errors)
                    continue
                kind, detail = reply
                ok[i] = kind is Reply.HIT
                if kind is Reply.ABSENT:
                    gone.append(keys[i])
                elif kind is Reply.BAD:
                    bad += 1
                    if detail is not None:
                        invalid.append((keys[i], detail))
                elif kind is Reply.ERROR:
                    failed.append(detail)
                    self._count(errors=1)
        self._link.note_error_replies(failed)
        if invalid:
            self._drop_invalid(namespace, invalid)
        for o, t, hit in zip(outs, staged, ok):
            if hit and len(o) > 1:
                _scatter(t, o)
        if gone:
            self._ledger.forget(namespace, gone, seen_at=started)
        hits = sum(ok)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits, checksum_failures=bad,
                    bytes_out=sum(d.nbytes for d, s in zip(dsts, ok) if s))
        return ok

    def _drop_invalid(self, namespace: str, invalid: list[tuple[str, BadValue]]) -> None:
        """Delete the invalid values a read found, each only if its key still holds that value
        (``_DROP_BAD_LUA``, atomic on the server): a delete by name could remove a valid value
        another process wrote since the GET. The ledger forgets the keys deleted (asking the
        server, as ``delete_many`` does, about puts of ours that overlapped) or found gone. A fault
        deletes nothing: the value stays, a miss for every reader, until a put overwrites it."""
        keys = [k for k, _ in invalid]
        rkeys = [self._rkey(namespace, k) for k in keys]
        started = time.monotonic()

        def drop(node: Any, idx: list[int]) -> list[Any]:
            replies = _compare_and_delete(node, [(rkeys[i], invalid[i][1]) for i in idx], True)
            unknown = [j for j, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if unknown:  # a server that never saw the script, or flushed it: EVAL loads it
                retry = [idx[j] for j in unknown]
                again = _compare_and_delete(node, [(rkeys[i], invalid[i][1]) for i in retry], False)
                for j, reply in zip(unknown, again):
                    replies[j] = reply
            return replies

        replies = self._link.fan_out(rkeys, drop) or [None] * len(keys)
        deleted = [k for k, r in zip(keys, replies) if r == 1]
        gone = [k for k, r in zip(keys, replies) if r == -1]
        failed = [r for r in replies if isinstance(r, Exception)]
        if deleted:
            recheck = self._ledger.forget_unlinked(namespace, deleted, seen_at=started)
            if recheck:  # a put of ours settled during the delete: which ran last?
                self._forget_if_gone(namespace, recheck)
        if gone:
            self._ledger.forget(namespace, gone, seen_at=started)
        self._link.note_error_replies(failed)
        kept = sum(1 for r in replies if r == 0)
        self._count(bad_values_deleted=len(deleted), bad_values_kept=kept, errors=len(failed))

    def contains_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Length of the leading run of keys that exist (existence only; reads verify the bytes)."""
        _check_namespace(namespace)
        _check_keys(keys)
        if not keys:
            return 0
        self._retry_clears()
        if self._cleared_out(namespace):  # what a pending clear did not delete yet is gone for callers
            return 0
        replies = self._per_node(namespace, keys, "exists")
        if replies is None:
            return 0
        run = 0
        for reply in replies:
            if reply != 1:
                break
            run += 1
        return run

    def _per_node(self, namespace: str, keys: Sequence[str], command: str) -> list[Any] | None:
        """One pipeline of ``command`` (exists / unlink) per server, one connection at a time: a
        cluster pipeline holds a connection of every node at once, and threads taking them in
        different orders deadlocked on the pools (None entries: a node that faulted)."""
        rkeys = [self._rkey(namespace, k) for k in keys]

        def call(conn: Any, idx: list[int]) -> list[Any]:
            pipe = conn.pipeline(transaction=False)
            for i in idx:
                getattr(pipe, command)(rkeys[i])
            return pipe.execute(raise_on_error=False)

        replies = self._link.fan_out(rkeys, call)
        # A MOVED/ASK reply (a slot resharded or failed over) says neither "absent" nor "deleted":
        # refresh the map (nothing else would for a caller that only probes or deletes) and move
        # fault_mark, so reconcile forgets nothing and a store retries the delete.
        moved = self._link.note_error_replies([r for r in replies or () if isinstance(r, Exception)])
        if moved:
            self._count(errors=moved)
        return replies

    def delete_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Delete the keys; returns how many existed (0 if the server is unreachable)."""
        _check_namespace(namespace)
        _check_keys(keys)
        if not keys:
            return 0
        started = time.monotonic()
        replies = self._per_node(namespace, keys, "unlink")
        if replies is None:
            return 0
        done = [k for k, r in zip(keys, replies) if r is not None and not isinstance(r, Exception)]
        recheck = self._ledger.forget_unlinked(namespace, done, seen_at=started)
        if recheck:  # a put of these keys settled during the UNLINKs: which ran last?
            self._forget_if_gone(namespace, recheck)
        present = sum(1 for r in replies if r == 1)
        self._count(deletes=present)
        return present

    def forget_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Stop counting the keys against this tier's capacity, leaving their values on the server
        (no I/O). A store forgets so the chunks it lost (a failed read, ``reconcile``, their
        orphans) and its evicted chunks of a borrowed namespace: what it knows of them predates a
        delete by name, which could remove a value another process wrote since. Returns how many
        were counted; a put of one in flight counts it again when it settles."""
        _check_namespace(namespace)
        _check_keys(keys)
        n = self._ledger.forget(namespace, keys, seen_at=math.inf)
        self._count(forgotten=n)
        return n

    def usage_bytes(self) -> int:
        """Frame bytes this tier wrote and has not seen deleted or expired, nor forgotten (see the
        module docstring)."""
        return self._ledger.used_bytes()

    def stats(self) -> TierStats:
        """Counters; ``errors`` includes link faults, ``extra`` has ``fast_fail_calls`` (calls answered
        as misses inside the back-off window) and ``capacity_refusals``."""
        with self._lock:
            s = replace(self._stats, extra=dict(self._stats.extra))
        s.errors += self._link.errors
        s.extra["fast_fail_calls"] = self._link.fast_fail_calls
        return s

    def clear(self, namespace: str | None = None) -> None:
        """Delete every chunk of ``namespace`` (or every chunk under ``key_prefix``) by SCAN + UNLINK.
        A clear the server could not complete (unreachable, a node down) is retried by later calls
        until it succeeds, so the byte ledger never keeps counting chunks the server lost."""
        if namespace is not None:
            _check_namespace(namespace)
        if not self._clear_now(namespace):
            with self._lock:
                self._pending_clears.add(namespace)

    def _retry_clears(self) -> None:
        """Run the clears a fault interrupted (cheap when there are none). A namespace stays pending
        until its clear succeeded, so puts of it are refused meanwhile (see :meth:`_cleared_out`)."""
        if not self._pending_clears or time.monotonic() < self._clear_retry_after:
            return
        with self._lock:
            pending = set(self._pending_clears)
        if None in pending:
            pending = {None}
        done = {ns for ns in pending if self._clear_now(ns)}
        if done:
            with self._lock:
                self._pending_clears -= done
                if None in done:
                    self._pending_clears.clear()

    def _cleared_out(self, namespace: str) -> bool:
        """Whether a clear of the namespace (or of everything) is pending or running: a put now
        would be deleted by it, so it is refused (a miss later, never a chunk acknowledged and lost),
        and gets and ``contains_many`` answer misses (the nodes the clear did reach lost their chunks,
        the others still hold pre-clear bytes that must not be served)."""
        blocked = self._pending_clears | self._clearing
        return bool(blocked) and (namespace in blocked or None in blocked)

    def _clear_now(self, namespace: str | None) -> bool:
        with self._lock:
            self._clearing.add(namespace)  # (one clear per namespace at a time: the last one wins)
        try:
            return self._scan_unlink(namespace)
        finally:
            with self._lock:
                self._clearing.discard(namespace)

    def _scan_unlink(self, namespace: str | None) -> bool:
        pattern = f"{self.config.key_prefix}:{namespace}:*" if namespace else f"{self.config.key_prefix}:*"
        started = time.monotonic()

        def action(client: Any) -> bool:
            batch: list[bytes] = []
            try:
                for rkey in client.scan_iter(match=pattern, count=1000):  # every primary in a cluster
                    batch.append(rkey)
                    if len(batch) >= 1000:
                        _unlink(client, batch)
                        batch = []
                if batch:
                    _unlink(client, batch)
            except ResponseError as e:
                if isinstance(e, (AskError, ClusterDownError, TryAgainError)):  # (MOVED is an AskError)
                    raise  # the cluster's topology moving: a fault, retried
                self._refused_clear(namespace, e)
                return False
            return True

        if self._link.guard(action):
            kept = self._ledger.forget_all(namespace, seen_at=started)
            for ns in {ns for ns, _key in kept}:  # puts settled during the clear: which ran last?
                self._forget_if_gone(ns, [key for n, key in kept if n == ns])
            return True
        return False

    def _refused_clear(self, namespace: str | None, exc: ResponseError) -> None:
        """The server refused the clear's SCAN or UNLINK (an ACL without them: NOPERM; a renamed command).
        Not a fault of the medium: the link stays up for every other call. The clear stays pending
        (its namespace's puts refused, its gets missing: pre-clear bytes are never served) and is
        retried no sooner than ``max(1 s, down_backoff_s)``. Before, each retry, run by every call
        of any namespace, opened the fail-fast window: the whole tier served misses for good."""
        self._clear_retry_after = time.monotonic() + max(1.0, self.config.down_backoff_s)
        with self._lock:
            self._stats.errors += 1
        if not self._warned_refused_clear:
            self._warned_refused_clear = True
            log.warning("redis tier %s: the server refused clear(%r) (%s); the namespace's chunks stay "
                        "unserved and it is retried; grant the user +scan and +unlink on the tier's "
                        "keys", self._link.url.redacted(), namespace, exc)

    def _forget_if_gone(self, namespace: str, keys: Sequence[str]) -> None:
        """Forget the keys the server does not hold now. For a put and a delete (or clear) of one
        key that overlapped: only the server knows whether the SET or the UNLINK ran last. A fault
        keeps the entries (an overcount until a later get, delete, clear or TTL settles them)."""
        started = time.monotonic()  # a put settled after this may have SET after the EXISTS: kept
        replies = self._per_node(namespace, keys, "exists")
        gone = [k for k, r in zip(keys, replies or ()) if r == 0]
        if gone:
            self._ledger.forget(namespace, gone, seen_at=started)

    def close(self) -> None:
        """Idempotent; later calls raise RuntimeError. A clear a fault interrupted is tried once more
        first (its pre-clear values would otherwise be served to the next process that adopts
        them); one that still fails is logged by namespace."""
        if self._pending_clears and not self._link.is_closed():
            self._clear_retry_after = 0.0
            try:
                self._retry_clears()
            except Exception:  # noqa: BLE001 - a fault: logged below, the close goes on
                pass
            if self._pending_clears:
                left = sorted("(all)" if ns is None else ns for ns in self._pending_clears)
                log.warning("radixkv: redis tier %s: clear of namespace(s) %s could not complete before "
                            "close; their pre-clear values stay on the server (until their TTL): clear "
                            "them again once it answers", self.name, left)
        self._link.close()

    def check_integrity(self) -> None:
        self._ledger.check_integrity()
        s = self.stats()
        assert s.hits + s.misses == s.gets, f"hits {s.hits} + misses {s.misses} != gets {s.gets}"
        assert min(s.as_dict().values(), default=0) >= 0, f"negative counter in {s.as_dict()}"

    def ping(self) -> bool:
        """True if the server (every primary of a cluster) answers now (ignores the fail-fast window;
        for health checks and delete retries, which must not take one live node for all); a ping
        every server answered ends the window. A cluster
        ping that fails makes the next call rediscover the primaries (a replica may have taken over)."""
        faults = self._link.errors
        try:
            client = self._link.client()
            if not self._link.url.cluster:
                answered = bool(client.ping())
            else:
                answered = all(client.get_redis_connection(n).ping() for n in client.get_primaries())
            if answered:
                self._link.note_ping_answered(faults)
                return True
            if not self._link.url.cluster:
                return False
        except Exception:  # noqa: BLE001 - a client in the middle of a topology change: not healthy
            if not self._link.url.cluster:
                return False
        # A primary that died may have been replaced by its replica since the slot map was read:
        # the next call rediscovers it (else an idle tier pinged the dead node, unhealthy, forever).
        self._link.rediscover()
        return False

    def fault_mark(self) -> int:
        """Faults, calls refused by the fail-fast window and stale slot maps (MOVED/ASK replies) so
        far: if it changed across some calls, their misses mean "unreachable", not "absent"
        (reconcile must not forget such chunks, a store retries such deletes)."""
        return self._link.errors + self._link.fast_fail_calls + self._link.stale_map_calls

    def __repr__(self) -> str:
        return (f"RedisTier({self._link.url.redacted()!r}, capacity_bytes={self.capacity_bytes}, "
                f"ttl_s={self.config.ttl_s})")


def _compare_and_delete(node: Any, items: list[tuple[str, BadValue]], by_sha1: bool) -> list[Any]:
    """``_DROP_BAD_LUA`` for each (key, value), in one pipeline (EVALSHA, or EVAL to send it)."""
    pipe = node.pipeline(transaction=False)
    for rkey, v in items:
        if by_sha1:
            pipe.evalsha(_DROP_BAD_SHA1, 1, rkey, v.nbytes, v.head, v.sha1)
        else:
            pipe.eval(_DROP_BAD_LUA, 1, rkey, v.nbytes, v.head, v.sha1)
    return pipe.execute(raise_on_error=False)


def _unlink(client: Any, rkeys: list[bytes]) -> None:
    """UNLINK the keys; raises the first error reply. A clear counts as done only if every UNLINK
    ran: the replies were not read, so a refused UNLINK (NOPERM) or a cluster node that timed out
    (a ClusterPipeline returns those inline too) left chunks that were served after a clear that
    reported success (a failover brought a paused node's chunks back)."""
    pipe = client.pipeline(transaction=False)
    for k in rkeys:
        pipe.unlink(k)
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, BaseException):
            raise reply


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def _scatter(src: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    at = 0
    for p in parts:
        n = p.nbytes
        p.copy_(src[at : at + n])
        at += n
