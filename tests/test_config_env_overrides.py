"""RADIXKV_POLICY over a RADIXKV_CONFIG file of another policy: the file's policy_options belong to
its policy, so they are dropped (logged), not applied to the new policy as unknown options."""

from __future__ import annotations

import logging

import pytest

from radixkv.config import StoreConfig
from radixkv.config_env import env_overrides

YAML = "policy: s3fifo\npolicy_options: {small_fraction: 0.2}\ntiers:\n  - url: mem://\n    capacity: 1GiB\n"


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text(YAML)
    return str(path)


def test_another_policy_drops_the_files_policy_options_and_logs_it(config_file, caplog):
    with caplog.at_level(logging.INFO, logger="radixkv.config_env"):
        cfg = StoreConfig.from_env({"RADIXKV_CONFIG": config_file, "RADIXKV_POLICY": "lru"})
    assert cfg.policy == "lru" and cfg.policy_options == {}
    (record,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert f"RADIXKV_CONFIG={config_file}" in message and "'small_fraction': 0.2" in message
    assert "RADIXKV_POLICY_OPTIONS" in message


def test_the_same_policy_keeps_the_files_policy_options(config_file, caplog):
    with caplog.at_level(logging.INFO, logger="radixkv.config_env"):
        cfg = StoreConfig.from_env({"RADIXKV_CONFIG": config_file, "RADIXKV_POLICY": "s3fifo"})
    assert cfg.policy == "s3fifo" and cfg.policy_options == {"small_fraction": 0.2}
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]


def test_radixkv_policy_options_replace_the_files(config_file):
    cfg = StoreConfig.from_env({"RADIXKV_CONFIG": config_file, "RADIXKV_POLICY": "oddsref",
                                "RADIXKV_POLICY_OPTIONS": '{"gap_quantile": 0.7}'})
    assert cfg.policy == "oddsref" and cfg.policy_options == {"gap_quantile": 0.7}
    cfg = StoreConfig.from_env({"RADIXKV_CONFIG": config_file, "RADIXKV_POLICY_OPTIONS": '{"small_fraction": 0.3}'})
    assert cfg.policy == "s3fifo" and cfg.policy_options == {"small_fraction": 0.3}


def test_a_tiers_own_policy_options_are_kept(tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text("policy: s3fifo\npolicy_options: {small_fraction: 0.2}\ntiers:\n  - url: mem://\n"
                    "    capacity: 1GiB\n    policy: s3fifo\n    policy_options: {small_fraction: 0.3}\n"
                    "  - url: mem://?name=second\n    capacity: 1GiB\n")
    cfg = StoreConfig.from_env({"RADIXKV_CONFIG": str(path), "RADIXKV_POLICY": "lru"})
    first, second = cfg.tiers
    assert cfg.policy_options_of(first) == {"small_fraction": 0.3} and cfg.policy_of(second) == "lru"
    assert cfg.policy_options_of(second) == {}


def test_env_overrides_drops_them_only_given_the_base(config_file):
    base = StoreConfig.from_yaml(config_file)
    env = {"RADIXKV_POLICY": "lru"}
    assert env_overrides(StoreConfig, env) == {"policy": "lru"}  # no base: nothing known to drop
    assert env_overrides(StoreConfig, env, base=base) == {"policy": "lru", "policy_options": {}}
    as_mapping = {"policy": "s3fifo", "policy_options": {"small_fraction": 0.2}}
    assert env_overrides(StoreConfig, env, base=as_mapping)["policy_options"] == {}
    assert env_overrides(StoreConfig, {"RADIXKV_POLICY": "s3fifo"}, base=base) == {"policy": "s3fifo"}
    # a base mapping without 'policy' runs the default policy (lru): its options are lru's
    assert env_overrides(StoreConfig, {"RADIXKV_POLICY": "lru"}, base={"policy_options": {"x": 1}}) == {"policy": "lru"}
