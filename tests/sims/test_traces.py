from __future__ import annotations

import json

import pytest

from radixkv.errors import InputError
from radixkv.keys import chunk_keys
from radixkv.sims.traces import Request, Trace, read_mooncake, read_radixkv, read_trace, write_radixkv


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_mooncake_reader(tmp_path):
    p = _write(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 2500, "input_length": 600, "output_length": 1, "hash_ids": [0, 2]},
    ])
    t = read_trace(p)
    assert t.block_tokens == 512 and len(t) == 3
    assert t.requests[1].arrival_s == 1.5 and t.requests[1].output_tokens == 7
    assert t.requests[0].block_keys == ["0", "1"]
    assert t.block_references == 6 and t.unique_blocks == 3
    assert t.infinite_hit_blocks() == 3  # 0 + 2 + 1
    t.check_integrity()
    assert len(read_mooncake(p, limit=2)) == 2


def test_radixkv_reader_keys_tokens_and_header(tmp_path):
    tokens = list(range(40))
    p = _write(tmp_path / "r.jsonl", [
        {"radixkv_trace": 1, "block_tokens": 16},
        {"arrival_s": 0.5, "output_tokens": 3, "block_keys": ["k1", "k2"], "tenant": "t", "session": "s"},
        {"arrival_s": 1.0, "output_tokens": 4, "token_ids": tokens},
    ])
    t = read_trace(p)
    assert t.block_tokens == 16
    r0, r1 = t.requests
    assert r0.block_keys == ["k1", "k2"] and r0.input_tokens == 32 and r0.tenant == "t" and r0.session == "s"
    # Raw tokens are hashed with the chunk-key scheme; the partial trailing chunk gets no key.
    assert r1.block_keys == chunk_keys(tokens, 16) and len(r1.block_keys) == 2 and r1.input_tokens == 40


def test_radixkv_roundtrip(tmp_path):
    t = Trace("x", 8, [Request(0.0, 10, 1, ["a", "b"], "ten", None), Request(2.0, 8, 0, ["a"], None, "s")])
    write_radixkv(t, str(tmp_path / "x.jsonl"))
    u = read_radixkv(str(tmp_path / "x.jsonl"))
    assert u.block_tokens == 8 and [r.block_keys for r in u.requests] == [["a", "b"], ["a"]]
    assert u.requests[0].tenant == "ten" and u.requests[1].session == "s" and u.requests[0].input_tokens == 10


@pytest.mark.parametrize(
    ("records", "match"),
    [
        ([{"timestamp": 0, "input_length": 5, "hash_ids": "nope"}], "hash_ids"),
        ([{"timestamp": -1, "input_length": 5, "hash_ids": [1]}], "timestamp"),
        ([{"timestamp": 0, "input_length": -5, "hash_ids": [1]}], "input_length"),
        ([{"arrival_s": 0}], "block_keys"),
        ([{"hello": 1}], "cannot tell the trace format"),
        ([{"timestamp": 0, "input_length": 600, "hash_ids": [1, -2]}], "non-negative integer"),
        ([{"timestamp": 0, "input_length": 100, "hash_ids": [1, 2, 3, 4]}], "makes 1 blocks of 512"),
        ([{"timestamp": 0, "input_length": 5000, "hash_ids": [1]}], "makes 10 blocks"),
        ([{"radixkv_trace": 2}, {"block_keys": ["a"]}], "version"),
        ([{"block_keys": ["a"], "token_ids": [1, 2]}], "not both"),
        ([{"token_ids": [-1, "x"]}], "integers in"),
    ],
)
def test_bad_records_name_the_field(tmp_path, records, match):
    p = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError, match=match):
        read_trace(p)


def test_not_json_and_missing_file(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{not json\n")
    with pytest.raises(InputError, match="not valid JSON"):
        read_trace(str(p))
    with pytest.raises(InputError, match="does not exist"):
        read_trace(str(tmp_path / "missing.jsonl"))


def test_prefix_conflict_detected():
    t = Trace("x", 4, [Request(0, 8, 0, ["a", "b"]), Request(1, 8, 0, ["c", "b"])])
    with pytest.raises(InputError, match="chained"):
        t.check_prefix_closed()


def test_compressed_traces_read_like_plain_ones(tmp_path):
    import gzip
    import lzma

    records = [{"timestamp": i * 100, "input_length": 700 + i, "output_length": 3, "hash_ids": [0, i + 1]}
               for i in range(20)]
    plain = _write(tmp_path / "m.jsonl", records)
    raw = open(plain, "rb").read()
    (tmp_path / "m.jsonl.xz").write_bytes(lzma.compress(raw))
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress(raw))
    want = read_trace(plain)
    for name in ("m.jsonl.xz", "m.jsonl.gz"):
        got = read_trace(str(tmp_path / name))
        assert [r.block_keys for r in got.requests] == [r.block_keys for r in want.requests]
        assert got.block_references == want.block_references
    (tmp_path / "cut.jsonl.xz").write_bytes(lzma.compress(raw)[:-40])
    with pytest.raises(InputError, match="cannot decompress"):
        read_trace(str(tmp_path / "cut.jsonl.xz"))


def test_the_shipped_mooncake_trace_reads_as_is(mooncake_trace):
    import os

    shipped = os.path.join(os.path.dirname(__file__), "..", "data", "mooncake_conversation.jsonl.xz")
    t = read_trace(shipped)  # the .xz copy in tests/data, as `radixkv sim --trace` gets it
    assert (len(t), t.block_references, t.unique_blocks) == (12_031, 288_500, 182_790)
    assert [r.block_keys for r in t.requests[:50]] == [r.block_keys for r in mooncake_trace.requests[:50]]


def test_a_directory_is_not_a_trace(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        read_trace(str(tmp_path))
