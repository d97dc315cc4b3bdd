from __future__ import annotations

import numpy as np
import pytest

from radixkv.errors import ConfigError
from radixkv.sims.model import MODEL_PRESETS, TierModel, parse_model, parse_size_bytes, ttft_s


def test_presets_kv_bytes_per_token():
    kib = 1024
    assert MODEL_PRESETS["llama3-8b"].kv_bytes_per_token == 128 * kib
    assert MODEL_PRESETS["qwen2.5-7b"].kv_bytes_per_token == 56 * kib
    assert MODEL_PRESETS["llama3-70b"].kv_bytes_per_token == 320 * kib
    assert MODEL_PRESETS["deepseek-v3"].kv_bytes_per_token == 70_272  # ~68.6 KiB (MLA)
    assert MODEL_PRESETS["llama3-8b"].block_bytes(512) == 64 * 2**20


def test_custom_model():
    m = parse_model("layers=32,kv_heads=8,head_dim=128,dtype=bf16,prefill_tps=1000")
    assert m.kv_bytes_per_token == 131072 and m.prefill_tokens_per_s == 1000
    assert parse_model("layers=61,mla_dim=576,dtype=bf16").kv_bytes_per_token == 70_272
    with pytest.raises(ConfigError, match="kv_heads"):
        parse_model("layers=32,head_dim=128")
    with pytest.raises(ConfigError, match="preset"):
        parse_model("gpt-9")


def test_sizes():
    assert parse_size_bytes("64GiB") == 64 * 2**30
    assert parse_size_bytes("1.5TB") == 1_500_000_000_000
    assert parse_size_bytes("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size_bytes("lots")


def test_ttft_by_hand():
    m = parse_model("layers=10,kv_heads=1,head_dim=50,dtype=fp8,prefill_tps=1000")  # 1000 B/token
    tiers = [TierModel("mem", 1e6), TierModel("disk", 1e5)]
    inputs = np.array([1000, 1000, 1000])
    hit = np.array([0, 2, 2])  # blocks of 250 tokens
    per_tier = np.array([[0, 0], [2, 0], [1, 1]])
    ttft, loaded = ttft_s(m, tiers, 250, inputs, hit, per_tier)
    # r0: prefill 1000 tok = 1 s. r1: load 500 tok * 1000 B / 1e6 = 0.5 s + prefill 500 = 0.5 s.
    # r2: mem 250 tok: 0.25 s; disk 250 tok: 2.5 s > recompute 0.25 s -> recomputed; prefill 750 = .75
    assert np.allclose(ttft, [1.0, 1.0, 1.0])
    assert np.allclose(loaded, [750_000, 0])
    ttft_o, _ = ttft_s(m, tiers, 250, inputs, hit, per_tier, overlap=True)
    assert np.allclose(ttft_o, [1.0, 0.5 + 0.5 / 10, 0.75 + 0.25 / 10])


def test_a_block_past_the_trees_bound_of_a_chunk_is_a_config_error_naming_the_model():
    # The tree refuses a chunk of 2**48 bytes or more (its columns are 64-bit). A model within its
    # own bound (1 TiB per token) with long blocks got there, and the replay's first insert named
    # size_bytes, which the user never gave, instead of the model and the block tokens.
    m = parse_model("layers=10000,kv_heads=4096,head_dim=3000,dtype=fp32")  # ~0.9 TiB per token
    assert m.block_bytes(256) < 1 << 48
    with pytest.raises(ConfigError, match=r"model 'custom': a block of 512 tokens .*2\*\*48.*--block-tokens"):
        m.block_bytes(512)
