"""radixkv.compiled: the mypyc build of the tree and policies is built where CI runs, replays exactly
as the Python source does, can be switched off, and a stale build never runs."""

from __future__ import annotations

import hashlib
import importlib.machinery
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


SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _fake_build(tmp_path: Path, modules=("tree", "policies")) -> dict:
    """A package directory with sources and 'extension files', and the stamp a build would write."""
    for m in modules:
        (tmp_path / f"{m}.py").write_text(f"# {m}\n")
        (tmp_path / f"{m}{SUFFIX}").write_bytes(f"ELF {m}".encode())
    (tmp_path / f"_core__mypyc{SUFFIX}").write_bytes(b"ELF group")
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    return {"format": compiled.STAMP_FORMAT, "builds": {SUFFIX: {
        "group": "radixkv._core",
        "sources": {f"radixkv.{m}": sha(tmp_path / f"{m}.py") for m in modules},
        "files": {p.name: sha(p) for p in tmp_path.glob("*" + SUFFIX)},
    }}}


def test_decide_accepts_a_complete_unchanged_build(tmp_path):
    assert compiled.decide(_fake_build(tmp_path), {}, tmp_path) == ""
    assert "RADIXKV_COMPILED=0" in compiled.decide(_fake_build(tmp_path), {"RADIXKV_COMPILED": "0"},
                                                   tmp_path)
    for off in ("false", "No", " off "):  # as RADIXKV_NATIVE reads its switch
        assert "RADIXKV_COMPILED=0" in compiled.decide(_fake_build(tmp_path), {"RADIXKV_COMPILED": off}, tmp_path)


@pytest.mark.parametrize("damage,expect", [
    (lambda d, st: (d / "tree.py").write_text("# edited\n"), "tree.py changed since it was compiled"),
    (lambda d, st: (d / f"tree{SUFFIX}").write_bytes(b"ELF other"), "changed since it was built"),
    (lambda d, st: (d / f"_core__mypyc{SUFFIX}").unlink(), "is missing"),
    (lambda d, st: ((d / "pins.py").write_text(""), (d / f"pins{SUFFIX}").write_bytes(b"ELF")),
     "radixkv.pins has an extension file this build did not make"),
    (lambda d, st: st.update(builds={".cpython-399-other.so": st["builds"][SUFFIX]}),
     "no complete build for this Python"),
    (lambda d, st: st.update(format=1), "no complete build for this Python"),
    (lambda d, st: st["builds"][SUFFIX]["sources"].clear(), "no complete build for this Python"),
])
def test_decide_refuses_a_stale_partial_or_foreign_build(tmp_path, damage, expect):
    """Sources edited, files rebuilt by another build, a file missing, a leftover module, only
    another Python's build recorded, an old stamp format, an empty record: the Python runs."""
    stamp = _fake_build(tmp_path)
    damage(tmp_path, stamp)
    assert expect in compiled.decide(stamp, {}, tmp_path)


def test_the_source_finder_takes_every_listed_module_from_its_py_file(tmp_path):
    """What install() does for a stale build: every module of the group is imported from its .py
    (all or none: compiled modules call each other in C, a mix would hold two copies of a class)."""
    real = REPO / "radixkv" / "_compiled.json"
    stamp = json.loads(real.read_text()) if real.is_file() else {"format": compiled.STAMP_FORMAT,
                                                                  "builds": {}}
    for build in stamp["builds"].values():
        build["sources"]["radixkv.tree"] = "0" * 64  # as if tree.py changed after the build
    bad = tmp_path / "_compiled.json"
    bad.write_text(json.dumps(stamp))
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
        assert "changed since" in why and any("reinstall radixkv" in m for m in warned)


_SUBCLASS = """
import json
from radixkv import compiled
from radixkv.policies import POLICIES, register_policy
from radixkv.sims.replay import TierCapacity, replay
from radixkv.sims.workloads import WorkloadConfig, generate

trace = generate("chat", WorkloadConfig(requests=200, block_tokens=64, seed=5))
out = {}
for name in ["lru", "s3fifo", "sieve", "lfu", "cost", "agedref", "oddsref", "opt"]:
    base = POLICIES[name]
    # A Python subclass that overrides a hook and calls the compiled one.
    sub = type(f"Counting_{name}", (base,), {
        "touches": 0,
        "on_access": lambda self, n, now, _b=base: (setattr(self, "touches", self.touches + 1),
                                                    _b.on_access(self, n, now))[1],
    })
    register_policy(f"sub-{name}")(sub)
    a = replay(trace, name, [TierCapacity("mem", 120)], check_every=20)
    b = replay(trace, f"sub-{name}", [TierCapacity("mem", 120)], check_every=20)
    out[name] = [a.block_hits, b.block_hits, a.evictions, b.evictions]
print(json.dumps(out))
"""


def test_python_subclasses_of_the_compiled_policies_work():
    """A user may subclass a built-in policy in Python (mypyc_attr(allow_interpreted_subclasses)):
    overriding a hook and calling the compiled one replays exactly like the policy itself. OPT too:
    compiled since it moved to radixkv.policy_opt, without the attribute it refused any subclass
    ("interpreted classes cannot inherit from compiled"), which the Python build allowed."""
    got = json.loads(_run(_SUBCLASS))
    for name, (hits, sub_hits, ev, sub_ev) in got.items():
        assert (hits, ev) == (sub_hits, sub_ev), name
        assert hits > 0 and ev > 0, name


_NO_PARTIAL_PENALTY = """
import json
from radixkv import compiled
from radixkv.policies import register_policy
from radixkv.policy_heap import AgedRefPolicy
from radixkv.tree import RadixTree

class NoPartialPenalty(AgedRefPolicy):
    _PARTIAL_PENALTY = 0.0  # partial chunks ordered like full ones

register_policy("agedref-no-partial-penalty")(NoPartialPenalty)
out = {"compiled": compiled.active()}
for name in ("agedref", "agedref-no-partial-penalty"):
    t = RadixTree(("mem",), name)
    full = t.insert("ns", ["full"], "mem", 16, 1).node_ids[0]
    part = t.insert("ns", ["part"], "mem", 8, 1).node_ids[0]  # a ragged end: fewer tokens
    for _ in range(3):
        t.match("ns", ["part"])
    t.match("ns", ["full"])
    out[name] = ["part" if n == part else "full" for n in t.evict_candidates("mem", 2)]
print(json.dumps(out))
"""


def test_a_python_subclass_overrides_a_policy_class_constant_in_both_builds():
    """Found by the compiled-vs-source fuzz: agedref's ``_PARTIAL_PENALTY`` was a plain class
    attribute, which mypyc makes an instance slot set to the base's value, so a Python subclass
    overriding it changed the Python build's order and not the compiled one's."""
    for env in ({"RADIXKV_COMPILED": "0"}, {}):
        got = json.loads(_run(_NO_PARTIAL_PENALTY, **env))
        assert got["agedref"] == ["part", "full"], got  # partial chunks first
        assert got["agedref-no-partial-penalty"] == ["full", "part"], got  # by references only


_COPY_RESULTS = """
import copy, json, pickle
from radixkv import compiled
from radixkv.tree import RadixTree

t = RadixTree(("mem", "disk"))
t.insert("ns", ["a", "b"], "mem", 16, 100)
r = t.clear(namespace="ns")
out = {"compiled": compiled.active(), "result": repr(r), "copies": []}
for f in (copy.copy, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
    try:
        c = f(r)
        out["copies"].append([repr(c), c == r, hash(c) == hash(r)])
    except Exception as exc:
        out["copies"].append(f"{type(exc).__name__}: {exc}")
print(json.dumps(out))
"""


def test_drop_results_copy_and_pickle_in_both_builds():
    """Found by the compiled-vs-source fuzz: copy, deepcopy and pickle of a DropResult (what evict,
    clear and clear_resident return) raised FrozenInstanceError in the compiled build only."""
    for env in ({"RADIXKV_COMPILED": "0"}, {}):
        got = json.loads(_run(_COPY_RESULTS, **env))
        assert got["result"] == "DropResult(removed_node_ids=(1, 0), orphaned_node_ids=())", got
        assert got["copies"] == [[got["result"], True, True]] * 3, got


_PIN_CLOCK = """
import json
from radixkv import compiled
from radixkv.errors import PinError
from radixkv.tree import RadixTree

now = [2 ** 63 + 7]  # an integer clock past 2**53: as a float it steps by 2048
t = RadixTree(("mem",), clock=lambda: now[0])
a, b = t.insert("ns", ["a", "b"], "mem", 16, 1).node_ids
t.pin([a], "r1", 1)  # integer leases
t.pin([b], "r2", 10_000)
out = {"compiled": compiled.active(), "pinned": [t.is_pinned(a), t.is_pinned(b)], "errors": []}
for lease in (0, -1, 0.0):
    try:
        t.pin([a], "r3", lease)
    except PinError as exc:
        out["errors"].append(str(exc))
print(json.dumps(out))
"""


def test_pin_leases_are_float_seconds_in_both_builds():
    """Found by the compiled-vs-source fuzz: the compiled build converts the clock and the lease
    to floats (their annotations), the Python build kept integers exact, so past 2**53 an integer
    clock's pin protected a node in one build only, and an integer lease's error read 0 or 0.0."""
    src = json.loads(_run(_PIN_CLOCK, RADIXKV_COMPILED="0"))
    cur = json.loads(_run(_PIN_CLOCK))
    assert src.pop("compiled") is False
    cur.pop("compiled")
    assert cur == src
    assert src["pinned"] == [False, True]  # 1 s is below the float clock's step there, 10,000 s not
    assert src["errors"] == [f"lease_s={v} must be a finite number of seconds > 0" for v in ("0.0", "-1.0", "0.0")]


_BAD_CALLS = r"""
import json, math, numpy as np
import radixkv.compiled as c
from radixkv.errors import RadixKVError
from radixkv.tree import RadixTree
t = RadixTree(("mem",))
t.insert("ns", ["k0", "k1"], "mem", 16, 1)
calls = {
    "pin(np.int64)": lambda: t.pin([np.int64(0)], "o"),
    "pin(True)": lambda: t.pin([True], "o"),
    "touch(np.int64)": lambda: t.touch([np.int64(1)]),
    "set_resident(np.int64)": lambda: t.set_resident([np.int64(1)], "mem"),
    "insert(namespace=None)": lambda: t.insert(None, ["a"], "mem", 16, 1),
    "insert(parent_key=5)": lambda: t.insert("ns", ["b"], "mem", 16, 1, parent_key=5),
    "pin(owner=7)": lambda: t.pin([0], 7),
    "pin(lease_s=inf)": lambda: t.pin([0], "o", math.inf),
    "pin(lease_s=True)": lambda: t.pin([0], "o", True),
    "evict_candidates(1.5)": lambda: t.evict_candidates("mem", 1.5),
    "evict_candidates(True)": lambda: t.evict_candidates("mem", True),
    "RadixTree('disk')": lambda: RadixTree("disk"),
    "RadixTree((1, 2))": lambda: RadixTree((1, 2)),
    "RadixTree(policy_options=pairs)": lambda: RadixTree(("mem",), "s3fifo", [("small_fraction", 0.2)]),
    "agedref(initial_half_life=inf)": lambda: RadixTree(("mem",), "agedref", {"initial_half_life": math.inf}),
    "agedref(ghost_factor=inf)": lambda: RadixTree(("mem",), "agedref", {"ghost_factor": math.inf}),
    "oddsref(odds_weight=nan)": lambda: RadixTree(("mem",), "oddsref", {"odds_weight": math.nan}),
}
out = {"compiled": c.active(), "calls": {}}
for name, call in calls.items():
    try:
        call()
        out["calls"][name] = "accepted"
    except (RadixKVError, TypeError) as e:  # TypeError: the compiled build's own check at the call
        out["calls"][name] = type(e).__name__
t.check_integrity()
out["namespaces"] = t.namespaces()
print(json.dumps(out))
"""


def test_bad_arguments_are_refused_in_both_builds():
    """Found by an audit: the Python build accepted what the compiled one refused at the call (a
    numpy node id stored in the pins, which then failed their check; a namespace None; an int
    parent_key; a str as the tier list: four tiers d, i, s, k), and both took an infinite lease or
    policy option (an infinite half-life made every heap priority NaN)."""
    for env in ({"RADIXKV_COMPILED": "0"}, {}):
        got = json.loads(_run(_BAD_CALLS, **env))
        accepted = [name for name, how in got["calls"].items() if how == "accepted"]
        assert not accepted, (got["compiled"], accepted)
        assert got["namespaces"] == ["ns"]
        if not got["compiled"]:  # the Python build names the problem itself: no bare TypeError
            assert "TypeError" not in got["calls"].values(), got["calls"]


_POLICY_INPUTS = r"""
import json, math
import radixkv.compiled as c
from radixkv.errors import ConfigError
from radixkv.policies import make_policy, register_policy
from radixkv.policy_heap import AgedRefPolicy
from radixkv.tree import RadixTree


@register_policy("boosted")
class Boosted(AgedRefPolicy):  # a user's subclass passing the base's options on
    def __init__(self, boost=1.0, **kw):
        super().__init__(**kw)
        self.boost = boost

calls = {
    "make_policy(None)": lambda: make_policy(None),
    "RadixTree(policy=None)": lambda: RadixTree(("mem",), None),
    "RadixTree(policy={'mem': None})": lambda: RadixTree(("mem",), {"mem": None}),
    "policy_options names a tier it lacks": lambda: RadixTree(
        ("mem", "disk"), "s3fifo", {"mem": {"small_fraction": 0.2}, "dsk": {"small_fraction": 0.1}}),
    "agedref(initial_half_life=1e-310)": lambda: make_policy("agedref", initial_half_life=1e-310),
}
calls["subclass, base option as str"] = lambda: make_policy("boosted", gap_quantile="0.5")
calls["subclass, base option inf"] = lambda: make_policy("boosted", ghost_factor=math.inf)
out = {"compiled": c.active(), "calls": {}}
for name, call in calls.items():
    try:
        call()
        out["calls"][name] = "accepted"
    except Exception as e:
        out["calls"][name] = f"{type(e).__name__}: {e}"
t = RadixTree(("mem",))
t.insert("ns", ["k0", "k1", "k2"], "mem", 16, 1)
r = t.evict("mem", 10**30)
out["evicted"] = list(r.removed_node_ids)
out["left"] = t.tier_chunks("mem")
t.check_integrity()
print(json.dumps(out))
"""


def test_policy_inputs_are_config_errors_in_both_builds():
    """Found by an audit: the compiled build answered a non-str policy name with a bare TypeError
    (its typed parameter refused it first), never checked the options a Python subclass passes on to a
    built-in base (a compiled __init__ reads as (*args, **kwargs)), and raised half-way through an
    eviction of more than 2**63 chunks; both builds read per-tier options naming a tier the tree lacks
    as one flat option set, and took a subnormal half-life that made every priority NaN."""
    for env in ({"RADIXKV_COMPILED": "0"}, {}):
        got = json.loads(_run(_POLICY_INPUTS, **env))
        wrong = {k: v for k, v in got["calls"].items() if not v.startswith("ConfigError")}
        assert not wrong, (got["compiled"], wrong)
        calls = got["calls"]
        assert "['dsk']" in calls["policy_options names a tier it lacks"]
        assert "gap_quantile='0.5'" in calls["subclass, base option as str"]
        assert "ghost_factor=inf" in calls["subclass, base option inf"]
        assert got["evicted"] == [2, 1, 0] and got["left"] == 0, got
