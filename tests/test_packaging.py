"""Packaging: one import root. triton_kernels/, adapters/ and sims/ install under radixkv only."""

from __future__ import annotations

import platform
import subprocess
import sys
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


def test_sdist_carries_the_c_sources(tmp_path):
    """A source install builds the helpers from radixkv/csrc/: the sdist must carry them."""
    cmd = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
           "-o", str(tmp_path), str(REPO)]
    subprocess.run(cmd, check=True, capture_output=True)
    (sdist,) = tmp_path.glob("radixkv-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"setup.py", "radixkv/csrc/abi.c", "radixkv/csrc/streamcopy.c", "radixkv/csrc/chunkio.c"} <= names


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
