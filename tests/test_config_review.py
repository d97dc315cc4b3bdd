"""Regression tests of the configuration/wiring review: URL passwords never shown, strict tier-URL
options, misspelt RADIXKV_* variables reported, the console command's bad arguments."""

from __future__ import annotations

import logging
import socket

import pytest

from radixkv import cli
from radixkv.config import StoreConfig, TierConfig, redact_url
from radixkv.errors import ConfigError
from radixkv.metrics import StoreMetrics
from radixkv.tiers.registry import make_tier

PW = "hunter2secret"


# ---------------------------------------------------------------- passwords never shown
@pytest.mark.parametrize(
    "build",
    [
        lambda: TierConfig(f"redis://:{PW}@h:6379/0", "lots"),  # bad capacity
        lambda: TierConfig(f"redis://user:{PW}@h:6379/0", policy="nope"),  # bad policy
        lambda: TierConfig(f"redsi://:{PW}@h:6379/0"),  # unknown scheme
        lambda: TierConfig(f"redis:/:{PW}@h:6379/0"),  # malformed (no ://)
        lambda: TierConfig(f"rediss+cluster://u:{PW}@h1:7000,h2:7001", options="x"),
        lambda: StoreConfig(f"redis://:{PW}@h/0"),  # tiers given as a string
        lambda: StoreConfig.from_dict({"tiers": [[f"redis://:{PW}@h/0"]]}),
        lambda: make_tier(f"redsi://:{PW}@h:1/0"),
        lambda: make_tier(f"redis:/:{PW}@h:1/0"),
    ],
)
def test_config_errors_never_show_the_url_password(build):
    with pytest.raises(ConfigError) as e:
        build()
    assert PW not in str(e.value)
    assert "***" in str(e.value) or "h" in str(e.value)


def test_tier_and_store_config_reprs_hide_the_url_password():
    tc = TierConfig(f"redis://user:{PW}@h:6379/0")
    cfg = StoreConfig([TierConfig("mem://", "1MiB"), tc])
    assert PW not in repr(tc) and PW not in repr(cfg) and PW not in str(cfg)
    assert "redis://user:***@h:6379/0" in repr(tc)
    assert tc.url == f"redis://user:{PW}@h:6379/0"  # the real URL is kept for the tier


def test_redact_url_masks_only_passwords():
    assert redact_url("redis://:p%40ss@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://user@h:1/0") == "redis://user@h:1/0"
    assert redact_url("file:///a:b@c/d") == "file:///a:b@c/d"
    assert redact_url("x 'rediss+cluster://u:pw@h1:1,h2:2' y") == "x 'rediss+cluster://u:***@h1:1,h2:2' y"


def test_redact_url_masks_a_password_holding_a_raw_at_sign():
    # The Redis tier takes the password up to the last '@' of the host part (as urllib does), so
    # "p@ss" is a working password; masking only up to its first '@' showed "ss".
    url = "redis://user:p@ss@h:6379/0"
    assert pytest.importorskip("radixkv.tiers.redis_client").parse_redis_url(url).password == "p@ss"
    assert redact_url(url) == "redis://user:***@h:6379/0"
    shown = redact_url(f"x '{url}', 'redis://:a@b@h2:1/0' y")
    assert shown == "x 'redis://user:***@h:6379/0', 'redis://:***@h2:1/0' y"
    assert "ss@" not in repr(TierConfig(url))


# ---------------------------------------------------------------- tier URLs
def test_a_blank_query_value_is_a_bad_value_not_a_repeat():
    with pytest.raises(ConfigError, match=r"pin='' must be a boolean"):
        make_tier("mem://?capacity=1MiB&pin=")


def test_integer_tier_options_are_not_truncated():
    for bad in (1.5, True, "2.0", "many"):
        with pytest.raises(ConfigError, match="io_threads=.* must be an integer"):
            make_tier("file:///tmp/radixkv-review-never-created?capacity=1MiB", io_threads=bad)


def test_tier_config_rejects_a_repeated_query_option():
    with pytest.raises(ConfigError, match="repeats a query option"):
        TierConfig("mem://?capacity=8GiB&capacity=4GiB")


def test_the_same_tier_config_listed_twice_gets_two_names_and_is_not_renamed():
    t = TierConfig("mem://", "1MiB")
    cfg = StoreConfig([t, t])
    assert cfg.tier_names == ("mem", "mem-2")
    assert t.name is None  # the caller's object is not mutated


# ---------------------------------------------------------------- environment
BASE = {"RADIXKV_TIERS": "mem://", "RADIXKV_TIER_CAPACITIES": "1MiB"}


@pytest.mark.parametrize(
    "var, meant",
    [
        ("RADIXKV_PROMOTE_ON_HITS", "RADIXKV_PROMOTE_ON_HIT"),
        ("RADIXKV_METRIC_PORT", "RADIXKV_METRICS_PORT"),
        ("RADIXKV_IOTHREADS", "RADIXKV_IO_THREADS"),
        ("RADIXKV_LEASE", "RADIXKV_LEASE_S"),
        ("radixkv_metrics_port", "RADIXKV_METRICS_PORT"),
    ],
)
def test_a_misspelt_store_variable_is_an_error_naming_the_right_one(var, meant):
    with pytest.raises(ConfigError, match=f"{var} is not understood; did you mean {meant}"):
        StoreConfig.from_env({**BASE, var: "0"})


def test_a_misspelt_store_variable_is_an_error_where_an_adapter_layers_the_environment(monkeypatch):
    # The engine adapters apply the non-tier RADIXKV_* variables over their own store config (the
    # SGLang extra config naming tiers, vLLM's "store" or "store_config_file") through
    # env_overrides: a misspelt one was silently ignored there, an error only without tiers.
    from radixkv.adapters.sglang_config import RadixKVOptions
    from radixkv.config_env import env_overrides

    with pytest.raises(ConfigError, match="RADIXKV_WRITE_POLCY is not understood; did you mean "
                                          "RADIXKV_WRITE_POLICY"):
        env_overrides(StoreConfig, {"RADIXKV_WRITE_POLCY": "write_back"})
    assert env_overrides(StoreConfig, {"RADIXKV_NATIVE": "0", "RADIXKV_TIER0_URL": "mem://",
                                       "RADIXKV_POLICY": "lfu"}) == {"policy": "lfu"}
    monkeypatch.setenv("RADIXKV_METRIC_PORT", "9400")
    opts = RadixKVOptions.from_extra_config({"tiers": [{"url": "mem://", "capacity": "1MiB"}]})
    with pytest.raises(ConfigError, match="did you mean RADIXKV_METRICS_PORT"):
        opts.store_config()


def test_sglang_keys_of_sglang_itself_are_not_reported_as_stray(caplog):
    # SGLang 0.5.23's unified radix cache puts --file-storage-path into every storage backend's extra
    # config (setdefault "file_storage_path"); radixkv logged it as a key "SGLang does not read".
    from radixkv.adapters.sglang_config import RadixKVOptions

    with caplog.at_level(logging.WARNING, logger="radixkv.adapters.sglang_config"):
        RadixKVOptions.from_extra_config({"backend_name": "radixkv", "file_storage_path": "/data/kv"})
        assert caplog.text == ""
        RadixKVOptions.from_extra_config({"file_storage_pth": "/data/kv"})
    assert "['file_storage_pth'] are neither radixkv options nor keys SGLang 0.5.23 reads" in caplog.text


def test_other_components_variables_stay_ignored():
    env = {**BASE, "RADIXKV_NATIVE": "0", "RADIXKV_COMPILED": "0", "RADIXKV_COMPILE": "0",
           "RADIXKV_STREAMING_COPY": "0", "RADIXKV_SOMETHING_ELSE": "x"}
    assert StoreConfig.from_env(env).tier_names == ("mem",)


def test_an_empty_radixkv_tiers_names_the_variable():
    for v in ("", " , "):
        with pytest.raises(ConfigError, match="RADIXKV_TIERS=.* names no tier"):
            StoreConfig.from_env({"RADIXKV_TIERS": v})


def test_a_zero_padded_tier_index_is_not_an_alias():
    env = {"RADIXKV_TIER0_URL": "mem://", "RADIXKV_TIER0_CAPACITY": "1MiB", "RADIXKV_TIER00_URL": "mem://"}
    with pytest.raises(ConfigError, match="RADIXKV_TIER00_URL is not understood"):
        StoreConfig.from_env(env)


# ---------------------------------------------------------------- metrics and CLI
def test_serving_metrics_on_an_impossible_port_is_a_warning(caplog):
    m = StoreMetrics(["mem"])
    with caplog.at_level(logging.WARNING, logger="radixkv.metrics"):
        assert m.serve(70000, "127.0.0.1") is None  # e.g. a base port + rank past 65535
    assert "cannot serve metrics" in caplog.text


def test_metrics_port_taken_is_a_warning(caplog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        with caplog.at_level(logging.WARNING, logger="radixkv.metrics"):
            assert StoreMetrics(["mem"]).serve(s.getsockname()[1], "127.0.0.1") is None
    finally:
        s.close()
    assert "cannot serve metrics" in caplog.text


def test_cli_subcommand_config_error_is_a_message_not_a_traceback(capsys):
    assert cli.main(["demo", "--page-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "radixkv demo: error:" in err and "chunk_tokens=0" in err and "Traceback" not in err


def test_cli_version_rejects_extra_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version", "extra"])
    assert e.value.code == 2
    assert "--version takes no arguments" in capsys.readouterr().err


def test_cli_version_says_which_builds_run(capsys):
    # Both are optional (no compiler, no mypyc, RADIXKV_COMPILE=0): an install must tell which it got.
    from radixkv import __version__, compiled, native

    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == __version__
    assert lines[1] == ("tree and policies: compiled (mypyc)" if compiled.active()
                        else f"tree and policies: Python ({compiled.reason()})")
    used = [name for name, on in native.available().items() if on]
    assert lines[2] == (f"C helpers: {', '.join(used)}" if used else "C helpers: none (the Python paths run)")


@pytest.mark.parametrize("value", [1e30, "9000000TiB", 1 << 63])
def test_a_size_past_8_eib_is_an_error_not_a_budget(value):
    from radixkv.sizes import parse_bytes

    with pytest.raises(ConfigError, match=r"capacity_bytes=.* is more than 8 EiB"):
        parse_bytes(value, "capacity_bytes")
    assert parse_bytes((1 << 63) - 1) == (1 << 63) - 1
