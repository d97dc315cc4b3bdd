"""agedref and oddsref (default parameters) do not lose to LRU on the synthetic workloads at 1-10 %.

At 25 % the two are within a few tenths of a point and the sign can depend on the seed (the earlier
parameters, gap_quantile=0.4 and count_weight=1, lost 0.23 points on agentic, seed 1), see
docs/policy-research.md."""

from __future__ import annotations

import pytest

from radixkv.sims.sweep import parse_capacity, run_sweep
from radixkv.sims.workloads import WORKLOADS, WorkloadConfig, generate


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_agedref_and_oddsref_at_least_lru(name):
    trace = generate(name, WorkloadConfig(requests=1500, seed=1))
    caps = [parse_capacity(c, trace.unique_blocks, None) for c in ("1%", "5%", "10%")]
    points = run_sweep(trace, ["lru", "agedref", "oddsref"], caps, jobs=1)
    lru = {p.capacity_blocks: p.block_hits for p in points if p.policy == "lru"}
    for p in points:
        if p.policy != "lru":
            assert p.block_hits >= lru[p.capacity_blocks], (p.policy, name, p.capacity_blocks)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_oddsref_above_lru_on_another_seed(name):
    # seed 2: oddsref's margins over LRU at 1-10 % are +179 blocks (chat, 10 %) or more.
    trace = generate(name, WorkloadConfig(requests=1500, seed=2))
    caps = [parse_capacity(c, trace.unique_blocks, None) for c in ("1%", "5%", "10%")]
    points = run_sweep(trace, ["lru", "oddsref"], caps, jobs=1)
    lru = {p.capacity_blocks: p.block_hits for p in points if p.policy == "lru"}
    for p in points:
        if p.policy == "oddsref":
            assert p.block_hits > lru[p.capacity_blocks], (name, p.capacity_blocks)


def test_oddsref_long_gap_guard_on_agent_loops_at_25_percent():
    # Without the guard oddsref (and agedref) lose to LRU here (-368 and -319 blocks): LRU's turnover
    # outlasts nearly every step gap, yet returning task contexts push H, hence the count bonus, up
    # until fresh chunks are evicted in the request that made them (docs/policy-research.md, "The
    # long-gap guard"). With it oddsref is above LRU.
    trace = generate("agentic", WorkloadConfig(requests=1500, seed=2))
    cap = parse_capacity("25%", trace.unique_blocks, None)
    points = run_sweep(trace, ["lru", "oddsref", "oddsref:long_gap_share=0"], [cap], jobs=1)
    hits = {p.policy: p.block_hits for p in points}
    assert hits["oddsref:long_gap_share=0"] < hits["lru"] < hits["oddsref"], hits


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_agedref_and_oddsref_above_lru_with_steady_arrivals(name):
    # Sessions keep starting for the whole trace (WorkloadConfig.arrivals="steady"), so no trace ends
    # in a stretch of sessions playing out with none starting, where every loss to LRU of these
    # policies on the default (burst) workloads lies (docs/policy-research.md). Here both are above
    # LRU at every capacity up to 25 % (seed 1: by +58 blocks, chat at 5 %, or more; seeds 0-6: at
    # all 112 points).
    trace = generate(name, WorkloadConfig(requests=1500, seed=1, arrivals="steady"))
    caps = [parse_capacity(c, trace.unique_blocks, None) for c in ("1%", "5%", "10%", "25%")]
    points = run_sweep(trace, ["lru", "agedref", "oddsref"], caps, jobs=1)
    lru = {p.capacity_blocks: p.block_hits for p in points if p.policy == "lru"}
    for p in points:
        if p.policy != "lru":
            assert p.block_hits > lru[p.capacity_blocks], (p.policy, name, p.capacity_blocks)
