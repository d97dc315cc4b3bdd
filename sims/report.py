"""Turn replay results into records, a terminal table, JSON/CSV files and plots.

One record per (policy, capacity)::

    policy (the spec's label, e.g. ``oddsref:gap_quantile=0.7``), policy_options (its options),
    capacity_fraction (of the trace's unique blocks; null when given in bytes/blocks),
    capacity_blocks, requests, block_references, block_hits, block_hit_rate, token_hit_rate,
    infinite_block_hit_rate, gap_closed (fraction of the LRU-to-OPT gap; null without both),
    tier_hit_blocks ({tier: hit blocks served from it}, summing to block_hits), tier_policies
    ({tier: policy label}), demotions (victims copied down a tier, not those the tier below
    already held), write_policy (the store's write policy modelled: write_through or write_back;
    it matters only with several tiers), elapsed_s, accesses_per_s, and with a model: ttft_mean_ms, ttft_p50_ms,
    ttft_p90_ms, ttft_p99_ms, loaded_bytes ({tier: bytes loaded from it}), recomputed_tokens
    (tokens the TTFT model prefills: misses plus hits it recomputes because loading them would be
    slower).

Hit rates are fractions in [0, 1]. CSV has no objects: each per-tier dict becomes one column per tier
(``hit_blocks_<tier>``, ``policy_<tier>``, ``loaded_bytes_<tier>``); ``policy_options`` is left out
(it is in the ``policy`` label).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from radixkv.errors import ConfigError

__all__ = ["Point", "records", "format_table", "write_json", "write_csv", "csv_row", "plot",
           "check_plot_backend"]


@dataclass(slots=True)
class Point:
    """One simulated (policy, capacity) point with its derived numbers."""

    policy: str
    capacity_fraction: float | None
    capacity_blocks: int
    requests: int
    block_references: int
    block_hits: int
    block_hit_rate: float
    token_hit_rate: float
    elapsed_s: float
    ttft_s: np.ndarray | None = None
    loaded_bytes: dict[str, float] | None = None
    recomputed_tokens: int | None = None
    policy_options: dict[str, Any] | None = None
    tier_hit_blocks: dict[str, int] | None = None  # {tier: hit blocks served from it (fastest holder)}
    demotions: int = 0
    tier_policies: dict[str, str] | None = None  # {tier: policy label}; lower tiers may differ from `policy`
    write_policy: str = "write_through"  # the store's write policy the replay modelled (several tiers)


def records(points: Sequence[Point], infinite_rate: float) -> list[dict[str, Any]]:
    """JSON-ready dicts, with the LRU-to-OPT gap closed per capacity when both were run."""
    by_cap: dict[int, dict[str, float]] = {}
    for p in points:
        by_cap.setdefault(p.capacity_blocks, {})[p.policy] = p.block_hit_rate
    out = []
    for p in points:
        rates = by_cap[p.capacity_blocks]
        gap = None
        if "lru" in rates and "opt" in rates and rates["opt"] - rates["lru"] > 1e-12:
            gap = (p.block_hit_rate - rates["lru"]) / (rates["opt"] - rates["lru"])
        rec: dict[str, Any] = {
            "policy": p.policy,
            "policy_options": dict(p.policy_options or {}),
            "capacity_fraction": p.capacity_fraction,
            "capacity_blocks": p.capacity_blocks,
            "requests": p.requests,
            "block_references": p.block_references,
            "block_hits": p.block_hits,
            "block_hit_rate": p.block_hit_rate,
            "token_hit_rate": p.token_hit_rate,
            "infinite_block_hit_rate": infinite_rate,
            "gap_closed": gap,
            "tier_hit_blocks": dict(p.tier_hit_blocks) if p.tier_hit_blocks is not None else None,
            "tier_policies": dict(p.tier_policies) if p.tier_policies is not None else None,
            "demotions": p.demotions,
            "write_policy": p.write_policy,
            "elapsed_s": round(p.elapsed_s, 4),
            "accesses_per_s": round(p.block_references / p.elapsed_s) if p.elapsed_s > 0 else None,
        }
        if p.ttft_s is not None:
            ms = p.ttft_s * 1e3
            rec.update(
                ttft_mean_ms=float(ms.mean()) if len(ms) else 0.0,
                ttft_p50_ms=float(np.percentile(ms, 50)) if len(ms) else 0.0,
                ttft_p90_ms=float(np.percentile(ms, 90)) if len(ms) else 0.0,
                ttft_p99_ms=float(np.percentile(ms, 99)) if len(ms) else 0.0,
                loaded_bytes=p.loaded_bytes,
                recomputed_tokens=p.recomputed_tokens,
            )
        out.append(rec)
    return out


def format_table(recs: Sequence[dict[str, Any]], title: str) -> str:
    """The terminal table, one row per record. With several tiers it adds one column per tier: the
    share of block references served from that tier ("disk hit"), and, where a lower tier runs a
    policy other than the row's, says which (``lru+disk:lru``); one tier gives the plain table."""
    has_ttft = any("ttft_p50_ms" in r for r in recs)
    tiers: list[str] = []
    for r in recs:
        tiers += [t for t in r.get("tier_hit_blocks") or {} if t not in tiers]
    per_tier = len(tiers) > 1
    head = ["policy", "capacity", "blocks", "block hit", "token hit", "gap closed"]
    if per_tier:
        head += [f"{t} hit" for t in tiers]
    if has_ttft:
        head += ["TTFT p50", "TTFT p99"]
    head += ["M acc/s"]
    rows = []
    for r in recs:
        cap = f"{r['capacity_fraction'] * 100:g}%" if r["capacity_fraction"] is not None else "-"
        gap = "-" if r["gap_closed"] is None else f"{r['gap_closed'] * 100:.0f}%"
        label = r["policy"]
        if per_tier:
            own = (r.get("tier_policies") or {}).items()
            label += "".join(f"+{t}:{pol}" for t, pol in own if pol != r["policy"])
        row = [label, cap, f"{r['capacity_blocks']:,}", f"{r['block_hit_rate'] * 100:.2f}%",
               f"{r['token_hit_rate'] * 100:.2f}%", gap]
        if per_tier:
            refs = r["block_references"] or 1
            row += [f"{(r.get('tier_hit_blocks') or {}).get(t, 0) / refs * 100:.2f}%" for t in tiers]
        if has_ttft:
            row += [f"{r.get('ttft_p50_ms', 0):.0f} ms", f"{r.get('ttft_p99_ms', 0):.0f} ms"]
        row += [f"{(r['accesses_per_s'] or 0) / 1e6:.2f}"]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def write_json(recs: Sequence[dict[str, Any]], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(list(recs), f, indent=1, allow_nan=False)  # NaN/Infinity are not JSON
        f.write("\n")


# Per-tier dicts of a record and the prefix of their CSV columns (one column per tier).
_CSV_PER_TIER = {"tier_hit_blocks": "hit_blocks_", "tier_policies": "policy_", "loaded_bytes": "loaded_bytes_"}


def csv_row(rec: dict[str, Any]) -> dict[str, Any]:
    """One record flattened for CSV: per-tier dicts become ``<prefix><tier>`` columns, in place;
    ``policy_options`` is dropped (its content is in the ``policy`` label)."""
    row: dict[str, Any] = {}
    for k, v in rec.items():
        if k == "policy_options":
            continue
        if k in _CSV_PER_TIER:
            for tier, value in (v or {}).items():
                row[_CSV_PER_TIER[k] + tier] = value
        else:
            row[k] = v
    return row


def write_csv(recs: Sequence[dict[str, Any]], path: str) -> None:
    rows = [csv_row(r) for r in recs]
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow(row)


PLOT_INSTALL_HINT = "pip install 'radixkv[sim]'"


def check_plot_backend() -> None:
    """Raise ConfigError naming the install command if matplotlib cannot be imported (checked before a
    sweep that may take minutes, not when :func:`plot` runs after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--plot needs matplotlib, which cannot be imported ({e}); install it with "
                          f"{PLOT_INSTALL_HINT} (or pip install matplotlib), or drop --plot") from None


def plot(points: Sequence[Point], infinite_rate: float, path: str, title: str) -> None:
    """Miss-ratio curves (hit rate vs capacity per policy) and, with a model, TTFT CDFs.

    Needs matplotlib (the ``sim`` extra); :func:`check_plot_backend` checks for it up front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ttft = [p for p in points if p.ttft_s is not None]
    fig, axes = plt.subplots(1, 2 if with_ttft else 1, figsize=(12 if with_ttft else 6.5, 4.5), squeeze=False)
    ax = axes[0][0]
    for pol in dict.fromkeys(p.policy for p in points):
        pts = sorted((p.capacity_blocks, p.block_hit_rate) for p in points if p.policy == pol)
        ax.plot([c for c, _ in pts], [h * 100 for _, h in pts], marker="o", label=pol)
    ax.axhline(infinite_rate * 100, color="grey", linestyle="--", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if with_ttft:
        ax2 = axes[0][1]
        biggest = max(p.capacity_blocks for p in with_ttft)
        smallest = min(p.capacity_blocks for p in with_ttft)
        for p in with_ttft:
            if p.capacity_blocks != smallest:
                continue
            ms = np.sort(p.ttft_s * 1e3)
            ax2.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{p.policy} @ {p.capacity_blocks:,} blocks")
        ax2.set_xscale("log")
        ax2.set_xlabel("TTFT (ms)")
        ax2.set_ylabel("fraction of requests")
        ax2.set_title(f"TTFT CDF at the smallest capacity (largest: {biggest:,} blocks)")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
