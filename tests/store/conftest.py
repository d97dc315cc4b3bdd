"""Fixtures of the hierarchical-store tests (helpers live in store_helpers.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from radixkv.config import StoreConfig
from radixkv.store import HierarchicalStore
from store_helpers import STACKS, tier_config


@pytest.fixture
def make_store(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., HierarchicalStore]]:
    """``make_store(stack, write_policy=..., chunks={'mem': 4}, urls={'redis': url}, **config)``.
    Stores are closed at teardown; the test fails if a store leaked a thread."""
    made: list[HierarchicalStore] = []
    threads_before = set(threading.enumerate())

    def make(
        stack: tuple[str, ...] | str,
        chunks: dict[str, int] | None = None,
        urls: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> HierarchicalStore:
        kinds = STACKS[stack] if isinstance(stack, str) else stack
        tiers = [
            tier_config(k, tmp_path, request, (chunks or {}).get(k), (urls or {}).get(k))
            for k in kinds
        ]
        store = HierarchicalStore(StoreConfig(tiers=tiers, **kwargs))
        made.append(store)
        return store

    yield make
    for s in made:
        s.close()
    leaked = [
        t for t in threading.enumerate() if t not in threads_before and t.name.startswith("radixkv")
    ]
    assert not leaked, f"threads left running after close: {[t.name for t in leaked]}"


@pytest.fixture(params=list(STACKS))
def stack(request: pytest.FixtureRequest) -> str:
    return request.param
