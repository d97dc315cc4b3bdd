"""Physical model of the hierarchy: KV bytes per token, tier bandwidths, and an estimated TTFT.

Presets (bf16 KV unless noted; prefill throughput = tokens/s of the serving unit, derived from
2 * active params FLOPs per token at ~400 TFLOP/s effective per GPU, see
shared/research/traces-and-eviction.md sections 7-8):

=============  ==============================  ====================  ==========================
preset         KV bytes per token              prefill tokens/s      unit
=============  ==============================  ====================  ==========================
llama3-8b      32 x 8 x 128 x 2 x 2 = 128 KiB  25,000                1 GPU
qwen2.5-7b     28 x 4 x 128 x 2 x 2 = 56 KiB   26,000                1 GPU
llama3-70b     80 x 8 x 128 x 2 x 2 = 320 KiB  22,600                8 GPUs
deepseek-v3    61 x 576 x 2 (MLA) ~ 68.6 KiB   43,400                8 GPUs (37B active)
=============  ==============================  ====================  ==========================

TTFT of one request (seconds)::

    load_t    = bytes of the hit chunks served by tier t / bandwidth_t + latency_t  (t with hits)
    load      = sum over tiers of load_t          (a tier slower than recomputing is recomputed)
    recomputed tokens = input tokens - loaded tokens   (misses + hits of tiers recomputed)
    prefill   = recomputed tokens / prefill_tokens_per_s
    TTFT      = load + prefill                    (no overlap)
              = max(load, prefill) + min(load, prefill) / layers   (layer-by-layer overlap)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from radixkv.errors import ConfigError

__all__ = ["ModelSpec", "MODEL_PRESETS", "TierModel", "DEFAULT_TIER_MODELS", "parse_model", "ttft_s",
           "estimate_ttft", "TTFTEstimate", "parse_size_bytes", "SizeTooLarge"]

# RadixTree.insert's bound of a chunk's size_bytes (its columns are 64-bit integers).
_MAX_BLOCK_BYTES = 1 << 48

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
                "float8": 1, "fp8": 1, "int8": 1}


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """KV footprint and prefill speed of one model deployment."""

    name: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    layers: int

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"model {self.name!r}: kv_bytes_per_token={self.kv_bytes_per_token} must be > 0")
        # At least 1 token/s (any real deployment prefills thousands): a tinier speed made every
        # TTFT overflow to inf, and the JSON records NaN.
        if not 1 <= self.prefill_tokens_per_s < math.inf:
            raise ConfigError(f"model {self.name!r}: prefill_tokens_per_s={self.prefill_tokens_per_s} must be a "
                              "finite number >= 1 (tokens/s)")
        if not 0 < self.layers <= 10_000:
            raise ConfigError(f"model {self.name!r}: layers={self.layers} must be in 1..10000")
        if self.kv_bytes_per_token > 1 << 40:
            raise ConfigError(f"model {self.name!r}: kv_bytes_per_token={self.kv_bytes_per_token} is beyond any "
                              "model (1 TiB per token); check layers, kv_heads and head_dim")

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of a block of ``block_tokens`` tokens; ConfigError at the tree's bound of a chunk's
        bytes (2**48, 256 TiB), which the replay's first insert would otherwise report as a
        ``size_bytes`` the user never gave."""
        size_bytes = self.kv_bytes_per_token * block_tokens
        if size_bytes >= _MAX_BLOCK_BYTES:
            raise ConfigError(
                f"model {self.name!r}: a block of {block_tokens} tokens is {size_bytes} bytes, beyond "
                f"the {_MAX_BLOCK_BYTES} (2**48) a cached chunk may have; use fewer block tokens "
                "(--block-tokens) or check layers, kv_heads and head_dim"
            )
        return size_bytes


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 32 * 8 * 128 * 2 * 2, 25_000.0, 32),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28 * 4 * 128 * 2 * 2, 26_000.0, 28),
    "llama3-70b": ModelSpec("llama3-70b", 80 * 8 * 128 * 2 * 2, 22_600.0, 80),
    "deepseek-v3": ModelSpec("deepseek-v3", 61 * 576 * 2, 43_400.0, 61),
}


def parse_model(text: str) -> ModelSpec:
    """A preset name, or ``layers=32,kv_heads=8,head_dim=128,dtype=bf16,prefill_tps=25000``
    (``mla_dim=576`` replaces kv_heads/head_dim for MLA models: one latent vector per layer)."""
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    if "=" not in text:
        raise ConfigError(
            f"unknown model {text!r}; choose a preset ({', '.join(MODEL_PRESETS)}) or give "
            "layers=..,kv_heads=..,head_dim=..,dtype=..,prefill_tps=.."
        )
    fields: dict[str, str] = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() in fields:
            raise ConfigError(f"custom model {text!r} gives {k.strip()} twice; give each field once")
        fields[k.strip()] = v.strip()
    def positive(name: str) -> int:
        # Each field on its own: two negatives (kv_heads=-8,head_dim=-128) multiply to a plausible size.
        raw = fields.pop(name)
        try:
            value = int(raw)
        except ValueError:  # int()'s own message names neither the field nor the fix
            value = 0
        if value <= 0:
            raise ConfigError(f"custom model {text!r}: {name}={raw} must be a positive integer")
        return value

    try:
        layers = positive("layers")
        dtype = fields.pop("dtype", "bf16")
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"model dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        if "mla_dim" in fields:
            both = sorted({"kv_heads", "head_dim"} & fields.keys())
            if both:  # else "unknown fields ['head_dim', 'kv_heads']": they are known, just exclusive
                raise ConfigError(f"custom model {text!r}: mla_dim (one latent vector per layer, MLA) replaces "
                                  f"kv_heads and head_dim; drop {' and '.join(both)} or mla_dim")
            per_layer = positive("mla_dim")
        else:
            per_layer = 2 * positive("kv_heads") * positive("head_dim")
        raw_tps = fields.pop("prefill_tps", "25000")
        try:
            tps = float(raw_tps)
        except ValueError:
            raise ConfigError(f"custom model {text!r}: prefill_tps={raw_tps} must be a number of tokens/s "
                              "> 0, e.g. prefill_tps=25000") from None
    except KeyError as e:
        raise ConfigError(f"custom model {text!r} is missing {e.args[0]}=..") from None
    except ConfigError:
        raise  # already names the field (ConfigError is a ValueError: keep it from being wrapped twice)
    except ValueError as e:
        raise ConfigError(f"custom model {text!r}: {e}") from None
    if fields:
        raise ConfigError(f"custom model {text!r}: unknown fields {sorted(fields)}")
    return ModelSpec("custom", layers * per_layer * _DTYPE_BYTES[dtype], tps, layers)


@dataclass(slots=True, frozen=True)
class TierModel:
    """Read bandwidth (bytes/s) and per-request latency (s) of loading from one tier."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.bandwidth_bytes_per_s < math.inf:
            raise ConfigError(f"tier {self.name!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be a "
                              "finite number > 0")
        if not 0 <= self.latency_s < math.inf:
            raise ConfigError(f"tier {self.name!r}: latency_s={self.latency_s!r} must be a finite number >= 0")

    def always_recomputed(self, model: ModelSpec) -> bool:
        """True if loading any amount of KV from this tier takes longer than recomputing it, so the
        TTFT model recomputes every hit this tier serves (bandwidth below ``kv_bytes_per_token *
        prefill_tokens_per_s``; the latency only adds to the load)."""
        return self.bandwidth_bytes_per_s < model.kv_bytes_per_token * model.prefill_tokens_per_s


GB = 1e9
DEFAULT_TIER_MODELS: dict[str, TierModel] = {
    # pinned host memory over PCIe Gen5 x16: radixkv's zero-copy scatter measured 51 GB/s into an
    # H200's pages (torch's pinned copy_ 55 GB/s; docs/benchmarks.md, kernels)
    "mem": TierModel("mem", 50 * GB, 20e-6),
    "disk": TierModel("disk", 7 * GB, 100e-6),  # NVMe Gen4 x4 sequential read
    "remote": TierModel("remote", 12.5 * GB, 500e-6),  # 100 GbE store (Redis, Mooncake, ...)
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "p": 10**15, "pb": 10**15, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40, "pi": 2**50, "pib": 2**50}
_MAX_BYTES = (1 << 63) - 1  # as radixkv.sizes: more is a unit slip, not a budget


class SizeTooLarge(ConfigError):
    """A byte size in the right syntax, past ``_MAX_BYTES``."""


def parse_size_bytes(text: str) -> int:
    """``64GiB``, ``1.5TB``, ``4096`` -> bytes (a fraction of a byte is dropped)."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r} is not a byte size like 64GiB, 1.5TB or 4096")
    # Exact, as radixkv.sizes.parse_bytes: through a float, 545.25952GB (8,125 blocks of 64 MiB) came
    # out a byte short, so a capacity of exactly n blocks held n - 1.
    try:
        value = math.floor(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:  # over 4,300 digits: int()'s limit on the text it converts
        value = _MAX_BYTES + 1
    if value > _MAX_BYTES:
        raise SizeTooLarge(f"size {text!r} is too large to be a byte size; give one like 64GiB or 1.5TB")
    return value


@dataclass(slots=True, frozen=True)
class TTFTEstimate:
    """What :func:`estimate_ttft` models for a trace's requests.

    ``ttft_s``: per request, seconds. ``loaded_bytes_per_tier``: per tier (in the order given), total
    bytes loaded from it. ``recomputed_tokens``: per request, tokens prefilled: the misses plus the hit
    tokens of tiers whose load would have been slower than recomputing them (fractional where a
    partial last block is shared among tiers)."""

    ttft_s: np.ndarray
    loaded_bytes_per_tier: np.ndarray
    recomputed_tokens: np.ndarray


def ttft_s(
    model: ModelSpec,
    tiers: list[TierModel],
    block_tokens: int,
    input_tokens: np.ndarray,
    hit_blocks: np.ndarray,
    tier_hit_blocks: np.ndarray,
    overlap: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-request TTFT (s) and loaded bytes per tier ([tier] totals): :func:`estimate_ttft`'s first two."""
    e = estimate_ttft(model, tiers, block_tokens, input_tokens, hit_blocks, tier_hit_blocks, overlap)
    return e.ttft_s, e.loaded_bytes_per_tier


def estimate_ttft(
    model: ModelSpec,
    tiers: list[TierModel],
    block_tokens: int,
    input_tokens: np.ndarray,
    hit_blocks: np.ndarray,
    tier_hit_blocks: np.ndarray,
    overlap: bool = False,
) -> TTFTEstimate:
    """Per-request TTFT, loaded bytes per tier and recomputed tokens under the model above.

    Each request loads the hits of some of its tiers and recomputes the others' (what a
    break-even-aware engine does), whichever gives the lower TTFT, so a cache never makes the
    estimate worse than no cache. Without ``overlap`` the times add up, so that is each tier on its
    own: loaded if its load is no slower than recomputing its tokens. With ``overlap`` a load is
    hidden behind the prefill it runs beside, so a tier slower than recomputing may still be worth
    loading: every choice of tiers is tried (up to :data:`_OVERLAP_EXACT_TIERS` tiers; beyond, the
    per-tier choice, all or none) and the fastest kept, ties to the one loading more."""
    input_tokens = input_tokens.astype(np.float64)
    hit_tokens = np.minimum(hit_blocks.astype(np.float64) * block_tokens, input_tokens)
    # Tokens per tier, scaled so they sum to the hit tokens (the last hit block may be partial).
    raw = tier_hit_blocks.astype(np.float64) * block_tokens
    total_raw = raw.sum(axis=1)
    scale = np.divide(hit_tokens, total_raw, out=np.zeros_like(hit_tokens), where=total_raw > 0)
    tier_tokens = raw * scale[:, None]
    # [request, tier]: seconds to load that tier's hit tokens, and to recompute them instead
    load_t = np.zeros_like(tier_tokens)
    for t, tm in enumerate(tiers):
        tok = tier_tokens[:, t]
        load_t[:, t] = tok * model.kv_bytes_per_token / tm.bandwidth_bytes_per_s + np.where(tok > 0, tm.latency_s, 0.0)
    recompute_t = tier_tokens / model.prefill_tokens_per_s
    use_load = load_t <= recompute_t  # [request, tier]: the per-tier choice
    if overlap:
        miss_s = (input_tokens - hit_tokens) / model.prefill_tokens_per_s
        use_load = _fastest_overlapped(load_t, recompute_t, miss_s, use_load, model.layers)
    load = np.zeros_like(input_tokens)
    recompute_tokens = input_tokens - hit_tokens
    loaded_bytes = np.zeros(len(tiers))
    for t in range(len(tiers)):  # tier by tier, in order: the sums' rounding as it always was
        use, tok = use_load[:, t], tier_tokens[:, t]
        load += np.where(use, load_t[:, t], 0.0)
        recompute_tokens += np.where(use, 0.0, tok)
        loaded_bytes[t] = float((tok * use).sum() * model.kv_bytes_per_token)
    prefill = recompute_tokens / model.prefill_tokens_per_s
    ttft = _overlapped(load, prefill, model.layers) if overlap else load + prefill
    return TTFTEstimate(ttft, loaded_bytes, recompute_tokens)


# With --overlap every subset of the tiers is tried per request up to this many tiers (2**8 = 256
# vectorised passes over the requests); more tiers try the per-tier choice, all and none.
_OVERLAP_EXACT_TIERS = 8


def _overlapped(load: np.ndarray, prefill: np.ndarray, layers: int) -> np.ndarray:
    # Layer-wise overlap of two stages over `layers` layers: the longer one, plus one layer's worth
    # of the shorter (the first layer's load before compute starts, or the last layer's compute).
    return np.maximum(load, prefill) + np.minimum(load, prefill) / layers


def _fastest_overlapped(load_t: np.ndarray, recompute_t: np.ndarray, miss_s: np.ndarray, per_tier: np.ndarray,
                        layers: int) -> np.ndarray:
    """[request, tier]: the tiers to load, per request, that give the lowest overlapped TTFT (ties: the
    choice loading more tiers). ``miss_s``: per request, seconds to prefill its misses."""
    n, k = load_t.shape
    if k <= _OVERLAP_EXACT_TIERS:
        # every subset, those loading more tiers first: a later one must be strictly faster
        masks = sorted(range(1 << k), key=lambda m: -bin(m).count("1"))
        choices = [np.broadcast_to(np.array([(m >> t) & 1 == 1 for t in range(k)]), (n, k)) for m in masks]
    else:
        choices = [np.ones((n, k), dtype=bool), per_tier, np.zeros((n, k), dtype=bool)]
    best = choices[0]
    best_s = np.full(n, np.inf)
    for use in choices:
        load = np.where(use, load_t, 0.0).sum(axis=1)
        s = _overlapped(load, miss_s + np.where(use, 0.0, recompute_t).sum(axis=1), layers)
        better = s < best_s
        best = np.where(better[:, None], use, best)
        best_s = np.where(better, s, best_s)
    return best
