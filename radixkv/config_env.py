"""``StoreConfig.from_env``: a store configuration from ``RADIXKV_*`` environment variables.

See docs/configuration.md for every variable. ``RADIXKV_CONFIG`` names a YAML file read first; every
other variable overrides it; variables of other radixkv components are ignored, misspelt tier
variables are errors.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Mapping

from radixkv.config import TierConfig
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.config import StoreConfig

__all__ = ["store_config_from_env", "env_overrides"]

logger = logging.getLogger(__name__)

_ENV_PREFIX = "RADIXKV_"
# Process-wide switches of other radixkv components (docs/configuration.md): never "misspelt".
_OTHER_COMPONENTS = frozenset({"NATIVE", "STREAMING_COPY", "COMPILED", "COMPILE"})


def store_config_from_env(
    cls: type[StoreConfig], env: Mapping[str, str], default_tiers: list[Any] | None = None
) -> StoreConfig:
    """The :class:`StoreConfig` the variables in ``env`` describe (``default_tiers`` when they name
    no tiers and no config file)."""
    data: dict[str, Any] = {}
    if env.get(_ENV_PREFIX + "CONFIG"):
        base = cls.from_yaml(env[_ENV_PREFIX + "CONFIG"])
        data = {f.name: getattr(base, f.name) for f in fields(cls)}
        data["tiers"] = [
            TierConfig(t.url, t.capacity_bytes, t.name, t.policy, dict(t.options), t.policy_options)
            for t in base.tiers
        ]
    # (it reports misspelt variables, and drops the YAML's policy_options if RADIXKV_POLICY replaces
    # their policy)
    config_name = f"RADIXKV_CONFIG={env.get(_ENV_PREFIX + 'CONFIG')}"
    data.update(env_overrides(cls, env, base=data or None, base_name=config_name))
    tiers = _tiers_from_env(env)
    if tiers is not None:
        data["tiers"] = tiers
    if "tiers" not in data and default_tiers is not None:
        data["tiers"] = [dict(t) if isinstance(t, Mapping) else t for t in default_tiers]
    if "tiers" not in data:
        raise ConfigError(
            "no tiers configured: set RADIXKV_TIERS (e.g. 'mem://,file:///var/cache/radixkv') with "
            "RADIXKV_TIER_CAPACITIES (e.g. '4GiB,100GiB'), or RADIXKV_CONFIG=<yaml file>"
        )
    return cls(**data)


def env_overrides(
    cls: type[StoreConfig],
    env: Mapping[str, str],
    base: StoreConfig | Mapping[str, Any] | None = None,
    base_name: str = "the base config",
) -> dict[str, Any]:
    """The store fields other than ``tiers`` that ``RADIXKV_<FIELD>`` variables set (raw strings; the
    StoreConfig parses them), for a caller layering them over a config of its own. A variable that
    nearly spells one of them is a ConfigError here too, as in :func:`store_config_from_env`: the
    engine adapters read the environment only through this when their own config names the tiers.

    ``base`` (a StoreConfig or a mapping of its fields; ``base_name`` names it in the log) is the
    config the result will be layered over. When ``RADIXKV_POLICY`` replaces its policy with another
    and ``RADIXKV_POLICY_OPTIONS`` is unset, the result also sets ``policy_options`` to ``{}``: the
    base's options belong to its policy (they would be unknown options of the new one), so they are
    dropped, logged at info. Without ``base`` nothing is dropped."""
    _check_misspelt(cls, env)
    out: dict[str, Any] = {}
    for f in fields(cls):
        key = _ENV_PREFIX + f.name.upper()
        if f.name != "tiers" and key in env:
            out[f.name] = env[key]
    if base is not None and "policy" in out and "policy_options" not in out:
        if isinstance(base, Mapping):
            default = next(f.default for f in fields(cls) if f.name == "policy")
            base_policy, base_options = base.get("policy", default), base.get("policy_options")
        else:
            base_policy, base_options = base.policy, base.policy_options
        if base_options and out["policy"] != base_policy:
            logger.info(
                "radixkv: RADIXKV_POLICY=%s replaces policy %r of %s; its policy_options %r (options of %r) "
                "are dropped. Set RADIXKV_POLICY_OPTIONS to give %s options",
                out["policy"], base_policy, base_name, dict(base_options), base_policy, out["policy"],
            )
            out["policy_options"] = {}
    return out


def _check_misspelt(cls: type[StoreConfig], env: Mapping[str, str]) -> None:
    """A ``RADIXKV_*`` variable that is not the store's but nearly spells one of its variables
    (``RADIXKV_PROMOTE_ON_HITS``, ``radixkv_metrics_port``) is a ConfigError, not silently ignored;
    variables of other components (not close to any store variable) stay ignored."""
    ours = {f.name.upper() for f in fields(cls) if f.name != "tiers"} | {"CONFIG", "TIERS", "TIER_CAPACITIES"}
    for k in env:
        if not k.upper().startswith(_ENV_PREFIX):
            continue
        suffix = k[len(_ENV_PREFIX):]
        if k.startswith(_ENV_PREFIX) and (suffix in ours or suffix in _OTHER_COMPONENTS):
            continue
        if k.upper().startswith(_ENV_PREFIX + "TIER"):
            if k.startswith(_ENV_PREFIX + "TIER"):
                continue  # tier variables: _tiers_from_env checks them
            # it reads only upper-case names: radixkv_tier0_url was ignored, and the store opened
            # without the tier (an engine adapter's default memory tier in its place)
            raise ConfigError(
                f"environment variable {k} is not understood; tier variables are upper case: "
                f"{k.upper()} (docs/configuration.md lists the RADIXKV_* variables)"
            )
        close = difflib.get_close_matches(suffix.upper(), sorted(ours), n=1, cutoff=0.8)
        if close:
            raise ConfigError(
                f"environment variable {k} is not understood; did you mean {_ENV_PREFIX + close[0]}? "
                "(docs/configuration.md lists the RADIXKV_* variables)"
            )


def _split_urls(listed: str) -> list[str]:
    """``RADIXKV_TIERS`` split at its commas, except those inside one URL: a Redis Cluster URL lists
    its seed nodes with commas (``redis+cluster://h1:7000,h2:7001``); a piece without ``://`` goes
    on the URL before it."""
    urls: list[str] = []
    for piece in (p.strip() for p in listed.split(",")):
        if not piece:
            continue
        if "://" not in piece and urls:
            urls[-1] += "," + piece
        else:
            urls.append(piece)
    return urls


def _tiers_from_env(env: Mapping[str, str]) -> list[TierConfig] | None:
    listed = env.get(_ENV_PREFIX + "TIERS")
    indexed: dict[int, dict[str, Any]] = {}
    pat = re.compile(r"^RADIXKV_TIER(0|[1-9][0-9]*)_(URL|CAPACITY|POLICY|NAME)$")  # TIER01: a typo
    for k, v in env.items():
        m = pat.match(k)
        if m:
            indexed.setdefault(int(m.group(1)), {})[m.group(2).lower()] = v
        elif k.startswith(_ENV_PREFIX + "TIER") and k not in (
            _ENV_PREFIX + "TIERS",
            _ENV_PREFIX + "TIER_CAPACITIES",
        ):
            raise ConfigError(
                f"environment variable {k} is not understood; tier variables are RADIXKV_TIERS, "
                "RADIXKV_TIER_CAPACITIES and RADIXKV_TIER<i>_URL/_CAPACITY/_POLICY/_NAME"
            )
    if listed is not None and indexed:
        raise ConfigError("set either RADIXKV_TIERS or RADIXKV_TIER<i>_* variables, not both")
    if listed is None and env.get(_ENV_PREFIX + "TIER_CAPACITIES", "").strip():
        raise ConfigError("RADIXKV_TIER_CAPACITIES is set without RADIXKV_TIERS: set RADIXKV_TIERS to the "
                          "tiers' URLs (e.g. 'mem://,file:///var/cache/radixkv'), one capacity each")
    if listed is not None:
        urls = _split_urls(listed)
        if not urls:
            raise ConfigError(
                f"RADIXKV_TIERS={listed!r} names no tier: give comma-separated tier URLs, fastest first "
                "(e.g. 'mem://,file:///var/cache/radixkv'), or unset it"
            )
        caps_raw = env.get(_ENV_PREFIX + "TIER_CAPACITIES", "")
        caps = [c.strip() for c in caps_raw.split(",")] if caps_raw.strip() else []
        if caps and len(caps) != len(urls):
            raise ConfigError(
                f"RADIXKV_TIER_CAPACITIES={caps_raw!r} has {len(caps)} entries but RADIXKV_TIERS has "
                f"{len(urls)} URLs; give one capacity per tier (0 = unbounded)"
            )
        return [
            TierConfig(url=u, capacity_bytes=caps[i] if caps else 0) for i, u in enumerate(urls)
        ]
    if not indexed:
        return None
    order = sorted(indexed)
    if order != list(range(len(order))):
        raise ConfigError(f"RADIXKV_TIER<i>_* indices {order} must be 0, 1, 2, ... without gaps")
    out = []
    for i in order:
        d = indexed[i]
        if "url" not in d:
            raise ConfigError(f"RADIXKV_TIER{i}_URL is missing; every indexed tier needs a URL")
        out.append(
            TierConfig(
                url=d["url"],
                capacity_bytes=d.get("capacity", 0),
                name=d.get("name"),
                policy=d.get("policy"),
            )
        )
    return out
