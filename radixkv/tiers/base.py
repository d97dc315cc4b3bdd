"""The tier protocol: what every storage tier (memory, disk, Redis, ...) provides.

A tier stores opaque chunk payloads under a storage identity ``(namespace digest, chunk key)``. A
payload (and a read buffer) is a :data:`ChunkBytes`: one contiguous ``torch.uint8`` CPU tensor, or a
tuple of them, the chunk's *parts* in order (a chunk whose bytes lie scattered in the caller's
memory, such as an SGLang host page's K and V blocks, is stored and read in place, without a
staging copy). A chunk is its bytes: the parts' concatenation. How it was cut is not stored, so a
chunk put as parts reads back into one tensor or into parts cut another way, byte for byte.

All calls are batched and thread-safe. A tier never
raises for a fault of its medium (server down, disk full, corrupted bytes): it reports a miss (or a
failed put) and counts it in :class:`TierStats`. It raises only for caller errors (wrong payload size,
bad arguments), with a message naming the value and the fix.

Eviction policy is *not* the tier's business: the hierarchical store decides what to evict through the
tree's per-tier policy and calls :meth:`Tier.delete_many`. A tier enforces its capacity as a hard
bound by refusing puts that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, TypeVar, Union, runtime_checkable

import torch

from radixkv.errors import ConfigError, InputError

__all__ = [
    "Tier", "TierStats", "ChunkBytes", "ChunkParts", "byte_parts", "byte_parts_all", "part_spans",
    "parts_nbytes", "check_buffers_disjoint", "chunk_nbytes", "chunk_copy", "check_payload_size",
    "config_or_options", "UNBOUNDED_BYTES", "capacity_limit",
]

_C = TypeVar("_C")

# One chunk's bytes: a tensor, or its parts in order (see the module docstring).
ChunkBytes = Union[torch.Tensor, "tuple[torch.Tensor, ...]"]

# ``capacity_bytes`` of a tier without a byte bound of its own (Redis: the server's maxmemory bounds it).
UNBOUNDED_BYTES = (1 << 63) - 1


def capacity_limit(tier: object) -> int:
    """The tier's capacity in bytes for accounting and reports: 0 when it is unbounded."""
    cap = getattr(tier, "capacity_bytes", 0)
    return 0 if not cap or cap >= 1 << 62 else int(cap)


def config_or_options(config_cls: type[_C], config: _C | None, options: dict[str, object]) -> _C:
    """A tier's config: the given object, or one built from keyword options (never both)."""
    if config is None:
        return config_cls(**options)
    if options:
        raise ConfigError(
            f"pass either a {config_cls.__name__} or keyword options, not both: {options}"
        )
    return config


def byte_tensor(t: object, arg: str, i: int) -> torch.Tensor:
    """``t`` (item ``i`` of the argument ``arg``) as a flat contiguous ``torch.uint8`` CPU tensor: a
    view, never a copy. Anything else is an :class:`InputError` naming the item and the fix."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.is_cpu and t.is_contiguous():
        return t if t.dim() == 1 else t.view(-1)
    what = f"{arg}[{i}]"
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} is {type(t).__name__}; pass a contiguous torch.uint8 CPU tensor")
    raise InputError(
        f"{what} is dtype={t.dtype}, device={t.device}, contiguous={t.is_contiguous()}; pass a "
        "contiguous torch.uint8 CPU tensor (use .view(torch.uint8).contiguous().cpu())"
    )


class ChunkParts(tuple):  # type: ignore[type-arg]
    """A chunk's parts, validated once: flat contiguous uint8 CPU tensors in order, with their total
    ``nbytes`` and ``spans`` (address, bytes) per part. For buffers a caller reuses call after call
    (an engine's page views): the store and the tiers then take them without checking every part of
    every chunk again. The parts must keep their storage and shape while the object is in use."""

    nbytes: int
    spans: tuple[tuple[int, int], ...]

    def __new__(cls, parts: Iterable[torch.Tensor], arg: str = "parts", i: int = 0) -> "ChunkParts":
        flat = byte_parts(tuple(parts), arg, i)
        self = super().__new__(cls, flat)
        self.spans = tuple((p.data_ptr(), p.nbytes) for p in flat)
        self.nbytes = sum(n for _a, n in self.spans)
        return self


def byte_parts(t: object, arg: str, i: int) -> Sequence[torch.Tensor]:
    """Item ``i`` of ``arg`` (a :data:`ChunkBytes`) as its parts, each a flat contiguous uint8 CPU
    view (never a copy): ``[t]`` for a tensor. A list is accepted like a tuple; an empty one, or any
    part :func:`byte_tensor` refuses, is an :class:`InputError` naming the item and the fix.

    Validation runs on every chunk of every call (twice through the store: its check and the
    tier's), so the accepted path is a tight loop; messages are built only on the error path."""
    if type(t) is ChunkParts:
        return t
    u8 = torch.uint8
    if isinstance(t, torch.Tensor):
        if t.dtype is u8 and t.is_cpu and t.is_contiguous():
            return [t if t.dim() == 1 else t.view(-1)]
    elif isinstance(t, (tuple, list)):
        if not t:
            raise InputError(
                f"{arg}[{i}] is an empty {type(t).__name__}; pass a tensor or a tuple of its parts"
            )
        parts = []
        for p in t:
            if not (isinstance(p, torch.Tensor) and p.dtype is u8 and p.is_cpu and p.is_contiguous()):
                return [byte_tensor(q, f"{arg}[{i}]", j) for j, q in enumerate(t)]  # raises at p
            parts.append(p if p.dim() == 1 else p.view(-1))
        return parts
    return [byte_tensor(t, arg, i)]  # raises, naming the type


def byte_parts_all(items: Sequence[object], arg: str) -> list[Sequence[torch.Tensor]]:
    """:func:`byte_parts` of every item of a batch."""
    return [byte_parts(t, arg, i) for i, t in enumerate(items)]


def parts_nbytes(parts: Sequence[Any]) -> int:
    """Total bytes of validated parts, tensors or memoryviews of them (a loop: a generator in sum()
    costs more for two parts)."""
    if type(parts) is ChunkParts:
        return parts.nbytes
    n = 0
    for p in parts:
        n += p.nbytes
    return n


def check_buffers_disjoint(outs: Sequence[Sequence[torch.Tensor]], arg: str = "buffers") -> None:
    """Raise InputError if two read buffers, or two parts of one, share bytes (``outs``: each
    buffer's validated parts). Filled in parallel, their bytes would depend on the order of the
    writes, and a tier verifying a checksum after its read would judge a good chunk corrupt."""
    spans: list[tuple[int, int, int]] = []
    add = spans.append
    for i, parts in enumerate(outs):
        for a, n in part_spans(parts):
            if n:
                add((a, a + n, i))
    if len(spans) < 2:
        return
    spans.sort()  # by start; then a span starting before the furthest end so far overlaps
    end, who = spans[0][1], spans[0][2]
    for k in range(1, len(spans)):
        a, b, i = spans[k]
        if a < end:
            i, j = min(i, who), max(i, who)
            what = f"two parts of {arg}[{i}]" if i == j else f"{arg}[{i}] and {arg}[{j}]"
            raise InputError(f"{what} share bytes; give every chunk (and every part) its own buffer memory")
        if b > end:
            end, who = b, i


def part_spans(parts: Sequence[torch.Tensor]) -> Sequence[tuple[int, int]]:
    """(address, bytes) of each validated part."""
    if type(parts) is ChunkParts:
        return parts.spans
    return [(p.data_ptr(), p.nbytes) for p in parts]


def chunk_nbytes(t: ChunkBytes) -> int:
    """Bytes of a (validated) chunk: the tensor's, or its parts' total."""
    return t.nbytes if isinstance(t, torch.Tensor) else parts_nbytes(t)


def chunk_copy(t: ChunkBytes) -> torch.Tensor:
    """A (validated) chunk's bytes copied into one new flat uint8 tensor."""
    return t.reshape(-1).clone() if isinstance(t, torch.Tensor) else torch.cat([p.reshape(-1) for p in t])


def check_payload_size(tier_name: str, namespace: str, fixed_bytes: int | None, nbytes: int, what: str) -> None:
    """Raise InputError unless ``nbytes`` is a valid chunk size for the namespace (every chunk of a
    namespace has the size its first put fixed, ``fixed_bytes``; None = not fixed yet)."""
    if fixed_bytes is not None and nbytes != fixed_bytes:
        raise InputError(
            f"{what} has {nbytes} bytes but namespace {namespace} stores {fixed_bytes}-byte chunks in tier "
            f"{tier_name!r} (fixed by its first put); every chunk of a namespace must have one size"
        )
    if nbytes <= 0:
        raise InputError(f"{what} is empty; a chunk payload must have at least one byte")


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since it was opened (plain data, safe to copy into metrics)."""

    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    deletes: int = 0
    checksum_failures: int = 0
    errors: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "extra"}  # type: ignore[attr-defined]
        out.update(self.extra)
        return out


@runtime_checkable
class Tier(Protocol):
    """One level of the hierarchy. See the module docstring for the contract."""

    name: str
    capacity_bytes: int

    def put_many(
        self, namespace: str, keys: Sequence[str], payloads: Sequence[ChunkBytes]
    ) -> list[bool]:
        """Store each payload under its key; True where stored (or already present), False where the
        medium refused (full, down). Never partially visible: a reader sees the whole payload or
        nothing."""
        ...

    def get_many(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[ChunkBytes]
    ) -> list[bool]:
        """Read each payload into the caller's buffer (no intermediate copy where the medium allows).
        True where the buffer now holds exactly the stored, verified bytes; False is a miss and the
        buffer's contents are unspecified."""
        ...

    def contains_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` present in this tier."""
        ...

    def delete_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Remove the keys; returns how many were present. Missing keys are not an error."""
        ...

    def usage_bytes(self) -> int:
        """Bytes currently held (payloads plus per-chunk overhead the tier counts against capacity)."""
        ...

    def stats(self) -> TierStats:
        ...

    def clear(self, namespace: str | None = None) -> None:
        """Delete every chunk (of one namespace, or all)."""
        ...

    def close(self) -> None:
        """Release resources; idempotent."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError/RuntimeError with numbers if an internal invariant is broken."""
        ...
