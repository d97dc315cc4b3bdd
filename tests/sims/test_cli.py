from __future__ import annotations

import csv
import json

import pytest

from radixkv.sims import cli


def test_sim_json_csv_plot(tmp_path, capsys):
    out_json, out_csv, out_png = tmp_path / "o.json", tmp_path / "o.csv", tmp_path / "o.png"
    rc = cli.main([
        "--workload", "chat", "--requests", "250", "--capacity", "5%,40", "--policy", "lru,agedref,opt",
        "--json", str(out_json), "--csv", str(out_csv), "--plot", str(out_png), "--jobs", "1", "--no-progress",
    ])
    assert rc == 0
    table = capsys.readouterr().out
    assert "infinite cache" in table and "agedref" in table
    recs = json.loads(out_json.read_text())
    assert len(recs) == 6
    for r in recs:
        for field in ("policy", "capacity_fraction", "capacity_blocks", "requests", "block_references",
                      "block_hits", "block_hit_rate", "token_hit_rate", "ttft_p50_ms", "ttft_p99_ms"):
            assert field in r
        assert 0.0 <= r["block_hit_rate"] <= r["infinite_block_hit_rate"] <= 1.0
        assert r["requests"] == 250
    by = {(r["policy"], r["capacity_blocks"]): r for r in recs}
    frac = [r for r in recs if r["capacity_fraction"] is not None]
    absolute = [r for r in recs if r["capacity_fraction"] is None]
    assert {r["capacity_fraction"] for r in frac} == {0.05} and {r["capacity_blocks"] for r in absolute} == {40}
    for (pol, cap), r in by.items():
        assert r["block_hits"] <= by[("opt", cap)]["block_hits"]
        if r["gap_closed"] is not None and pol in ("lru", "opt"):
            assert r["gap_closed"] == (0.0 if pol == "lru" else 1.0)
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 6 and rows[0]["policy"] == "lru"
    assert out_png.stat().st_size > 10_000


def test_sim_tiers_and_bytes(tmp_path, capsys):
    rc = cli.main(["--workload", "agentic", "--requests", "150", "--capacity", "2GiB", "--tiers", "mem@50,disk=30%@7",
                   "--policy", "lru,opt", "--model", "qwen2.5-7b", "--jobs", "1", "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "opt models a single tier" in captured.err
    # 2 GiB / (256 tokens x 56 KiB) = 146 blocks
    assert " 146 " in captured.out


def test_sim_errors_name_the_value(capsys):
    assert cli.main(["--workload", "chat", "--requests", "20", "--policy", "lru,fifo-ish"]) == 2
    assert "fifo-ish" in capsys.readouterr().err
    # opt alone with several tiers: a reason, not "a sweep needs at least one policy"
    assert cli.main(["--workload", "chat", "--requests", "20", "--policy", "opt", "--tiers", "mem,disk=25%"]) == 2
    assert "models a single tier" in capsys.readouterr().err
    assert cli.main(["--workload", "chat", "--requests", "20", "--capacity", "1GiB", "--model", "none"]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli.main(["--trace", "/nonexistent/trace.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_defaults_are_the_documented_ones():
    args = cli.build_parser().parse_args([])
    assert args.trace is None and args.workload is None  # -> the default "mix" workload
    assert args.capacity == "1%,5%,10%,25%" and args.policy.split(",")[0] == "lru" and "opt" in args.policy


def test_radixkv_console_dispatches_sim(capsys):
    from radixkv.cli import main

    assert main(["sim", "--workload", "rag", "--requests", "60", "--capacity", "10%", "--policy", "lru",
                 "--model", "none", "--jobs", "1", "--no-progress"]) == 0
    assert "rag(seed=0,n=60)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--seed", "-1"], "seed=-1"),
        (["--capacity", "inf%"], "inf%"),
        (["--limit", "5"], "--limit"),  # --limit with a workload
        (["--trace", ""], "--trace"),
        (["--json", ""], "--json"),
        (["--block-tokens", "0"], "block_tokens=0"),
        (["--jobs", "0"], "--jobs 0"),
        (["--rate", "0"], "--rate 0"),
        (["--rate", "inf"], "--rate inf"),
        (["--tiers", "mem=99%"], "--capacity"),
        (["--tiers", "mem,foo=25%"], "'foo'"),
        (["--model", "layers=32,layers=8,kv_heads=8,head_dim=128"], "layers twice"),
        (["--model", "layers=32,kv_heads=8,head_dim=128,prefill_tps=inf"], "finite"),
        (["--json", "/nonexistent/dir/x.json"], "does not exist"),
        (["--csv", "."], "is a directory"),
        (["--plot", "out.notanimage"], ".png"),
    ],
)
def test_bad_arguments_are_one_line_errors_before_the_sweep(argv, named, capsys):
    # Each was a traceback or a silently different run; output paths are checked before the sweep.
    rc = cli.main(["--requests", "30", "--policy", "lru", "--model", "none", "--no-progress", "--jobs", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and named in err, err


def test_limit_on_a_trace(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                                     "hash_ids": [0, i + 1]}) + "\n" for i in range(5)))
    assert cli.main(["--trace", str(p), "--limit", "0", "--model", "none"]) == 2
    assert "--limit 0" in capsys.readouterr().err
    assert cli.main(["--trace", str(p), "--limit", "3", "--model", "none", "--policy", "lru", "--capacity", "2",
                     "--no-progress", "--jobs", "1"]) == 0
    assert "3 requests" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--requests", "50"], ["--seed", "3"], ["--requests", "50", "--seed", "3"],
                                   ["--arrivals", "steady"], ["--rate", "1"]])
def test_workload_options_with_a_trace_are_errors_not_ignored(tmp_path, extra, capsys):
    # They were silently ignored: the run replayed the whole trace as if they were not given.
    p = tmp_path / "t.jsonl"
    p.write_text("".join(f'{{"timestamp": {i}, "input_length": 1024, "output_length": 1, "hash_ids": [0, {i + 1}]}}\n'
                         for i in range(5)))
    rc = cli.main(["--trace", str(p), "--model", "none", "--policy", "lru", "--capacity", "2", "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and extra[0] in err and "--limit" in err, err


def test_a_trace_that_is_not_a_regular_file_says_so(capsys):
    # /dev/null was reported as a file that "does not exist".
    rc = cli.main(["--trace", "/dev/null", "--model", "none", "--policy", "lru", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a regular file" in err and "Traceback" not in err, err


def test_write_policy_is_the_stores_default_and_can_be_write_back(tmp_path, capsys):
    """With several tiers the replay models the store's write_policy, write_through unless told:
    every new block reaches the disk when written, so a disk no larger than memory holds only what
    memory holds and serves nothing (before, the simulator always modelled write_back and counted
    that disk as extra capacity). Records say which was modelled."""
    out = tmp_path / "o.json"
    argv = ["--workload", "chat", "--requests", "300", "--capacity", "2%", "--policy", "lru",
            "--tiers", "mem,disk=2%", "--model", "none", "--jobs", "1", "--no-progress", "--json", str(out)]
    assert cli.main(argv) == 0
    through = json.loads(out.read_text())[0]
    assert cli.main([*argv, "--write-policy", "write_back"]) == 0
    back = json.loads(out.read_text())[0]
    assert (through["write_policy"], back["write_policy"]) == ("write_through", "write_back")
    assert through["tier_hit_blocks"]["disk"] == 0 and back["tier_hit_blocks"]["disk"] > 0
    assert back["block_hits"] > through["block_hits"] and back["demotions"] > through["demotions"]
    capsys.readouterr()
    assert cli.main(["--workload", "chat", "--requests", "30", "--write-policy", "write_back", "--model", "none",
                     "--jobs", "1", "--no-progress"]) == 0
    assert "--write-policy write_back decides how blocks reach lower tiers" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the choices
        cli.main([*argv, "--write-policy", "write-back"])
    assert "write_through" in capsys.readouterr().err


def test_arrivals_steady_names_itself_in_the_title(capsys):
    argv = ["--workload", "agentic", "--requests", "200", "--capacity", "5%", "--policy", "lru", "--model", "none",
            "--jobs", "1", "--no-progress"]
    assert cli.main([*argv, "--arrivals", "steady"]) == 0
    assert "agentic(seed=0,n=200,arrivals=steady)" in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert "agentic(seed=0,n=200):" in capsys.readouterr().out  # burst, the default: named as before
    with pytest.raises(SystemExit):  # argparse names the choices
        cli.main([*argv, "--arrivals", "poisson"])
    assert "steady" in capsys.readouterr().err
