from __future__ import annotations

import pytest

from radixkv.errors import ConfigError
from radixkv.sims.workloads import WORKLOADS, WorkloadConfig, generate


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_is_seeded_prefix_closed_and_sized(name):
    cfg = WorkloadConfig(requests=300, block_tokens=128, seed=3)
    a, b = generate(name, cfg), generate(name, cfg)
    assert [r.block_keys for r in a.requests] == [r.block_keys for r in b.requests]
    assert len(a) == 300
    a.check_integrity()
    for r in a.requests:
        assert len(r.block_keys) == -(-r.input_tokens // 128)
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times) and times[0] == 0.0
    other = generate(name, WorkloadConfig(requests=300, block_tokens=128, seed=4))
    assert [r.block_keys for r in other.requests] != [r.block_keys for r in a.requests]
    # Every workload has prefix reuse to cache.
    assert a.infinite_hit_blocks() > 0.2 * a.block_references


def test_unknown_workload_and_bad_config():
    with pytest.raises(ConfigError, match="choose one of"):
        generate("nope")
    with pytest.raises(ConfigError, match="requests"):
        WorkloadConfig(requests=0)
