"""Packaging: one import root. triton_kernels/, adapters/ and sims/ install under radixkv only."""

from __future__ import annotations

import subprocess
import sys
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
