"""Shared test configuration: CPU by default; `gpu` tests skip without CUDA."""

from __future__ import annotations

import pytest

# Real redis-server processes (standalone + 3-node cluster) on loopback, started once per session.
pytest_plugins = ["_redis_servers"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error reported elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
