"""What the docs show a user, run through the real code: the YAML and environment examples of
docs/configuration.md, the launch configs of docs/sglang.md, docs/vllm.md and the README load and
mean what the prose around them says, the API tour of docs/store.md runs as written, and every
default column of the option tables (and the Redis row of docs/tiers.md) equals the code's default.
A doc or a default edited alone fails here."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from radixkv.adapters.sglang_config import DEFAULT_TIERS, RadixKVOptions
from radixkv.adapters.vllm_options import VllmConnectorOptions
from radixkv.config import StoreConfig, TierConfig
from radixkv.sizes import parse_bytes
from radixkv.tiers.redis_client import RedisTierConfig

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _doc(name: str) -> str:
    return (ROOT / name).read_text()


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def _quoted_json_after(text: str, flag: str) -> list[dict]:
    """The JSON objects a shell command passes as ``flag '<json>'``, as the shell hands them over."""
    out = []
    for block in _fenced(text, "bash"):
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        out += [json.loads(words[i + 1]) for i, w in enumerate(words) if w == flag]
    return out


def _defaults_table(text: str, heading: str) -> dict[str, str]:
    """``{option: default cell}`` of the first table after ``heading``; a row naming several options
    (``| `a`, `b` | 1, 2 |``) gives one entry each."""
    section = text[text.index(heading):]
    table = section[:section.index("\n\n", section.index("| ---"))]
    rows = re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", table, re.M)
    out: dict[str, str] = {}
    for names, defaults in rows:
        names_l = re.findall(r"`([^`]+)`", names)
        cells = [c.strip() for c in defaults.split(",")] if len(names_l) > 1 else [defaults.strip()]
        assert len(cells) == len(names_l), (names, defaults)
        out.update(zip(names_l, cells))
    return out


def _value(cell: str):
    """A default cell as a value: YAML (`true`, `0`, `"lru"`, `{}`) or a size (`2 GiB`)."""
    cell = cell.strip("`")
    if re.fullmatch(r"[0-9.]+ ?[KMGT]i?B", cell):
        return parse_bytes(cell)
    return yaml.safe_load(cell)


def _code_defaults(cls) -> dict:
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------- docs/configuration.md

def test_configuration_yaml_example_loads_as_described(tmp_path):
    (block,) = _fenced(_doc("docs/configuration.md"), "yaml")
    path = tmp_path / "radixkv.yaml"
    path.write_text(block)
    cfg = StoreConfig.from_yaml(path)
    assert [(t.name, t.url, t.capacity_bytes) for t in cfg.tiers] == [
        ("mem", "mem://", 8 * GiB),
        ("disk", "file:///var/cache/radixkv", 100 * GiB),
        ("redis", "redis://cache.internal:6379/0", 0),
    ]
    disk = cfg.tiers[1]
    assert (cfg.policy_of(disk), cfg.policy_options_of(disk), disk.options) == (
        "s3fifo", {"small_fraction": 0.1}, {"io_threads": 4})
    assert cfg.policy_of(cfg.tiers[0]) == "lru" and cfg.tiers[2].options == {"ttl_s": 86400}
    assert (cfg.write_policy, cfg.promote_on_hit) == ("write_through", True)


def test_configuration_environment_example_loads_as_described():
    (block,) = [b for b in _fenced(_doc("docs/configuration.md"), "sh") if "export RADIXKV_" in b]
    env = {k: v for k, v in (shlex.split(line)[1].split("=", 1) for line in block.splitlines() if line)}
    cfg = StoreConfig.from_env(env)
    assert [(t.kind, t.capacity_bytes) for t in cfg.tiers] == [
        ("mem", 8 * GiB), ("disk", 100 * GiB), ("redis", 0)]
    assert cfg.write_policy == "write_back"


@pytest.mark.parametrize(("cls", "heading"), [(StoreConfig, "## `StoreConfig` options"),
                                              (TierConfig, "## `TierConfig` options")])
def test_configuration_default_columns_are_the_code_defaults(cls, heading):
    table = _defaults_table(_doc("docs/configuration.md"), heading)
    code = _code_defaults(cls)
    assert set(table) == set(code), "every field has a row, and every row a field"
    for name, cell in table.items():
        if cell in ("required", "from the scheme") or cell.startswith("store's"):
            continue  # no default of its own
        assert _value(cell) == code[name], f"{heading}: {name} is {cell} there, {code[name]!r} in code"


# ---------------------------------------------------------------- docs/store.md

def test_store_api_example_runs_as_written(tmp_path, monkeypatch):
    """The API tour at the top of docs/store.md, run as written over a memory tier and a shared disk
    directory (so ``borrow`` has a tier to borrow from): each comment's claim holds."""
    import torch

    (block,) = [b for b in _fenced(_doc("docs/store.md"), "python") if "HierarchicalStore(" in b]
    (tmp_path / "radixkv.yaml").write_text(
        f"tiers:\n  - {{url: 'mem://', capacity: 8MiB}}\n"
        f"  - {{url: 'file://{tmp_path}/disk', capacity: 8MiB, options: {{shared: true}}}}\n")
    monkeypatch.chdir(tmp_path)
    payloads = [torch.full((4096,), i, dtype=torch.uint8) for i in range(6)]
    scope = {"token_ids": list(range(6 * 64)), "payloads": payloads,
             "buffers": [torch.zeros(4096, dtype=torch.uint8) for _ in range(6)]}
    store_close = block.rindex("store.close()")
    exec(compile(block[:store_close], "docs/store.md", "exec"), scope)  # everything but the close
    store = scope["store"]
    try:
        assert scope["ok"] == [True] * 6 and scope["n"] == 6 and scope["k"] == 0
        assert all(torch.equal(a, b) for a, b in zip(scope["buffers"], payloads))
        # The tour deletes chunk 3 right after starting the prefetch: an explicit delete wins over
        # the prefetch's pins, so a read that had not reached chunk 3 yet stops there (a miss).
        assert scope["h"].wait(5) in (3, 6) and scope["h"].done()
        assert store.lookup(scope["ns"], scope["keys"]) == 3  # chunk 3 and everything after it went
    finally:
        store.close()


# ---------------------------------------------------------------- docs/tiers.md

def test_tiers_redis_option_defaults_are_the_code_defaults():
    row = next(line for line in _doc("docs/tiers.md").splitlines() if line.startswith("| `redis://`"))
    documented = dict(re.findall(r"`(\w+)` \(([^)]+)\)", row))
    code = _code_defaults(RedisTierConfig)
    named = {k: v for k, v in documented.items() if k in code and k != "capacity_bytes"}
    assert set(named) == set(code) - {"url", "capacity_bytes"}, "every option's default is documented"
    for name, cell in named.items():
        value = None if cell == "none" else _value(cell)
        assert value == code[name], f"docs/tiers.md: {name} is {cell} there, {code[name]!r} in code"


# ---------------------------------------------------------------- SGLang (README, docs/sglang.md)

@pytest.mark.parametrize("doc", ["README.md", "docs/sglang.md"])
def test_sglang_launch_extra_config_loads_as_described(doc, monkeypatch):
    for var in [k for k in os.environ if k.upper().startswith("RADIXKV_")]:
        monkeypatch.delenv(var)
    (extra,) = _quoted_json_after(_doc(doc), "--hicache-storage-backend-extra-config")
    opts = RadixKVOptions.from_extra_config(extra)
    cfg = opts.store_config()
    assert opts.interface_v1 is True
    if doc == "README.md":  # no tiers given: the default store
        assert [(t.url, t.capacity_bytes) for t in cfg.tiers] == [
            (t["url"], parse_bytes(t["capacity"])) for t in DEFAULT_TIERS] == [("mem://", 4 * GiB)]
    else:
        assert [(t.kind, t.capacity_bytes) for t in cfg.tiers] == [
            ("mem", 32 * GiB), ("disk", 1 << 40), ("redis", 0)]
        assert cfg.write_policy == "write_through"


def test_sglang_option_defaults_are_the_code_defaults():
    table = _defaults_table(_doc("docs/sglang.md"), "## Options (extra config)")
    store = _code_defaults(StoreConfig)
    assert set(store) - {"tiers"} <= set(table), "every store field the backend reads has a row"
    for name, cell in table.items():
        if name in store and name != "tiers":
            assert _value(cell) == store[name], f"docs/sglang.md: {name} documented as {cell}"
    assert _value(table["interface_v1"]) == RadixKVOptions.from_extra_config({}).interface_v1
    assert table["tiers"] == "one `mem://` tier of 4 GiB"
    assert DEFAULT_TIERS == [{"url": "mem://", "capacity": "4GiB"}]


# ---------------------------------------------------------------- vLLM (README, docs/vllm.md)

@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_vllm_kv_transfer_config_loads_as_described(doc):
    (config,) = _quoted_json_after(_doc(doc), "--kv-transfer-config")
    assert (config["kv_connector"], config["kv_connector_module_path"], config["kv_role"]) == (
        "RadixKVConnector", "radixkv.adapters.vllm", "kv_both")
    opts = VllmConnectorOptions.from_extra_config(config.get("kv_connector_extra_config"))
    if doc == "docs/vllm.md":
        cfg = StoreConfig.from_dict(opts.store)
        assert opts.chunk_tokens == 256 and config["kv_load_failure_policy"] == "recompute"
        # "with TP=2 the example may use 400 GiB under /var/cache/radixkv": 200 GiB per worker
        assert [(t.kind, t.capacity_bytes) for t in cfg.tiers] == [
            ("mem", 16 * GiB), ("disk", 200 * GiB), ("redis", 0)]


def test_vllm_option_defaults_are_the_code_defaults():
    table = _defaults_table(_doc("docs/vllm.md"), "## 2. Options")
    code = _code_defaults(VllmConnectorOptions)
    assert set(code) <= set(table), "every option has a row"
    for name, cell in table.items():
        if cell == "—" or name in ("chunk_tokens", "model_name"):  # none, or derived from vLLM's config
            assert code.get(name) is None, name
            continue
        assert _value(cell) == code[name], f"docs/vllm.md: {name} is {cell} there, {code[name]!r} in code"
