"""Correctness gates on the real Mooncake conversation trace (512-token blocks).

Reference values (issue 4, computed independently): block hit rates at 1/5/10/25/50 % of the
182,790 unique blocks. The replay must match them within 0.05 percentage points."""

from __future__ import annotations

import pytest

from radixkv.sims.sweep import parse_capacity, run_sweep

CAPS = ["1%", "5%", "10%", "25%", "50%"]
BLOCKS = [1828, 9140, 18279, 45698, 91395]
LRU = [5.25, 19.58, 27.89, 35.35, 36.31]
OPT = [24.64, 36.64, 36.64, 36.64, 36.64]
TOL = 0.05 / 100


def test_trace_statistics(mooncake_trace):
    t = mooncake_trace
    assert (len(t), t.block_references, t.unique_blocks) == (12_031, 288_500, 182_790)
    assert t.infinite_hit_blocks() / t.block_references == pytest.approx(0.366, abs=TOL + 0.0005)
    assert [parse_capacity(c, t.unique_blocks, None).blocks for c in CAPS] == BLOCKS


@pytest.mark.slow
def test_lru_and_opt_match_the_reference(mooncake_trace):
    caps = [parse_capacity(c, mooncake_trace.unique_blocks, None) for c in CAPS]
    points = run_sweep(mooncake_trace, ["lru", "opt"], caps, jobs=2)
    got = {(p.policy, p.capacity_blocks): p.block_hit_rate for p in points}
    for blocks, lru, opt in zip(BLOCKS, LRU, OPT):
        assert got[("lru", blocks)] == pytest.approx(lru / 100, abs=TOL), ("lru", blocks)
        assert got[("opt", blocks)] == pytest.approx(opt / 100, abs=TOL), ("opt", blocks)


@pytest.mark.slow
def test_agedref_beats_lru_at_small_capacities(mooncake_trace):
    """The documented agedref results (docs/policy-research.md): above LRU at 1 / 5 / 10 %."""
    caps = [parse_capacity(c, mooncake_trace.unique_blocks, None) for c in CAPS[:3]]
    points = run_sweep(mooncake_trace, ["agedref"], caps, jobs=2)
    got = [p.block_hit_rate for p in points]
    assert got == pytest.approx([0.0912, 0.2197, 0.2937], abs=TOL)
    assert all(g > lru / 100 for g, lru in zip(got, LRU))


@pytest.mark.slow
def test_oddsref_results_on_the_trace(mooncake_trace):
    """The documented oddsref results (docs/policy-research.md): above agedref's and LRU's at 1 / 5 /
    10 %, 20 % of the LRU-to-OPT gap at 10 % (the issue's 30 / 20 % targets at 1 / 5 % are not met)."""
    caps = [parse_capacity(c, mooncake_trace.unique_blocks, None) for c in CAPS[:3]]
    points = run_sweep(mooncake_trace, ["oddsref"], caps, jobs=2)
    got = [p.block_hit_rate for p in points]
    assert got == pytest.approx([0.0924, 0.2278, 0.2970], abs=TOL)
    assert all(g > agedref for g, agedref in zip(got, [0.0912, 0.2197, 0.2937]))
    gap_closed = [(g - lru / 100) / ((opt - lru) / 100) for g, lru, opt in zip(got, LRU, OPT)]
    assert gap_closed[2] >= 0.20 and all(0 < c < 1 for c in gap_closed)
