"""The compiled one-tier replay loop (radixkv.replay_loop) against the replay's Python loop.

One tier replays in ``radixkv.replay_loop`` (``radixkv.sims.replay._COMPILED_ONE_TIER``); the Python
loop that replays several tiers replays one tier too when that switch is off. Both must give the same
counts, request by request, for every policy, with partial last blocks, OPT's oracle, an unbounded
tier, integrity checks and a progress bar."""

from __future__ import annotations

import pytest

import radixkv.sims.replay as replay_mod
from radixkv.policies import POLICIES
from radixkv.sims.replay import UNBOUNDED, TierCapacity, replay
from radixkv.sims.traces import Request, Trace
from radixkv.sims.workloads import WorkloadConfig, generate


def _both(monkeypatch, trace, policy, capacity, **kw):
    out = []
    for compiled in (True, False):
        monkeypatch.setattr(replay_mod, "_COMPILED_ONE_TIER", compiled)
        r = replay(trace, policy, [TierCapacity("mem", capacity)], **kw)
        out.append((r.block_references, r.block_hits, r.input_tokens, r.token_hits, r.evictions,
                    r.hit_blocks.tolist(), r.tier_hit_blocks.tolist(), r.tree_stats))
    return out


@pytest.mark.parametrize("policy", sorted(set(POLICIES) | {"opt"}))
@pytest.mark.parametrize("workload, seed", [("mix", 0), ("chat", 1), ("agentic", 2)])
def test_the_compiled_loop_replays_like_the_python_loop(monkeypatch, policy, workload, seed):
    trace = generate(workload, WorkloadConfig(requests=400, seed=seed, block_tokens=64))
    for capacity in (max(4, trace.unique_blocks // 50), max(8, trace.unique_blocks // 8), UNBOUNDED):
        compiled, python = _both(monkeypatch, trace, policy, capacity)
        assert compiled == python, (policy, workload, capacity)


def test_partial_blocks_empty_requests_checks_and_progress(monkeypatch):
    # Hand-made: a partial last block inserted on its own, then cached (a full hit), a one-block
    # partial request, an empty request, integrity checks after every request and a progress bar.
    reqs = [
        Request(0.0, 250, 1, ["a", "b", "c"]),  # 2 full blocks of 100 tokens + 50
        Request(1.0, 250, 1, ["a", "b", "c"]),  # the same: wholly hit, partial block included
        Request(2.0, 0, 1, []),
        Request(3.0, 40, 1, ["x"]),  # one partial block
        Request(4.0, 300, 1, ["a", "b", "d"]),
        Request(5.0, 230, 1, ("a", "b", "e")),  # a tuple of keys (a Trace built by hand)
    ]
    trace = Trace(name="hand", block_tokens=100, requests=reqs)
    for policy in ("lru", "agedref", "opt"):
        for capacity in (2, 3, UNBOUNDED):
            compiled, python = _both(monkeypatch, trace, policy, capacity, check_every=1, progress=True)
            assert compiled == python, (policy, capacity)
    monkeypatch.setattr(replay_mod, "_COMPILED_ONE_TIER", True)
    r = replay(trace, "lru", [TierCapacity("mem", UNBOUNDED)])
    assert r.hit_blocks.tolist() == [0, 3, 0, 0, 2, 2]
    assert (r.block_references, r.block_hits, r.input_tokens, r.token_hits) == (13, 7, 1070, 250 + 200 + 200)
