"""The Mooncake synthetic trace: a second real trace, not used while designing agedref and oddsref.

Its policies' results are pinned as documented (docs/policy-research.md, "On a trace it was not
designed on"): oddsref above LRU at every capacity of the sweep, agedref below LRU at 10 %, no online
policy above OPT."""

from __future__ import annotations

import pytest

from radixkv.sims.sweep import parse_capacity, run_sweep

CAPS = ["1%", "5%", "10%", "25%", "50%"]
BLOCKS = [439, 2196, 4392, 10981, 21962]
TOL = 0.05 / 100
# block hit rates in %, radixkv sim --trace tests/data/mooncake_synthetic.jsonl.xz (twenty-ninth session;
# oddsref with its long-gap guard since the thirty-third)
LRU = [3.81, 15.66, 26.23, 44.41, 58.88]
AGEDREF = [4.24, 15.67, 26.02, 46.67, 59.76]
ODDSREF = [4.22, 16.02, 26.48, 47.08, 59.76]
OPT = [18.54, 39.56, 50.63, 62.60, 63.96]


def test_trace_statistics(mooncake_synthetic_trace):
    t = mooncake_synthetic_trace
    assert (len(t), t.block_references, t.unique_blocks) == (3_993, 121_877, 43_924)
    assert t.infinite_hit_blocks() / t.block_references == pytest.approx(0.6396, abs=0.0001)
    assert [parse_capacity(c, t.unique_blocks, None).blocks for c in CAPS] == BLOCKS


def test_policies_on_a_trace_they_were_not_designed_on(mooncake_synthetic_trace):
    t = mooncake_synthetic_trace
    caps = [parse_capacity(c, t.unique_blocks, None) for c in CAPS]
    points = run_sweep(t, ["lru", "agedref", "oddsref", "opt"], caps, jobs=2)
    got = {p.policy: [] for p in points}
    for p in sorted(points, key=lambda p: p.capacity_blocks):
        got[p.policy].append(p.block_hit_rate)
    for name, want in (("lru", LRU), ("agedref", AGEDREF), ("oddsref", ODDSREF), ("opt", OPT)):
        assert got[name] == pytest.approx([w / 100 for w in want], abs=TOL), name
    assert all(o > lru for o, lru in zip(got["oddsref"], got["lru"])), "oddsref below LRU somewhere"
    for name in ("lru", "agedref", "oddsref"):
        assert all(h <= opt for h, opt in zip(got[name], got["opt"])), f"{name} above OPT"
