"""Validated configuration of the hierarchical store: one dataclass, from code, YAML or environment.

:class:`StoreConfig` lists the tiers fastest first (each a :class:`TierConfig`: URL, capacity,
optional eviction policy) plus the store's behaviour (write policy, promotion, background queues).
Three loaders build the same object::

    StoreConfig.from_dict(d)        # plain dict (what YAML decodes to)
    StoreConfig.from_yaml(path)     # a YAML file with the same keys
    StoreConfig.from_env()          # RADIXKV_* variables (on top of RADIXKV_CONFIG=<yaml> if set)

Every bad value raises :class:`~radixkv.errors.ConfigError` naming the value and the fix. Sizes may be
integers (bytes) or strings with a binary/decimal unit (``"8GiB"``, ``"512MiB"``, ``"100GB"``).
Every option is documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from radixkv.errors import ConfigError
from radixkv.sizes import parse_bytes

logger = logging.getLogger(__name__)

__all__ = ["TierConfig", "StoreConfig", "parse_bytes", "redact_url", "WRITE_POLICIES", "TIER_SCHEMES",
           "tier_is_shared", "private_disk_dirs"]

# ``scheme://user:password@host``: the password is masked in anything shown. It runs to the *last*
# '@' of the URL (which ends at a space or a quote in a message): a raw '@' in a password is legal
# (the Redis tier and urllib read the password up to the last '@'), and a raw '/' or '?' (base64
# passwords hold '/') makes the URL invalid, but the error that says so must not show it either:
# stopping at the first '@', '/' or '?' showed the rest of the password.
_USERINFO_PASSWORD = re.compile(r"(://[^/\s'\"@:]*):[^\s'\"]*@")


def redact_url(text: Any) -> str:
    """``text`` (a URL, or a message or repr holding URLs) with every URL password replaced by
    ``***``: Redis URLs carry credentials, which must never reach logs, errors or reprs. A password
    holding a space or a quote cannot be told from the message around it here: for a known URL use
    :func:`_redact_one_url` (``TierConfig`` does)."""
    return _USERINFO_PASSWORD.sub(r"\1:***@", text if isinstance(text, str) else repr(text))


def _redact_one_url(url: str) -> str:
    """``url`` (one whole URL, nothing around it) with everything between the user name's ':' and
    the last '@' shown as ``***``, whatever characters the password holds."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0 or rest.startswith("/"):  # no credentials (file:///a:b@c is a path)
        return url
    user, colon, _ = rest[:at].partition(":")
    return f"{scheme}://{user}:***@{rest[at + 1:]}" if colon else url


def _redact_known_url(text: str, url: Any) -> str:
    """``text`` with ``url`` (and its repr) masked exactly, then any other URL password too."""
    if isinstance(url, str):
        safe = _redact_one_url(url)
        text = text.replace(repr(url), repr(safe)).replace(url, safe)
    return redact_url(text)


def _malformed_url(url: Any) -> str:
    """repr of a value that should have been a URL and is not (no ``://``): whatever precedes an
    '@' may be credentials, so it is not shown."""
    if isinstance(url, str) and "@" in url:
        return repr("***@" + url.rsplit("@", 1)[1])
    return redact_url(repr(url))

WRITE_POLICIES = ("write_through", "write_back")
# Schemes the store knows how to name; the tier registry decides which ones it can actually open.
TIER_SCHEMES = {
    "mem": "mem",
    "memory": "mem",
    "file": "disk",
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
}


def _parse_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{what}={value!r} is not a boolean: use true/false (or 1/0, yes/no, on/off)")


def _parse_int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(
                f"{what}={value!r} is not an integer: give a whole number >= {minimum}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}={value!r} must be an integer >= {minimum}")
    return value


def _parse_seconds(value: Any, what: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip().removesuffix("s"))
        except ValueError:
            raise ConfigError(
                f"{what}={value!r} is not a number of seconds (for example 30 or '2.5')"
            ) from None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{what}={value!r} must be a positive, finite number of seconds")
    return float(value)


def _parse_mapping(value: Any, what: str) -> dict[str, Any]:
    """A dict from a mapping or a JSON object string (environment variables)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ConfigError(
                f"{what}={value!r} is not a JSON object such as '{{\"a\": 1}}'"
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what}={value!r} must be a mapping of option names to values")
    return dict(value)


def _known_policies() -> list[str] | None:
    """Names in radixkv.policies.POLICIES, or None while that module is not importable."""
    try:
        from radixkv.policies import POLICIES
    except ImportError:  # pragma: no cover - only while the tree work is in flight
        return None
    return sorted(POLICIES)


def _check_policy(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what}={name!r} must be an eviction policy name such as 'lru'")
    known = _known_policies()
    if known is not None and name not in known:
        raise ConfigError(f"{what}={name!r} is not a known eviction policy; choose one of {known}")
    if known is not None and _is_offline(name):
        # opt is registered once radixkv.sims is imported; it needs the trace's future, which a
        # store never has (before, such a config was valid or not by import order).
        raise ConfigError(f"{what}={name!r} is an offline policy (the simulator's upper bound, it needs "
                          "the future); choose a runtime policy such as 'lru' or 'oddsref'")


def _is_offline(name: str) -> bool:
    from radixkv.policies import POLICIES

    return bool(getattr(POLICIES.get(name), "offline", False))


@dataclass(slots=True)
class TierConfig:
    """One tier: where it lives (URL), how many bytes it may hold, and optionally its own policy.

    ``capacity_bytes == 0`` means unbounded on radixkv's side (allowed for remote tiers such as Redis,
    whose server enforces its own ``maxmemory``; the memory tier needs a bound). ``name`` defaults to
    ``mem``/``disk``/``redis`` from the scheme (suffixed ``-2``, ``-3`` on repeats). ``options`` are
    passed through to the tier's constructor (for example ``io_threads`` or ``ttl_s``).
    """

    url: str
    capacity_bytes: int = 0
    name: str | None = None
    policy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    policy_options: dict[str, Any] | None = None

    def __repr__(self) -> str:  # the URL's password stays out of logs and error messages
        return _redact_known_url(
            f"TierConfig(url={self.url!r}, capacity_bytes={self.capacity_bytes!r}, name={self.name!r}, "
            f"policy={self.policy!r}, options={self.options!r}, policy_options={self.policy_options!r})",
            self.url,
        )

    def __post_init__(self) -> None:
        try:
            self._validate()
        except ConfigError as e:  # every message below may quote the URL: never its password
            raise ConfigError(_redact_known_url(str(e), self.url)) from None

    def _validate(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ConfigError(
                f"tier url={_malformed_url(self.url)} is not a tier URL: use mem://, file:///abs/path, "
                "redis://host:port/db or rediss://... for TLS"
            )
        if self.scheme not in TIER_SCHEMES:
            raise ConfigError(
                f"tier url={self.url!r} has unknown scheme {self.scheme!r}; "
                f"use one of {sorted(s + '://' for s in TIER_SCHEMES)}"
            )
        if self.scheme == "file":
            parts = urlsplit(self.url)
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise ConfigError(
                    f"tier url={self.url!r} must name an absolute directory: file:///abs/path "
                    "(three slashes)"
                )
        self.capacity_bytes = parse_bytes(
            self.capacity_bytes, f"capacity_bytes of tier {self.url!r}"
        )
        pairs = parse_qsl(urlsplit(self.url).query, keep_blank_values=True)
        query = dict(pairs)
        if len(pairs) != len(query):
            raise ConfigError(f"tier url={self.url!r} repeats a query option; give each once")
        if "capacity" in query:  # the registry's URL form: mem://?capacity=8GiB
            in_url = parse_bytes(query["capacity"], f"capacity in tier URL {self.url!r}")
            if self.capacity_bytes not in (0, in_url):
                raise ConfigError(
                    f"tier {self.url!r} gives capacity {in_url} in the URL and capacity_bytes="
                    f"{self.capacity_bytes}; give it once"
                )
            self.capacity_bytes = in_url
        if "name" in query:  # the registry's URL form too (mem://?capacity=8GiB&name=fast)
            if self.name is not None and self.name != query["name"]:
                raise ConfigError(
                    f"tier {self.url!r} gives name {query['name']!r} in the URL and name={self.name!r}; "
                    "give it once"
                )
            self.name = query["name"]
        if self.kind in ("mem", "disk") and self.capacity_bytes == 0:
            raise ConfigError(
                f"capacity_bytes of tier {self.url!r} is 0 (unbounded), which a {self.kind} tier cannot be: "
                "give it a size such as '4GiB' (only remote tiers such as Redis may be unbounded)"
            )
        if self.name is not None and (
            not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)
        ):
            raise ConfigError(f"tier name={self.name!r} must be a non-empty word of [A-Za-z0-9_.-]")
        if self.policy is not None:
            _check_policy(self.policy, f"policy of tier {self.url!r}")
        if not isinstance(self.options, dict):
            raise ConfigError(
                f"options of tier {self.url!r} must be a mapping, got {self.options!r}"
            )
        # The store opens the tier with this config's name and capacity: the same keys in options
        # were silently overridden (capacity) or broke the open with a TypeError (name).
        for key in sorted(set(self.options) & {"capacity", "capacity_bytes", "name"}):
            field_name = "name" if key == "name" else "capacity"
            raise ConfigError(
                f"options of tier {self.url!r} give {key}={self.options[key]!r}, which is the tier's "
                f"own '{field_name}' setting, not an option: give it as the tier's {field_name} "
                f"(e.g. {{url: ..., {field_name}: ...}}) and remove it from options"
            )
        if self.policy_options is not None:
            self.policy_options = _parse_mapping(
                self.policy_options, f"policy_options of tier {self.url!r}"
            )

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0].lower()

    @property
    def kind(self) -> str:
        """``mem``, ``disk`` or ``redis``."""
        return TIER_SCHEMES[self.scheme]

    @classmethod
    def from_dict(cls, d: Any, where: str = "tier") -> TierConfig:
        if isinstance(d, str):
            return cls(url=d)
        if not isinstance(d, Mapping):
            raise ConfigError(redact_url(
                f"{where}={d!r} must be a mapping with at least 'url' (or a URL string)"
            ))
        d = dict(d)
        if "capacity" in d:  # friendlier spelling in YAML
            if "capacity_bytes" in d:
                raise ConfigError(f"{where} gives both 'capacity' and 'capacity_bytes'; keep one")
            d["capacity_bytes"] = d.pop("capacity")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed, key=repr)  # YAML keys may be ints or bools (`on:`): repr sorts any
        if unknown:
            raise ConfigError(
                f"{where} has unknown key(s) {unknown}; valid keys are {sorted(allowed | {'capacity'})}"
            )
        if "url" not in d:
            raise ConfigError(
                f"{where} has no 'url'; give one such as 'mem://' or 'file:///var/cache/radixkv'"
            )
        return cls(**d)


@dataclass(slots=True)
class StoreConfig:
    """The whole store: tiers fastest first plus behaviour. See docs/configuration.md."""

    tiers: list[TierConfig]
    policy: str = "lru"
    write_policy: str = "write_through"
    promote_on_hit: bool = True
    promote_after_hits: int = 1
    probe_tiers: bool = True
    queue_depth: int = 256
    io_threads: int = 2
    prefetch_threads: int = 2
    lease_s: float = 60.0
    close_timeout_s: float = 30.0
    flush_on_close: bool = True
    metrics: bool = True
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    policy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, (list, tuple)) or not self.tiers:
            raise ConfigError(redact_url(
                f"tiers={self.tiers!r} must be a non-empty list of tiers, fastest first, e.g. "
                "[TierConfig(url='mem://', capacity_bytes='4GiB')]"
            ))
        # copies: naming the tiers below must not rename the caller's TierConfig objects, and the
        # same object listed twice is two tiers (two names), not one name used twice
        self.tiers = [
            dataclasses.replace(t) if isinstance(t, TierConfig) else TierConfig.from_dict(t, f"tiers[{i}]")
            for i, t in enumerate(self.tiers)
        ]
        _assign_names(self.tiers)
        _check_distinct_storage(self.tiers)
        _check_policy(self.policy, "policy")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy={self.write_policy!r} must be one of {list(WRITE_POLICIES)}"
            )
        self.promote_on_hit = _parse_bool(self.promote_on_hit, "promote_on_hit")
        self.promote_after_hits = _parse_int(self.promote_after_hits, "promote_after_hits", 1)
        self.probe_tiers = _parse_bool(self.probe_tiers, "probe_tiers")
        self.queue_depth = _parse_int(self.queue_depth, "queue_depth", 1)
        self.io_threads = _parse_int(self.io_threads, "io_threads", 1)
        self.prefetch_threads = _parse_int(self.prefetch_threads, "prefetch_threads", 1)
        self.lease_s = _parse_seconds(self.lease_s, "lease_s")
        self.close_timeout_s = _parse_seconds(self.close_timeout_s, "close_timeout_s")
        self.flush_on_close = _parse_bool(self.flush_on_close, "flush_on_close")
        self.metrics = _parse_bool(self.metrics, "metrics")
        self.metrics_port = _parse_int(self.metrics_port, "metrics_port", 0)
        if self.metrics_port > 65535:
            raise ConfigError(f"metrics_port={self.metrics_port} must be a TCP port (1-65535), or 0 for none")
        if self.metrics_port and not self.metrics:  # no registry to serve: the port did nothing
            raise ConfigError(f"metrics_port={self.metrics_port} serves the store's Prometheus metrics, but "
                              "metrics=false keeps none: set metrics to true, or metrics_port to 0")
        if not isinstance(self.metrics_addr, str) or not self.metrics_addr:
            raise ConfigError(f"metrics_addr={self.metrics_addr!r} must be an address to listen on, "
                              "e.g. '0.0.0.0' or '127.0.0.1'")
        self.policy_options = _parse_mapping(self.policy_options, "policy_options")
        from radixkv.policies import make_policy

        for t in self.tiers:  # build each tier's policy once now: bad options fail here, by name
            make_policy(self.policy_of(t), **self.policy_options_of(t))

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)  # type: ignore[misc]

    def policy_of(self, tier: TierConfig) -> str:
        return tier.policy or self.policy

    def policy_options_of(self, tier: TierConfig) -> dict[str, Any]:
        """The tier's own policy options, else the store's (only when the tier uses the store's
        policy: options of one policy do not fit another)."""
        if tier.policy_options is not None:
            return dict(tier.policy_options)
        return dict(self.policy_options) if tier.policy in (None, self.policy) else {}

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreConfig:
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"store config must be a mapping of options, got {type(d).__name__}: "
                f"{redact_url(repr(d)):.60}"
            )
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed, key=repr)
        if unknown:
            raise ConfigError(
                f"store config has unknown key(s) {unknown}; valid keys are {sorted(allowed)}"
            )
        if "tiers" not in d:
            raise ConfigError(
                "store config has no 'tiers'; list at least one, e.g. tiers: [{url: 'mem://', capacity: 4GiB}]"
            )
        return cls(**dict(d))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> StoreConfig:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(
                f"cannot read store config file {os.fspath(path)!r}: {e.strerror}; check the path"
            ) from None
        except UnicodeDecodeError as e:  # a ValueError, not an OSError or a YAMLError
            raise ConfigError(
                f"store config file {os.fspath(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                "save it as UTF-8"
            ) from None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"store config file {os.fspath(path)!r} is not valid YAML: {e}"
            ) from None
        if data is None:
            raise ConfigError(
                f"store config file {os.fspath(path)!r} is empty; it needs at least 'tiers'"
            )
        return cls.from_dict(data)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, default_tiers: list[Any] | None = None
    ) -> StoreConfig:
        """Build from ``RADIXKV_*`` variables (see docs/configuration.md).

        ``RADIXKV_CONFIG`` names a YAML file read first; every other variable overrides it. Tiers come
        from ``RADIXKV_TIERS`` (comma-separated URLs, fastest first) with
        ``RADIXKV_TIER_CAPACITIES`` (comma-separated sizes), or from indexed variables
        ``RADIXKV_TIER<i>_URL`` / ``_CAPACITY`` / ``_POLICY`` / ``_NAME``; else ``default_tiers``
        (an adapter's default), else it is an error. Variables of other radixkv components are
        ignored.
        """
        from radixkv.config_env import store_config_from_env

        return store_config_from_env(cls, os.environ if environ is None else environ, default_tiers)


def _storage_of(t: TierConfig) -> tuple[str, Any] | None:
    """Where a persistent tier keeps its chunks: ("disk", real directory) or ("redis", (servers, db,
    key prefix)); None for a memory tier (process-local: two are two caches)."""
    if t.kind == "disk":
        return "disk", os.path.realpath(unquote(urlsplit(t.url).path))
    if t.kind == "redis":
        try:
            from radixkv.tiers.redis_client import parse_redis_url
        except ImportError:  # no redis-py: opening the tier says so
            return None
        try:
            u = parse_redis_url(t.url)
        except ConfigError:  # opening the tier says what is wrong with its URL
            return None
        prefix = dict(u.tier_options).get("key_prefix", t.options.get("key_prefix", "radixkv"))
        return "redis", (frozenset(u.hosts), u.db, prefix)
    return None


def _check_distinct_storage(tiers: list[TierConfig]) -> None:
    """Two tiers of one store must not keep chunks in the same place: each keeps its own books and
    evicts, clears and scans on its own, so one would delete the other's files or keys (a restart's
    scan of a directory holding another tier's directory treats it as a namespace)."""
    seen: list[tuple[TierConfig, tuple[str, Any]]] = []
    for t in tiers:
        where = _storage_of(t)
        if where is None:
            continue
        for other, there in seen:
            if where[0] != there[0]:
                continue
            if where[0] == "disk":
                a, b = where[1], there[1]
                clash = a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")
            else:
                clash = where[1][1:] == there[1][1:] and bool(where[1][0] & there[1][0])
            if clash:
                raise ConfigError(redact_url(
                    f"tiers {other.name!r} ({other.url}) and {t.name!r} ({t.url}) keep chunks in the same "
                    + ("directory (or one inside the other)" if where[0] == "disk" else
                       "Redis database under the same key_prefix")
                    + "; give each tier its own "
                    + ("directory" if where[0] == "disk" else "database or key_prefix (?key_prefix=NAME)")
                ))
        seen.append((t, where))


def _assign_names(tiers: list[TierConfig]) -> None:
    seen: set[str] = set()
    for t in tiers:
        if t.name is not None:
            if t.name in seen:
                raise ConfigError(
                    f"tier name {t.name!r} is used twice; give each tier a distinct name"
                )
            seen.add(t.name)
    counts: dict[str, int] = {}
    for t in tiers:
        if t.name is None:
            base = t.kind
            counts[base] = counts.get(base, 0) + 1
            name = base if counts[base] == 1 else f"{base}-{counts[base]}"
            while name in seen:
                counts[base] += 1
                name = f"{base}-{counts[base]}"
            t.name = name
            seen.add(name)


def metrics_port_for_rank(config: StoreConfig, rank: int) -> StoreConfig:
    """``config`` with ``metrics_port`` moved up by the process's rank on its host (engines run one
    store per TP/PP rank; each serves its metrics on its own port: base, base + 1, ...)."""
    if not config.metrics_port or not rank:
        return config
    return dataclasses.replace(config, metrics_port=config.metrics_port + rank)


def tier_is_shared(tc: TierConfig) -> bool:
    """Whether other processes (an engine's other workers, other servers) see this tier's chunks:
    Redis always, a disk tier when ``shared`` (in ``options`` or the URL's query, parsed as the tier
    registry parses it), memory never."""
    if tc.kind == "redis":
        return True
    if tc.kind != "disk":
        return False
    from radixkv.tiers.registry import _parse_bool  # the tier's own reading of the option

    query = dict(parse_qsl(urlsplit(tc.url).query))
    value = tc.options.get("shared", query.get("shared", False))
    return _parse_bool(value, f"shared of tier {tc.url!r}")


def private_disk_dirs(config: StoreConfig, subdir: str, owner: str) -> StoreConfig:
    """``config`` with every disk tier that is not ``shared`` moved to ``<root>/<subdir>``: the
    directory of one process among several that an engine starts from the same store config (its
    scheduler ranks or workers), ``owner`` naming them in the log (``"SGLang rank"``).

    A private disk tier assumes its process owns the directory: its start indexes every file there
    into its own capacity and evicts to fit, deletes every temp file (another process's put in
    flight) and its spare files. So each process needs a directory of its own, stable across
    restarts, and a tier's ``capacity`` is then per process. ``subdir`` must hold a dot, so that no
    walk of a root takes it for a namespace directory (``radixkv.keys.KEY_RE`` has none). Shared disk
    tiers are made for several processes and Redis is shared by nature: both stay as given."""
    if "." not in subdir or "/" in subdir or subdir.startswith("."):
        raise ValueError(f"subdir={subdir!r} must be one path component holding a dot, not leading "
                         "with one (a namespace directory has none; a leading one is hidden)")
    tiers = []
    for tc in config.tiers:
        if tc.kind == "disk" and not tier_is_shared(tc):
            parts = urlsplit(tc.url)
            root = parts.path.rstrip("/") or ""
            _warn_old_layout(unquote(root) or "/", tc.url, owner)
            tc = dataclasses.replace(tc, url=urlunsplit(parts._replace(path=f"{root}/{subdir}")))
        tiers.append(tc)
    return dataclasses.replace(config, tiers=tiers)


def _warn_old_layout(root: str, url: str, owner: str) -> None:
    """Namespace directories right under a private root are from the one-directory layout of
    earlier releases: no process reads or evicts them any more. Say so, naming them, rather than let
    them hold disk space silently."""
    from radixkv.keys import KEY_RE

    try:
        old = sorted(n for n in os.listdir(root)
                     if KEY_RE.fullmatch(n) and os.path.isdir(os.path.join(root, n)))
    except OSError:
        return
    if old:
        shown = ", ".join(old[:3]) + (", ..." if len(old) > 3 else "")
        logger.warning("radixkv: disk tier %s: %d namespace directories directly under %s (%s) are from "
                       "the layout before per-process directories (each %s now uses %s/<its "
                       "coordinates>); they are no longer used: remove them, or move them into a "
                       "directory of the new layout to keep them", redact_url(url), len(old), root,
                       shown, owner, root)
