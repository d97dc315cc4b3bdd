from __future__ import annotations

import csv
import json

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
