"""The tier protocol: what every storage tier (memory, disk, Redis, ...) provides.

A tier stores opaque chunk payloads (1-D contiguous ``torch.uint8`` CPU tensors) under a storage
identity ``(namespace digest, chunk key)``. All calls are batched and thread-safe. A tier never
raises for a fault of its medium (server down, disk full, corrupted bytes): it reports a miss (or a
failed put) and counts it in :class:`TierStats`. It raises only for caller errors (wrong payload size,
bad arguments), with a message naming the value and the fix.

Eviction policy is *not* the tier's business: the hierarchical store decides what to evict through the
tree's per-tier policy and calls :meth:`Tier.delete_many`. A tier enforces its capacity as a hard
bound by refusing puts that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypeVar, runtime_checkable

import torch

from radixkv.errors import ConfigError, InputError

__all__ = ["Tier", "TierStats", "check_payload_size", "config_or_options", "UNBOUNDED_BYTES", "capacity_limit"]

_C = TypeVar("_C")

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
        self, namespace: str, keys: Sequence[str], payloads: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Store each payload under its key; True where stored (or already present), False where the
        medium refused (full, down). Never partially visible: a reader sees the whole payload or
        nothing."""
        ...

    def get_many(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[torch.Tensor]
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
