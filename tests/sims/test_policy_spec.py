"""Policy specs (``NAME:KEY=VALUE...``): parsing, validation, and that the options reach the policy."""

from __future__ import annotations

import json
import re

import pytest

from radixkv.errors import ConfigError
from radixkv.sims import cli
from radixkv.sims.policy_spec import parse_policy_spec
from radixkv.sims.sweep import parse_capacity, run_sweep
from radixkv.sims.workloads import WorkloadConfig, generate


def test_parse_names_options_and_label():
    s = parse_policy_spec(" oddsref: gap_quantile=0.7 :gap_step=0.003:odds_weight=2 ")
    assert s.name == "oddsref" and not s.offline
    assert s.options == {"gap_quantile": 0.7, "gap_step": 0.003, "odds_weight": 2}
    assert s.label == "oddsref:gap_quantile=0.7:gap_step=0.003:odds_weight=2"
    assert parse_policy_spec("opt").offline and parse_policy_spec("lru").options == {}


@pytest.mark.parametrize(
    ("spec", "named"),
    [("fifo-ish", "fifo-ish"), ("agedref:gap_quantile", "gap_quantile"), ("agedref:=3", "=3"),
     ("agedref:gap_quantile=2", "gap_quantile=2"), ("agedref:gap_quantile=high", "high"),
     ("lru:bogus=1", "bogus"), ("agedref:count_weight=1:count_weight=0.5", "count_weight")],
)
def test_bad_specs_name_the_culprit(spec, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_policy_spec(spec)


def test_options_reach_the_replayed_policy():
    # odds_weight=0 switches oddsref's one rule off: it must then replay exactly as agedref does,
    # while the default oddsref differs somewhere (so the options did reach the policy).
    trace = generate("rag", WorkloadConfig(requests=600, seed=3))
    caps = [parse_capacity(c, trace.unique_blocks, None) for c in ("2%", "10%")]
    specs = ["agedref", "oddsref:odds_weight=0", "oddsref"]
    points = run_sweep(trace, specs, caps, jobs=1)
    hits = {(p.policy, p.capacity_blocks): p.block_hits for p in points}
    assert {p.policy for p in points} == set(specs)
    for c in caps:
        assert hits[("oddsref:odds_weight=0", c.blocks)] == hits[("agedref", c.blocks)]
    assert any(hits[("oddsref", c.blocks)] != hits[("agedref", c.blocks)] for c in caps)


def test_the_same_spec_twice_is_an_error():
    trace = generate("chat", WorkloadConfig(requests=50, seed=0))
    with pytest.raises(ConfigError, match="twice"):
        run_sweep(trace, ["lru", " lru "], [parse_capacity("5%", trace.unique_blocks, None)], jobs=1)


def test_cli_labels_records_with_the_spec(tmp_path, capsys):
    out = tmp_path / "o.json"
    rc = cli.main(["--workload", "chat", "--requests", "200", "--capacity", "5%", "--model", "none",
                   "--policy", "lru,agedref:gap_quantile=0.7,opt", "--json", str(out), "--jobs", "1",
                   "--no-progress"])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [r["policy"] for r in recs] == ["lru", "agedref:gap_quantile=0.7", "opt"]
    assert [r["policy_options"] for r in recs] == [{}, {"gap_quantile": 0.7}, {}]
    assert "agedref:gap_quantile=0.7" in capsys.readouterr().out
    assert cli.main(["--workload", "chat", "--requests", "20", "--policy", "agedref:gap_quantile=2"]) == 2
    assert "gap_quantile=2" in capsys.readouterr().err
