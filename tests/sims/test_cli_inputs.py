"""Bad inputs the simulator must name up front (the line, the field, the option), exact byte
capacities, and the sweep's process count."""

from __future__ import annotations

import json

import pytest

from radixkv.errors import ConfigError, InputError
from radixkv.sims import sweep
from radixkv.sims.cli import main
from radixkv.sims.model import MODEL_PRESETS, parse_model, parse_size_bytes
from radixkv.sims.sweep import parse_capacity
from radixkv.sims.traces import read_trace
from radixkv.sims.workloads import WorkloadConfig, generate


def test_an_empty_block_key_is_an_error_naming_the_line(tmp_path):
    # The tree refuses an empty key, but only once the sweep runs, without the trace's line.
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"block_keys": ["a", "b"]}) + "\n" + json.dumps({"block_keys": ["a", ""]}) + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl:2: block key '' must be a non-empty string"):
        read_trace(str(path))


@pytest.mark.parametrize(
    "text, message",
    [
        ("layers=32,kv_heads=8,head_dim=1.5", "head_dim=1.5 must be a positive integer"),
        ("layers=32.0,kv_heads=8,head_dim=128", "layers=32.0 must be a positive integer"),
        ("layers=32,kv_heads=8,head_dim=128,prefill_tps=fast", "prefill_tps=fast must be a number of tokens/s"),
        # kv_heads and head_dim are known fields, not "unknown": they conflict with mla_dim
        ("layers=61,mla_dim=576,kv_heads=1,head_dim=128", "mla_dim .* replaces kv_heads and head_dim; drop "
                                                         "head_dim and kv_heads or mla_dim"),
    ],
)
def test_custom_model_errors_name_the_field(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_model(text)


def test_a_tier_named_twice_is_a_tiers_error(capsys):
    rc = main(["--workload", "chat", "--requests", "30", "--tiers", "mem,disk=5%,disk=10%", "--policy", "lru,opt",
               "--capacity", "2", "--model", "none", "--jobs", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--tiers names tier 'disk' twice" in err
    assert "note: opt" not in err  # refused before anything about the sweep is decided


def test_the_sweep_starts_no_more_processes_than_points(monkeypatch):
    started: list[int] = []
    real = sweep.ProcessPoolExecutor

    def pool(max_workers, mp_context):
        started.append(max_workers)
        return real(max_workers=max_workers, mp_context=mp_context)

    monkeypatch.setattr(sweep, "ProcessPoolExecutor", pool)
    trace = generate("chat", WorkloadConfig(requests=40, seed=1))
    points = sweep.run_sweep(trace, ["lru"], [sweep.Capacity(2), sweep.Capacity(5)], jobs=16)
    assert [p.capacity_blocks for p in points] == [2, 5]
    assert started == [2]  # a fork pool starts every worker at once: 16 would be 14 idle forks


@pytest.mark.parametrize(
    "text, block_bytes, blocks",
    [
        ("545.25952GB", MODEL_PRESETS["llama3-8b"].block_bytes(512), 8125),  # exactly 8,125 blocks of 64 MiB
        ("33.73056GB", MODEL_PRESETS["deepseek-v3"].block_bytes(256), 1875),
        ("16710.107136MB", MODEL_PRESETS["llama3-8b"].block_bytes(512), 249),
    ],
)
def test_a_byte_capacity_of_exactly_n_blocks_holds_n(text, block_bytes, blocks):
    # Through a float these sizes came out a byte short and held n - 1 blocks.
    assert parse_capacity(text, 10**6, block_bytes).blocks == blocks
    assert parse_size_bytes("1.001KB") == 1001
