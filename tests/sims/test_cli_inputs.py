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


_MC = [{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
       {"timestamp": 5, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 3]}]


def _mooncake(tmp_path, name="mc.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in _MC))
    return path


def _sim(args, capsys):
    rc = main([*args, "--model", "none", "--jobs", "1", "--no-progress"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--csv", "{trace}"], ["--json", "{trace}"], ["--json", "{out}", "--csv", "{out}"],
                                   ["--json", "{out}", "--plot", "{out}"]])
def test_an_output_naming_the_trace_or_another_output_is_refused(tmp_path, capsys, flags):
    trace = _mooncake(tmp_path)
    before = trace.read_bytes()
    args = [f.format(trace=trace, out=tmp_path / "out.png") for f in flags]
    rc, err = _sim(["--trace", str(trace), "--capacity", "1", "--policy", "lru", *args], capsys)
    assert rc == 2 and "the output would overwrite it" in err, err
    assert trace.read_bytes() == before  # the trace is untouched
    assert not (tmp_path / "out.png").exists()


def test_a_capacity_named_twice_is_refused(tmp_path, capsys):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1,5%,1", "--policy", "lru"], capsys)
    assert rc == 2 and "--capacity names '1' twice" in err, err


def test_an_unreadable_trace_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    # (chmod 000 does not stop root, who runs CI: the open itself is made to fail)
    path = _mooncake(tmp_path)
    real_open = open

    def deny(file, *a, **k):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(InputError, match=r"cannot read trace .*mc\.jsonl.*Permission denied"):
        read_trace(str(path))


def test_a_json_line_nested_too_deep_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(_MC[0]) + "\n" + '{"hash_ids":' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(InputError, match=r"deep\.jsonl:2: not valid JSON"):
        read_trace(str(path))


def test_limit_on_a_radixkv_trace_without_header_never_parses_the_line_after(tmp_path):
    # A garbled tail past --limit must not abort the run (as with a Mooncake trace).
    path = tmp_path / "rk.jsonl"
    path.write_text('{"block_keys": ["a"]}\n{"block_keys": ["a", "b"]}\n{"block_keys": ["a", "b"\n')
    trace = read_trace(str(path), limit=2)
    assert [r.block_keys for r in trace.requests] == [["a"], ["a", "b"]]
    path.write_text('{"radixkv_trace": 1, "block_tokens": 16}\n{"block_keys": ["a"]}\n{"block_keys": [\n')
    trace = read_trace(str(path), limit=1)
    assert trace.block_tokens == 16 and len(trace.requests) == 1
    with pytest.raises(InputError, match="limit=0 must be a positive number"):
        read_trace(str(path), limit=0)


@pytest.mark.parametrize(
    "capacity, message",
    [("-1", "capacity '-1' must be at least 1 block"), ("0", "must be at least 1 block"),
     ("9999999999999999PiB", "too large to be a byte size")],
)
def test_capacity_errors_say_what_is_wrong(capacity, message):
    with pytest.raises(ConfigError, match=message):
        parse_capacity(capacity, 1000, 4096)


def test_a_bandwidth_that_overflows_is_a_tiers_error(tmp_path, capsys):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1", "--policy", "lru",
                    "--tiers", "mem,disk=25%@1e308"], capsys)
    assert rc == 2 and "--tiers: tier 'disk=25%@1e308': bandwidth '1e308' must be a finite number" in err, err


def test_a_block_size_past_the_trees_bound_is_an_error_naming_the_header(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"radixkv_trace": 1, "block_tokens": 1000000000000000}\n{"block_keys": ["a"]}\n')
    with pytest.raises(InputError, match=r"h\.jsonl:1: header field 'block_tokens'=1000000000000000 must be "
                                         r"a positive integer below 2\*\*48"):
        read_trace(str(path))


@pytest.mark.parametrize("policy", ["agedref:ghost_factor=inf", "oddsref:odds_weight=nan"])
def test_a_non_finite_policy_option_is_refused(policy, tmp_path, capsys):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1", "--policy", policy,
                    "--json", str(tmp_path / "o.json")], capsys)
    assert rc == 2 and "must be a finite number" in err, err


def test_a_prefill_speed_below_one_token_per_second_is_refused_and_json_stays_json(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"prefill_tokens_per_s=1e-320 must be a finite number >= 1"):
        parse_model("layers=32,kv_heads=8,head_dim=128,prefill_tps=1e-320")
    out = tmp_path / "o.json"
    rc = main(["--trace", str(_mooncake(tmp_path)), "--capacity", "1", "--policy", "lru", "--model",
               "layers=32,kv_heads=8,head_dim=128,prefill_tps=1", "--jobs", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
