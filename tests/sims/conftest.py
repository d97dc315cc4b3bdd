"""Shared fixtures of the simulator tests: the Mooncake trace beside the repository, if present."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOONCAKE = os.path.join(os.path.dirname(REPO), "shared", "traces", "mooncake_conversation.jsonl")


@pytest.fixture(scope="session")
def mooncake_path() -> str:
    if not os.path.isfile(MOONCAKE):
        pytest.skip(f"Mooncake trace not found at {MOONCAKE}")
    return MOONCAKE


@pytest.fixture(scope="session")
def mooncake_trace(mooncake_path):
    from radixkv.sims.traces import read_trace

    return read_trace(mooncake_path)
