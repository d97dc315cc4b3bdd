from __future__ import annotations

import math

import pytest

from radixkv.errors import ConfigError
from radixkv.sims.workloads import ARRIVALS, WORKLOADS, WorkloadConfig, generate


@pytest.mark.parametrize("arrivals", ARRIVALS)
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_is_seeded_prefix_closed_and_sized(name, arrivals):
    cfg = WorkloadConfig(requests=300, block_tokens=128, seed=3, arrivals=arrivals)
    a, b = generate(name, cfg), generate(name, cfg)
    assert [r.block_keys for r in a.requests] == [r.block_keys for r in b.requests]
    assert len(a) == 300
    a.check_integrity()
    for r in a.requests:
        assert len(r.block_keys) == -(-r.input_tokens // 128)
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times) and times[0] == 0.0
    other = generate(name, WorkloadConfig(requests=300, block_tokens=128, seed=4, arrivals=arrivals))
    assert [r.block_keys for r in other.requests] != [r.block_keys for r in a.requests]
    # Every workload has prefix reuse to cache.
    assert a.infinite_hit_blocks() > 0.2 * a.block_references


def _starts(trace) -> list[int]:
    # Index of each session's first request (every request of a workload without sessions).
    seen: set[str] = set()
    out = []
    for i, r in enumerate(trace.requests):
        if r.session is None or r.session not in seen:
            out.append(i)
            if r.session is not None:
                seen.add(r.session)
    return out


@pytest.mark.parametrize("name", ["chat", "agentic", "mix"])
def test_steady_arrivals_keep_starting_sessions_to_the_end(name):
    # burst: every session starts early and the rest of the trace plays them out (chat: the last of
    # 1,500 requests' conversations starts at request 455); steady: new sessions start throughout, at
    # about the same rate in each half of the trace.
    burst = generate(name, WorkloadConfig(requests=1500, seed=1))
    steady = generate(name, WorkloadConfig(requests=1500, seed=1, arrivals="steady"))
    if name != "mix":  # (mix's rag queries start throughout either way)
        assert _starts(burst)[-1] < 600
    starts = _starts(steady)
    assert starts[-1] >= 1450
    first_half = sum(1 for i in starts if i < 750)
    assert 0.3 < (len(starts) - first_half) / first_half < 1.5, (first_half, len(starts))
    if name == "mix":  # each part at its own rate over one window: all three to the end
        tail = {r.tenant for r in steady.requests[1400:]}
        assert tail == {"chat", "rag", "agent"}, tail


def test_burst_arrivals_are_the_default_and_unchanged():
    # The default keeps every earlier result reproducible: chat, seed 1, as sized before arrivals existed.
    t = generate("chat", WorkloadConfig(requests=1500, seed=1))
    assert t.name == "chat(seed=1,n=1500)"
    assert WorkloadConfig().arrivals == "burst"
    assert (len(t), t.unique_blocks, t.block_references) == (1500, 4598, 21843)


def test_unknown_workload_and_bad_config():
    with pytest.raises(ConfigError, match="choose one of"):
        generate("nope")
    with pytest.raises(ConfigError, match="requests"):
        WorkloadConfig(requests=0)
    with pytest.raises(ConfigError, match="arrivals='poisson' must be one of burst, steady"):
        WorkloadConfig(arrivals="poisson")
    for bad in (0.0, -1.0, math.inf, math.nan):  # inf started every session at t=0: steady never ended
        with pytest.raises(ConfigError, match="rate_per_s=.* must be a finite number of sessions per second"):
            WorkloadConfig(rate_per_s=bad)


@pytest.mark.parametrize("name", ["chat", "agentic"])
def test_a_lower_rate_stretches_a_steady_window(name):
    # Same requests, sessions starting half as often: the window lasts longer, and each session has
    # more of its requests in it (its turns come at the same think times).
    fast = generate(name, WorkloadConfig(requests=1500, seed=1, arrivals="steady"))
    slow = generate(name, WorkloadConfig(requests=1500, seed=1, arrivals="steady", rate_per_s=2.0))
    assert slow.requests[-1].arrival_s > 1.4 * fast.requests[-1].arrival_s
    assert len(_starts(slow)) < len(_starts(fast))
