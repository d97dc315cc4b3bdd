"""Capacity x policy sweeps (the miss-ratio curve), run in parallel processes.

:func:`run_sweep` replays one trace for every (policy, capacity) point, each in a fresh tree, and
returns :class:`~radixkv.sims.report.Point` s in (policy, capacity) order. Worker processes are forked
so they share the parsed trace copy-on-write; ``jobs=1`` runs in-process (tests, profiling).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

import numpy as np

from radixkv.errors import ConfigError
from radixkv.sims.model import (DEFAULT_TIER_MODELS, ModelSpec, SizeTooLarge, TierModel, estimate_ttft,
                                 parse_size_bytes)
from radixkv.sims.opt import next_use_table
from radixkv.sims.policy_spec import PolicySpec, parse_policy_spec
from radixkv.sims.replay import TierCapacity, replay
from radixkv.sims.report import Point
from radixkv.sims.traces import Trace

__all__ = ["Capacity", "LowerTier", "parse_capacity", "run_sweep", "tier_models"]


@dataclass(slots=True, frozen=True)
class Capacity:
    """A top-tier capacity: ``fraction`` of the trace's unique blocks (None if given absolutely)."""

    blocks: int
    fraction: float | None = None


@dataclass(slots=True)
class LowerTier:
    """A tier below the swept one (victims of the tier above are demoted into it).

    ``policy``: its own eviction policy; None (the default) runs the swept policy there too."""

    name: str
    capacity_text: str
    model: TierModel | None = None
    policy: PolicySpec | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy.offline:
            raise ConfigError(f"tier {self.name!r}: policy {self.policy.label!r} needs the future and models a "
                              "single tier; give a lower tier an online policy (e.g. :lru)")


def tier_models(
    top_tier: str, top_tier_model: TierModel | None, lower_tiers: Sequence[LowerTier]
) -> list[TierModel]:
    """The load model of each tier, fastest first: the one given, else the tier name's default, else
    the default of mem (top tier) or disk (lower tiers)."""
    models = [top_tier_model or DEFAULT_TIER_MODELS.get(top_tier) or DEFAULT_TIER_MODELS["mem"]]
    for lt in lower_tiers:
        models.append(lt.model or DEFAULT_TIER_MODELS.get(lt.name) or DEFAULT_TIER_MODELS["disk"])
    return models


def parse_capacity(text: str, unique_blocks: int, block_bytes: int | None) -> Capacity:
    """``5%`` (of unique blocks), ``1828`` / ``1828blocks`` / ``1828 blocks`` (whole blocks) or ``64GiB``
    (a byte size with a unit; needs a model). A bare number is always a block count."""
    t = text.strip()
    if not t:
        raise ConfigError("capacity '' is empty; give 5% (of unique blocks), 1828 (blocks) or 64GiB")
    if t.endswith("%"):
        try:
            frac = float(t[:-1]) / 100.0
        except ValueError:
            raise ConfigError(f"capacity {text!r} is not a percentage like 5%") from None
        if not 0 < frac < math.inf:
            raise ConfigError(f"capacity {text!r} must be a finite percentage > 0%")
        blocks_f = frac * unique_blocks + 0.5
        if not math.isfinite(blocks_f):  # 1e308% of any trace overflows a float
            raise ConfigError(f"capacity {text!r} is not a real share of the trace; give a percentage such as "
                              "5% (over 100% never evicts)")
        # Round half up, like the table (1% of 182,790 = 1,827.9 -> 1,828), on the exact
        # share: through a float an exact half can land just below it (70% of 89,165 = 62,415.5
        # computes as 62,415.4999...) and round down. Fraction reads every finite float literal.
        exact = Fraction(t[:-1]) * unique_blocks / 100
        return Capacity(max(1, math.floor(exact + Fraction(1, 2))), frac)
    unit_blocks = t.endswith("block") or t.endswith("blocks")
    if unit_blocks:
        t = t[: -len("blocks")] if t.endswith("blocks") else t[: -len("block")]
        t = t.strip()  # "2 blocks" as well as "2blocks"
    if t.isascii() and t.isdigit():  # (str.isdigit also accepts '²', which int() refuses)
        blocks = int(t)
        if blocks < 1:
            raise ConfigError(f"capacity {text!r} must be at least 1 block")
        return Capacity(blocks)
    try:
        number = float(t)
    except ValueError:
        number = None
    if number is not None and number.is_integer() and number < 1:  # -1, -3 blocks, 0.0
        raise ConfigError(f"capacity {text!r} must be at least 1 block")
    if number is not None and number.is_integer():  # finite: inf.is_integer() is False
        # Whole, but not in digits (1e3, 1.0): refused rather than read, as 1.0 may be meant as 100%.
        raise ConfigError(f"capacity {text!r} is a block count only when written in digits: give "
                          f"{int(number)} (blocks), a percentage of unique blocks (e.g. 2.5%) or a byte size "
                          "with a unit (e.g. 64GiB)")
    if number is not None or unit_blocks:
        # A bare number is a block count (a byte size needs a unit), so 2.5 is not 2.5 bytes.
        raise ConfigError(f"capacity {text!r} is not a whole number of blocks; give whole blocks (e.g. 1828), "
                          "a percentage of unique blocks (e.g. 2.5%) or a byte size with a unit (e.g. 64GiB)")
    try:
        size = parse_size_bytes(t)
    except SizeTooLarge:  # a byte size, just too big: say that, not "not a capacity"
        raise ConfigError(f"capacity {text!r} is too large to be a byte size; give one like 64GiB") from None
    except ConfigError:
        # Not "a byte size like ... 4096": a bare number here is a block count, and a percentage works too.
        raise ConfigError(f"capacity {text!r} is not a capacity; give a percentage of unique blocks (e.g. 5%), "
                          "whole blocks (e.g. 1828) or a byte size with a unit (e.g. 64GiB)") from None
    if block_bytes is None:
        raise ConfigError(f"capacity {text!r} is in bytes: pass --model so a block has a byte size")
    blocks = size // block_bytes
    if blocks < 1:
        raise ConfigError(f"capacity {text!r} holds less than one {block_bytes:,}-byte block")
    return Capacity(blocks)


@dataclass(slots=True)
class _Job:
    policy: PolicySpec
    capacity: Capacity
    tiers: list[TierCapacity]
    block_bytes: int | None
    model: ModelSpec | None
    tier_models: list[TierModel] = field(default_factory=list)
    overlap: bool = False
    progress: bool = False
    tier_labels: list[str | None] = field(default_factory=list)  # per tier: its own policy's label, or None
    write_policy: str = "write_through"


_TRACE: Trace | None = None  # set before forking, read by workers
_NEXT_USE: list[list[int]] | None = None  # the trace's next-use table, when an offline policy runs


def _run(job: _Job) -> Point:
    trace = _TRACE
    assert trace is not None
    spec = job.policy
    r = replay(trace, spec.name, job.tiers, block_bytes=job.block_bytes, policy_options=spec.options,
               progress=job.progress, next_use=_NEXT_USE if spec.offline else None,
               write_policy=job.write_policy)
    names = [t.name for t in job.tiers]
    point = Point(
        policy=spec.label,
        policy_options=dict(spec.options),
        capacity_fraction=job.capacity.fraction,
        capacity_blocks=job.capacity.blocks,
        requests=r.requests,
        block_references=r.block_references,
        block_hits=r.block_hits,
        block_hit_rate=r.block_hit_rate,
        token_hit_rate=r.token_hit_rate,
        elapsed_s=r.elapsed_s,
        tier_hit_blocks={n: int(h) for n, h in zip(names, r.tier_hit_blocks.sum(axis=0))},
        demotions=r.demotions,
        tier_policies={t.name: label or spec.label
                       for t, label in zip(job.tiers, job.tier_labels or [None] * len(job.tiers))},
        write_policy=job.write_policy,
    )
    if job.model is not None:
        inputs = np.fromiter((q.input_tokens for q in trace.requests), dtype=np.int64, count=len(trace))
        est = estimate_ttft(job.model, job.tier_models, trace.block_tokens, inputs, r.hit_blocks,
                            r.tier_hit_blocks, overlap=job.overlap)
        point.ttft_s = est.ttft_s
        # Keyed by the simulated tier names (the models' names may differ: --tiers x@7 names "x").
        point.loaded_bytes = {n: float(b) for n, b in zip(names, est.loaded_bytes_per_tier)}
        # What the TTFT model prefills: misses plus hits it chose to recompute (rounded: a partial
        # last block shared among tiers makes fractions).
        point.recomputed_tokens = int(round(float(est.recomputed_tokens.sum())))
    return point


def run_sweep(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[Capacity],
    *,
    top_tier: str = "mem",
    lower_tiers: Sequence[LowerTier] = (),
    model: ModelSpec | None = None,
    top_tier_model: TierModel | None = None,
    overlap: bool = False,
    jobs: int | None = None,
    progress: bool = False,
    write_policy: str = "write_through",
) -> list[Point]:
    """Replay every (policy, capacity) point; results in (policy, capacity) order.

    ``policies``: specs, ``NAME`` or ``NAME:KEY=VALUE...`` (:mod:`radixkv.sims.policy_spec`); a
    point's ``policy`` is its spec's label. ``write_policy``: the store's, which the replay models
    with several tiers (:func:`~radixkv.sims.replay.replay`)."""
    global _TRACE, _NEXT_USE
    if not policies or not capacities:
        raise ConfigError("a sweep needs at least one policy and one capacity")
    specs = [parse_policy_spec(p) for p in policies]
    labels = [s.label for s in specs]
    # By the parsed spec, not its text: s3fifo:small_fraction=0.2 and ...=.2 would replay one policy twice.
    first: dict[tuple, str] = {}
    for s in specs:
        if s.identity in first:
            seen = first[s.identity]
            same = repr(seen) if seen == s.label else f"{seen!r} and {s.label!r}: one policy, the same options"
            raise ConfigError(f"policies {labels} name the same spec twice ({same}); list each once")
        first[s.identity] = s.label
    block_bytes = model.block_bytes(trace.block_tokens) if model else None
    unique = trace.unique_blocks
    models = tier_models(top_tier, top_tier_model, lower_tiers)
    lower: list[TierCapacity] = []
    for lt in lower_tiers:
        lower.append(TierCapacity(
            lt.name, parse_capacity(lt.capacity_text, unique, block_bytes).blocks,
            policy=lt.policy.name if lt.policy else None,
            policy_options=dict(lt.policy.options) if lt.policy else None,
        ))
    labels_per_tier: list[str | None] = [None, *(lt.policy.label if lt.policy else None for lt in lower_tiers)]
    if lower and any(s.offline for s in specs):
        raise ConfigError("the opt policy models a single tier; drop --tiers or the opt policy")
    todo = [
        _Job(s, c, [TierCapacity(top_tier, c.blocks)] + lower, block_bytes, model, models, overlap,
             tier_labels=labels_per_tier, write_policy=write_policy)
        for s in specs
        for c in capacities
    ]
    _TRACE = trace
    # Offline policies need the future: one table for all their points, shared with the forked
    # workers (not one per point).
    if any(s.offline for s in specs):
        _NEXT_USE = next_use_table(trace)
    try:
        # Never more processes than points: a forked pool starts all its workers up front, so
        # --jobs 64 on a 4-point sweep would fork 60 idle copies of the process.
        n_jobs = min(len(todo), jobs or os.cpu_count() or 1)
        if n_jobs <= 1 or len(todo) == 1:
            if progress and len(todo) == 1:
                todo[0].progress = True
            return [_run(j) for j in _with_bar(todo, progress)]
        ctx = multiprocessing.get_context("fork")
        # Longest first, so the last jobs to finish are short ones (a greedy schedule's makespan is
        # the sum over workers plus about the last job): small capacities evict the most, and LRU
        # (one ordered dict, no heap) is the cheapest policy to replay, so its points go last.
        order = sorted(range(len(todo)), key=lambda i: (todo[i].policy.name == "lru", todo[i].capacity.blocks))
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=ctx) as pool:
            futures = {i: pool.submit(_run, todo[i]) for i in order}
            results: dict[int, Point] = {}
            bar = _bar(len(todo)) if progress else None
            for i in order:
                results[i] = futures[i].result()
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(todo))]
    finally:
        _TRACE = _NEXT_USE = None


def _with_bar(todo: list[_Job], progress: bool):
    if not progress or len(todo) == 1:
        return todo
    from tqdm import tqdm

    return tqdm(todo, unit="point", leave=False)


def _bar(total: int):  # pragma: no cover - cosmetic
    from tqdm import tqdm

    return tqdm(total=total, unit="point", leave=False)
