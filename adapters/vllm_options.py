"""Options, namespaces and chunk keys of the vLLM connector (no vLLM, torch or CUDA imports).

Everything here is a pure function of ``kv_connector_extra_config`` and of vLLM's config objects, so the
scheduler process and every worker process derive the same chunk size, the same keys and the same
namespaces without talking to each other.

Glossary: a *block* is vLLM's KV page (``block_size`` tokens of one KV-cache group); a *hash block* is
the granularity of ``Request.block_hashes`` (``hash_block_size`` tokens); a *chunk* is
``chunk_tokens`` tokens, a multiple of both, and the unit radixkv stores. A chunk's key is derived from
the block hash of its last hash block; vLLM chains block hashes over the whole prefix (and the
request's LoRA, multimodal and ``cache_salt`` extra keys), so equal keys mean equal prefixes.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from radixkv.errors import ConfigError
from radixkv.keys import Namespace

__all__ = [
    "VllmConnectorOptions",
    "GroupGeometry",
    "resolve_chunk_tokens",
    "chunk_keys_from_block_hashes",
    "group_namespace",
    "NULL_BLOCK_ID",
    "geometries_from_kv_cache_config",
    "cached_group_ids",
    "dtype_name",
    "model_identity_digest",
    "new_cache_generation",
    "worker_dir",
]

logger = logging.getLogger(__name__)

# vLLM's BlockPool pops block 0 off a fresh free queue as its null block (the placeholder that
# sliding-window and Mamba groups put where a block was skipped); it never holds KV.
NULL_BLOCK_ID = 0

_DEFAULT_CHUNK_TOKENS = 256
_MODEL_DIGEST_TAG = "radixkv-vllm-model-v1"
_MODEL_DIGEST_HEX = 16  # 64 bits: only distinct configurations of one model name must not collide
_MODEL_DIGEST_RE = re.compile(r"[0-9a-f]{%d}" % _MODEL_DIGEST_HEX)
# A cache generation (new_cache_generation): 64 random bits, so no two resets of any engine, before
# or after a restart, draw the same one and read each other's chunks.
_GENERATION_BYTES = 8
_GENERATION_RE = re.compile(r"[0-9a-f]{%d}" % (2 * _GENERATION_BYTES))
# HF config keys that name files or versions, or only steer tokenization and outputs: they never change
# a K/V value, and leaving them out keeps two copies of one model (other paths, other transformers
# version) in one namespace. Keys starting with "_" (``_name_or_path``, ``_commit_hash``, transformers'
# private switches) are left out as well.
_NON_KV_HF_KEYS = frozenset(
    {
        "transformers_version",
        "name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
        "problem_type",
        "task_specific_params",
        "tokenizer_class",
        "finetuning_task",
    }
)
_KEY_TAG = b"radixkv-vllm-chunk-v1\x00"

_KNOWN_OPTIONS = frozenset(
    {
        "chunk_tokens",
        "store",
        "store_config_file",
        "save_generated",
        "max_staging_bytes",
        "lookup_min_chunks",
        "sync_load_wait_s",
        "model_name",
        "layerwise",
    }
)


@dataclass(slots=True)
class VllmConnectorOptions:
    """radixkv options read from ``kv_connector_extra_config`` (see docs/vllm.md for each one).

    ``chunk_tokens`` None = the smallest multiple of every block size and of the hash block size that
    is at least 256 tokens. ``store`` is a :class:`radixkv.config.StoreConfig` mapping,
    ``store_config_file`` a YAML file of the same; with neither, the store comes from ``RADIXKV_*``
    environment variables, and with none of those, one ``mem://`` tier of 4 GiB per worker.
    """

    chunk_tokens: int | None = None
    store: dict[str, Any] | None = None
    store_config_file: str | None = None
    save_generated: bool = False
    max_staging_bytes: int = 2 << 30
    lookup_min_chunks: int = 1
    sync_load_wait_s: float = 0.005
    model_name: str | None = None
    layerwise: bool = False

    def __post_init__(self) -> None:
        if self.chunk_tokens is not None and (
            not isinstance(self.chunk_tokens, int)
            or isinstance(self.chunk_tokens, bool)
            or self.chunk_tokens <= 0
        ):
            raise ConfigError(
                f"chunk_tokens={self.chunk_tokens!r} must be a positive integer number of tokens"
            )
        if self.store is not None and not isinstance(self.store, Mapping):
            raise ConfigError(
                f"store={self.store!r} must be a mapping like {{'tiers': [{{'url': 'mem://', "
                "'capacity_bytes': 4294967296}]}}"
            )
        if self.store is not None and self.store_config_file is not None:
            raise ConfigError(
                "pass either 'store' or 'store_config_file' in kv_connector_extra_config, not both"
            )
        if not isinstance(self.layerwise, bool):
            raise ConfigError(f"layerwise={self.layerwise!r} must be true or false")
        if not isinstance(self.save_generated, bool):
            raise ConfigError(f"save_generated={self.save_generated!r} must be true or false")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise ConfigError(f"model_name={self.model_name!r} must be a non-empty string (or left out: "
                              "vLLM's served model)")
        if self.store_config_file is not None and (
            not isinstance(self.store_config_file, str) or not self.store_config_file.strip()
        ):
            raise ConfigError(f"store_config_file={self.store_config_file!r} must be the path of a YAML file")
        if self.store is not None:  # fail at startup on the scheduler too, not first in a worker
            from radixkv.config import StoreConfig

            StoreConfig.from_dict(self.store)
        if isinstance(self.max_staging_bytes, bool) or isinstance(self.lookup_min_chunks, bool) or isinstance(
            self.sync_load_wait_s, bool
        ):
            raise ConfigError("max_staging_bytes, lookup_min_chunks and sync_load_wait_s take numbers, not "
                              f"true/false (got {self.max_staging_bytes!r}, {self.lookup_min_chunks!r}, "
                              f"{self.sync_load_wait_s!r})")
        if isinstance(self.max_staging_bytes, str):
            # A size string, as every store size takes ("2GiB"); parse_bytes names the value if not.
            from radixkv.sizes import parse_bytes

            self.max_staging_bytes = parse_bytes(self.max_staging_bytes, "max_staging_bytes")
        if not isinstance(self.max_staging_bytes, int) or self.max_staging_bytes < 0:
            raise ConfigError(
                f"max_staging_bytes={self.max_staging_bytes!r} must be a non-negative integer number of "
                "bytes or a size string like '2GiB'"
            )
        if not isinstance(self.lookup_min_chunks, int) or self.lookup_min_chunks < 1:
            raise ConfigError(
                f"lookup_min_chunks={self.lookup_min_chunks!r} must be an integer >= 1"
            )
        if (
            not isinstance(self.sync_load_wait_s, (int, float))
            or not 0 <= self.sync_load_wait_s <= 10
        ):
            raise ConfigError(
                f"sync_load_wait_s={self.sync_load_wait_s!r} must be a number of seconds in [0, 10]"
            )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> VllmConnectorOptions:
        """Parse ``kv_connector_extra_config``; unknown keys are an error (they are usually typos)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown radixkv option(s) {unknown} in kv_connector_extra_config; "
                f"supported: {sorted(_KNOWN_OPTIONS)}"
            )
        return cls(**extra)


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """One KV-cache group as the connector sees it: its layers and block size (plain data)."""

    group_id: int
    block_size: int
    layer_names: tuple[str, ...]
    kind: str  # "full", "sliding_window<W>", "mla", ... (part of the namespace)
    head_size: int
    dtype: str  # torch dtype name without "torch."
    mla: bool = False
    sliding_window_tokens: int | None = None

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens // self.block_size


def resolve_hash_block_size(kv_cache_config: Any, cache_config: Any, block_sizes: Sequence[int]) -> int:
    """The token span of one of vLLM's block hashes, as both connector sides must use it.

    ``KVCacheConfig.hash_block_size`` first: vLLM's EngineCore sets it for the scheduler-side
    connector, whose process never sees ``cache_config.hash_block_size`` with a multi-process
    executor (TP/PP > 1; only worker processes set it). Then ``cache_config.hash_block_size``, then
    the GCD of the groups' block sizes (what vLLM resolves for several KV-cache groups), never one
    group's block size: a span too coarse would derive a chunk's key from a hash in its middle, so
    two prompts agreeing on half a chunk would share its key (and its KV)."""
    for src in (kv_cache_config, cache_config):
        v = getattr(src, "hash_block_size", None)
        if v:
            return int(v)
    if not block_sizes:
        raise ConfigError("the KV-cache config has no groups; nothing to store")
    return math.gcd(*(int(b) for b in block_sizes))


def resolve_chunk_tokens(
    requested: int | None, block_sizes: Sequence[int], hash_block_size: int
) -> int:
    """The chunk size: ``requested`` validated, or the default (see :class:`VllmConnectorOptions`)."""
    unit = hash_block_size
    for bs in block_sizes:
        unit = math.lcm(unit, bs)
    if requested is None:
        return unit * max(1, -(-_DEFAULT_CHUNK_TOKENS // unit))
    if requested % unit:
        raise ConfigError(
            f"chunk_tokens={requested} must be a multiple of every KV-cache block size {sorted(set(block_sizes))} "
            f"and of hash_block_size={hash_block_size}: use a multiple of {unit}"
        )
    return requested


def chunk_keys_from_block_hashes(
    block_hashes: Sequence[bytes], hash_block_size: int, chunk_tokens: int, num_chunks: int
) -> list[str]:
    """Keys of the first ``num_chunks`` chunks: chunk ``i``'s key is derived from the hash of its last
    hash block (vLLM's hashes are chained, so it names the whole prefix). Needs
    ``num_chunks * chunk_tokens // hash_block_size`` hashes; 64 hex characters each, deterministic
    across processes whenever vLLM's block hashes are (sha256 default; see docs/vllm.md)."""
    per_chunk = chunk_tokens // hash_block_size
    if num_chunks * per_chunk > len(block_hashes):
        raise ValueError(
            f"{num_chunks} chunks need {num_chunks * per_chunk} block hashes, have {len(block_hashes)}"
        )
    return [
        hashlib.sha256(_KEY_TAG + bytes(block_hashes[(i + 1) * per_chunk - 1])).hexdigest()
        for i in range(num_chunks)
    ]


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON data that is the same in every process.

    Never a ``repr`` that holds a memory address or anything seeded per process (``hash()``): an object
    without a value form below stands for its type's qualified name only."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and NaN/inf are not JSON numbers
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, Mapping):
        return {
            str(k): _canonical(v)
            for k, v in value.items()
            if not str(k).startswith("_") and str(k) not in _NON_KV_HF_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if callable(value) and hasattr(value, "__qualname__"):  # an hf_overrides function, a class
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    to_dict = getattr(value, "to_dict", None)  # a transformers config nested in another
    if callable(to_dict):
        return _canonical(to_dict())
    text = str(value)  # torch.dtype ("torch.bfloat16") and other value-like objects
    return text if " at 0x" not in text else f"{type(value).__module__}.{type(value).__qualname__}"


def _longrope_factors(hf: Any, max_model_len: Any) -> list[str] | None:
    """Which LongRoPE factors vLLM rotates K with, per LongRoPE block of the HF config (None: none).

    vLLM 0.33's ``Phi3LongRoPEScaledRotaryEmbedding`` picks the long factors for *every* position
    when ``max_model_len > original_max_position_embeddings`` and the short ones otherwise, so one
    model with two context lengths caches different K for the same prefix. ``"long"`` / ``"short"``
    as vLLM decides it; the context length itself where the original length is not in the config."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if "longrope" in (node.get("rope_type"), node.get("type")):
                original = node.get("original_max_position_embeddings")
                if original is None and isinstance(hf, Mapping):
                    original = hf.get("original_max_position_embeddings")
                if isinstance(original, int) and isinstance(max_model_len, int):
                    found.append("long" if max_model_len > original else "short")
                else:
                    found.append(f"max_model_len={max_model_len}")
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(hf)
    return sorted(set(found)) or None


def model_identity_digest(
    model_config: Any,
    cache_config: Any = None,
    speculative_config: Any = None,
    *,
    draft_path: bool = True,
) -> str:
    """A 16-hex digest of what, beside the model name, decides the values of the KV this deployment
    computes (duck-typed over vLLM's ``ModelConfig`` / ``CacheConfig``: no vLLM import).

    It covers the weights (``revision``, ``model_weights``, ``code_revision``, ``quantization``,
    ``quantization_config``, the compute ``dtype``), the architecture as configured (every key of the
    resolved HF config, so ``hf_overrides`` such as ``rope_theta`` / ``rope_scaling`` and a locally
    edited ``config.json`` count, except :data:`_NON_KV_HF_KEYS` and ``_``-prefixed keys), the
    ``hf_overrides`` themselves, ``model_class_overrides``, ``disable_sliding_window``, and the KV
    cache's encoding (``cache_dtype``: fp8 variants are all ``uint8`` in the KV spec;
    ``kv_cache_dtype_skip_layers``).
    Not covered on purpose: the model path (the namespace's ``model`` part, or ``model_name``), the
    tokenizer (tokens are in the keys), ``max_model_len``, parallelism (the namespace's shard). The one
    exception is what ``max_model_len`` decides about K: with LongRoPE (Phi-3 and kin) vLLM rotates
    every position with the long factors when ``max_model_len`` exceeds the original context
    (:func:`_longrope_factors`), so that choice is covered.

    ``speculative_config`` (vLLM's ``SpeculativeConfig``, or None): with a drafter that has KV
    (:func:`_drafter_identity`: EAGLE, EAGLE3, MTP, DFlash, a draft model, ...) vLLM registers the
    drafter's attention layers beside the target's, so the chunks hold the drafter's KV too and the
    drafter's identity counts; ``draft_path=False`` (an explicit ``model_name``) leaves the draft's
    path out, as the target's is. Without one (None, or ngram / suffix decoding: no drafter KV) the
    digest is what it was before drafters counted, so those deployments keep their stored chunks.

    SHA-256 of canonical JSON: the same in every process, rank and machine given equal configs."""
    identity = _model_identity(model_config, cache_config)
    drafter = _drafter_identity(speculative_config, draft_path=draft_path)
    if drafter is not None:  # a key only with a drafter that has KV: every other digest stays
        identity["drafter"] = drafter
    text = json.dumps(
        [_MODEL_DIGEST_TAG, _canonical(identity)], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_MODEL_DIGEST_HEX]


def _drafter_identity(speculative_config: Any, *, draft_path: bool) -> dict[str, Any] | None:
    """What decides the values of the drafter's KV, or None where the drafter has none.

    vLLM 0.33 allocates drafter KV exactly when ``SpeculativeConfig.uses_draft_kv_cache()`` (EAGLE,
    EAGLE3, MTP, DFlash, DSpark, ``draft_model``, ``extract_hidden_states``); ngram, ngram_gpu,
    suffix and custom-class proposers have none. The drafter's KV depends on its method (EAGLE3
    feeds it other hidden states than EAGLE), its weights and architecture (the draft
    ``ModelConfig``: for MTP that is the target's path under the MTP architecture), the draft
    path, the load format (``draft_load_config``), its KV dtype where set apart from the target's
    (``kv_cache_dtype``; None inherits the target's, already covered) and the draft TP size."""
    if speculative_config is None:
        return None
    uses_kv = getattr(speculative_config, "uses_draft_kv_cache", None)
    if callable(uses_kv):
        if not uses_kv():
            return None
    elif getattr(speculative_config, "method", None) in ("ngram", "ngram_gpu", "suffix", "custom_class"):
        return None  # a config without vLLM's predicate: the proposers known to keep no KV
    draft = getattr(speculative_config, "draft_model_config", None)
    load = getattr(speculative_config, "draft_load_config", None)
    return {
        "method": getattr(speculative_config, "method", None),
        "model": getattr(speculative_config, "model", None) if draft_path else None,
        "draft": _model_identity(draft, None) if draft is not None else None,
        "load_format": getattr(load, "load_format", None) if load is not None else None,
        "kv_cache_dtype": getattr(speculative_config, "kv_cache_dtype", None),
        "draft_tensor_parallel_size": getattr(speculative_config, "draft_tensor_parallel_size", None),
    }


def _model_identity(model_config: Any, cache_config: Any) -> dict[str, Any]:
    """The fields of :func:`model_identity_digest` for one model (the target, or a drafter)."""
    hf_config = getattr(model_config, "hf_config", None)
    try:
        hf = hf_config.to_dict() if hf_config is not None else None
    except Exception:  # a config that cannot deep-copy itself: its attributes are the same data
        hf = dict(vars(hf_config))
    identity = {
        "model_weights": getattr(model_config, "model_weights", None) or None,
        "revision": getattr(model_config, "revision", None),
        "code_revision": getattr(model_config, "code_revision", None),
        # The hub commit of a model named by repo id (`revision=None` follows `main`, which moves),
        # where transformers keeps it on the config (4.x; 5.x drops it: docs/vllm.md says to pin).
        "commit": getattr(hf_config, "_commit_hash", None),
        "quantization": getattr(model_config, "quantization", None),
        "quantization_config": getattr(model_config, "quantization_config", None),
        "dtype": getattr(model_config, "dtype", None),
        "hf_overrides": getattr(model_config, "hf_overrides", None) or None,
        "model_class_overrides": getattr(model_config, "model_class_overrides", None) or None,
        "disable_sliding_window": bool(getattr(model_config, "disable_sliding_window", False)),
        "hf_config": hf,
        "cache_dtype": getattr(cache_config, "cache_dtype", None),
        "kv_cache_dtype_skip_layers": (
            getattr(cache_config, "kv_cache_dtype_skip_layers", None) or None
        ),
    }
    longrope = _longrope_factors(hf, getattr(model_config, "max_model_len", None))
    if longrope is not None:  # a key only for LongRoPE models: every other digest stays as it was
        identity["longrope_factors"] = longrope
    return identity


def group_namespace(
    model: str,
    geometry: GroupGeometry,
    chunk_tokens: int,
    kv_cache_layout: str,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    model_digest: str = "",
    generation: str = "",
) -> Namespace:
    """The namespace of one KV-cache group's chunks on one TP/PP rank.

    The payload byte layout is radixkv's chunk layout (docs/kernels.md: layer, K/V, token, head, dim)
    for the group's layers; ``kv_cache_layout`` (vLLM's physical page layout) and the block size are part
    of the identity as well, so a deployment never reads bytes produced under another layout.
    ``model_digest`` (:func:`model_identity_digest`) ends ``extra`` as ``-m<hex>``, so configurations of
    one model name whose KV differs (revision, quantization, RoPE overrides, ...) never share chunks;
    ``""`` (tools without a vLLM config only) leaves it out. ``generation``
    (:func:`new_cache_generation`, after vLLM reset the connector's cache) ends ``extra`` as
    ``-gen<hex>``, so chunks stored before the reset (KV of the weights served then) are never read
    after it; ``""`` (never reset) leaves the namespace as it was, so stored chunks stay valid.
    """
    if model_digest and not _MODEL_DIGEST_RE.fullmatch(model_digest):
        raise ConfigError(
            f"model_digest={model_digest!r} must be {_MODEL_DIGEST_HEX} lowercase hex characters "
            "(model_identity_digest's output)"
        )
    if generation and not _GENERATION_RE.fullmatch(generation):
        raise ConfigError(
            f"generation={generation!r} must be {2 * _GENERATION_BYTES} lowercase hex characters "
            "(new_cache_generation's output) or empty"
        )
    layers = len(geometry.layer_names)
    layout = f"vllm-{kv_cache_layout}-bs{geometry.block_size}-L{layers}-D{geometry.head_size}" + (
        "-mla" if geometry.mla else ""
    )
    return Namespace(
        model=model,
        dtype=geometry.dtype,
        layout=layout,
        chunk_tokens=chunk_tokens,
        shard=f"tp{tp_rank}of{tp_size}.pp{pp_rank}of{pp_size}",
        extra=f"g{geometry.group_id}-{geometry.kind}"
        + (f"-m{model_digest}" if model_digest else "")
        + (f"-gen{generation}" if generation else ""),
    )


def new_cache_generation() -> str:
    """A fresh cache generation for :func:`group_namespace`: random (``secrets``), never derived
    from state a later reset or a restarted engine could reproduce, since the chunks of a
    generation's namespaces may outlive the process in a disk or Redis tier."""
    return secrets.token_hex(_GENERATION_BYTES)


def worker_dir(
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    pcp_rank: int = 0,
    pcp_size: int = 1,
    dp_index: int = 0,
) -> str:
    """The name of one worker's own directory under a disk tier that is not ``shared``
    (``tp0of2.pp0of1.pcp0of1.dp0``): its coordinates among the host's workers, the DP part being the
    engine's ``data_parallel_index`` (the metrics port's rank order, ``WorkerSide.metrics_rank``).

    vLLM hands every worker of every engine the same ``kv_connector_extra_config``, and a private
    disk tier takes its directory for its own (its start indexes and evicts every file there and
    deletes every temp file): each worker needs one of its own. The name is stable across restarts,
    so a restarted worker finds its chunks again; a single-worker engine has one too
    (``tp0of1.pp0of1.pcp0of1.dp0``): it cannot tell that no DP engine shares its root, since vLLM
    resets a dense DP engine's ``data_parallel_size`` to 1. The dots keep it apart from namespace
    directories (``radixkv.keys.KEY_RE`` has none)."""
    return f"tp{tp_rank}of{tp_size}.pp{pp_rank}of{pp_size}.pcp{pcp_rank}of{pcp_size}.dp{dp_index}"


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (works on the dtype object or its string)."""
    return str(dtype).removeprefix("torch.")


_LOGGED_SKIPS: set[tuple[str, ...]] = set()


def cached_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV-cache groups a hash-addressed store may hold: vLLM's ``prefix_cacheable_group_ids``
    (groups that take part in KV transfer, ``enable_kv_transfer``, and whose spec is prefix-cacheable;
    not e.g. a ``CircularBufferSpec`` ring or a HiSparse replica). It is also what vLLM's
    ``get_loaded_kv_cache_group_ids`` says a load restores: vLLM zeroes and rebuilds the other groups'
    blocks itself, so a connector writing them would race with it. Every group on a config without
    the attribute (duck-typed stand-ins)."""
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if ids is None:
        return tuple(range(len(kv_cache_config.kv_cache_groups)))
    return tuple(int(i) for i in ids)


def geometries_from_kv_cache_config(kv_cache_config: Any) -> list[GroupGeometry]:
    """One :class:`GroupGeometry` per group of vLLM's ``KVCacheConfig`` that radixkv stores
    (:func:`cached_group_ids`), in group order; ``group_id`` stays vLLM's group index. Duck-typed: no
    vLLM import.

    Skipped groups (logged once at INFO) are neither looked up, loaded nor saved. Attention groups
    (full, sliding window, chunked local, MLA) are supported; a stored group without a ``head_size``
    (Mamba state) raises :class:`ConfigError`, since its blocks are not token pages, and so does a
    config where no group is left to store.
    """
    keep = set(cached_group_ids(kv_cache_config))
    out: list[GroupGeometry] = []
    skipped: list[str] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if gid not in keep:
            skipped.append(f"{gid} ({type(spec).__name__})")
            continue
        head_size = getattr(spec, "head_size", None)
        if head_size is None:
            raise ConfigError(
                f"KV-cache group {gid} ({type(spec).__name__}) has no token pages; radixkv's vLLM connector "
                "supports attention groups only (full, sliding window, MLA)"
            )
        kind_name = type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        mla = "MLA" in kind_name
        if window:
            kind = f"sliding_window{window}"
        elif mla:
            kind = "mla"
        else:
            kind = "full"
        out.append(
            GroupGeometry(
                group_id=gid,
                block_size=int(spec.block_size),
                layer_names=tuple(group.layer_names),
                kind=kind,
                head_size=int(head_size),
                dtype=dtype_name(spec.dtype),
                mla=mla,
                sliding_window_tokens=int(window) if window else None,
            )
        )
    if skipped and tuple(skipped) not in _LOGGED_SKIPS:  # once per process, not once per role
        _LOGGED_SKIPS.add(tuple(skipped))
        logger.info(
            "radixkv: KV-cache group(s) %s are not prefix-cacheable or not transferable in vLLM "
            "(prefix_cacheable_group_ids); radixkv neither stores nor loads them",
            ", ".join(skipped),
        )
    if not out:
        raise ConfigError(
            f"no KV-cache group of this model can be stored by radixkv: vLLM marks all of them "
            f"({', '.join(skipped)}) non-prefix-cacheable or excluded from KV transfer"
        )
    return out
