"""Chunk keys: SGLang's page-key chain bit for bit, determinism across processes, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from radixkv.errors import ConfigError, InputError
from radixkv.keys import Namespace, chunk_keys, namespace_seed, sglang_page_keys

# Fixed vectors, computed once from the recipe with hashlib (see test_matches_independent_recipe).
VECTORS = {
    (tuple(range(10)), 4, None, None): [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ],
    ((2**40, 1, 2, 3), 4, "lora", "s"): [
        "15e76d701a21ffc3d8d3d3ee42e40bd9b51b519c86ffbc8982e03b9707b9a769",
    ],
}


def _recipe(tokens: list[int], page: int, extra: str | None, salt: str | None) -> list[str]:
    """The byte recipe of sglang/srt/mem_cache/utils.py, written out independently."""

    def part(v: str | None) -> bytes:
        if v is None:
            return b"\x00"
        raw = v.encode()
        return b"\x01" + struct.pack("<Q", len(raw)) + raw

    prior = None
    if extra is not None or salt is not None:
        prior = hashlib.sha256(b"sglang-cache-namespace-v1" + part(extra) + part(salt)).digest()
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        pg = tokens[i : i + page]
        h = hashlib.sha256(prior or b"")
        if max(pg) > 2**32 - 1:
            h.update(b"\xff" + struct.pack(f"<{page}Q", *pg))
        else:
            h.update(struct.pack(f"<{page}I", *pg))
        prior = h.digest()
        out.append(prior.hex())
    return out


@pytest.mark.parametrize("case", list(VECTORS))
def test_fixed_vectors(case):
    tokens, page, extra, salt = case
    assert sglang_page_keys(list(tokens), page, extra_key=extra, cache_salt=salt) == VECTORS[case]


@pytest.mark.parametrize("page", [1, 3, 16, 64])
@pytest.mark.parametrize("salts", [(None, None), ("lora-a", None), (None, "tenant"), ("x", "y")])
def test_matches_independent_recipe(page, salts):
    import random

    rng = random.Random(page)
    tokens = [rng.randrange(0, 150_000) for _ in range(page * 5 + page // 2)]
    tokens[page] = 2**33  # one wide page
    assert sglang_page_keys(tokens, page, *salts) == _recipe(tokens, page, *salts)


def test_partial_page_and_empty():
    assert sglang_page_keys([], 16) == []
    assert sglang_page_keys(list(range(15)), 16) == []
    assert len(sglang_page_keys(list(range(33)), 16)) == 2


def test_chain_continuation_and_prefix_property():
    tokens = list(range(64))
    full = sglang_page_keys(tokens, 16)
    assert sglang_page_keys(tokens[32:], 16, prior_key=full[1]) == full[2:]
    # A different first page changes every later key; equal prefixes give equal keys.
    other = sglang_page_keys([1] + tokens[1:], 16)
    assert all(a != b for a, b in zip(full, other))
    assert sglang_page_keys(tokens[:32], 16) == full[:2]


def test_salts_isolate():
    tokens = list(range(32))
    plain = sglang_page_keys(tokens, 16)
    assert sglang_page_keys(tokens, 16, extra_key="a") != plain
    assert sglang_page_keys(tokens, 16, extra_key="a") != sglang_page_keys(tokens, 16, cache_salt="a")
    assert namespace_seed() is None and len(namespace_seed("a")) == 32
    assert sglang_page_keys(tokens, 16, cache_salt="") == plain  # SGLang: empty salt = no salt


def test_chunk_keys_multiple_of_page():
    tokens = list(range(256))
    assert chunk_keys(tokens, 64, page_size=16) == sglang_page_keys(tokens, 64)
    with pytest.raises(InputError, match="multiple of page_size=16"):
        chunk_keys(tokens, 40, page_size=16)


@pytest.mark.parametrize(
    "tokens, page, match",
    [([1, -2, 3, 4], 2, "out of range"), ([1, 2], 0, "page_size"), ([1, 2], -1, "page_size"),
     ([1.5, 2], 2, "not an integer"), ([2**64, 1], 2, "out of range"), (None, 2, "token_ids=None"),
     ("1234", 2, "sequence of int"), (7, 2, "sequence of int")],
)
def test_bad_input(tokens, page, match):
    with pytest.raises(InputError, match=match):
        sglang_page_keys(tokens, page)


@pytest.mark.parametrize("kwargs", [dict(cache_salt=5), dict(extra_key=b"lora"), dict(cache_salt=["t"])])
def test_non_str_salt_or_extra_key_is_an_input_error(kwargs):
    # Was an AttributeError ('int' object has no attribute 'encode') from inside the hash.
    name = next(iter(kwargs))
    with pytest.raises(InputError, match=f"{name}="):
        chunk_keys([1, 2, 3, 4], 2, **kwargs)


def test_a_model_path_with_a_non_utf8_byte_has_a_digest():
    """Python decodes a non-UTF-8 byte of a path (argv, os.listdir) to a lone surrogate: such a model
    name passed validation and then every use of the namespace raised a bare UnicodeEncodeError."""
    model = os.fsdecode(b"/models/caf\xe9")
    a = Namespace(model, "bfloat16", "page_first", 64)
    assert len(a.digest) == 32 and a.digest == Namespace(model, "bfloat16", "page_first", 64).digest
    assert a.digest != Namespace(os.fsdecode(b"/models/caf\xe8"), "bfloat16", "page_first", 64).digest
    assert a.digest != Namespace("/models/café", "bfloat16", "page_first", 64).digest


@pytest.mark.parametrize("name", ["extra_key", "cache_salt"])
def test_a_salt_utf8_cannot_encode_is_an_input_error_naming_it(name):
    with pytest.raises(InputError, match=f"{name}=.*UTF-8 cannot encode"):
        namespace_seed(**{name: "lora-\udce9"})


def test_keys_identical_across_processes():
    code = (
        "import json,sys; from radixkv.keys import sglang_page_keys as k, Namespace as N;"
        "print(json.dumps([k(list(range(100)),16,'e','s'), N('m','bfloat16','page_first',64).digest]))"
    )
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    assert outs[0][0] == sglang_page_keys(list(range(100)), 16, "e", "s")


def test_namespace_identity():
    a = Namespace("llama", "bfloat16", "page_first", 64)
    assert a.digest == Namespace("llama", "bfloat16", "page_first", 64).digest
    for other in (
        Namespace("llama2", "bfloat16", "page_first", 64),
        Namespace("llama", "float16", "page_first", 64),
        Namespace("llama", "bfloat16", "layer_first", 64),
        Namespace("llama", "bfloat16", "page_first", 128),
        Namespace("llama", "bfloat16", "page_first", 64, shard="tp1of2"),
        Namespace("llama", "bfloat16", "page_first", 64, extra="group1"),
    ):
        assert other.digest != a.digest
    assert len(a.digest) == 32 and "llama" in str(a)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(model=""), "model"), (dict(dtype="float64x"), "dtype"), (dict(chunk_tokens=0), "chunk_tokens"),
     # non-str fields were bare TypeErrors; True passed as chunk_tokens=1
     (dict(model=5), "model=5"), (dict(shard=None), "shard=None"), (dict(dtype=["bfloat16"]), "dtype="),
     (dict(layout=b"page_first"), "layout="), (dict(chunk_tokens=True), "chunk_tokens=True")],
)
def test_namespace_rejects_bad_values(kwargs, match):
    base = dict(model="m", dtype="bfloat16", layout="page_first", chunk_tokens=64)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        Namespace(**base)


@pytest.mark.parametrize("chunk_tokens", [1 << 48, 1 << 60])
def test_namespace_refuses_chunk_tokens_the_tree_cannot_hold(chunk_tokens):
    # The tree's columns hold chunk sizes below 2**48; such a namespace failed only at its first put.
    with pytest.raises(ConfigError, match="below 2\\*\\*48"):
        Namespace("llama", "bfloat16", "page_first", chunk_tokens)
    Namespace("llama", "bfloat16", "page_first", (1 << 48) - 1)


def test_numpy_token_ids_hash_like_ints_also_on_wide_pages():
    """Found by an audit: numpy ids of a page holding an id >= 2**32 were refused, with an error
    naming a valid id (the wide-page check asked isinstance(t, int)); SGLang hashes them."""
    np = pytest.importorskip("numpy")
    ids = [1, 2**33, 3, 4, 5, 6, 7, 8]
    assert sglang_page_keys(np.array(ids, dtype=np.int64), 4) == sglang_page_keys(ids, 4)
    assert sglang_page_keys([np.int64(t) for t in ids], 4) == sglang_page_keys(ids, 4)
    with pytest.raises(InputError, match=r"token id '1' is not an integer"):
        sglang_page_keys(["1", 2**33, 3, 4], 4)


def test_a_prior_key_with_whitespace_is_refused():
    """bytes.fromhex skips whitespace: 64 characters with spaces were taken as a 31-byte prior."""
    with pytest.raises(InputError, match="not valid hex"):
        sglang_page_keys([1, 2, 3, 4], 4, prior_key="ab" * 30 + " cd ")
    good = sglang_page_keys([1, 2, 3, 4], 4)[0]
    assert sglang_page_keys([5, 6, 7, 8], 4, prior_key=good.upper()) == sglang_page_keys([5, 6, 7, 8], 4, prior_key=good)
