"""Chunk keys and namespaces.

A *chunk* is ``chunk_tokens`` consecutive tokens (a multiple of the engine page size). Its key names the
chunk together with its whole prefix: ``key_i = H(key_{i-1}, tokens of chunk i)``, so equal keys mean
equal prefixes and ``parent(key_i) == key_{i-1}``.

The default scheme is SGLang 0.5.23's HiCache page-key chain, reproduced bit for bit (see
``sglang/srt/mem_cache/utils.py``: ``get_hash_str`` / ``storage_namespace_seed``)::

    seed = None                                        if extra_key is None and cache_salt is None
         = SHA256(b"sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))  otherwise
    part(None) = b"\\x00";  part(s) = b"\\x01" || len(utf8 s) as u64 LE || utf8 s
    h_i  = SHA256([h_{i-1} or seed as 32 raw bytes] || page tokens as u32 LE)
    wide page (a token >= 2**32): SHA256(prior || b"\\xff" || page tokens as u64 LE)

Keys depend only on the token ids and the salts: never on Python's ``hash()``, PYTHONHASHSEED or the
process. A :class:`Namespace` (model, dtype, KV layout, chunk size, parallel shard) is kept beside the
chain key and is part of every storage identity, so two models, dtypes or layouts never read each
other's chunks.
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

from radixkv.errors import ConfigError, InputError

__all__ = [
    "Namespace",
    "chunk_keys",
    "sglang_page_keys",
    "namespace_seed",
    "hash_page",
    "KEY_RE",
]

# What a stored chunk key (and a namespace digest) may be: every tier can name it as it is, as a file
# name (disk) or within a Redis key. The keys of chunk_keys / SGLang are 64 hex characters.
KEY_RE = re.compile(r"[A-Za-z0-9_\-]{1,128}")

_NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_U32_MAX = (1 << 32) - 1
_I64_MAX = (1 << 63) - 1
_HEX_KEY_CHARS = 64
_HEX_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")


def _part(name: str, value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:
        # SGLang's own seed fails on it too: no key both sides agree on exists.
        raise InputError(
            f"{name}={value!r:.80} holds {value[e.start:e.end]!r}, which UTF-8 cannot encode (a lone "
            "surrogate: a non-UTF-8 byte decoded by Python); pass the LoRA id / cache salt as valid text"
        ) from None
    return b"\x01" + len(raw).to_bytes(8, "little") + raw


def namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The 32-byte chain seed for a LoRA/extra key and a per-request cache salt (None if neither).

    An empty cache salt means no salt, as in SGLang (``RadixKey`` stores ``cache_salt or None``)."""
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):  # else an AttributeError deep in the hash
            raise InputError(f"{name}={value!r:.80} must be a str or None (a LoRA id / cache salt as text)")
    cache_salt = cache_salt or None
    if extra_key is None and cache_salt is None:
        return None
    parts = _part("extra_key", extra_key) + _part("cache_salt", cache_salt)
    return hashlib.sha256(_NAMESPACE_TAG + parts).digest()


def hash_page(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """SHA-256 of one page chained on ``prior`` (32 raw bytes or None); returns 32 raw bytes."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    try:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error:
        # A token outside uint32: the whole page uses the wide encoding (the odd 0xff byte keeps
        # it from colliding with any uint32 page), after validating the ids.
        wide: list[int] = []
        for t in tokens:
            try:
                v = operator.index(t)  # a numpy integer too, as the uint32 path takes it
            except TypeError:
                raise InputError(f"token id {t!r:.40} is not an integer: token ids must be integers in "
                                 "[0, 2**63); check the tokenizer output") from None
            if not 0 <= v <= _I64_MAX:
                raise InputError(
                    f"token id {v} is out of range: token ids must be integers in [0, 2**63); "
                    "check the tokenizer output"
                ) from None
            wide.append(v)
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(b"\xff")
        h.update(struct.pack(f"<{len(wide)}Q", *wide))
    return h.digest()


def _validate_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise InputError(f"page_size={page_size!r} must be a positive integer (engine page size in tokens)")


def sglang_page_keys(
    token_ids: Sequence[int],
    page_size: int,
    extra_key: str | None = None,
    cache_salt: str | None = None,
    prior_key: str | None = None,
) -> list[str]:
    """SGLang 0.5.23-compatible page keys: one 64-hex string per *full* page of ``token_ids``.

    A partial trailing page gets no key (only full pages are ever stored). ``prior_key`` continues
    an existing chain (the key of the page just before ``token_ids``). Empty input returns ``[]``.
    Raises :class:`InputError` for a non-positive page size or a token id outside [0, 2**63).
    """
    _validate_page_size(page_size)
    if token_ids is None or isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise InputError(f"token_ids={token_ids!r:.80} must be a sequence of int token ids (a list)")
    prior: bytes | None
    if prior_key is not None:
        prior = _parse_hex_key(prior_key)
    else:
        prior = namespace_seed(extra_key, cache_salt)
    n_full_tokens = (len(token_ids) // page_size) * page_size
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    keys: list[str] = []
    for start in range(0, n_full_tokens, page_size):
        page = tokens[start : start + page_size]
        prior = hash_page(prior, page)
        keys.append(prior.hex())
    return keys


def _parse_hex_key(key: str) -> bytes:
    if not isinstance(key, str) or len(key) != _HEX_KEY_CHARS:
        raise InputError(f"prior_key={key!r} must be a 64-character hex chunk key")
    if not _HEX_KEY_RE.fullmatch(key):  # bytes.fromhex skips whitespace: 64 chars could be 31 bytes
        raise InputError(f"prior_key={key!r} is not valid hex")
    return bytes.fromhex(key)


def chunk_keys(
    token_ids: Sequence[int],
    chunk_tokens: int,
    page_size: int | None = None,
    extra_key: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """Keys of the full chunks of ``token_ids``, one per ``chunk_tokens`` tokens.

    With ``chunk_tokens == page_size`` (the default when ``page_size`` is None) these are exactly
    SGLang's page keys; a larger chunk hashes all of its tokens as one page of the chain.
    """
    if page_size is not None:
        _validate_page_size(page_size)
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0 or chunk_tokens % page_size:
            raise InputError(
                f"chunk_tokens={chunk_tokens!r} must be a positive multiple of page_size={page_size}"
            )
    return sglang_page_keys(token_ids, chunk_tokens, extra_key=extra_key, cache_salt=cache_salt)


_KNOWN_DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8", "int8", "fp8"}
)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the token chain that makes two chunks' bytes interchangeable.

    Chunks are stored under ``(namespace.digest, chain key)``; two namespaces that differ in any field
    never see each other's chunks. ``shard`` names the parallel slice this process holds (for example
    ``"tp0of2"`` or ``"tp1of8.pp0of1"``); ``extra`` carries engine-specific identity (KV-cache group,
    sidecar pool name, ...).
    """

    model: str
    dtype: str
    layout: str
    chunk_tokens: int
    shard: str = "tp0of1"
    extra: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout", "shard", "extra"):
            value = getattr(self, name)
            if not isinstance(value, str):  # else a TypeError from the checks below or from digest
                raise ConfigError(f"Namespace.{name}={value!r:.80} must be a str")
        if not self.model:
            raise ConfigError("Namespace.model must be a non-empty model name or path")
        if self.dtype not in _KNOWN_DTYPES:
            raise ConfigError(
                f"Namespace.dtype={self.dtype!r} is not one of {sorted(_KNOWN_DTYPES)}; pass the KV "
                "cache dtype as torch names it without the 'torch.' prefix"
            )
        if (not isinstance(self.chunk_tokens, int) or isinstance(self.chunk_tokens, bool) or self.chunk_tokens <= 0
                or self.chunk_tokens >= 1 << 48):
            # 2**48: the tree's per-chunk columns refuse more (and no chunk is that long); said here,
            # at configuration, not at the first put.
            raise ConfigError(f"Namespace.chunk_tokens={self.chunk_tokens!r} must be a positive integer below 2**48")
        for name in ("model", "layout", "shard", "extra"):
            if "\x00" in getattr(self, name):
                raise ConfigError(f"Namespace.{name} must not contain NUL bytes")

    def canonical(self) -> bytes:
        """Deterministic byte encoding of every field (the input of :attr:`digest`)."""
        fields: Iterable[str] = (
            "radixkv-ns-v1",
            self.model,
            self.dtype,
            self.layout,
            str(self.chunk_tokens),
            self.shard,
            self.extra,
        )
        # surrogatepass: a model path with a non-UTF-8 byte (which Python decodes to a lone
        # surrogate) gets a digest like any other; no valid text encodes to those bytes.
        return b"\x00".join(f.encode("utf-8", "surrogatepass") for f in fields)

    @property
    def digest(self) -> str:
        """32-hex-character identity of this namespace, stable across processes and machines."""
        return hashlib.sha256(self.canonical()).hexdigest()[:32]

    def tokens_in(self, chunks: int) -> int:
        """Tokens whose KV ``chunks`` chunks of this namespace hold (for metrics)."""
        return chunks * self.chunk_tokens

    def __str__(self) -> str:
        return (
            f"{self.model}/{self.dtype}/{self.layout}/c{self.chunk_tokens}/{self.shard}"
            + (f"/{self.extra}" if self.extra else "")
        )
