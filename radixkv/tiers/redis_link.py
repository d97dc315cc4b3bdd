"""One Redis tier's link to its server or cluster: lazy client, fail-fast window, per-node fan-out.

Every network call of :class:`~radixkv.tiers.redis.RedisTier` goes through :meth:`RedisLink.guard`,
which turns a medium fault into ``None`` (the caller reports misses / failed puts), counts it and opens
a ``down_backoff_s`` window in which calls return ``None`` at once without touching the network. The
first call after the window tries again: a standalone client reconnects by itself; a cluster client is
dropped at each fault and rebuilt (rediscovering the topology) on the next try.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import redis
from redis.exceptions import RedisClusterException

from radixkv.forksafe import hold_across_fork
from radixkv.tiers.redis_client import RedisTierConfig, check_tls_files, make_client, parse_redis_url

__all__ = ["RedisLink", "DOWN_ERRORS", "is_topology_error"]

log = logging.getLogger("radixkv.tiers.redis")

# A pipeline returns per-command errors (OOM, NOPERM, WRONGTYPE) inline, so any RedisError that
# escapes means the transport or the cluster client is broken: a fault of the medium.
DOWN_ERRORS = (redis.exceptions.RedisError, RedisClusterException, OSError)
_TOPOLOGY_PREFIXES = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")
_TOPOLOGY_EXC = (redis.exceptions.AskError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)


def _is_migrating(reply: object) -> bool:
    """ASK / TRYAGAIN: the slot is being migrated (the slot map is still right)."""
    if isinstance(reply, redis.exceptions.MovedError):  # (redis-py derives it from AskError)
        return False
    if isinstance(reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError)):
        return True
    return isinstance(reply, (Exception, str)) and str(reply).startswith(("ASK", "TRYAGAIN"))


def is_topology_error(reply: object) -> bool:
    """True for an error reply that says the slot map is stale (MOVED, ASK, CLUSTERDOWN, TRYAGAIN)."""
    if isinstance(reply, _TOPOLOGY_EXC):
        return True
    return isinstance(reply, (Exception, str)) and str(reply).startswith(_TOPOLOGY_PREFIXES)


class RedisLink:
    """Thread-safe; ``errors`` and ``fast_fail_calls`` count faults and calls refused in the window,
    ``stale_map_calls`` the calls that got MOVED/ASK/CLUSTERDOWN/TRYAGAIN replies."""

    def __init__(self, config: RedisTierConfig) -> None:
        self.config = config
        self.url = parse_redis_url(config.url)
        check_tls_files(self.url)  # a bad file is a ConfigError now, not misses at every call
        self.errors = 0
        self.fast_fail_calls = 0
        self.stale_map_calls = 0  # calls with MOVED/ASK replies (in fault_mark, not in errors)
        self._lock = threading.Lock()
        # Building a client does network I/O (a cluster client reads the slot map from its seeds, a
        # socket timeout per seed that does not answer): it runs under this lock of its own, never
        # under _lock, which calls inside the fail-fast window take to count themselves (they waited
        # for another thread's rediscovery, up to seconds, where they must answer at once).
        self._build_lock = threading.Lock()
        hold_across_fork(self, in_child=_fresh_build_lock)  # a child must not inherit _lock held
        self._client: Any = None
        self._down_until = 0.0
        # The outage in progress (from its first fault to the next call that works): logged once at
        # its start and once at its end, however long it lasts and however short the window is.
        self._down_since: float | None = None
        self._down_faults = 0
        self._down_fast_fails = 0
        self._closed = False
        self._warned_moved = False
        self._warned_kinds: set[str] = set()  # error replies already logged (see _warn_refusals)
        self._warned_unexpected = False  # the first non-medium exception is logged with its traceback
        # Cluster clients dropped for rediscovery: other threads may still be inside them (a
        # pipeline, a SCAN), so they are closed only after a grace period, or at close().
        self._retired: list[tuple[float, Any]] = []

    def client(self) -> Any:
        """The redis-py client (``Redis`` or ``RedisCluster``), built on first use."""
        client = self._client
        if client is not None:
            return client
        with self._build_lock:  # one build at a time; the others then take its client
            if self._closed:
                raise RuntimeError(f"RedisTier {self.config.name!r} is closed; open a new one")
            client = self._client
            if client is not None:
                return client
            client = make_client(
                self.url, socket_timeout_s=self.config.socket_timeout_s,
                connect_timeout_s=self.config.socket_connect_timeout_s,
                max_connections=self.config.max_connections)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._client = client
        if closed:  # close() ran during the build: it could not see this client
            _close_quietly(client)
            raise RuntimeError(f"RedisTier {self.config.name!r} is closed; open a new one")
        return client

    def guard(self, action: Callable[[Any], Any]) -> Any:
        """``action(client)``; None after a medium fault (counted, window opened) or inside the window."""
        if self._closed:
            raise RuntimeError(f"RedisTier {self.config.name!r} is closed; open a new one")
        if time.monotonic() < self._down_until:
            with self._lock:
                self.fast_fail_calls += 1
            return None
        faults = self.errors
        try:
            result = action(self.client())
        except DOWN_ERRORS as exc:
            self.mark_down(exc)
            return None
        except Exception as exc:  # noqa: BLE001
            if self._closed and not self.url.cluster:
                raise  # closed under this call (client() says so): the caller's error, as after close()
            # redis-py fails in other ways on replies it does not expect: a server that is not Redis
            # or a hostile one (a HELLO reply that is no map: AttributeError; a SCAN reply that is
            # no [cursor, keys]: TypeError, which left a clear neither done nor pending; an array
            # header claiming billions of elements: MemoryError), and the cluster client while its
            # topology changes under another thread (a node's connection gone mid-pipeline, a reply
            # read out of step). A fault of the medium too, never an exception into the engine;
            # the first one is logged with its traceback, since a bug of ours would look the same.
            if not self._warned_unexpected:
                self._warned_unexpected = True
                log.warning("redis tier %s: unexpected %s, treated as a fault of the server (first "
                            "occurrence; traceback follows)", self.url.redacted(), type(exc).__name__,
                            exc_info=True)
            self.mark_down(exc)
            return None
        if self._down_since is not None:
            self._note_up(faults)
        return result

    def note_ping_answered(self, faults_before: int) -> None:
        """Every server answered a ping (``errors`` was ``faults_before`` before it): the fail-fast
        window ends now, so a delete retried right after a ping reaches the server (inside the window
        it answered 0 untried, and a closing store gave the delete up)."""
        with self._lock:
            if self.errors != faults_before:
                return
            self._down_until = 0.0
        if self._down_since is not None:
            self._note_up(faults_before)

    def _note_up(self, faults_before: int) -> None:
        """A call got through: end the outage in progress, unless the call itself faulted (a cluster
        node it reached was down) or another thread's fault came since."""
        with self._lock:
            if self._down_since is None or self.errors != faults_before:
                return
            down_s = time.monotonic() - self._down_since
            faults = self.errors - self._down_faults
            fast_fails = self.fast_fail_calls - self._down_fast_fails
            self._down_since = None
        log.info("redis tier %s reachable again after %.1f s (%d faults, %d calls answered as misses "
                 "without trying)", self.url.redacted(), down_s, faults, fast_fails)

    def fan_out(self, rkeys: Sequence[str], call: Callable[[Any, list[int]], list[Any]]) -> list[Any] | None:
        """``call(node_client, indices)`` once per server holding some of ``rkeys`` (a single call for
        a standalone server). Entries of a cluster node that faulted stay None (and open the window)
        while the other nodes' replies are kept; None if nothing could be tried."""

        def action(client: Any) -> list[Any]:
            if not self.url.cluster:
                return call(client, list(range(len(rkeys))))
            groups: dict[str, tuple[Any, list[int]]] = {}
            for i, rk in enumerate(rkeys):
                node = client.get_node_from_key(rk)
                groups.setdefault(node.name, (node, []))[1].append(i)
            out: list[Any] = [None] * len(rkeys)
            fault: BaseException | None = None
            for node, idx in groups.values():
                try:  # a dead node costs its own keys, not the replies of the others
                    got = call(client.get_redis_connection(node), idx)
                except DOWN_ERRORS as exc:
                    fault = exc
                    continue
                for i, reply in zip(idx, got):
                    out[i] = reply
            if fault is not None:
                self.mark_down(fault)
            return out

        return self.guard(action)

    def mark_down(self, exc: BaseException) -> None:
        """Count a fault and open the fail-fast window (a cluster client is dropped for rediscovery)."""
        backoff_s = self.config.down_backoff_s
        with self._lock:
            # Logged at an outage's start only: each retry after the window that fails again is
            # counted, not logged (that was a line per down_backoff_s, per call with 0, while down).
            starts = self._down_since is None
            if starts:
                self._down_since = time.monotonic()
                self._down_faults = self.errors
                self._down_fast_fails = self.fast_fail_calls
            self._down_until = time.monotonic() + backoff_s
            self.errors += 1
            if self.url.cluster:
                self._retire_locked()
        if starts:
            log.warning("redis tier %s unreachable (%s: %s); serving misses, retrying every %.1f s "
                        "(logged again when it answers; stats: errors, fast_fail_calls)",
                        self.url.redacted(), type(exc).__name__, exc, backoff_s)

    def note_error_replies(self, replies: Sequence[object]) -> int:
        """Of one call's error replies, count those that say the slot map is stale (returned; they
        move ``stale_map_calls``, so the caller's misses read as "unknown", never "absent").
        MOVED/CLUSTERDOWN drop the client so the next call rediscovers the map. ASK/TRYAGAIN do not:
        the map is right while a slot migrates (a rebuilt client gets ASK again), and rebuilding
        at every call held sockets of hundreds of retired clients open for the grace period."""
        stale: list[object] = []
        refused: list[object] = []
        for r in replies:
            (stale if is_topology_error(r) else refused).append(r)
        if refused:
            self._warn_refusals(refused)
        if not stale:
            return 0
        if not self.url.cluster and not self._warned_moved:
            self._warned_moved = True
            log.warning("redis tier %s got MOVED/ASK replies: the server is a cluster node; use a "
                        "redis+cluster:// URL", self.url.redacted())
        with self._lock:
            self.stale_map_calls += 1
            if not all(_is_migrating(r) for r in stale):
                self._retire_locked()
        return len(stale)

    def _warn_refusals(self, replies: Sequence[object]) -> None:
        """Log the first error reply of each kind (NOPERM, READONLY, OOM, WRONGTYPE, ...) once: the
        server refused those commands, which stay failed puts and misses (counted in ``errors``), but
        a refusal of *every* command (an ACL whose key pattern misses ``key_prefix``, a replica's
        address) looked like a healthy, empty tier: ``ping`` answered, nothing was logged."""
        for reply in replies:
            if isinstance(reply, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
                continue  # a cluster pipeline's inline transport fault: no refusal by the server
            kind = _refusal_kind(reply)
            if kind in self._warned_kinds:
                continue
            with self._lock:
                if kind in self._warned_kinds:
                    continue
                self._warned_kinds.add(kind)
            log.warning("redis tier %s: the server refused a command (%s; %s: %s); those chunks are failed "
                        "puts or misses (stats: errors). Logged once per kind: check the ACL user's "
                        "commands and key pattern (%s:*), the server's role and maxmemory",
                        self.url.redacted(), kind, type(reply).__name__, reply, self.config.key_prefix)

    def rediscover(self) -> None:
        """Drop a cluster client so the next call reads the slot map and the primaries again."""
        with self._lock:
            self._retire_locked()

    def _retire_locked(self) -> None:
        """Drop the client for rediscovery; close the ones retired more than a grace period ago."""
        now = time.monotonic()
        if self._client is not None:
            self._retired.append((now, self._client))
            self._client = None
        grace_s = max(60.0, 4 * self.config.socket_timeout_s)
        old = [c for t, c in self._retired if now - t > grace_s]
        self._retired = [(t, c) for t, c in self._retired if now - t <= grace_s]
        for c in old:
            _close_quietly(c)

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = [self._client] + [c for _, c in self._retired]
            self._client, self._retired = None, []
        for c in clients:
            _close_quietly(c)


# redis-py strips the prefix of the errors it maps to a class of its own; the direct GET path keeps
# the server's text ("NOPERM ..."): one kind either way.
_PREFIX_OF = {redis.exceptions.NoPermissionError: "NOPERM", redis.exceptions.OutOfMemoryError: "OOM",
              redis.exceptions.ReadOnlyError: "READONLY"}


def _refusal_kind(reply: object) -> str:
    """The kind of an error reply: its prefix (NOPERM, OOM, WRONGTYPE, ...) or its class's name."""
    prefix = _PREFIX_OF.get(type(reply))  # type: ignore[call-overload]
    if prefix is not None:
        return prefix
    word = str(reply).split(" ", 1)[0]
    return word if word.isupper() else type(reply).__name__


def _fresh_build_lock(link: RedisLink) -> None:
    """In a fork child: a build another thread of the parent was running never ends here."""
    link._build_lock = threading.Lock()


def _close_quietly(client: Any) -> None:
    if client is None:
        return
    try:
        client.close()
    except Exception:  # noqa: BLE001 - best effort on a client that may already be broken
        pass
