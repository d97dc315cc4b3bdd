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


@pytest.mark.parametrize("password", ["Ab+c/De=fG", "pa?ss", "pass word", "it's", 'say"hi'])
def test_a_password_holding_a_raw_slash_question_mark_space_or_quote_is_never_shown(password):
    # base64 passwords hold '/': the host part then ended early, and the password was shown whole by
    # the TierConfig/StoreConfig repr and, cut into a "host" and a "port", by the Redis tier's error.
    url = f"redis://user:{password}@h:6379/0"
    pieces = [p for p in {password, *password.replace("?", "/").replace(" ", "/").split("/")} if len(p) > 2]
    tc = TierConfig(url)
    shown = [repr(tc), repr(StoreConfig([TierConfig("mem://", "1MiB"), tc]))]
    if password.isprintable() and not set(password) & set(" '\""):  # in free text these end the URL
        shown.append(redact_url(f"tier {url} failed"))
    with pytest.raises(ConfigError) as e:
        TierConfig(url, policy="nope")
    shown.append(str(e.value))
    redis_client = pytest.importorskip("radixkv.tiers.redis_client")
    try:
        redis_client.parse_redis_url(url)
    except ConfigError as e2:  # a raw '/' or '?' ends the host part: the URL is invalid
        assert "/" in password or "?" in password
        assert "percent-encode" in str(e2)
        shown.append(str(e2))
    for enc in ("Ab%2Bc%2FDe%3DfG", "pa%3Fss"):  # percent-encoded, both work and stay hidden
        assert redis_client.parse_redis_url(f"redis://user:{enc}@h:6379/0").password in ("Ab+c/De=fG", "pa?ss")
    shown.append(repr(redis_client.RedisTierConfig(url="redis://user:Ab%2Bc%2FDe%3DfG@h:6379/0")))
    for text in shown:
        assert "user:***@h:6379/0" in text or "user:***@h:6379" in text, text
        assert not [p for p in pieces if p in text], text
    assert "Ab%2Bc" not in shown[-1]


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


# ---------------------------------------------------------------- options ignored or misapplied
def test_a_tier_url_name_names_the_tier(tmp_path):
    # Found by a review: ?name= (a documented URL option of every tier) was ignored by TierConfig,
    # which named the tier after its scheme; opening it then failed with "name is given twice
    # ('fast' in the URL, 'mem' as a keyword)", a name the user never gave.
    from radixkv.store import HierarchicalStore

    cfg = StoreConfig.from_dict({"tiers": ["mem://?capacity=4MiB&name=fast",
                                           f"file://{tmp_path}/d?capacity=4MiB&name=slow"]})
    assert cfg.tier_names == ("fast", "slow")
    store = HierarchicalStore(cfg)
    try:
        assert [t.name for t in store.tiers] == ["fast", "slow"]
    finally:
        store.close()
    assert StoreConfig.from_env({"RADIXKV_TIERS": "mem://?capacity=4MiB&name=fast"}).tier_names == ("fast",)
    assert TierConfig("redis://127.0.0.1:1/0?name=l3").name == "l3"
    redis = make_tier("redis://127.0.0.1:1/0?name=l3")
    assert redis.name == "l3"
    redis.close()
    with pytest.raises(ConfigError, match="name 'fast' in the URL and name='other'"):
        TierConfig("mem://?capacity=4MiB&name=fast", name="other")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?ttl_s=5&ttl_s=6",
                                 "redis://127.0.0.1:1/0?capacity=1GiB&capacity_bytes=2GiB",
                                 "rediss://127.0.0.1:1/0?ssl_cert_reqs=none&ssl_cert_reqs=required"])
def test_a_redis_url_option_given_twice_is_an_error(url):
    # Found by a review: make_tier's Redis URLs took the last value (ttl_s=6), though a query option
    # is given once (docs/configuration.md), as mem:// and file:// URLs check.
    with pytest.raises(ConfigError, match="given twice"):
        make_tier(url)


@pytest.mark.parametrize("option", ["ttl_s", "socket_timeout_s", "socket_connect_timeout_s",
                                    "down_backoff_s", "max_connections"])
def test_true_is_not_a_number_of_a_redis_option(option):
    # Found by a review: True passed the number checks (bool is an int): ttl_s=true expired every
    # chunk after a second, max_connections=true gave a one-connection pool.
    with pytest.raises(ConfigError, match=f"{option}=True must be a number"):
        make_tier("redis://127.0.0.1:1/0", **{option: True})


def test_true_is_not_a_number_of_seconds_of_a_disk_tier(tmp_path):
    with pytest.raises(ConfigError, match="stale_temp_s=True must be a number"):
        make_tier(f"file://{tmp_path}/d", capacity_bytes="1MiB", stale_temp_s=True)


@pytest.mark.parametrize("options", [{"capacity_bytes": "8MiB"}, {"capacity": "8MiB"}, {"name": "x"}])
def test_tier_options_cannot_repeat_the_tiers_name_or_capacity(options):
    # Found by a review: options={capacity_bytes: 8MiB} beside capacity 4MiB was silently dropped
    # (the tier held 4 MiB), options={name: x} failed the store's open with a TypeError.
    with pytest.raises(ConfigError, match="not an option"):
        StoreConfig.from_dict({"tiers": [{"url": "mem://", "capacity": "4MiB", "options": options}]})


def test_a_metrics_port_without_metrics_is_an_error():
    # Found by a review: metrics=false keeps no registry, so metrics_port served nothing, silently.
    with pytest.raises(ConfigError, match="metrics_port=9400 .* metrics=false"):
        StoreConfig.from_dict({"tiers": ["mem://?capacity=4MiB"], "metrics": False, "metrics_port": 9400})
    with pytest.raises(ConfigError, match="metrics_port=9400"):
        StoreConfig.from_env({"RADIXKV_TIERS": "mem://?capacity=4MiB", "RADIXKV_METRICS": "0",
                              "RADIXKV_METRICS_PORT": "9400"})
    assert StoreConfig.from_dict({"tiers": ["mem://?capacity=4MiB"], "metrics": False}).metrics_port == 0


@pytest.mark.parametrize("var", ["radixkv_tier0_url", "RADIXKV_tier0_url", "Radixkv_Tier0_Url"])
def test_a_tier_variable_in_the_wrong_case_is_an_error(var):
    # Found by a review: only exact upper-case tier variables were read or checked; these were
    # ignored, and an adapter opened its default memory tier in place of the tier named.
    with pytest.raises(ConfigError, match=f"{var} is not understood"):
        StoreConfig.from_env({var: "mem://?capacity=4MiB"}, default_tiers=["mem://?capacity=8MiB"])


def test_redis_size_options_take_units_as_keywords_too():
    # Found by a review: batch_bytes="32MiB" worked in the URL but was an error in a tier's options
    # (a YAML config), though every size takes a unit (docs/configuration.md, "Sizes").
    tier = StoreConfig.from_dict({"tiers": [{"url": "redis://127.0.0.1:1/0", "capacity": "1GiB",
                                             "options": {"batch_bytes": "32MiB"}}]}).tiers[0]
    from radixkv.store import open_tier

    redis = open_tier(tier)
    try:
        assert redis.config.batch_bytes == 32 << 20 and redis.capacity_bytes == 1 << 30
    finally:
        redis.close()
    with pytest.raises(ConfigError, match="batch_bytes"):
        make_tier("redis://127.0.0.1:1/0", batch_bytes="lots")


@pytest.mark.parametrize(("a", "b"), [
    ("file:///tmp/rk-tier", "file:///tmp/rk-tier/"),  # one directory, spelt twice
    ("file:///tmp/rk-tier", "file:///tmp/rk-tier/inner"),  # the outer tier's scan would take it as a namespace
    ("redis://127.0.0.1:6400/0", "redis://:pw@127.0.0.1:6400"),
    ("redis://127.0.0.1:6400/2?key_prefix=kv", "redis://127.0.0.1:6400/2"),
])
def test_two_tiers_keeping_chunks_in_one_place_are_refused(a, b):
    # Found by a review: two disk tiers on one directory (or two Redis tiers on one database and key
    # prefix) were accepted. Each keeps its own books and evicts, clears and scans on its own, so one
    # deletes the other's chunks.
    options = {"key_prefix": "kv"} if "redis" in b and "key_prefix" in a else {}
    with pytest.raises(ConfigError, match="keep chunks in the same"):
        StoreConfig.from_dict({"tiers": [{"url": a, "capacity": "1MiB"},
                                         {"url": b, "capacity": "1MiB", "options": options}]})


def test_tiers_in_separate_places_are_accepted():
    tiers = StoreConfig.from_dict({"tiers": [
        "mem://?capacity=1MiB", "mem://?capacity=1MiB",  # process-local: two caches
        "file:///tmp/rk-tier?capacity=1MiB", "file:///tmp/rk-tier2?capacity=1MiB",  # a shared name prefix only
        "redis://127.0.0.1:6400/0", "redis://127.0.0.1:6400/1", "redis://127.0.0.1:6400/0?key_prefix=other",
        "redis://127.0.0.1:6401/0"]}).tiers
    assert len(tiers) == 8


def test_an_offline_policy_is_refused_whatever_was_imported():
    """Found by an audit: StoreConfig(policy="opt") was refused in a fresh process but accepted once
    radixkv.sims had registered opt; a store would then run a policy that never learns the future."""
    import radixkv.sims.opt  # noqa: F401  (registers opt)

    with pytest.raises(ConfigError, match="offline policy"):
        StoreConfig(tiers=[TierConfig("mem://", 1 << 20)], policy="opt")
    with pytest.raises(ConfigError, match="offline policy"):
        TierConfig("mem://", 1 << 20, policy="opt")
