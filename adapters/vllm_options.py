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

import hashlib
import math
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
    "dtype_name",
]

# vLLM's BlockPool pops block 0 off a fresh free queue as its null block (the placeholder that
# sliding-window and Mamba groups put where a block was skipped); it never holds KV.
NULL_BLOCK_ID = 0

_DEFAULT_CHUNK_TOKENS = 256
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
        if not isinstance(self.max_staging_bytes, int) or self.max_staging_bytes < 0:
            raise ConfigError(
                f"max_staging_bytes={self.max_staging_bytes!r} must be a non-negative integer"
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


def group_namespace(
    model: str,
    geometry: GroupGeometry,
    chunk_tokens: int,
    kv_cache_layout: str,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> Namespace:
    """The namespace of one KV-cache group's chunks on one TP/PP rank.

    The payload byte layout is radixkv's chunk layout (docs/kernels.md: layer, K/V, token, head, dim)
    for the group's layers; ``kv_cache_layout`` (vLLM's physical page layout) and the block size are part
    of the identity as well, so a deployment never reads bytes produced under another layout.
    """
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
        extra=f"g{geometry.group_id}-{geometry.kind}",
    )


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (works on the dtype object or its string)."""
    return str(dtype).removeprefix("torch.")


def geometries_from_kv_cache_config(kv_cache_config: Any) -> list[GroupGeometry]:
    """One :class:`GroupGeometry` per group of vLLM's ``KVCacheConfig`` (duck-typed: no vLLM import).

    Attention groups (full, sliding window, chunked local, MLA) are supported; a group without a
    ``head_size`` (Mamba state) raises :class:`ConfigError`, since its blocks are not token pages.
    """
    out: list[GroupGeometry] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
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
    return out
