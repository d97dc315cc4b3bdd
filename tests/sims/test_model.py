from __future__ import annotations

import numpy as np
import pytest

from radixkv.errors import ConfigError
from radixkv.sims.model import MODEL_PRESETS, TierModel, estimate_ttft, parse_model, parse_size_bytes, ttft_s


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


def test_overlap_chooses_what_to_load_by_the_overlapped_time():
    """With --overlap a load hides behind the prefill beside it. The per-tier rule (load only if
    faster than recomputing) ignored that: at llama3-70b's 7.41 GB/s break-even a 0.1 % slower disk
    doubled the estimate (229 -> 453 ms), recomputing a hit whose overlapped load cost ~nothing."""
    m = MODEL_PRESETS["llama3-70b"]  # 320 KiB/token at 22,600 tokens/s: loading beats prefill above 7.41 GB/s
    inputs, hit, per_tier = np.array([10_240]), np.array([10]), np.array([[0, 10]])  # 5,120 tokens from disk
    est = {}
    for gbps in (7.40, 7.41):
        tiers = [TierModel("mem", 50e9, 20e-6), TierModel("disk", gbps * 1e9, 100e-6)]
        est[gbps] = estimate_ttft(m, tiers, 512, inputs, hit, per_tier, overlap=True)
        plain = estimate_ttft(m, tiers, 512, inputs, hit, per_tier)
        assert est[gbps].ttft_s[0] <= plain.ttft_s[0]
        assert est[gbps].recomputed_tokens[0] == 5120 and est[gbps].loaded_bytes_per_tier[1] == 5120 * 327_680
    assert plain.recomputed_tokens[0] == 5120  # (the last, 7.41 GB/s: loaded without overlap too)
    # (the load itself takes 0.14 % longer at the 0.14 % lower bandwidth; it was 2x)
    assert abs(est[7.40].ttft_s[0] - est[7.41].ttft_s[0]) < 2e-3 * est[7.41].ttft_s[0]
    # far below the break-even the overlapped load would outlast recomputing: recomputed
    slow = [TierModel("mem", 50e9), TierModel("disk", 1e9)]
    e = estimate_ttft(m, slow, 512, inputs, hit, per_tier, overlap=True)
    assert e.recomputed_tokens[0] == 10_240 and e.loaded_bytes_per_tier[1] == 0
    assert np.isclose(e.ttft_s[0], 10_240 / m.prefill_tokens_per_s)


def test_overlap_never_worse_than_the_per_tier_rule_or_no_cache():
    rng = np.random.default_rng(5)
    m = parse_model("layers=8,kv_heads=2,head_dim=64,dtype=bf16,prefill_tps=4000")
    tiers = [TierModel("mem", 2e9, 1e-3), TierModel("disk", 5e8, 1e-2), TierModel("remote", 1e8, 5e-2)]
    n = 400
    per_tier = rng.integers(0, 6, size=(n, 3))
    hit = per_tier.sum(axis=1)
    inputs = hit * 64 + rng.integers(0, 500, size=n)
    best = estimate_ttft(m, tiers, 64, inputs, hit, per_tier, overlap=True).ttft_s
    none = inputs / m.prefill_tokens_per_s
    assert np.all(best <= none * (1 + 1e-12))
    # the plain rule's choice, overlapped: one of the choices the overlapped estimate tried
    plain = estimate_ttft(m, tiers, 64, inputs, hit, per_tier)
    load = plain.ttft_s - plain.recomputed_tokens / m.prefill_tokens_per_s
    prefill = plain.recomputed_tokens / m.prefill_tokens_per_s
    assert np.all(best <= np.maximum(load, prefill) + np.minimum(load, prefill) / m.layers + 1e-12)


def test_a_block_past_the_trees_bound_of_a_chunk_is_a_config_error_naming_the_model():
    # The tree refuses a chunk of 2**48 bytes or more (its columns are 64-bit). A model within its
    # own bound (1 TiB per token) with long blocks got there, and the replay's first insert named
    # size_bytes, which the user never gave, instead of the model and the block tokens.
    m = parse_model("layers=10000,kv_heads=4096,head_dim=3000,dtype=fp32")  # ~0.9 TiB per token
    assert m.block_bytes(256) < 1 << 48
    with pytest.raises(ConfigError, match=r"model 'custom': a block of 512 tokens .*2\*\*48.*--block-tokens"):
        m.block_bytes(512)
