"""Build a tier from a URL: ``make_tier("mem://?capacity=8GiB")``.

Schemes::

    mem://[?capacity=SIZE&pin=auto|true|false&unit=SIZE&slab=SIZE&prefault=1
           &huge_pages=0|1&copy_threads=N]                                 MemoryTier (pinned if CUDA)
    memory://...                                                           alias of mem://
    file:///abs/dir[?capacity=SIZE&io_threads=N&fsync=0|1&shared=0|1&stale_temp_s=S
                    &overlap_min_bytes=SIZE|off&recycle=0|1]                     DiskTier
    redis://host[:port][/db]   rediss://...                                RedisTier, one server
    redis+cluster://host:port[,host:port...]   rediss+cluster://...        RedisTier, Redis Cluster

SIZE is bytes (``1048576``) or a number with a unit: ``KiB MiB GiB TiB`` (powers of 1024) or
``KB MB GB TB`` / ``K M G T`` (powers of 1000); see :mod:`radixkv.sizes`. Keyword arguments give the same options (``capacity_bytes=``,
``pin=``, ``io_threads=``, ...); an option given both ways must agree. The Redis tier is imported only
when a Redis URL is used, and receives the URL unchanged (its options are documented in
:mod:`radixkv.tiers.redis_client`).
"""

from __future__ import annotations

import importlib
import urllib.parse
from typing import Any

from radixkv.config import _malformed_url, redact_url
from radixkv.errors import ConfigError
from radixkv.sizes import parse_bytes
from radixkv.tiers.base import Tier

__all__ = ["make_tier", "parse_bytes", "SUPPORTED_SCHEMES"]

SUPPORTED_SCHEMES = ("mem", "memory", "file", "redis", "rediss", "redis+cluster", "rediss+cluster")
_REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+cluster", "rediss+cluster"})
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(f"{what}={value!r} must be a boolean: one of {sorted(_TRUE | _FALSE)}")


def _parse_int(value: Any, what: str) -> int:
    """A whole number from an int or a decimal string; never a truncated float (1.5) or a bool."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{what}={value!r} must be an integer (a whole number such as 4)")


def _merge(spec: str, query: dict[str, str], kwargs: dict[str, Any],
           parsers: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """Options from the URL query and from keyword arguments, parsed; both given must agree."""
    out: dict[str, Any] = {}
    for source, items in (("URL", query.items()), ("keyword", kwargs.items())):
        for raw_name, raw in items:
            name = aliases.get(raw_name, raw_name)
            if name not in parsers:
                known = sorted(set(parsers) | set(aliases))
                raise ConfigError(f"{source} option {raw_name!r} is not supported by {spec!r}; "
                                  f"supported options: {', '.join(known)}")
            value = parsers[name](raw, name)
            if name in out and out[name] != value:
                raise ConfigError(f"{name} is given twice with different values ({out[name]!r} in the "
                                  f"URL, {value!r} as a keyword) for {spec!r}; give it once")
            out[name] = value
    return out


def _size_or_off(value: Any, what: str) -> int | None:
    return None if value is None or str(value).lower() in ("off", "none") else parse_bytes(value, what)


def _pin(value: Any, what: str) -> bool | None:
    return None if str(value).lower() == "auto" or value is None else _parse_bool(value, what)


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool):  # float(True) is 1.0: a wrongly typed value read as one second
        raise ConfigError(f"{what}={value!r} must be a number, not true/false")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={value!r} must be a number") from None


def make_tier(spec: str, *, capacity_bytes: int | str | None = None, name: str | None = None,
              **options: Any) -> Tier:
    """A tier for ``spec`` (see the module docstring). Raises :class:`ConfigError` for an unknown
    scheme (listing the supported ones), a bad option, or a missing capacity for mem:// and file://."""
    if not isinstance(spec, str) or "://" not in spec:
        raise ConfigError(f"tier URL {_malformed_url(spec)} has no scheme; use one of: "
                          + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))
    scheme = spec.split("://", 1)[0].lower()
    if scheme in _REDIS_SCHEMES:
        return _make_redis(spec, capacity_bytes, name, options)
    if scheme not in SUPPORTED_SCHEMES:
        raise ConfigError(f"tier URL {redact_url(repr(spec))}: unknown scheme {scheme!r}; supported "
                          "schemes: " + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))
    parsed = urllib.parse.urlsplit(spec)
    pairs = urllib.parse.parse_qsl(parsed.query, keep_blank_values=True, strict_parsing=False)
    query = dict(pairs)
    if len(pairs) != len(query):  # (blank values count: '?pin=' is a bad value, not a repeat)
        raise ConfigError(f"tier URL {spec!r} repeats a query option; give each once")
    if capacity_bytes is not None and not (capacity_bytes == 0 and "capacity" in query):
        options["capacity_bytes"] = capacity_bytes
    if name is not None:
        options["name"] = name
    if scheme in ("mem", "memory"):
        if parsed.netloc or parsed.path not in ("", "/"):
            raise ConfigError(f"tier URL {spec!r}: mem:// takes no host or path; write mem://?capacity=8GiB")
        from radixkv.tiers.memory import MemoryTier, MemoryTierConfig

        opts = _merge(spec, query, options,
                      {"capacity_bytes": parse_bytes, "pin": _pin, "unit_bytes": parse_bytes,
                       "slab_target_bytes": parse_bytes, "prefault": _parse_bool, "huge_pages": _parse_bool,
                       "copy_threads": _parse_int, "name": lambda v, w: str(v)},
                      {"capacity": "capacity_bytes", "unit": "unit_bytes", "slab": "slab_target_bytes"})
        _need_capacity(spec, opts)
        return MemoryTier(MemoryTierConfig(**opts))
    # file://
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"tier URL {spec!r}: file:// URLs name a local path; write file:///abs/dir "
                          "(three slashes), a shared filesystem mounted locally included")
    path = urllib.parse.unquote(parsed.path)
    if not path.startswith("/"):
        raise ConfigError(f"tier URL {spec!r}: the directory must be absolute (file:///abs/dir)")
    from radixkv.tiers.disk import DiskTier, DiskTierConfig

    opts = _merge(spec, query, options,
                  {"capacity_bytes": parse_bytes, "io_threads": _parse_int, "fsync": _parse_bool,
                   "shared": _parse_bool, "stale_temp_s": _float, "overlap_min_bytes": _size_or_off,
                   "recycle": _parse_bool, "name": lambda v, w: str(v)},
                  {"capacity": "capacity_bytes"})
    _need_capacity(spec, opts)
    return DiskTier(DiskTierConfig(root=path, **opts))


def _need_capacity(spec: str, opts: dict[str, Any]) -> None:
    if not opts.get("capacity_bytes"):
        raise ConfigError(f"tier URL {spec!r} needs a positive capacity: add ?capacity=8GiB to the URL "
                          "or pass capacity_bytes=")


def _make_redis(spec: str, capacity_bytes: int | str | None, name: str | None,
                options: dict[str, Any]) -> Tier:
    try:
        module = importlib.import_module("radixkv.tiers.redis")
    except ImportError as e:
        raise ConfigError(f"tier URL {spec.split('@')[-1]!r} needs the Redis tier, which failed to import "
                          f"({e}); if redis/hiredis are missing, pip install 'radixkv[redis]'") from None
    kwargs = dict(options)
    if capacity_bytes is not None and parse_bytes(capacity_bytes, "capacity_bytes") > 0:
        # 0 (as in TierConfig) means unbounded on our side: the Redis tier's default
        kwargs["capacity_bytes"] = parse_bytes(capacity_bytes, "capacity_bytes")
    if name is not None:
        kwargs["name"] = name
    return module.RedisTier(spec, **kwargs)
