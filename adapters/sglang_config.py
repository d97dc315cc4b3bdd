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
                    also accepted at the top level (a field given both ways must agree)
``model``           model identity for the namespace (default: SGLang's ``model_name``)
``probe_tiers``     on a tree miss, ask the disk/Redis tiers (pages from before a restart or from
                    another server); default true. A StoreConfig field: it may also come from
                    ``store``, ``config_file`` or ``RADIXKV_PROBE_TIERS``
``interface_v1``    SGLang's own switch: 1 = zero-copy ``batch_*_v1`` (recommended). Read exactly as
                    SGLang reads it (``bool(value)``): any non-empty string, ``"0"`` and ``"false"``
                    included, turns it on
==================  =============================================================================

Per-rank state (:func:`per_rank_config`, :func:`check_mla_sharing`): every scheduler rank of a server
(TP x PP x CP x DP) builds its own store from the same extra config. A disk tier that is not
``shared`` is then one directory per rank, ``<root>/tp<r>of<n>.pp<r>of<n>.cp<r>of<n>.dp<r>`` (the DP
part: the attention-DP rank, or the replica's index under plain ``--dp-size``), and its capacity is
per rank; ``shared`` disk tiers and Redis are used as given. Rank directories beside this one
whose coordinates no rank of this server has (another TP/PP/CP size) are logged at attach
(:func:`warn_foreign_rank_dirs`). An MLA model with non-writer TP ranks needs a tier those ranks
share (Redis, or a ``shared`` disk tier), ``probe_tiers`` on and ``write_policy`` write_through
unless its first tier is shared, and cannot store an MHA draft model's KV
(:func:`check_draft_sharding`).

Without ``tiers``/``config_file``, the store comes from the ``RADIXKV_*`` environment
(``StoreConfig.from_env``), with one 4 GiB memory tier when it names no tiers and no config file.

A top-level key that is neither radixkv's nor one SGLang 0.5.23 reads itself is an error when it is
one typo away from a radixkv option (``write_polcy``), else a logged warning (it may be another
SGLang version's own key).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

from radixkv.config import StoreConfig, private_disk_dirs, tier_is_shared
from radixkv.config_env import env_overrides
from radixkv.errors import ConfigError
from radixkv.keys import Namespace

__all__ = ["RadixKVOptions", "namespace_for", "sglang_model_digest", "tp_replicated", "DEFAULT_TIERS", "interface_v1_of",
           "dp_rank_of", "rank_dir", "per_rank_config", "tier_is_shared", "check_mla_sharing",
           "check_draft_sharding", "foreign_rank_dirs", "warn_foreign_rank_dirs"]

logger = logging.getLogger(__name__)

DEFAULT_TIERS = [{"url": "mem://", "capacity": "4GiB"}]
_STORE_FIELDS = {f.name for f in fields(StoreConfig)}
_OURS = _STORE_FIELDS | {"config_file", "store", "model", "interface_v1"}
# Keys SGLang 0.5.23 itself reads from the extra config (factory, controllers, hybrid controller).
# ``file_storage_path``: its unified radix cache adds ``--file-storage-path`` to every backend's extra
# config (for its ``file`` backend), so it is no stray key of the user's.
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
    "hicache_storage_pass_prefix_keys", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "enable_metadata_cache", "metadata_ttl", "extra_backend_tag",
    "file_storage_path",
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


def interface_v1_of(extra: Mapping[str, Any]) -> bool:
    """``interface_v1`` exactly as SGLang 0.5.23 reads it to pick its transfer functions
    (``bool(extra_config.get("interface_v1", 0))`` in ``HiCacheController.attach_storage_backend``).

    The backend must agree with SGLang, not with what the value seems to mean: the zero-copy and
    copying paths store pages in different namespaces, so a backend that disagreed would answer
    ``batch_exists`` from the other path's namespace and every prefetch would miss. A string that
    reads as "off" (``"0"``, ``"false"``) is on for SGLang: logged, and followed."""
    value = extra.get("interface_v1", 0)
    on = bool(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", "none"):
        logger.warning("radixkv: interface_v1=%r is a non-empty string, which SGLang 0.5.23 reads as on "
                       "(bool(%r) is True): it uses the zero-copy batch_*_v1 path, and so does radixkv. "
                       "To turn it off pass the JSON number 0 or false, not a string", value, value)
    return on


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
        # An empty or non-string path was skipped as if absent (the store then came from the
        # environment, or the 4 GiB default) or failed later with a TypeError.
        if self.config_file is not None and (not isinstance(self.config_file, str) or not self.config_file.strip()):
            raise ConfigError(f"config_file={self.config_file!r} must be the path of a radixkv YAML store config "
                              "(or left out)")

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
                if k in store and store[k] != v:  # one of the two was silently dropped
                    raise ConfigError(f"extra_config gives {k}={v!r} and store.{k}={store[k]!r}; give it "
                                      "once (at the top level or under store)")
                store[k] = v
        return cls(
            store=store,
            config_file=extra.get("config_file"),
            model=extra.get("model"),
            interface_v1=interface_v1_of(extra),
        )

    def store_config(self) -> StoreConfig:
        """The radixkv store config, each layer overriding the one before: defaults, then
        ``config_file`` (else the ``RADIXKV_*`` tiers, else DEFAULT_TIERS), then the other
        ``RADIXKV_*`` variables (they apply either way), then the fields given here."""
        if self.config_file:
            base = StoreConfig.from_yaml(self.config_file)
            data = {f: getattr(base, f) for f in _STORE_FIELDS}
            data.update(env_overrides(StoreConfig, os.environ, base=base,
                                      base_name=f"config_file={self.config_file}"))
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


# The server arguments that, beside the served model name, decide the values of the KV a server
# computes: which weights (path, revision, load format and loader options, weight version label),
# how they are quantized, the architecture overrides (RoPE base/scaling...), the compute and KV dtypes.
_SGLANG_KV_IDENTITY_ARGS = (
    "model_path", "revision", "load_format", "model_loader_extra_config", "weight_version",
    "quantization", "quantization_param_path", "modelopt_quant", "json_model_override_args",
    "model_impl", "dtype", "kv_cache_dtype",
)
# With speculative decoding SGLang stores the draft model's KV too: in a "draft" sidecar pool
# (EAGLE and friends), or packed into the KV pool's pages (MTP). Its values depend on the draft
# model and its KV dtype, which the host pool cannot tell (fp8_e4m3 and fp8_e5m2 are both uint8 there).
# Counted only when a speculative algorithm is set, so other servers keep their digests (and pages).
_SGLANG_DRAFT_IDENTITY_ARGS = (
    "speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_draft_load_format", "speculative_draft_model_quantization", "speculative_draft_kv_cache_dtype",
)
_SGLANG_DIGEST_TAG = "radixkv-sglang-model-v1"


def runtime_weight_version() -> str | None:
    """The weight version SGLang serves now (``get_serving().weight_version``), or None where no
    server config is published (tools and tests without a server).

    SGLang starts it at ``--weight-version`` and moves it when an in-place weight update
    (``update_weights_from_disk`` / ``_tensor`` / ``_distributed`` / ``_ipc``) or
    ``/update_weight_version`` names a new ``weight_version``; the startup server arguments keep the
    old value (``runtime_context.override`` changes the resolved config only)."""
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().weight_version)
    except Exception:  # no config published in this process
        return None


def sglang_model_digest(opts: RadixKVOptions, server_args: Any = None,
                        weight_version: str | None = None) -> str:
    """A 16-hex digest of SGLang's server arguments that decide the KV beside the model name
    (:data:`_SGLANG_KV_IDENTITY_ARGS`); ``""`` where no server arguments are published (tools and
    tests that drive the controller without a server).

    SGLang names a backend's pages by its served model name only (``HiCacheStorageConfig.model_name``),
    which stays the same across another ``--revision``, ``--quantization`` or
    ``--json-model-override-args``. ``model_path`` counts unless the ``model`` option names the model
    (the operator's statement that these weights are the same wherever they lie). ``server_args``
    None: SGLang's published ones (``runtime_context.get_server_args``). ``weight_version``: the
    version served now (:func:`runtime_weight_version`), in place of the startup ``weight_version``:
    after an in-place weight update that names a new version, the KV of the old weights is in
    other namespaces. With speculative decoding (``speculative_algorithm`` set) the draft model's
    identity and KV dtype (:data:`_SGLANG_DRAFT_IDENTITY_ARGS`) count too: SGLang stores the
    draft's KV beside the target's."""
    if server_args is None:
        try:
            from sglang.srt import runtime_context

            server_args = runtime_context.get_server_args()
        except Exception:  # not published in this process: no server, so nothing to tell apart
            return ""
    identity = {name: getattr(server_args, name, None) for name in _SGLANG_KV_IDENTITY_ARGS}
    if getattr(server_args, "speculative_algorithm", None) is not None:
        identity.update({name: getattr(server_args, name, None) for name in _SGLANG_DRAFT_IDENTITY_ARGS})
    if weight_version is not None:
        identity["weight_version"] = weight_version
    if opts.model:
        identity.pop("model_path")
        # The operator's name covers the draft's weights too (MTP's draft path is the model path).
        identity.pop("speculative_draft_model_path", None)
    text = json.dumps([_SGLANG_DIGEST_TAG, identity], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def namespace_for(config: Any, opts: RadixKVOptions, pool: Any, pool_name: str, plan_tag: str,
                  layout: str | None = None, model_digest: str = "") -> Namespace:
    """The storage identity of one host pool's pages (SGLang passes no dtype/layout: sglang#33268).

    Shard: MLA KV is replicated across TP, so its pages are shared by all TP ranks (only the PP/CP
    slice and the DCP rank matter); otherwise the TP/PP/CP coordinates are part of it, but not the
    DP rank: every DP group (DP attention) and replica (plain DP) holds the same KV per TP shard.
    A pool whose state has a second dtype (Mamba: conv ``dtype``, SSM ``temporal_dtype``) carries
    that one in ``extra`` as ``/ssm-<dtype>``, also where the two are equal: earlier releases
    stored every SSM dtype's state without it, so a name without it may hold any SSM dtype's state.
    A pool with a page format of its own (``storage_format_tag``) carries it as ``/fmt-<tag>``.
    ``model_digest`` (:func:`sglang_model_digest`) ends ``extra`` as ``/m<hex>``."""
    model = opts.model or getattr(config, "model_name", None) or "unnamed-model"
    pp = f"pp{config.pp_rank}of{config.pp_size}"
    cp = f"cp{config.attn_cp_rank}of{config.attn_cp_size}"
    if tp_replicated(config, pool_name):
        shard = f"mla.{pp}.{cp}.dcp{getattr(config, 'dcp_rank', 0)}of{getattr(config, 'dcp_size', 1)}"
    else:
        # The DP part is the constant ``dp0``, never the DP rank: the DP groups of DP attention
        # (SGLang passes the attention-TP rank and size with them) hold the same KV per attention-TP
        # rank, as plain-DP replicas do, so they share pages (SGLang's own file and mooncake
        # backends key MHA pages by TP rank too). Kept in the name so that servers without DP
        # attention keep their namespaces.
        shard = f"tp{config.tp_rank}of{config.tp_size}.{pp}.{cp}.dp0"
    page_size = int(getattr(pool, "page_size", 1) or 1)
    dtype = _dtype_name(getattr(pool, "dtype", "uint8"))
    # A Mamba pool's ``dtype`` is its conv state's; the SSM (temporal) state has its own
    # (``--mamba-ssm-dtype``, SGLANG_MAMBA_SSM_DTYPE or the model config): bfloat16 and float16
    # states are the same size, so without it one would be read as the other.
    temporal = getattr(pool, "temporal_dtype", None)
    # Always named, even when it equals the conv dtype: releases before the suffix wrote states of
    # every SSM dtype under the bare name (a float16 state there would load into a bfloat16 pool).
    state = f"/ssm-{_dtype_name(temporal)}" if temporal is not None else ""
    # A host pool with a page format of its own (UnifiedPageEnvelopeHostPool: token-major envelopes)
    # names it; SGLang appends it to the model name it hands backends (storage_model_name), but the
    # ``model`` option replaces that name, so without this a unified server's pages and a page_first
    # server's (same dtype, layout and page bytes, another byte order) shared one namespace.
    tag = getattr(pool, "storage_format_tag", None)
    fmt = f"/fmt-{tag}" if tag else ""
    return Namespace(
        model=str(model),
        dtype=dtype,
        layout=layout or str(getattr(pool, "layout", "flat")),
        chunk_tokens=page_size,
        shard=shard,
        extra=f"sglang-0.5.23/{pool_name}/{plan_tag}{state}{fmt}" + (f"/m{model_digest}" if model_digest else ""),
    )


# ---------------------------------------------------------------------------- per-rank state

def dp_rank_of(config: Any) -> int:
    """This scheduler's data-parallel rank: with DP attention the attention-DP rank SGLang's storage
    config carries; with plain data parallelism (``--dp-size N`` without DP attention: N replicas
    from SGLang's DataParallelController) the replica's index, which the storage config does not
    carry (``HiCacheController._generate_storage_config`` passes ``dp_rank=0`` to every replica)
    and SGLang publishes as ``runtime_context.get_parallel().dp_rank`` (None without a DP
    controller); 0 when neither applies. It names a scheduler among the host's (disk directory,
    metrics port), not its KV: replicas hold the same KV and keep one namespace (:func:`namespace_for`)."""
    dp = int(getattr(config, "dp_rank", 0) or 0)
    if dp:
        return dp
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel

        if is_dp_attention_enabled():  # the config's rank is the attention-DP rank: 0 it is
            return 0
        replica = get_parallel().dp_rank
    except Exception:  # no published context (a tool, a test): no DP controller either
        return 0
    return int(replica or 0)


def rank_dir(config: Any) -> str:
    """The name of this scheduler rank's own directory under a non-shared disk tier's root: its
    coordinates (``tp0of2.pp0of1.cp0of1.dp0``), the DP part being
    :func:`dp_rank_of` (the replica's index under plain data parallelism, so replicas on one host
    get a directory each; ``dp0`` without DP, as before). Stable across restarts (a rank finds its
    own files again) and distinct for every scheduler of a server. The dots keep it apart from
    namespace directories (``radixkv.keys.KEY_RE`` has none), so nothing that walks a root's
    namespaces ever takes it for one."""
    def get(name: str, default: int) -> int:
        v = getattr(config, name, default)
        return int(default if v is None else v)

    return (f"tp{get('tp_rank', 0)}of{get('tp_size', 1)}.pp{get('pp_rank', 0)}of{get('pp_size', 1)}"
            f".cp{get('attn_cp_rank', 0)}of{get('attn_cp_size', 1)}.dp{dp_rank_of(config)}")


def per_rank_config(store: StoreConfig, config: Any) -> StoreConfig:
    """``store`` with every non-shared disk tier moved to this rank's own directory,
    ``<root>/<rank_dir(config)>``.

    SGLang hands every scheduler rank the same extra config, so without this all ranks of a TP/PP/
    CP/DP server (and all replicas of a ``--dp-size`` server) would open one directory each believing it owns it: a starting rank's scan indexes
    and evicts the other ranks' files and deletes their temp and spare files, spare names collide,
    and the directory holds up to ranks x capacity. With one directory per rank each rank owns its
    files, restarts find them again, and a tier's ``capacity`` is per rank. Shared disk tiers are
    made for several processes and stay as given (their chunks are named by namespace, which
    carries the shard)."""
    warn_foreign_rank_dirs(store, config)
    return private_disk_dirs(store, rank_dir(config), "SGLang rank")


_RANK_DIR_RE = re.compile(r"tp(\d+)of(\d+)\.pp(\d+)of(\d+)\.cp(\d+)of(\d+)\.dp(\d+)")
_warned_foreign: set[tuple[str, tuple[str, ...]]] = set()


def _sizes(config: Any) -> tuple[int, int, int]:
    def get(name: str) -> int:
        v = getattr(config, name, 1)
        return int(1 if v is None else v)

    return get("tp_size"), get("pp_size"), get("attn_cp_size")


def foreign_rank_dirs(root: str, config: Any) -> list[str]:
    """The rank directories (:func:`rank_dir` names) directly under ``root`` that no rank of this
    server can own: another TP, PP or CP size (a server started before with another layout), or a
    rank beyond its size. The DP part carries no size, so a directory of a DP rank the server no
    longer has is not told apart."""
    sizes = _sizes(config)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for name in names:
        m = _RANK_DIR_RE.fullmatch(name)
        if not m or not os.path.isdir(os.path.join(root, name)):
            continue
        tp, tp_n, pp, pp_n, cp, cp_n, _ = (int(g) for g in m.groups())
        if (tp_n, pp_n, cp_n) != sizes or tp >= tp_n or pp >= pp_n or cp >= cp_n:
            out.append(name)
    return out


def warn_foreign_rank_dirs(store: StoreConfig, config: Any) -> None:
    """Log, once per process for a root and set of directories, the :func:`foreign_rank_dirs` of
    every non-shared disk tier: no rank of this server reads, evicts or removes them, so the pages
    there keep their disk space (up to the tier's capacity each) until removed by hand."""
    for tc in store.tiers:
        if tc.kind != "disk" or tier_is_shared(tc):
            continue
        root = unquote(urlsplit(tc.url).path.rstrip("/")) or "/"
        foreign = foreign_rank_dirs(root, config)
        key = (root, tuple(foreign))
        if not foreign or key in _warned_foreign:
            continue
        _warned_foreign.add(key)
        logger.warning(
            "radixkv: disk tier root %s holds %d rank directories that belong to no rank of this "
            "server (its ranks use %s): a server with another TP/PP/CP layout left them; no rank of "
            "this one reads, evicts or removes them, so their pages keep their disk space. Unless a "
            "server of that layout still runs on this root, remove them: rm -r %s", root, len(foreign),
            "tp<r>of{}.pp<r>of{}.cp<r>of{}.dp<r>".format(*_sizes(config)),
            " ".join(os.path.join(root, n) for n in foreign))


def check_mla_sharing(store: StoreConfig, config: Any) -> None:
    """Refuse an MLA server whose non-writer ranks could never hit L3.

    With MLA only the storage-writer rank of each DCP shard writes (SGLang's ``is_storage_writer``:
    ``tp_rank == dcp_rank``); the other TP ranks find its pages only by probing a tier they share
    with it. SGLang all-reduces ``batch_exists`` with MIN over the ranks, so without such a tier the
    non-writers answer 0 and every prefetch misses, silently. The same holds when the pages reach
    the shared tier only on eviction: ``write_back`` with a process-local first tier. Raises
    :class:`ConfigError`."""
    if not getattr(config, "is_mla_model", False):
        return
    tp_size = int(getattr(config, "tp_size", 1) or 1)
    dcp_size = int(getattr(config, "dcp_size", 1) or 1)
    if tp_size <= dcp_size:  # every TP rank is a writer (of its own DCP shard)
        return
    urls = [tc.url for tc in store.tiers]
    if not any(tier_is_shared(tc) for tc in store.tiers):
        raise ConfigError(
            f"MLA model with tp_size={tp_size}: only the storage-writer rank writes pages to L3 and the "
            f"other ranks can read them only from a tier they share with it, but the tiers {urls} are "
            "all process-local (memory, or disk without shared: true); SGLang takes the minimum hit "
            "count over the ranks, so L3 would never hit. Add a shared tier to \"tiers\": "
            "{\"url\": \"redis://host:6379/0\"} or {\"url\": \"file:///dir\", \"capacity\": \"200GiB\", "
            "\"options\": {\"shared\": true}}")
    if not store.probe_tiers:
        raise ConfigError(
            f"MLA model with tp_size={tp_size} and probe_tiers=false: the non-writer ranks find the "
            "writer rank's pages only by probing the shared tier, so L3 would never hit (SGLang takes "
            "the minimum hit count over the ranks); set probe_tiers to true (the default) in the "
            "extra config, store, config_file and RADIXKV_PROBE_TIERS")
    if store.write_policy == "write_back" and not tier_is_shared(store.tiers[0]):
        # The writer's pages land in its first tier, private to its process, and reach the shared
        # tier only when evicted from the tiers above it: hot prefixes, never evicted, never do.
        raise ConfigError(
            f"MLA model with tp_size={tp_size} and write_policy='write_back': the storage-writer rank's "
            f"pages stay in its process-local first tier ({store.tiers[0].url}) and reach the shared "
            "tier the other ranks read only when evicted, so the pages in use would never hit (SGLang "
            "takes the minimum hit count over the ranks); set \"write_policy\": \"write_through\" (the "
            "default) wherever it is set (extra config, store, config_file, RADIXKV_WRITE_POLICY), or "
            "make the first tier a shared one")


# Draft pools SGLang 0.5.23 backs up per TP rank when their host pool is MHA (heads split across
# TP), but only for its Mooncake backend (HybridCacheController.should_backup).
_DRAFT_POOLS = ("draft", "draft_swa")


def check_draft_sharding(config: Any, pool_name: str, pool: Any) -> None:
    """Refuse an MHA draft pool (EAGLE/EAGLE3 sidecar ``draft`` / ``draft_swa``) under an MLA
    target whose server has non-writer TP ranks. Raises :class:`ConfigError`.

    The draft's KV heads are split across the TP ranks, so each rank holds a shard of its own;
    but SGLang 0.5.23 treats every pool of an MLA target as replicated: its backup thread asks only
    the storage-writer rank to store the draft (``HybridCacheController.should_backup`` makes an
    exception for MHA drafts with its Mooncake backend alone), so the other ranks' shards never
    reach the backend. In the MLA namespace a non-writer would load the writer's shard (wrong KV,
    same size); in a per-rank one it would hold nothing, and since the draft gates the KV hit
    (``all_pages``) and SGLang intersects the ranks' answers, every prefetch would miss. A draft
    whose host pool is MLA (a DeepSeek-architecture draft) is replicated and stays accepted; MTP/NextN
    drafts are packed into the KV pool's pages and never register a draft pool."""
    if pool_name not in _DRAFT_POOLS or not getattr(config, "is_mla_model", False):
        return
    tp_size = int(getattr(config, "tp_size", 1) or 1)
    dcp_size = int(getattr(config, "dcp_size", 1) or 1)
    if tp_size <= dcp_size:  # every TP rank is a writer (TP 1, or one DCP rank each: own namespace)
        return
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if not isinstance(pool, MHATokenToKVPoolHost):
        return
    heads = getattr(pool, "head_num", "?")
    raise ConfigError(
        f"the {pool_name!r} pool of this server is an MHA draft model's KV ({heads} KV heads per rank, "
        f"split across tp_size={tp_size}) under an MLA target: SGLang 0.5.23 stores it from the "
        "storage-writer rank only (it writes per-rank draft shards for its mooncake backend alone), so "
        "the other TP ranks could only load the writer's shard (wrong KV) or miss every prefetch. "
        "Use a draft whose KV is MLA (the model's own MTP/NextN layers), attention TP 1 "
        "(--enable-dp-attention with --dp-size equal to --tp-size), --hicache-storage-backend mooncake, "
        "or HiCache without an L3 storage backend")
