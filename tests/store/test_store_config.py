"""StoreConfig: from code, a dict, YAML and RADIXKV_* environment variables; every bad value is a
ConfigError naming the value and the fix; docs/configuration.md documents every option."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from radixkv.config import StoreConfig, TierConfig, parse_bytes
from radixkv.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

YAML_TEXT = """
policy: lru
write_policy: write_back
promote_on_hit: false
queue_depth: 32
tiers:
  - url: mem://
    capacity: 64MiB
  - url: file:///var/cache/radixkv
    capacity: 1GiB
    policy: lru
    options: {io_threads: 2}
  - url: redis://127.0.0.1:6379/0
"""


class TestLoaders:
    def test_defaults_and_names(self):
        cfg = StoreConfig(
            tiers=[
                TierConfig("mem://", "8GiB"),
                TierConfig("file:///x", 10 << 30),
                TierConfig("redis://h:1/0"),
                TierConfig("redis://h:2/0"),
            ]
        )
        assert cfg.tier_names == ("mem", "disk", "redis", "redis-2")
        assert cfg.tiers[0].capacity_bytes == 8 << 30
        assert cfg.write_policy == "write_through" and cfg.promote_on_hit is True
        assert cfg.tiers[2].capacity_bytes == 0  # unbounded on our side

    def test_yaml(self, tmp_path):
        path = tmp_path / "store.yaml"
        path.write_text(YAML_TEXT)
        cfg = StoreConfig.from_yaml(path)
        assert (
            cfg.write_policy == "write_back"
            and cfg.promote_on_hit is False
            and cfg.queue_depth == 32
        )
        assert [t.capacity_bytes for t in cfg.tiers] == [64 << 20, 1 << 30, 0]
        assert cfg.tiers[1].options == {"io_threads": 2}
        assert cfg.tier_names == ("mem", "disk", "redis")

    def test_env_list_form(self):
        env = {
            "RADIXKV_TIERS": "mem://, file:///tmp/rkv",
            "RADIXKV_TIER_CAPACITIES": "1GiB,10GB",
            "RADIXKV_WRITE_POLICY": "write_back",
            "RADIXKV_PROMOTE_ON_HIT": "no",
            "RADIXKV_LEASE_S": "5",
            "RADIXKV_SOMETHING_ELSE": "ignored",
        }
        cfg = StoreConfig.from_env(env)
        assert [t.url for t in cfg.tiers] == ["mem://", "file:///tmp/rkv"]
        assert [t.capacity_bytes for t in cfg.tiers] == [1 << 30, 10 * 10**9]
        assert (
            cfg.write_policy == "write_back" and cfg.promote_on_hit is False and cfg.lease_s == 5.0
        )

    def test_env_indexed_form_over_yaml(self, tmp_path):
        path = tmp_path / "store.yaml"
        path.write_text(YAML_TEXT)
        env = {
            "RADIXKV_CONFIG": str(path),
            "RADIXKV_TIER0_URL": "mem://",
            "RADIXKV_TIER0_CAPACITY": "2GiB",
            "RADIXKV_TIER1_URL": "redis://r:6379/1",
            "RADIXKV_TIER1_NAME": "remote",
            "RADIXKV_QUEUE_DEPTH": "8",
        }
        cfg = StoreConfig.from_env(env)
        assert cfg.tier_names == ("mem", "remote")
        assert cfg.queue_depth == 8 and cfg.write_policy == "write_back"  # the rest from YAML

    def test_env_yaml_only(self, tmp_path):
        path = tmp_path / "store.yaml"
        path.write_text(YAML_TEXT)
        assert StoreConfig.from_env({"RADIXKV_CONFIG": str(path)}).tier_names == (
            "mem",
            "disk",
            "redis",
        )

    def test_env_refines_an_adapters_default_tiers(self):
        # An adapter's default (one memory tier) when the environment names no tiers; every other
        # variable still applies, so RADIXKV_POLICY alone is not silently ignored.
        default = [{"url": "mem://", "capacity": "4GiB"}]
        cfg = StoreConfig.from_env({"RADIXKV_POLICY": "s3fifo"}, default_tiers=default)
        assert cfg.policy == "s3fifo" and cfg.tiers[0].capacity_bytes == 4 << 30
        named = StoreConfig.from_env({"RADIXKV_TIERS": "mem://", "RADIXKV_TIER_CAPACITIES": "1MiB"},
                                     default_tiers=default)
        assert named.tiers[0].capacity_bytes == 1 << 20
        with pytest.raises(ConfigError, match="no tiers configured"):
            StoreConfig.from_env({"RADIXKV_POLICY": "s3fifo"})
        with pytest.raises(ConfigError, match="without RADIXKV_TIERS"):
            StoreConfig.from_env({"RADIXKV_TIER_CAPACITIES": "1GiB"}, default_tiers=default)

    def test_url_capacity_form(self):
        assert TierConfig("mem://?capacity=2MiB").capacity_bytes == 2 << 20
        with pytest.raises(ConfigError, match="give it once"):
            TierConfig("mem://?capacity=2MiB", capacity_bytes=1 << 20)

    def test_policy_options(self):
        cfg = StoreConfig.from_dict(
            {
                "tiers": [
                    "mem://?capacity=1MiB",
                    {
                        "url": "file:///x",
                        "capacity": "1MiB",
                        "policy": "s3fifo",
                        "policy_options": {"small_fraction": 0.2},
                    },
                ],
                "policy": "cost",
                "policy_options": {"attention_tokens": 4096},
            }
        )
        assert cfg.policy_options_of(cfg.tiers[0]) == {"attention_tokens": 4096}
        assert cfg.policy_options_of(cfg.tiers[1]) == {"small_fraction": 0.2}
        env = {
            "RADIXKV_TIERS": "mem://",
            "RADIXKV_TIER_CAPACITIES": "1MiB",
            "RADIXKV_POLICY": "s3fifo",
            "RADIXKV_POLICY_OPTIONS": '{"small_fraction": 0.25}',
        }
        assert StoreConfig.from_env(env).policy_options == {"small_fraction": 0.25}

    def test_parse_bytes(self):
        assert (
            parse_bytes("1.5KiB", "x") == 1536
            and parse_bytes(7, "x") == 7
            and parse_bytes("3 MB", "x") == 3_000_000
            and parse_bytes("64M", "x") == 64_000_000
        )
        with pytest.raises(ConfigError, match="whole number of bytes"):
            parse_bytes("1.0001KiB", "x")

    def test_parse_bytes_is_exact_for_decimals(self):
        # Found by a review: float arithmetic refused exact sizes ("1.001KB is not a whole number of
        # bytes; round it, e.g. 1000 or 1001") and suggested wrong roundings.
        assert parse_bytes("1.001KB") == 1001 and parse_bytes("1.015MB") == 1_015_000
        assert all(parse_bytes(f"{i / 1000:.3f}KB") == i for i in range(1, 5000))
        with pytest.raises(ConfigError, match=r"round it, e.g. 1 or 2"):
            parse_bytes("1.5B")

    def test_env_tiers_keep_a_cluster_url_with_seed_commas(self):
        env = {
            "RADIXKV_TIERS": "mem://, redis+cluster://h1:7000,h2:7001,h3:7002/0",
            "RADIXKV_TIER_CAPACITIES": "1GiB,0",
        }
        cfg = StoreConfig.from_env(env)
        assert [t.url for t in cfg.tiers] == ["mem://", "redis+cluster://h1:7000,h2:7001,h3:7002/0"]

    def test_metrics_port_is_checked(self):
        for bad in (-1, 70000, "x"):
            with pytest.raises(ConfigError, match="metrics_port"):
                StoreConfig(tiers=["mem://?capacity=1M"], metrics_port=bad)
        assert StoreConfig.from_env({"RADIXKV_TIERS": "mem://", "RADIXKV_TIER_CAPACITIES": "1M",
                                     "RADIXKV_METRICS_PORT": "9400"}).metrics_port == 9400

    def test_every_size_the_config_takes_opens_a_store(self, tmp_path):
        # The tier registry once had its own size parser without K/M/G/T: a config that validated
        # then failed to open ("capacity_bytes='1M' is not a size").
        from radixkv.store import HierarchicalStore

        cfg = StoreConfig(tiers=["mem://?capacity=1M", {"url": f"file://{tmp_path}?capacity=10M"}])
        with HierarchicalStore(cfg) as store:
            assert [t.capacity_bytes for t in store.tiers] == [1_000_000, 10_000_000]


BAD = [
    (dict(tiers=[]), "non-empty list of tiers"),
    (
        dict(tiers=[{"url": "mem://", "capacity": "lots"}]),
        "capacity_bytes of tier 'mem://'='lots' is not a size",
    ),
    (dict(tiers=[{"url": "mem://"}]), "0 \\(unbounded\\), which a mem tier cannot be"),
    (dict(tiers=[{"url": "file:///x"}]), "which a disk tier cannot be"),
    (dict(tiers=[{"url": "file://relative/x", "capacity": 1}]), "absolute directory"),
    (dict(tiers=[{"url": "ftp://x", "capacity": 1}]), "unknown scheme 'ftp'"),
    (
        dict(tiers=[{"url": "mem://", "capacity": 1, "colour": "red"}]),
        "unknown key\\(s\\) \\['colour'\\]",
    ),
    (dict(tiers=[{"capacity": 1}]), "has no 'url'"),
    (dict(tiers=[{"url": "mem://", "capacity": -5}]), "must be >= 0"),
    (
        dict(
            tiers=[
                {"url": "mem://", "capacity": 1, "name": "a"},
                {"url": "mem://", "capacity": 1, "name": "a"},
            ]
        ),
        "used twice",
    ),
    (
        dict(tiers=["mem://?capacity=1MiB"], write_policy="write_around"),
        "write_policy='write_around'",
    ),
    (
        dict(tiers=["mem://?capacity=1MiB"], policy="random"),
        "policy='random' is not a known eviction policy",
    ),
    (
        dict(tiers=[{"url": "mem://", "capacity": 1, "policy": "nope"}]),
        "policy of tier 'mem://'='nope'",
    ),
    (dict(tiers=["mem://?capacity=1MiB"], queue_depth=0), "queue_depth=0 must be an integer >= 1"),
    (dict(tiers=["mem://?capacity=1MiB"], io_threads="two"), "io_threads='two' is not an integer"),
    (dict(tiers=["mem://?capacity=1MiB"], lease_s=-1), "lease_s=-1 must be a positive"),
    (
        dict(tiers=["mem://?capacity=1MiB"], promote_on_hit="maybe"),
        "promote_on_hit='maybe' is not a boolean",
    ),
    (dict(tiers=["mem://?capacity=1MiB"], bogus=1), "unknown key\\(s\\) \\['bogus'\\]"),
    (
        dict(tiers=["mem://?capacity=1MiB"], policy="s3fifo", policy_options={"size": 3}),
        "unknown option 'size' for eviction policy 's3fifo'; its options: small_fraction",
    ),
    (dict(tiers=["mem://?capacity=1MiB"], policy_options="{nope"), "not a JSON object"),
    (dict(tiers=["mem://?capacity=1MiB"], policy_options=[1]), "must be a mapping"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_values_name_the_value(data, message):
    with pytest.raises(ConfigError, match=message):
        StoreConfig.from_dict(data)


class TestBadFilesAndEnv:
    def test_missing_file(self, tmp_path):
        with pytest.raises(ConfigError, match="cannot read store config file"):
            StoreConfig.from_yaml(tmp_path / "nope.yaml")

    def test_invalid_yaml_and_empty(self, tmp_path):
        bad = tmp_path / "bad.yaml"
        bad.write_text("tiers: [unclosed\n")
        with pytest.raises(ConfigError, match="not valid YAML"):
            StoreConfig.from_yaml(bad)
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        with pytest.raises(ConfigError, match="is empty"):
            StoreConfig.from_yaml(empty)

    def test_non_utf8_file(self, tmp_path):
        # Was a bare UnicodeDecodeError (neither an OSError nor a YAMLError).
        latin = tmp_path / "latin1.yaml"
        latin.write_bytes("tiers: [{url: 'mem://', capacity: 1GiB}]\nmetrics_addr: caf\xe9\n".encode("latin-1"))
        with pytest.raises(ConfigError, match="latin1.yaml.*not UTF-8"):
            StoreConfig.from_yaml(latin)

    def test_unknown_keys_of_mixed_types(self, tmp_path):
        # YAML reads `on:` as the bool True and `1:` as an int: sorting them with 'foo' for the message
        # was a TypeError.
        path = tmp_path / "keys.yaml"
        path.write_text("tiers: [{url: 'mem://', capacity: 1GiB}]\non: 1\nfoo: 2\n")
        with pytest.raises(ConfigError, match=r"unknown key\(s\) \['foo', True\]"):
            StoreConfig.from_yaml(path)
        with pytest.raises(ConfigError, match=r"tiers\[0\] has unknown key\(s\) \['x', 1\]"):
            StoreConfig.from_dict({"tiers": [{"url": "mem://", "capacity": "1GiB", 1: 2, "x": 3}]})

    @pytest.mark.parametrize(
        "env,message",
        [
            ({}, "no tiers configured"),
            (
                {"RADIXKV_TIERS": "mem://,file:///x", "RADIXKV_TIER_CAPACITIES": "1GiB"},
                "has 1 entries but",
            ),
            ({"RADIXKV_TIERS": "mem://", "RADIXKV_TIER0_URL": "mem://"}, "not both"),
            ({"RADIXKV_TIER1_URL": "mem://"}, "without gaps"),
            ({"RADIXKV_TIER0_CAPACITY": "1GiB"}, "RADIXKV_TIER0_URL is missing"),
            ({"RADIXKV_TIER0_SIZE": "1GiB"}, "RADIXKV_TIER0_SIZE is not understood"),
            (
                {
                    "RADIXKV_TIERS": "mem://",
                    "RADIXKV_TIER_CAPACITIES": "1GiB",
                    "RADIXKV_WRITE_POLICY": "x",
                },
                "write_policy='x'",
            ),
        ],
    )
    def test_bad_env(self, env, message):
        with pytest.raises(ConfigError, match=message):
            StoreConfig.from_env(env)


def test_docs_cover_every_option():
    """docs/configuration.md names every config field and every environment variable form."""
    text = DOCS.read_text()
    for cls in (StoreConfig, TierConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in text, (
                f"{cls.__name__}.{f.name} is not documented in {DOCS.name}"
            )
        for f in dataclasses.fields(StoreConfig):
            if f.name != "tiers":
                assert f"RADIXKV_{f.name.upper()}" in text, (
                    f"RADIXKV_{f.name.upper()} not documented"
                )
    for var in (
        "RADIXKV_CONFIG",
        "RADIXKV_TIERS",
        "RADIXKV_TIER_CAPACITIES",
        "RADIXKV_TIER<i>_URL",
    ):
        assert var in text


def test_docs_list_every_policy_option_with_its_default():
    """docs/configuration.md's policy table names every option each eviction policy takes (what
    policy_options and `radixkv sim --policy NAME:KEY=VALUE` accept) with its default."""
    import inspect

    from radixkv.policies import POLICIES

    text = DOCS.read_text()
    table = text[text.index("## Policy options"):text.index("## `TierConfig` options")]
    # The runtime's own policies: not OPT (offline: it needs the future, which the simulator tells
    # it), nor the ones tests register.
    runtime = {n: c for n, c in POLICIES.items()
               if c.__module__.startswith("radixkv.") and not getattr(c, "offline", False)}
    assert {"lru", "lfu", "s3fifo", "sieve", "cost", "agedref", "oddsref"} <= set(runtime)
    for name, cls in runtime.items():
        assert f"`{name}`" in table, f"policy {name!r} is missing from the policy options table"
        for p in inspect.signature(cls).parameters.values():
            assert f"`{p.name}` ({p.default:g}" in table, (
                f"option {p.name}={p.default!r} of policy {name!r} is not in {DOCS.name}'s policy table"
            )
