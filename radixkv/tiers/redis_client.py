"""Configuration and connections of :mod:`radixkv.tiers.redis`: URL, options, zero-copy clients.

URL scheme (parsed here, errors are :class:`~radixkv.errors.ConfigError`)::

    redis://[[user]:password@]host[:port][/db][?tls options]          one server
    rediss://...                                                      one server over TLS
    redis+cluster://[[user]:password@]host:port[,host:port...][/0]    Redis Cluster (seed nodes)
    rediss+cluster://...                                              Redis Cluster over TLS

``user`` is an ACL user (omit it for ``requirepass``/the ``default`` user); user and password are
percent-decoded, and a '/' or '?' in them must be percent-encoded (``%2F``, ``%3F``; base64
passwords hold '/'), or it ends the host part (a ``ConfigError``, which never shows the password).
Query options:

* TLS (``rediss`` only): ``ssl_ca_certs=PATH``, ``ssl_certfile=PATH``, ``ssl_keyfile=PATH``,
  ``ssl_cert_reqs=none|optional|required`` (default required), ``ssl_check_hostname=true|false``
  (default false). ``ssl_keyfile`` needs ``ssl_certfile`` (which may hold the key itself). The tier
  loads the files when it is built (:func:`check_tls_files`): a missing, unreadable or malformed
  file, an encrypted key or a key that does not match its certificate is a ``ConfigError`` naming
  the option, not a server that never answers.
* Tier options, the same as the keyword arguments of :class:`~radixkv.tiers.redis.RedisTier`:
  ``capacity=SIZE`` (``capacity_bytes``, e.g. ``8GiB``), ``ttl_s``, ``socket_timeout_s``,
  ``socket_connect_timeout_s``, ``down_backoff_s``, ``batch_bytes=SIZE``, ``max_connections``,
  ``key_prefix``, ``name``. Each is given once; an option given both in the URL and as a keyword
  must agree.

Zero-copy puts: with hiredis installed redis-py packs every command with ``hiredis.pack_command``,
which copies memoryviews into ``bytes`` and then into one packed buffer. The connection classes here
pack with a Python packer that understands :class:`FramedValue` (frame header + payload memoryview) and
writes it as *one* RESP bulk string whose payload part is handed to ``sendall`` uncopied. Replies are
still parsed by hiredis.
"""

from __future__ import annotations

import re
import ssl
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import BlockingConnectionPool, Connection, PythonRespSerializer, SSLConnection
from redis.retry import Retry

from radixkv.config import _redact_one_url
from radixkv.errors import ConfigError

__all__ = ["RedisUrl", "RedisTierConfig", "build_config", "parse_redis_url", "check_tls_files", "FramedValue",
           "make_client"]

_SCHEMES = {"redis": (False, False), "rediss": (False, True),
            "redis+cluster": (True, False), "rediss+cluster": (True, True)}
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
# URL query name -> RedisTierConfig field.
TIER_OPTIONS = {"capacity": "capacity_bytes", "capacity_bytes": "capacity_bytes", "ttl_s": "ttl_s",
                "socket_timeout_s": "socket_timeout_s", "socket_connect_timeout_s": "socket_connect_timeout_s",
                "down_backoff_s": "down_backoff_s", "batch_bytes": "batch_bytes",
                "max_connections": "max_connections", "max_value_bytes": "max_value_bytes",
                "key_prefix": "key_prefix", "name": "name"}
_DEFAULT_PORT = 6379
_MAX_TTL_S = 1e9  # seconds (~31 years): Redis refuses an expiry past its 64-bit milliseconds
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # namespaces and key prefixes


@dataclass(frozen=True, slots=True)
class RedisUrl:
    """A parsed tier URL. ``hosts`` has one entry unless ``cluster``."""

    cluster: bool
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    tls_options: tuple[tuple[str, str], ...] = ()
    tier_options: tuple[tuple[str, str], ...] = ()  # (RedisTierConfig field, raw text)

    def redacted(self) -> str:
        """The URL without the password (safe for logs and error messages)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = f"{self.username or ''}{':***' if self.password else ''}@" if (self.username or self.password) else ""
        return f"{scheme}://{auth}" + ",".join(_host_port(h, p) for h, p in self.hosts) + f"/{self.db}"


def _host_port(host: str, port: int) -> str:
    """``host:port`` for a URL; an IPv6 address in brackets, or its last group reads as the port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bad(url: str, why: str) -> ConfigError:
    # Everything up to the URL's last '@' after a ':' is masked, not only what urllib reads as the
    # password: with a raw '/' or '?' in it, urllib read a piece of it, and the rest was shown.
    return ConfigError(
        f"Redis URL {_redact_one_url(url)!r}: {why}. Expected redis://[user:password@]host:port[/db], "
        "rediss://... for TLS, or redis+cluster://host:port,host:port,... for Redis Cluster"
    )


def _parse_host(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6addr]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _bad(url, f"host {text!r} is empty")
    if not port_text:
        return host, _DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"port {port_text!r} of host {text!r} is not an integer in 1..65535")
    return host, int(port_text)


def parse_redis_url(url: str) -> RedisUrl:
    """Parse a tier URL (see the module docstring); raises ConfigError naming the problem."""
    if not isinstance(url, str) or "://" not in url:
        raise _bad(str(url), "not a URL")
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in _SCHEMES:
        raise _bad(url, f"unknown scheme {scheme!r} (use one of {sorted(_SCHEMES)})")
    cluster, tls = _SCHEMES[scheme.lower()]
    rest, _, query = rest.partition("?")  # first: option values may contain "/" (file paths)
    netloc, _, path = rest.partition("/")
    # No '@' in the host part but one in the database path or in a query option (but a TLS file's
    # path): a raw '/' or '?' in the user name or password ended the host part early. Say so before
    # anything below quotes a piece of the password as a host, a port or an option.
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if "@" not in netloc and ("@" in path or any("@" in n or ("@" in v and n not in _TLS_OPTIONS)
                                                 for n, v in pairs)):
        raise _bad(url, "an '@' follows the host part: a raw '/' or '?' in the user name or password "
                        "ends the host part; percent-encode them ('/' as %2F, '?' as %3F)")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user_text, colon, pw_text = userinfo.partition(":")
        username = urllib.parse.unquote(user_text) or None
        password = urllib.parse.unquote(pw_text) if colon else None
    if not hostlist:
        raise _bad(url, "no host")
    hosts = tuple(_parse_host(url, h) for h in hostlist.split(","))
    if not cluster and len(hosts) != 1:
        raise _bad(url, f"{len(hosts)} hosts given; list several hosts only with redis+cluster://")
    path = path.strip("/")
    if path and not path.isdigit():
        raise _bad(url, f"database {path!r} is not a non-negative integer")
    db = int(path) if path else 0
    if cluster and db != 0:
        raise _bad(url, f"database {db} requested; Redis Cluster only has database 0")
    tls_options, tier_options = [], []
    seen: dict[str, str] = {}  # option -> how the URL spelt it (capacity and capacity_bytes are one)
    for name, value in pairs:
        option = TIER_OPTIONS.get(name, name)
        if option in seen:  # the last one silently won
            raise _bad(url, f"option {name!r} is given twice ({seen[option]!r} and {name!r}); give it once")
        seen[option] = name
        if name in TIER_OPTIONS:
            tier_options.append((TIER_OPTIONS[name], value))
        elif name not in _TLS_OPTIONS:
            raise _bad(url, f"unknown option {name!r} (URL options: {list(_TLS_OPTIONS) + list(TIER_OPTIONS)})")
        elif not tls:
            raise _bad(url, f"option {name!r} needs TLS: use the rediss:// scheme")
        else:
            tls_options.append((name, value))
    parsed = RedisUrl(cluster, tls, hosts, username, password, db, tuple(tls_options), tuple(tier_options))
    _tls_kwargs(parsed)  # validates the TLS option values now rather than at first connect
    return parsed


@dataclass(slots=True)
class RedisTierConfig:
    """Options of a :class:`~radixkv.tiers.redis.RedisTier` (validated here; semantics there)."""

    url: str
    capacity_bytes: int | None = None  # None: no client-side bound (the server's maxmemory still is)
    ttl_s: float | None = None  # expiry of every chunk written; None: never
    socket_timeout_s: float = 1.0  # per socket read/write, never retried
    socket_connect_timeout_s: float = 0.5
    down_backoff_s: float = 1.0  # after a fault, calls fail fast as misses for this long
    batch_bytes: int = 64 << 20  # payload bytes per pipeline (one round trip each)
    max_connections: int = 64  # per server/node connection pool
    key_prefix: str = "radixkv"  # Redis keys are <key_prefix>:<namespace>:<chunk key>
    name: str = "redis"
    # The largest value the server takes: its proto-max-bulk-len (512 MB by default in Redis and
    # Valkey). A larger value makes the server drop the connection mid-send, so such a chunk is
    # refused up front (CapacityError) instead of looking like a server outage.
    max_value_bytes: int = 512 << 20

    def __repr__(self) -> str:  # the URL's password stays out of logs (the dataclass repr showed it)
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__ if f != "url")
        return f"RedisTierConfig(url={_redact_one_url(self.url)!r}, {shown})"

    def __post_init__(self) -> None:
        parse_redis_url(self.url)  # raises ConfigError with the reason
        for name in ("capacity_bytes", "ttl_s", "socket_timeout_s", "socket_connect_timeout_s",
                     "down_backoff_s", "batch_bytes", "max_connections", "max_value_bytes"):
            if isinstance(getattr(self, name), bool):  # an int to Python: True read as 1 (second)
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a number, not true/false")
        if self.capacity_bytes is not None and (
            not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes={self.capacity_bytes!r} must be a positive int or None (unbounded)")
        # At most ~31 years: inf failed in the constructor (OverflowError), and 1e17 s passed here
        # but Redis refused every put ("invalid expire time").
        ttl = self.ttl_s
        if ttl is not None and not (isinstance(ttl, (int, float)) and 0.001 <= ttl <= _MAX_TTL_S):
            raise ConfigError(f"ttl_s={self.ttl_s!r} must be None (no expiry) or a number of seconds in "
                              f"[0.001, {_MAX_TTL_S:.0e}]")
        for name in ("socket_timeout_s", "socket_connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 600:
                raise ConfigError(f"{name}={value!r} must be a number of seconds in (0, 600]")
        if not isinstance(self.down_backoff_s, (int, float)) or not 0 <= self.down_backoff_s <= 600:
            raise ConfigError(f"down_backoff_s={self.down_backoff_s!r} must be in [0, 600] seconds")
        if not isinstance(self.batch_bytes, int) or self.batch_bytes < 1 << 16:
            raise ConfigError(f"batch_bytes={self.batch_bytes!r} must be an int >= 65536")
        if not isinstance(self.max_value_bytes, int) or self.max_value_bytes < 1 << 20:
            raise ConfigError(f"max_value_bytes={self.max_value_bytes!r} must be an int >= 1 MiB (the "
                              "server's proto-max-bulk-len; Redis's smallest setting is 1mb)")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections!r} must be a positive int")
        if not NAME_RE.fullmatch(self.key_prefix):
            raise ConfigError(f"key_prefix={self.key_prefix!r} must match {NAME_RE.pattern}")
        if not isinstance(self.name, str) or not self.name:  # as the memory and disk tiers
            raise ConfigError(f"RedisTierConfig.name={self.name!r} must be a non-empty tier name")


def _url_options(url: str) -> dict[str, Any]:
    """Tier options from the URL query, converted to RedisTierConfig field types."""
    from radixkv.tiers.registry import parse_bytes  # registry imports this module lazily: no cycle

    out: dict[str, Any] = {}
    for field_name, raw in parse_redis_url(url).tier_options:
        try:
            if field_name in ("capacity_bytes", "batch_bytes", "max_value_bytes"):
                out[field_name] = parse_bytes(raw, field_name)
            elif field_name == "max_connections":
                out[field_name] = int(raw)
            elif field_name in ("key_prefix", "name"):
                out[field_name] = raw
            else:
                out[field_name] = float(raw)
        except ConfigError:
            raise
        except ValueError:
            raise ConfigError(f"URL option {field_name}={raw!r} is not a number") from None
    return out


def build_config(url: str, options: dict[str, Any]) -> RedisTierConfig:
    """Merge URL query options and keyword options (they must agree) into a validated config."""
    known = set(RedisTierConfig.__dataclass_fields__) - {"url"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"RedisTier got unknown option(s) {unknown}; known: {sorted(known)}")
    merged = _url_options(url)
    for field_name, value in options.items():
        if field_name in ("capacity_bytes", "batch_bytes", "max_value_bytes") and isinstance(value, str):
            from radixkv.sizes import parse_bytes  # sizes take units everywhere (docs/configuration.md)

            value = parse_bytes(value, field_name)
        if field_name in merged and merged[field_name] != value:
            raise ConfigError(f"{field_name} is {merged[field_name]!r} in the URL but {value!r} as a "
                              "keyword; give it one way")
        merged[field_name] = value
    return RedisTierConfig(url=url, **merged)


class FramedValue:
    """A RESP bulk string made of a small header and a large payload that is sent without copying."""

    __slots__ = ("header", "payload", "nbytes")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload
        self.nbytes = len(header) + payload.nbytes

    def __len__(self) -> int:
        return self.nbytes


_SEND_SLICE_BYTES = 1 << 20  # a payload is sent in slices of this size (see _FramePacker.pack)


class _FramePacker(PythonRespSerializer):
    """redis-py's pure-Python packer plus :class:`FramedValue` support (payload left as memoryview)."""

    def pack(self, *args: Any) -> list[Any]:
        if not any(isinstance(a, FramedValue) for a in args):
            return super().pack(*args)
        out: list[Any] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, FramedValue):
                out.append(buff + b"$%d\r\n" % arg.nbytes + arg.header)
                # In slices (views, no copy): redis-py sends each item with one sock.sendall, whose
                # timeout bounds the whole call, so on a link slower than payload / socket_timeout_s
                # every put of a large chunk timed out and the tier was taken for unreachable (found
                # by an audit: 12 MiB at 8 MiB/s). A slice's send is bounded on its own.
                payload = arg.payload.cast("B") if arg.payload.format != "B" else arg.payload
                n = payload.nbytes
                out.extend(payload[i : i + _SEND_SLICE_BYTES] for i in range(0, n, _SEND_SLICE_BYTES))
                buff = b"\r\n"
            else:
                raw = self.encode(arg)
                buff += b"$%d\r\n" % len(raw) + bytes(raw) + b"\r\n"
        out.append(buff)
        return out


class FrameConnection(Connection):
    def _construct_command_packer(self, packer: Any) -> Any:
        return packer if packer is not None else _FramePacker(self._buffer_cutoff, self.encoder.encode)


class FrameSSLConnection(SSLConnection):
    def _construct_command_packer(self, packer: Any) -> Any:
        return packer if packer is not None else _FramePacker(self._buffer_cutoff, self.encoder.encode)


# More threads than max_connections wait for a free connection (blocking pool) instead of failing,
# which the tier would otherwise take for a dead server.
_POOL_WAIT_S = 30.0
_CERT_REQS = {"none": "none", "optional": "optional", "required": "required"}


def _tls_kwargs(parsed: RedisUrl) -> dict[str, Any]:
    opts = dict(parsed.tls_options)
    reqs = opts.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ConfigError(f"ssl_cert_reqs={reqs!r} must be one of none, optional, required")
    check = opts.get("ssl_check_hostname", "false").lower()
    if check not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"ssl_check_hostname={check!r} must be true or false")
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in opts and not opts[name]:
            raise ConfigError(f"{name}= is empty; give the path of a PEM file, or leave the option out")
    if opts.get("ssl_keyfile") and not opts.get("ssl_certfile"):
        # redis-py then raised a TypeError out of every call of the tier
        raise ConfigError(f"ssl_keyfile={opts['ssl_keyfile']!r} needs ssl_certfile=PATH, the client "
                          "certificate of that key")
    return {
        "ssl_ca_certs": opts.get("ssl_ca_certs"),
        "ssl_certfile": opts.get("ssl_certfile"),
        "ssl_keyfile": opts.get("ssl_keyfile"),
        "ssl_cert_reqs": _CERT_REQS[reqs],
        "ssl_check_hostname": check in ("true", "1", "yes"),
    }


def check_tls_files(parsed: RedisUrl) -> None:
    """Load the TLS files ``parsed`` names into a throwaway SSL context; ConfigError naming the
    option and the file if one cannot be used (missing, unreadable, not PEM, an encrypted key, a key
    that does not match its certificate). redis-py reads them only when it connects: every call of
    the tier then failed as if the server were down, logged as "unreachable (... No such file or
    directory)", which named neither the option nor the file."""
    if not parsed.tls:
        return
    opts = _tls_kwargs(parsed)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca = opts["ssl_ca_certs"]
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except OSError as exc:  # ssl.SSLError included
            raise ConfigError(f"ssl_ca_certs={ca!r} cannot be loaded ({exc}); give the PEM file of the "
                              "CA certificate(s) that signed the server's certificate") from None
    cert, key = opts["ssl_certfile"], opts["ssl_keyfile"]
    if cert is None:
        return

    def encrypted() -> bytes:  # else OpenSSL asks for the passphrase on the terminal
        raise ConfigError(f"the private key in {key or cert!r} is encrypted, and the Redis tier has no "
                          "option for its passphrase; give an unencrypted key (readable only by this user)")

    try:
        context.load_cert_chain(cert, key, password=encrypted)
    except OSError as exc:
        shown = f"ssl_certfile={cert!r}" + (f" with ssl_keyfile={key!r}" if key else "")
        raise ConfigError(f"{shown} cannot be loaded as a client certificate and its key ({exc}); give "
                          "PEM files of a certificate and its unencrypted private key (one file may hold "
                          "both)") from None


def make_client(
    parsed: RedisUrl, *, socket_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> Any:
    """A redis-py client for ``parsed`` that never retries (the tier owns fault handling).

    Every client accepts :class:`FramedValue` arguments. A standalone client connects lazily; a cluster client discovers the topology here and may raise
    redis-py's connection errors.
    """
    common: dict[str, Any] = {
        "username": parsed.username,
        "password": parsed.password,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": max_connections,
    }
    if not parsed.cluster:
        host, port = parsed.hosts[0]
        klass = FrameSSLConnection if parsed.tls else FrameConnection
        extra = _tls_kwargs(parsed) if parsed.tls else {}
        pool = BlockingConnectionPool(connection_class=klass, host=host, port=port, db=parsed.db,
                                      timeout=_POOL_WAIT_S, **common, **extra)
        # from_pool: the client owns the pool, so close() closes its connections (with
        # ``connection_pool=`` one socket stayed open until the garbage collector ran).
        return redis.Redis.from_pool(pool)
    # RedisCluster hands ``connection_class`` to the node pools only in its from-URL mode, so the
    # first seed goes in as a plain redis:// URL (TLS is configured by the connection class).
    (host0, port0), *others = parsed.hosts
    klass = FrameSSLConnection if parsed.tls else FrameConnection
    extra = _tls_kwargs(parsed) if parsed.tls else {}
    client = RedisCluster(
        url=f"redis://{_host_port(host0, port0)}", startup_nodes=[ClusterNode(h, p) for h, p in others],
        connection_class=klass, connection_pool_class=BlockingConnectionPool, timeout=_POOL_WAIT_S,
        **common, **extra,
    )
    return client
