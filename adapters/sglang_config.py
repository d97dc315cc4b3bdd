"""Options of the SGLang backend (from ``--hicache-storage-backend-extra-config``) and namespaces.

Every key SGLang leaves in ``extra_config`` reaches the backend; radixkv reads these and ignores
SGLang's own (``backend_name``, ``module_path``, ``class_name``, ...):

==================  =============================================================================
``tiers``           list of tiers, fastest first: ``{"url": "mem://", "capacity": "8GiB"}``,
                    ``{"url": "file:///var/cache/radixkv", "capacity": "200GiB"}``,
                    ``{"url": "redis://host:6379/0"}`` (or bare URL strings)
``config_file``     a radixkv YAML store config (``StoreConfig.from_yaml``); keys given here override
``store``           any other :class:`~radixkv.config.StoreConfig` field as a dict (``policy``,
                    ``write_policy``, ``promote_on_hit``, ``io_threads``, ...); the same fields are
                    also accepted at the top level
``model``           model identity for the namespace (default: SGLang's ``model_name``)
``probe_tiers``     on a tree miss, ask the disk/Redis tiers (pages from before a restart or from
                    another server); default true. A StoreConfig field: it may also come from
                    ``store``, ``config_file`` or ``RADIXKV_PROBE_TIERS``
``interface_v1``    SGLang's own switch: 1 = zero-copy ``batch_*_v1`` (recommended)
==================  =============================================================================

Without ``tiers``/``config_file``, the store comes from the ``RADIXKV_*`` environment
(``StoreConfig.from_env``), with one 4 GiB memory tier when it names no tiers and no config file.

A top-level key that is neither radixkv's nor one SGLang 0.5.23 reads itself is an error when it is
one typo away from a radixkv option (``write_polcy``), else a logged warning (it may be another
SGLang version's own key).
"""

from __future__ import annotations

import difflib
import os
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from radixkv.config import StoreConfig
from radixkv.config_env import env_overrides
from radixkv.errors import ConfigError
from radixkv.keys import Namespace

__all__ = ["RadixKVOptions", "namespace_for", "tp_replicated", "DEFAULT_TIERS"]

logger = logging.getLogger(__name__)

DEFAULT_TIERS = [{"url": "mem://", "capacity": "4GiB"}]
_STORE_FIELDS = {f.name for f in fields(StoreConfig)}
_OURS = _STORE_FIELDS | {"config_file", "store", "model", "interface_v1"}
# Keys SGLang 0.5.23 itself reads from the extra config (factory, controllers, hybrid controller).
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
    "hicache_storage_pass_prefix_keys", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "enable_metadata_cache", "metadata_ttl", "extra_backend_tag",
})


def _check_keys(extra: Mapping[str, Any]) -> None:
    stray = sorted(k for k in extra if k not in _OURS and k not in _SGLANG_KEYS)
    for k in stray:
        near = difflib.get_close_matches(str(k), sorted(_OURS), n=1, cutoff=0.8)
        if near:
            raise ConfigError(f"extra_config key {k!r} is not a radixkv option; did you mean {near[0]!r}? "
                              f"(radixkv options: {sorted(_OURS)})")
    if stray:
        logger.warning("radixkv: extra_config keys %s are neither radixkv options nor keys SGLang 0.5.23 "
                       "reads; ignored", stray)


def _as_bool(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{what}={v!r} must be a boolean (true/false or 1/0)")


@dataclass(slots=True)
class RadixKVOptions:
    """Validated backend options. ``store`` holds StoreConfig fields (tiers included)."""

    store: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    model: str | None = None
    interface_v1: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.store) - _STORE_FIELDS)
        if unknown:
            raise ConfigError(f"radixkv store option(s) {unknown} are unknown; valid: {sorted(_STORE_FIELDS)}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model={self.model!r} must be a non-empty string")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> RadixKVOptions:
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra_config={extra!r} must be a JSON object")
        _check_keys(extra)
        store: dict[str, Any] = {}
        nested = extra.get("store", {})
        if not isinstance(nested, Mapping):
            raise ConfigError(f"store={nested!r} must be an object of StoreConfig fields")
        store.update(nested)
        for k, v in extra.items():
            if k in _STORE_FIELDS:
                store[k] = v
        return cls(
            store=store,
            config_file=extra.get("config_file"),
            model=extra.get("model"),
            interface_v1=_as_bool(extra.get("interface_v1", 0), "interface_v1"),
        )

    def store_config(self) -> StoreConfig:
        """The radixkv store config, each layer overriding the one before: defaults, then
        ``config_file`` (else the ``RADIXKV_*`` tiers, else DEFAULT_TIERS), then the other
        ``RADIXKV_*`` variables (they apply either way), then the fields given here."""
        if self.config_file:
            base = StoreConfig.from_yaml(self.config_file)
            data = {f: getattr(base, f) for f in _STORE_FIELDS}
            data.update(env_overrides(StoreConfig, os.environ))
            data.update(self.store)
            return StoreConfig(**data)
        if "tiers" not in self.store:  # the RADIXKV_* environment, DEFAULT_TIERS unless it names tiers
            base = StoreConfig.from_env(default_tiers=DEFAULT_TIERS)
            data = {f: getattr(base, f) for f in _STORE_FIELDS}
            data.update(self.store)
            return StoreConfig(**data)
        return StoreConfig.from_dict({**env_overrides(StoreConfig, os.environ), **self.store})


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tp_replicated(config: Any, pool_name: str) -> bool:
    """Whether a pool's pages are the same on every TP rank: MLA KV and its sidecars, but not Mamba
    state, which SGLang shards by TP even in MLA models (every rank writes its own)."""
    return bool(getattr(config, "is_mla_model", False)) and pool_name != "mamba"


def namespace_for(config: Any, opts: RadixKVOptions, pool: Any, pool_name: str, plan_tag: str,
                  layout: str | None = None) -> Namespace:
    """The storage identity of one host pool's pages (SGLang passes no dtype/layout: sglang#33268).

    Shard: MLA KV is replicated across TP, so its pages are shared by all TP ranks (only the PP/CP
    slice and the DCP rank matter); otherwise every TP/PP/CP/DP coordinate is part of it."""
    model = opts.model or getattr(config, "model_name", None) or "unnamed-model"
    pp = f"pp{config.pp_rank}of{config.pp_size}"
    cp = f"cp{config.attn_cp_rank}of{config.attn_cp_size}"
    if tp_replicated(config, pool_name):
        shard = f"mla.{pp}.{cp}.dcp{getattr(config, 'dcp_rank', 0)}of{getattr(config, 'dcp_size', 1)}"
    else:
        shard = f"tp{config.tp_rank}of{config.tp_size}.{pp}.{cp}.dp{getattr(config, 'dp_rank', 0)}"
    page_size = int(getattr(pool, "page_size", 1) or 1)
    return Namespace(
        model=str(model),
        dtype=_dtype_name(getattr(pool, "dtype", "uint8")),
        layout=layout or str(getattr(pool, "layout", "flat")),
        chunk_tokens=page_size,
        shard=shard,
        extra=f"sglang-0.5.23/{pool_name}/{plan_tag}",
    )
