"""Packaging: one import root. triton_kernels/, adapters/ and sims/ install under radixkv only."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("radixkv-*.whl")
    return whl


def test_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith("top_level.txt")]
        assert zf.read(top_level).decode().split() == ["radixkv"]
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"radixkv"}, roots
    for sub in ("kernels", "adapters", "sims", "tiers", "bench"):
        assert f"radixkv/{sub}/__init__.py" in names
    if sys.platform == "linux" and platform.machine() == "x86_64":  # the optional C parts (setup.py)
        for mod in ("_native", "_core__mypyc", "tree", "policies", "policy_heap"):
            assert any(n.startswith(f"radixkv/{mod}.") and n.endswith(".so") for n in names), (mod, names)
        # the digests radixkv.compiled checks the compiled modules against, and their sources
        assert {"radixkv/_compiled.json", "radixkv/tree.py", "radixkv/policies.py"} <= set(names)


def _setuptools_warnings(output: str) -> list[str]:
    """The backend's Python warnings in ``python -m build`` output ("WARNING ..." lines). setuptools'
    deprecations become build errors on a date (the licence table: 2027-02-18), and an isolated build
    from the sdist takes the newest setuptools."""
    return [line.strip() for line in output.splitlines() if line.startswith("WARNING ") or "Warning:" in line]


def test_sdist_carries_the_c_sources(tmp_path):
    """A source install builds the helpers from radixkv/csrc/: the sdist must carry them, and both
    the sdist and a wheel built from it build without a setuptools warning."""
    cmd = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
           "-o", str(tmp_path), str(REPO)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    assert not _setuptools_warnings(res.stdout + res.stderr)
    (sdist,) = tmp_path.glob("radixkv-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        tf.extractall(tmp_path / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert {"setup.py", "radixkv/csrc/abi.c", "radixkv/csrc/streamcopy.c", "radixkv/csrc/chunkio.c"} <= names
    # ... and the rest of the source: the suite runs from it (setuptools alone took tests/test*.py
    # without conftest.py, fixtures or data), the README's scripts and docs are there.
    assert {"MANIFEST.in", "tests/conftest.py", "tests/_redis_servers.py", "tests/sims/test_replay.py",
            "tests/data/mooncake_conversation.jsonl.xz", "tests/_stubs/torchvision/__init__.py",
            "scripts/run.sh", "scripts/test.sh", "docs/design.md"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    # RADIXKV_COMPILE=0 keeps it short (no mypyc); the C helpers still build from the sdist alone.
    (src,) = (tmp_path / "src").iterdir()
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
           "-o", str(tmp_path / "wheel"), str(src)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "RADIXKV_COMPILE": "0"})
    assert not _setuptools_warnings(res.stdout + res.stderr)
    (whl,) = (tmp_path / "wheel").glob("radixkv-*.whl")
    with zipfile.ZipFile(whl) as zf:
        built = zf.namelist()
    assert not [n for n in built if n.endswith(".c")], built  # sources, not package data
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert any(n.startswith("radixkv/_native.") for n in built), built


@pytest.mark.parametrize("env", [{"RADIXKV_COMPILE": "0"}, {"CC": "/bin/false"}], ids=["off", "no-compiler"])
def test_a_build_without_the_compiled_tree_removes_an_earlier_one(tmp_path, env):
    """RADIXKV_COMPILE=0, or a failed compile, over an earlier compiled build's output folder (pip
    builds in the source tree and keeps build/; -e builds in place): this Python's compiled files and
    record must go, or the wheel packs them (and the install runs them) as if this build had made
    them. Another Python's build stays."""
    suffix, other = sysconfig.get_config_var("EXT_SUFFIX"), ".cpython-399-x86_64-linux-gnu.so"
    lib = tmp_path / "lib"
    (lib / "radixkv").mkdir(parents=True)
    earlier = {f"{stem}{ext}": b"an earlier build" for stem in ("_core__mypyc", "tree", "policies")
               for ext in (suffix, other)}
    for name, data in earlier.items():
        (lib / "radixkv" / name).write_bytes(data)
    build = {"group": "radixkv._core", "sources": {"radixkv.tree": "0" * 64}, "files": {}}
    stamp = lib / "radixkv" / "_compiled.json"
    stamp.write_text(json.dumps({"format": 2, "builds": {suffix: build, other: build}}))
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib),
           "--build-temp", str(tmp_path / "tmp")]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, **env})
    left = {p.name for p in (lib / "radixkv").iterdir()}
    assert {n for n in earlier if n.endswith(other)} <= left
    assert not {n for n in earlier if n.endswith(suffix)} & left, left
    assert list(json.loads(stamp.read_text())["builds"]) == [other]


def test_mapped_subpackages_import_from_the_repo_folders():
    import radixkv.adapters
    import radixkv.kernels
    import radixkv.sims

    assert Path(radixkv.kernels.__file__).parent.name == "triton_kernels"
    assert Path(radixkv.adapters.__file__).parent.name == "adapters"
    assert Path(radixkv.sims.__file__).parent.name == "sims"


def test_core_never_imports_an_engine():
    code = (
        "import sys, radixkv, radixkv.tree, radixkv.policies, radixkv.keys, radixkv.cli;"
        "bad=[m for m in ('sglang','vllm') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_console_command():
    res = subprocess.run([sys.executable, "-m", "radixkv.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "sim" in res.stdout and "bench" in res.stdout


def _help_of(argv: list[str]) -> str:
    """Run ``radixkv ARGV --help`` in-process; argparse prints the help and exits 0."""
    import contextlib
    import io

    from radixkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0, f"radixkv {' '.join(argv)} --help exited {exc.value.code}"
    return out.getvalue()


def test_sim_help_lists_its_defaults():
    # argparse %-formats help strings: a default like "1%,5%" once crashed ``radixkv sim --help``.
    text = _help_of(["sim"])
    assert "--capacity" in text and "1%,5%,10%,25%" in text and "mem@50,disk=25%@7" in text


@pytest.mark.parametrize("name", __import__("radixkv.bench.__main__", fromlist=["available"]).available())
def test_every_benchmark_has_a_working_help(name):
    # Benchmarks parse their arguments before importing an engine, so --help works in any env.
    assert "usage:" in _help_of(["bench", name])
