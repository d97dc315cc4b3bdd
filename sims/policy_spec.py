"""Policy specs of a sweep: a registered policy name with optional options, as one string.

``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE...]``, for example ``oddsref:gap_quantile=0.7:gap_step=0.003``.
The whole spec is the label of its points (so one sweep can compare a policy with itself under other
options); the options are exactly the policy's constructor arguments, the same ones a runtime tier
takes as ``policy_options``, so what is tuned here is what is deployed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from radixkv.errors import ConfigError
from radixkv.policies import POLICIES, make_policy
from radixkv.sims import opt as _opt  # noqa: F401  (registers "opt")

__all__ = ["PolicySpec", "parse_policy_spec"]


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """``name`` (registered), its constructor ``options``, and ``label`` (the spec text)."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def identity(self) -> tuple[str, tuple[tuple[str, bool, Any], ...]]:
        """What the spec runs: its name and parsed options, in any order (``s3fifo:small_fraction=0.2``
        and ``s3fifo:small_fraction=.2`` are one policy; ``x=true`` and ``x=1`` are not)."""
        return self.name, tuple(sorted((k, isinstance(v, bool), v) for k, v in self.options.items()))

    @property
    def offline(self) -> bool:
        """True for policies that need the trace's future (``opt``)."""
        return bool(getattr(POLICIES.get(self.name), "offline", False))


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_policy_spec(text: str) -> PolicySpec:
    """Parse and validate one spec (the policy is built once, so a bad option fails here, naming
    itself, not in a worker process minutes later)."""
    name, *parts = [p.strip() for p in text.strip().split(":")]
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r} in {text!r}; supported policies: {', '.join(sorted(POLICIES))}")
    options: dict[str, Any] = {}
    label = name
    for part in parts:
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key.isidentifier() or not raw:
            raise ConfigError(f"policy spec {text!r}: {part!r} is not KEY=VALUE (as in "
                              "oddsref:gap_quantile=0.7)")
        if key in options:
            raise ConfigError(f"policy spec {text!r} sets {key!r} twice")
        value = _value(raw)
        if isinstance(value, float) and not math.isfinite(value):
            # (a policy may take it, but it means nothing to tune, and records carry options as JSON)
            raise ConfigError(f"policy spec {text!r}: {key}={raw} must be a finite number")
        options[key] = value
        label += f":{key}={raw}"
    make_policy(name, **options)  # raises ConfigError naming the bad option or value
    return PolicySpec(label, name, options)
