"""The exceptions radixkv raises at its boundaries.

Every error names the offending value and the fix. Faults of a tier (a server down, a full disk, a
corrupted file) are *not* errors: they degrade to cache misses and are counted in stats.
"""

from __future__ import annotations

__all__ = ["RadixKVError", "InputError", "ConfigError", "PinError", "CapacityError"]


class RadixKVError(Exception):
    """Base class of every radixkv error."""


class InputError(RadixKVError, ValueError):
    """A caller passed a value radixkv cannot use (bad token ids, sizes, keys, ...)."""


class ConfigError(RadixKVError, ValueError):
    """A configuration value is invalid or inconsistent."""


class PinError(RadixKVError, RuntimeError):
    """A pin/unpin request does not match the pins held (for example unpinning what is not pinned)."""


class CapacityError(RadixKVError, ValueError):
    """A capacity cannot hold even one chunk, or a payload does not fit its slot size."""
