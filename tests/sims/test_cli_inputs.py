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


# A radixkv block-key trace's block size is its header's: the keys were cut by the trace's writer.
def _keyed(tmp_path, header, name="k.jsonl"):
    path = tmp_path / name
    rows = [header] + [{"arrival_s": i, "block_keys": ["s1", "s2", f"u{i}"]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_block_tokens_that_differ_from_a_block_key_headers_are_refused(tmp_path, capsys):
    path = _keyed(tmp_path, {"radixkv_trace": 1, "block_tokens": 16})
    assert read_trace(str(path)).requests[0].input_tokens == 48
    assert read_trace(str(path), block_tokens=16).block_tokens == 16  # the header's own value is fine
    with pytest.raises(InputError, match=r"k\.jsonl:2: block_tokens=512 \(--block-tokens\) differs from the "
                                         r"header's block_tokens=16: .*drop --block-tokens \(or give 16\)"):
        read_trace(str(path), block_tokens=512)
    rc, err = _sim(["--trace", str(path), "--block-tokens", "512", "--capacity", "1", "--policy", "lru"], capsys)
    assert rc == 2 and "differs from the header's block_tokens=16" in err, err


def test_block_tokens_still_recut_a_token_id_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"radixkv_trace": 1, "block_tokens": 16}) + "\n"
                    + json.dumps({"token_ids": list(range(64))}) + "\n")
    trace = read_trace(str(path), block_tokens=32)  # token ids are hashed here, at any block size
    assert trace.block_tokens == 32 and len(trace.requests[0].block_keys) == 2


@pytest.mark.parametrize("header, named", [({"radixkv_trace": 1, "block_token": 16}, "'block_token'"),
                                           ({"radixkv_trace": 1, "block_tokens": 16, "tokenizer": "x"},
                                            "'tokenizer'")])
def test_an_unknown_header_field_is_an_error_naming_it(tmp_path, header, named):
    with pytest.raises(InputError, match=rf"k\.jsonl:1: unknown header field\(s\) {named}; a radixkv_trace header "
                                         r"has only 'block_tokens', 'name', 'radixkv_trace'"):
        read_trace(str(_keyed(tmp_path, header)))
    with pytest.raises(InputError, match="unknown header field"):  # also when --block-tokens is given
        read_trace(str(_keyed(tmp_path, header)), block_tokens=16)


def test_a_trace_written_by_write_radixkv_reads_back_at_its_block_size(tmp_path):
    from radixkv.sims.traces import write_radixkv

    src = read_trace(str(_keyed(tmp_path, {"radixkv_trace": 1, "block_tokens": 16})))
    write_radixkv(src, str(tmp_path / "w.jsonl"))  # its header has a 'name'
    again = read_trace(str(tmp_path / "w.jsonl"))
    assert again.block_tokens == 16 and [r.block_keys for r in again.requests] == [r.block_keys for r in src.requests]


@pytest.mark.parametrize("capacities, named", [("5%,5.0%", "'5%' and '5.0%' are both 5% of unique blocks"),
                                               ("1,+1%,1blocks", "'1' and '1blocks' are both 1 block;"),
                                               ("2,2 blocks", "'2' and '2 blocks' are both 2 blocks;")])
def test_a_capacity_named_twice_in_other_words_is_refused(tmp_path, capsys, capacities, named):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", capacities, "--policy", "lru"], capsys)
    assert rc == 2 and f"--capacity names one capacity twice: {named}" in err, err


def test_a_capacity_that_rounds_to_the_same_blocks_is_still_a_point(tmp_path, capsys):
    # 1% and 2% of a tiny trace are both 1 block, but two different shares (two records): not a repeat.
    out = tmp_path / "o.json"
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1%,2%", "--policy", "lru",
                    "--json", str(out)], capsys)
    assert rc == 0, err
    assert [r["capacity_fraction"] for r in json.loads(out.read_text())] == [0.01, 0.02]


@pytest.mark.parametrize("policies", [["s3fifo:small_fraction=0.2", "s3fifo:small_fraction=.2"],
                                      ["oddsref:gap_quantile=0.7:gap_step=0.003",
                                       "oddsref:gap_step=3e-3:gap_quantile=0.70"]])
def test_a_policy_spec_named_twice_in_other_words_is_refused(tmp_path, capsys, policies):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1", "--policy", ",".join(policies)], capsys)
    assert rc == 2 and "name the same spec twice" in err and "one policy, the same options" in err, err


def test_a_spec_identity_tells_bool_from_number():
    from radixkv.sims.policy_spec import PolicySpec

    assert PolicySpec("p:x=true", "p", {"x": True}).identity != PolicySpec("p:x=1", "p", {"x": 1}).identity
    assert PolicySpec("p:x=1", "p", {"x": 1}).identity == PolicySpec("p:x=1.0", "p", {"x": 1.0}).identity


@pytest.mark.parametrize("capacity, digits", [("1e3", "1000"), ("1.0", "1"), ("2e1 blocks", "20")])
def test_a_whole_block_count_not_in_digits_names_the_digits(capacity, digits):
    with pytest.raises(ConfigError, match=rf"capacity '{capacity}' is a block count only when written in digits: "
                                          rf"give {digits} \(blocks\)"):
        parse_capacity(capacity, 5000, None)
    with pytest.raises(ConfigError, match="is not a whole number of blocks"):
        parse_capacity("2.5", 5000, None)


def test_a_lower_tier_block_count_not_in_digits_names_the_digits(tmp_path, capsys):
    rc, err = _sim(["--trace", str(_mooncake(tmp_path)), "--capacity", "1", "--policy", "lru",
                    "--tiers", "mem,disk=1e3"], capsys)
    assert rc == 2 and "tier 'disk': capacity '1e3' is a block count only when written in digits: give 1000" in err, err
