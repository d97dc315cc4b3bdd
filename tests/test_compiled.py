"""radixkv.compiled: the mypyc build of the tree and policies is built where CI runs, replays exactly
as the Python source does, can be switched off, and a stale build never runs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv import compiled

REPO = Path(__file__).resolve().parents[1]
x86_linux = pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"),
                               reason="the compiled build is checked on x86-64 Linux, where CI runs")


def _run(code: str, **env: str) -> str:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, check=True).stdout


@x86_linux
def test_the_tree_and_policies_are_compiled_on_x86_64_linux():
    """setup.py compiles them with mypyc (optional: an install without mypyc or a compiler runs the
    Python source). Where CI runs they must be compiled: a silent failure would only show as a slower
    simulator and tree. After editing a compiled module, reinstall (``pip install -e .``)."""
    assert compiled.active(), f"the tree and policies run as Python: {compiled.reason()}"
    import radixkv.policy_heap
    import radixkv.tree

    for mod in (radixkv.tree, radixkv.policy_heap):
        assert not mod.__file__.endswith(".py"), mod.__file__
    assert set(compiled.modules()) >= {"radixkv.tree", "radixkv.policies", "radixkv.policy_heap"}


def test_switched_off_by_the_environment():
    code = ("import json, radixkv.compiled as c, radixkv.tree as t, radixkv.policies as p;"
            "print(json.dumps([c.active(), c.reason(), t.__file__, p.__file__]))")
    active, why, tree_file, pol_file = json.loads(_run(code, RADIXKV_COMPILED="0"))
    assert not active and "RADIXKV_COMPILED=0" in why
    assert tree_file.endswith("tree.py") and pol_file.endswith("policies.py")


_REPLAY = """
import hashlib, json, sys
from radixkv import compiled
from radixkv.sims.workloads import WorkloadConfig, generate
from radixkv.sims.replay import replay, TierCapacity
trace = generate("mix", WorkloadConfig(requests=300, block_tokens=64, seed=3))
out = {"compiled": compiled.active()}
for pol in ["lru", "s3fifo", "sieve", "lfu", "cost", "agedref", "oddsref", "opt"]:
    r = replay(trace, pol, [TierCapacity("mem", 150)], check_every=25)
    out[pol] = [r.block_hits, r.evictions, hashlib.sha256(r.hit_blocks.tobytes()).hexdigest()]
r = replay(trace, "agedref", [TierCapacity("mem", 100), TierCapacity("disk", 200)], check_every=25)
out["two-tier"] = [r.block_hits, r.evictions, r.demotions, r.tier_hit_blocks.tolist()]
print(json.dumps(out))
"""


def test_compiled_and_source_replay_identically():
    """Same code, same results: every policy, request by request (and the tree's invariants hold)."""
    src = json.loads(_run(_REPLAY, RADIXKV_COMPILED="0"))
    cur = json.loads(_run(_REPLAY))
    assert src.pop("compiled") is False
    cur.pop("compiled")
    assert cur == src
    assert all(v[0] > 0 for v in cur.values())  # the workload hits, so the comparison means something


def test_a_changed_source_is_not_run_compiled(tmp_path):
    """decide() refuses a build whose recorded digest no longer matches the source."""
    stamp = {"group": "radixkv._core", "modules": {"radixkv.tree": "0" * 64}}
    why = compiled.decide(stamp, {})
    if compiled.active():
        assert "tree.py changed since it was compiled" in why
    else:
        assert why  # not built here: refused either way
    assert "RADIXKV_COMPILED=0" in compiled.decide(stamp, {"RADIXKV_COMPILED": "0"})
    assert "was not compiled" in compiled.decide({"group": "radixkv._core",
                                                  "modules": {"radixkv.keys": "0" * 64}}, {})


def test_the_source_finder_takes_every_listed_module_from_its_py_file(tmp_path):
    """What install() does for a stale build: every module of the group is imported from its .py
    (all or none: compiled modules call each other in C, a mix would hold two copies of a class)."""
    bad = tmp_path / "_compiled.json"
    good = json.loads((REPO / "radixkv" / "_compiled.json").read_text()) if compiled.active() else {
        "group": "radixkv._core", "modules": {"radixkv.tree": "", "radixkv.policies": ""}}
    good["modules"]["radixkv.tree"] = "0" * 64
    bad.write_text(json.dumps(good))
    code = f"""
import importlib.util, json, sys, warnings
spec = importlib.util.spec_from_file_location("rk_compiled", {str(REPO / "radixkv" / "compiled.py")!r})
c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
c._STAMP = __import__("pathlib").Path({str(bad)!r})
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    c.install()
import radixkv.tree, radixkv.policies
print(json.dumps([c.active(), c.reason(), radixkv.tree.__file__, radixkv.policies.__file__,
                  [str(x.message) for x in w]]))
"""
    active, why, tree_file, pol_file, warned = json.loads(_run(code))
    assert not active and tree_file.endswith("tree.py") and pol_file.endswith("policies.py")
    if compiled.active():
        assert "changed since" in why and any("pip install -e ." in m for m in warned)
