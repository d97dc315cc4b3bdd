"""Shared fixtures of the simulator tests: the Mooncake conversation and synthetic traces.

The conversation trace is read from ``../shared/traces`` beside the repository when present, else
decompressed from the copy shipped in ``tests/data`` (xz, 200 KB) and checked against its published
sha256. The synthetic trace (``tests/data/README.md``) ships only in ``tests/data`` (xz, 64 KB)."""

from __future__ import annotations

import hashlib
import lzma
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOONCAKE = os.path.join(os.path.dirname(REPO), "shared", "traces", "mooncake_conversation.jsonl")
SHIPPED = os.path.join(REPO, "tests", "data", "mooncake_conversation.jsonl.xz")
SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
SYNTHETIC = os.path.join(REPO, "tests", "data", "mooncake_synthetic.jsonl.xz")
SYNTHETIC_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


def _unpack(shipped: str, sha256: str, tmp_path_factory) -> str:
    """Decompress a trace shipped in tests/data into a temporary file, checked against its sha256."""
    with lzma.open(shipped, "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == sha256, f"shipped trace {shipped} is corrupted"
    path = tmp_path_factory.mktemp("trace") / os.path.basename(shipped).removesuffix(".xz")
    path.write_bytes(raw)
    return str(path)


@pytest.fixture(scope="session")
def mooncake_path(tmp_path_factory) -> str:
    if os.path.isfile(MOONCAKE):
        return MOONCAKE
    if not os.path.isfile(SHIPPED):
        pytest.skip(f"Mooncake trace found neither at {MOONCAKE} nor at {SHIPPED}")
    return _unpack(SHIPPED, SHA256, tmp_path_factory)


@pytest.fixture(scope="session")
def mooncake_trace(mooncake_path):
    from radixkv.sims.traces import read_trace

    return read_trace(mooncake_path)


@pytest.fixture(scope="session")
def mooncake_synthetic_trace(tmp_path_factory):
    from radixkv.sims.traces import read_trace

    if not os.path.isfile(SYNTHETIC):
        pytest.skip(f"Mooncake synthetic trace not found at {SYNTHETIC}")
    return read_trace(_unpack(SYNTHETIC, SYNTHETIC_SHA256, tmp_path_factory))
