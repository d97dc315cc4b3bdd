"""Helpers for hierarchical-store tests: tier stacks over real tiers (memory, disk, redis-server).

Capacities are counted in chunks of ``CHUNK_BYTES`` so tests can reason about evictions. Every
payload is derived from its key, so every hit is checked byte for byte.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from radixkv.config import TierConfig
from radixkv.keys import Namespace, chunk_keys

if TYPE_CHECKING:
    from radixkv.store import HierarchicalStore

CHUNK_BYTES = 4096
CHUNK_TOKENS = 16
FRAME_SLACK = 200  # header + identity bytes a framed tier stores per chunk (132 with 64-char keys)
CAP_CHUNKS = {"mem": 8, "disk": 16, "redis": 32}
# Fast failure against a dead server: the store's reads must degrade within these bounds.
REDIS_OPTIONS = {"socket_timeout_s": 0.5, "socket_connect_timeout_s": 0.3, "down_backoff_s": 0.2}

STACKS = {
    "mem": ("mem",),
    "mem-disk": ("mem", "disk"),
    "mem-redis": ("mem", "redis"),
    "mem-disk-redis": ("mem", "disk", "redis"),
}


def payload_for(key: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 2
    return torch.randint(
        0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def buffers(n: int) -> list[torch.Tensor]:
    return [torch.full((CHUNK_BYTES,), 0xAB, dtype=torch.uint8) for _ in range(n)]


def chain(seed: int, n_chunks: int, prefix: list[int] | None = None) -> tuple[list[int], list[str]]:
    """Token ids (continuing ``prefix``) and their SGLang-style chunk keys."""
    rng = random.Random(seed)
    tokens = list(prefix or []) + [rng.randrange(50_000) for _ in range(n_chunks * CHUNK_TOKENS)]
    return tokens, chunk_keys(tokens, CHUNK_TOKENS)


def new_namespace() -> Namespace:
    return Namespace(
        model=f"test-{uuid.uuid4().hex[:12]}",
        dtype="bfloat16",
        layout="page_first",
        chunk_tokens=CHUNK_TOKENS,
    )


def assert_exact(keys: list[str], bufs: list[torch.Tensor], n: int) -> None:
    """buffers[:n] hold exactly the payloads of keys[:n]."""
    for i in range(n):
        assert torch.equal(bufs[i], payload_for(keys[i])), (
            f"chunk {i} ({keys[i][:12]}) has wrong bytes"
        )


def assert_within_capacity(store: HierarchicalStore) -> None:
    for tier in store.tiers:
        cap = tier.capacity_bytes
        if cap and cap < 1 << 62:
            assert tier.usage_bytes() <= cap, f"tier {tier.name} holds {tier.usage_bytes()} > {cap}"


def tier_config(
    kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    chunks: int | None = None,
    url: str | None = None,
) -> TierConfig:
    n = CAP_CHUNKS[kind] if chunks is None else chunks
    if kind == "mem":
        return TierConfig(url="mem://", capacity_bytes=n * CHUNK_BYTES)
    if kind == "disk":
        d = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
        return TierConfig(url=f"file://{d}", capacity_bytes=n * (CHUNK_BYTES + FRAME_SLACK))
    url = url or request.getfixturevalue("redis_url")
    return TierConfig(
        url=url, capacity_bytes=n * (CHUNK_BYTES + FRAME_SLACK), options=dict(REDIS_OPTIONS)
    )
