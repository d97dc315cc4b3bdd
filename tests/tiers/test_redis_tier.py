"""Redis-specific behaviour of RedisTier against real redis-server processes (tests/_redis_servers.py).

The shared contract (round trip, leading run, delete, capacity, 8 threads) runs for Redis and Redis
Cluster in test_tier_contract.py; this module covers what only a remote store has: cluster placement,
TTL, values corrupted or planted behind the tier's back, servers killed/paused/restarted, auth, ACL,
TLS, server OOM and URL parsing. Every test isolates itself with a fresh namespace.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
import uuid

import pytest
import torch

from radixkv.errors import CapacityError, ConfigError, InputError
from radixkv.testing_redis import make_tls_files
from radixkv.tiers.framing import HEADER_BYTES
from radixkv.tiers.redis_accounting import ByteLedger

from frame_edits import reframed

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'radixkv[redis]')")
from radixkv.tiers.redis import RedisTier  # noqa: E402 - needs redis-py
from radixkv.tiers.redis_client import parse_redis_url  # noqa: E402

pytestmark = pytest.mark.redis


def payload(key: str, nbytes: int = 4096, salt: str = "") -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes((salt + "|" + key).encode(), "little") % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def empty(n: int, nbytes: int = 4096) -> list[torch.Tensor]:
    return [torch.full((nbytes,), 0xAB, dtype=torch.uint8) for _ in range(n)]


def fresh_ns() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def make(request: pytest.FixtureRequest):
    """Build tiers that are integrity-checked, cleared and closed when the test ends."""
    made: list[RedisTier] = []

    def factory(url: str, **options) -> RedisTier:
        tier = RedisTier(url, **options)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.check_integrity()
        tier.close()


def raw_client(url: str) -> redis.Redis:
    p = parse_redis_url(url)
    (host, port), = p.hosts
    return redis.Redis(host=host, port=port, username=p.username, password=p.password)


# ------------------------------------------------------------------------------------------ placement

def test_cluster_round_trip_spreads_keys_over_every_node(make, redis_cluster_url):
    """64 chunks in a 3-node cluster land on all 3 primaries (no hash tag pins them to one slot)."""
    tier = make(redis_cluster_url, batch_bytes=64 << 10)  # several pipelines per call
    ns, keys = fresh_ns(), [f"{i:064x}" for i in range(64)]
    payloads = [payload(k) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 64
    outs = empty(64)
    assert tier.get_many(ns, keys, outs) == [True] * 64
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs))
    per_node = {}
    for node in tier.redis_client.get_primaries():
        per_node[node.port] = sum(1 for _ in node.redis_connection.scan_iter(match=f"radixkv:{ns}:*"))
    assert len(per_node) == 3 and sum(per_node.values()) == 64
    assert min(per_node.values()) > 0, per_node
    tier.clear(ns)
    assert tier.contains_many(ns, keys) == 0


def test_stale_cluster_slot_map_is_a_miss_then_refreshed(make, redis_cluster_url):
    """A client whose slot map points at the wrong node gets MOVED: a miss / failed put (never an
    exception or wrong bytes), and the next call uses the rediscovered topology."""
    tier = make(redis_cluster_url)
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]

    def mislead() -> None:
        client = tier.redis_client
        slot = client.keyslot(f"radixkv:{ns}:k")
        owner = client.get_node_from_key(f"radixkv:{ns}:k")
        wrong = next(n for n in client.get_primaries() if n.name != owner.name)
        client.nodes_manager.slots_cache[slot] = [wrong]

    mislead()
    assert tier.get_many(ns, ["k"], empty(1)) == [False]
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))
    mislead()
    assert tier.put_many(ns, ["k"], [payload("k", salt="v2")]) == [False]
    assert tier.put_many(ns, ["k"], [payload("k", salt="v2")]) == [True]
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k", salt="v2"))
    assert tier.stats().errors == 2


@pytest.mark.parametrize("nbytes", [1, 3 << 20])
def test_standalone_round_trip_sizes(make, redis_url, nbytes):
    """1 byte and 3 MiB chunks round-trip exactly; batch_bytes splits a call into several pipelines."""
    tier = make(redis_url, batch_bytes=4 << 20)
    ns, keys = fresh_ns(), ["a", "b", "c"]
    payloads = [payload(k, nbytes) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 3
    outs = empty(3, nbytes)
    assert tier.get_many(ns, keys, outs) == [True] * 3
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs))
    # The stored value is header + identity + payload, nothing else.
    assert raw_client(redis_url).strlen(f"radixkv:{ns}:a") == HEADER_BYTES + len(ns) + 1 + nbytes


def test_any_shape_uint8_payload_is_accepted(make, redis_url):
    tier = make(redis_url)
    ns, p = fresh_ns(), payload("k", 4096).view(64, 64)
    assert tier.put_many(ns, ["k"], [p]) == [True]
    out = torch.empty(64, 64, dtype=torch.uint8)
    assert tier.get_many(ns, ["k"], [out]) == [True] and torch.equal(out, p)


# ------------------------------------------------------------------------------------------ TTL

def test_ttl_expires_chunks_and_their_bytes(make, redis_url):
    tier = make(redis_url, ttl_s=0.3)
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    assert 0 < raw_client(redis_url).pttl(f"radixkv:{ns}:k") <= 300
    assert tier.contains_many(ns, ["k"]) == 1 and tier.usage_bytes() > 4096
    time.sleep(0.45)
    assert tier.contains_many(ns, ["k"]) == 0
    assert tier.get_many(ns, ["k"], empty(1)) == [False]
    assert tier.usage_bytes() == 0


# ------------------------------------------------------------------------------------------ integrity

def test_a_value_of_unknown_flags_or_version_is_a_miss(make, redis_url):
    """A value whose header (its checksum intact) sets a flag this reader does not know is a miss,
    as one of another version is: its payload may mean something else (it was served as raw KV)."""
    tier = make(redis_url)
    ns, r = fresh_ns(), raw_client(redis_url)
    keys = ["flag", "version", "good"]
    payloads = [payload(k) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 3
    rk = {k: f"radixkv:{ns}:{k}" for k in keys}
    r.set(rk["flag"], reframed(r.get(rk["flag"]), flags=1))
    r.set(rk["version"], reframed(r.get(rk["version"]), version=2))
    outs = empty(3)
    assert tier.get_many(ns, keys, outs) == [False, False, True]
    assert torch.equal(outs[2], payloads[2])


def test_corrupted_values_are_counted_misses_and_a_put_repairs(make, redis_url):
    """Bit flip in payload, bit flip in header, truncation, garbage: each a miss + checksum failure;
    good chunks around them in the same batch still hit (the reply stream stays aligned)."""
    tier = make(redis_url)
    ns, r = fresh_ns(), raw_client(redis_url)
    keys = ["flip", "good1", "head", "short", "junk", "good2"]
    payloads = [payload(k) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 6
    rk = {k: f"radixkv:{ns}:{k}" for k in keys}
    frame = bytearray(r.get(rk["flip"]))
    frame[-100] ^= 0x01
    r.set(rk["flip"], bytes(frame))
    head = bytearray(r.get(rk["head"]))
    head[20] ^= 0x80  # inside payload_len
    r.set(rk["head"], bytes(head))
    r.set(rk["short"], r.get(rk["short"])[:-1])
    r.set(rk["junk"], b"\x80\x04not a frame, and never unpickled")
    before = tier.stats().checksum_failures
    outs = empty(6)
    assert tier.get_many(ns, keys, outs) == [False, True, False, False, False, True]
    assert torch.equal(outs[1], payloads[1]) and torch.equal(outs[5], payloads[5])
    assert tier.stats().checksum_failures - before == 4
    assert tier.put_many(ns, keys, payloads) == [True] * 6  # overwrite repairs
    outs = empty(6)
    assert tier.get_many(ns, keys, outs) == [True] * 6
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs))


def test_wrong_type_under_our_key_is_a_miss(make, redis_url):
    """A hash stored under the tier's key: WRONGTYPE is an error reply, a miss, and the batch goes on."""
    tier = make(redis_url)
    ns, r = fresh_ns(), raw_client(redis_url)
    tier.put_many(ns, ["ok"], [payload("ok")])
    r.hset(f"radixkv:{ns}:h", "field", "value")
    outs = empty(3)
    assert tier.get_many(ns, ["h", "ok", "absent"], outs) == [False, True, False]
    assert torch.equal(outs[1], payload("ok"))
    assert tier.stats().errors == 1 and tier.stats().misses == 2


def test_value_of_another_namespace_or_key_under_our_name_is_a_miss(make, redis_url):
    tier = make(redis_url)
    ns, other, r = fresh_ns(), fresh_ns(), raw_client(redis_url)
    tier.put_many(other, ["k"], [payload("k", salt="other")])
    tier.put_many(ns, ["k1"], [payload("k1")])
    r.set(f"radixkv:{ns}:k", r.get(f"radixkv:{other}:k"))  # colliding name, foreign namespace
    r.set(f"radixkv:{ns}:k2", r.get(f"radixkv:{ns}:k1"))  # same namespace, wrong key
    before = tier.stats().checksum_failures
    assert tier.get_many(ns, ["k", "k2"], empty(2)) == [False, False]
    assert tier.stats().checksum_failures - before == 2
    out = empty(1)
    assert tier.get_many(other, ["k"], out) == [True] and torch.equal(out[0], payload("k", salt="other"))


def test_wrong_buffer_size_is_a_counted_miss(make, redis_url):
    tier = make(redis_url)
    ns = fresh_ns()
    tier.put_many(ns, ["k"], [payload("k")])
    assert tier.get_many(ns, ["k"], [torch.empty(4095, dtype=torch.uint8)]) == [False]
    assert tier.stats().checksum_failures == 1


def test_a_read_deletes_the_invalid_values_it_found(make, redis_url):
    """Before, the store deleted a failed read's key by name (and another process's value written
    since went with it). The read itself deletes each invalid value now, by a compare-and-delete
    on the server, also when the server lacks the script (NOSCRIPT: EVAL); a valid frame of this
    chunk of another size is another reader's, and stays."""
    frame = HEADER_BYTES + 32 + 4 + 4096
    tier = make(redis_url)
    ns, r = fresh_ns(), raw_client(redis_url)
    keys = ["flip", "head", "shrt", "junk", "good"]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 5
    assert tier.put_many(ns, ["size"], [payload("size", 8192)]) == [True]
    rk = {k: f"radixkv:{ns}:{k}" for k in keys + ["size"]}
    value = r.get(rk["flip"])
    r.set(rk["flip"], value[:-100] + bytes([value[-100] ^ 1]) + value[-99:])
    value = r.get(rk["head"])
    r.set(rk["head"], value[:20] + bytes([value[20] ^ 0x80]) + value[21:])
    r.set(rk["shrt"], r.get(rk["shrt"])[:-1])
    r.set(rk["junk"], b"not a frame")
    r.script_flush()
    assert tier.get_many(ns, keys[:2] + ["size"], empty(3)) == [False, False, False]
    assert tier.get_many(ns, keys[2:], empty(3)) == [False, False, True]  # (EVALSHA, loaded now)
    assert [r.exists(rk[k]) for k in keys + ["size"]] == [0, 0, 0, 0, 1, 1]
    st = tier.stats()
    assert st.checksum_failures == 5 and st.extra["bad_values_deleted"] == 4
    assert tier.usage_bytes() == frame + frame + 4096  # "good" and "size": the ledger forgot the rest


@pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url"])
@pytest.mark.parametrize("damage", ["payload", "header", "truncated"])
def test_a_value_written_again_after_a_failed_read_is_kept(make, request, monkeypatch, server, damage):
    """Another tier object (another process) writes the chunk again between the read's GET of an
    invalid value and its delete of it: the new value, valid, must stay (a delete by name removed
    it). Each damage is told apart by another part of the comparison: the payload only by the
    value's SHA-1 (the header is the valid one's), the header by the first bytes, a truncated
    value by its length."""
    import radixkv.tiers.redis as redis_module

    url = request.getfixturevalue(server)
    tier, other = make(url), make(url)
    ns, key = fresh_ns(), "k"
    assert tier.put_many(ns, [key], [payload(key)]) == [True]
    client, name = tier.redis_client, f"radixkv:{ns}:{key}"
    good = client.get(name)
    damaged = {"payload": good[:-100] + bytes([good[-100] ^ 1]) + good[-99:],
               "header": good[:20] + bytes([good[20] ^ 0x80]) + good[21:],
               "truncated": good[:-1]}[damage]
    client.set(name, damaged)
    real, ran = redis_module.get_frames_into, []

    def get_then_other_writes(*args):
        replies = real(*args)
        if replies and replies[0][0] is redis_module.Reply.BAD and not ran:
            ran.append(True)
            assert other.put_many(ns, [key], [payload(key)]) == [True]
        return replies

    monkeypatch.setattr(redis_module, "get_frames_into", get_then_other_writes)
    assert tier.get_many(ns, [key], empty(1)) == [False]
    assert ran
    assert client.get(name) == good, "the read deleted a valid value written after its GET"
    st = tier.stats()
    assert st.extra["bad_values_kept"] == 1 and st.extra.get("bad_values_deleted", 0) == 0
    monkeypatch.undo()
    out = empty(1)
    assert tier.get_many(ns, [key], out) == [True] and torch.equal(out[0], payload(key))


def test_forget_many_stops_counting_and_leaves_the_values(make, redis_url):
    """What a store does with the chunks it lost in a tier other processes write."""
    tier = make(redis_url, capacity_bytes=1 << 20)
    ns = fresh_ns()
    assert tier.put_many(ns, ["a", "b"], [payload("a"), payload("b")]) == [True, True]
    used = tier.usage_bytes()
    assert tier.forget_many(ns, ["a", "absent"]) == 1
    assert tier.usage_bytes() == used // 2 and tier.stats().extra["forgotten"] == 1
    out = empty(1)
    assert tier.get_many(ns, ["a"], out) == [True] and torch.equal(out[0], payload("a"))
    assert tier.delete_many(ns, ["a", "b"]) == 2 and tier.usage_bytes() == 0


# ------------------------------------------------------------------------------------------ faults

def test_killed_server_degrades_to_fast_misses_then_recovers(make, redis_server):
    """Kill -9: every call returns misses/failed puts within the timeout bound; restart: works again."""
    tier = make(redis_server.url, socket_timeout_s=0.5, socket_connect_timeout_s=0.25, down_backoff_s=0.2)
    ns, keys = fresh_ns(), ["a", "b"]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True, True]
    redis_server.stop()
    t0 = time.monotonic()
    assert tier.get_many(ns, keys, empty(2)) == [False, False]
    assert tier.put_many(ns, ["c"], [payload("c")]) == [False]
    assert tier.contains_many(ns, keys) == 0
    assert tier.delete_many(ns, keys) == 0
    tier.clear(ns)
    assert time.monotonic() - t0 < 1.5
    stats = tier.stats()
    assert stats.errors >= 1 and stats.put_failures == 1 and stats.misses == 2
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.25)  # past the fail-fast window
    assert tier.get_many(ns, keys, empty(2)) == [False, False]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True, True]
    outs = empty(2)
    assert tier.get_many(ns, keys, outs) == [True, True]
    assert torch.equal(outs[0], payload("a")) and torch.equal(outs[1], payload("b"))


def test_a_long_outage_is_logged_once_then_its_end(make, redis_server_factory, caplog):
    """A server down for 2,000 calls (as for hours at the default 1 s window): one warning naming the
    tier, the fault and the misses, with the password hidden, then one line when it answers again.
    The warning came at every retry after the window: a line per second per tier and process for
    an outage's whole length, a line per call with down_backoff_s=0."""
    server = redis_server_factory(password="kv-Secret-pw")
    tier = make(server.url, socket_timeout_s=0.3, socket_connect_timeout_s=0.3, down_backoff_s=0.0)
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    server.stop()
    caplog.set_level(logging.INFO, logger="radixkv")
    for i in range(1000):
        assert tier.get_many(ns, ["k"], empty(1)) == [False]
        assert tier.put_many(ns, [f"p{i}"], [payload("p")]) == [False]
    lines = [r for r in caplog.records if r.name.startswith("radixkv")]
    assert len(lines) == 1, [r.getMessage() for r in lines[:5]]
    msg = lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING and lines[0].name == "radixkv.tiers.redis"
    assert f"127.0.0.1:{server.port}" in msg and "unreachable" in msg and "misses" in msg
    assert "kv-Secret-pw" not in msg and not lines[0].exc_info
    assert tier.stats().errors == 2000
    server.start()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    assert tier.put_many(ns, ["k2"], [payload("k2")]) == [True]
    lines = [r for r in caplog.records if r.name.startswith("radixkv")]
    assert len(lines) == 2 and "reachable again" in lines[1].getMessage(), [r.getMessage() for r in lines]
    assert "2000 faults" in lines[1].getMessage() and "kv-Secret-pw" not in lines[1].getMessage()
    server.stop()  # a new outage is a new warning
    assert tier.get_many(ns, ["k"], empty(1)) == [False]
    assert len([r for r in caplog.records if r.name.startswith("radixkv")]) == 3


def test_unresponsive_server_times_out_into_misses(make, redis_server):
    """SIGSTOP (accepts TCP, answers nothing): a get returns misses after ~socket_timeout_s, then
    calls fail fast inside the back-off window; SIGCONT: hits again."""
    tier = make(redis_server.url, socket_timeout_s=0.3, socket_connect_timeout_s=0.3, down_backoff_s=0.5)
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    redis_server.pause()
    try:
        t0 = time.monotonic()
        assert tier.get_many(ns, ["k"], empty(1)) == [False]
        first_s = time.monotonic() - t0
        t1 = time.monotonic()
        assert tier.get_many(ns, ["k"], empty(1)) == [False]
        second_s = time.monotonic() - t1
    finally:
        redis_server.resume()
    assert 0.25 <= first_s < 1.2, first_s  # socket_timeout_s plus scheduling slack
    assert second_s < 0.05, second_s
    assert tier.stats().extra["fast_fail_calls"] >= 1
    time.sleep(0.55)
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))


def test_cluster_node_killed_degrades_then_recovers(make, redis_cluster):
    """Kill one of 3 primaries: no exception, no wrong bytes, its keys miss within the time bound
    while the other nodes' keys still hit;
    restart it (same port and nodes.conf): the tier reconnects and stores again."""
    tier = make(redis_cluster.url, socket_timeout_s=0.5, socket_connect_timeout_s=0.25, down_backoff_s=0.2)
    ns, keys = fresh_ns(), [f"{i:064x}" for i in range(24)]
    payloads = [payload(k) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 24
    victim = redis_cluster.nodes[0]
    client = tier.redis_client
    on_victim = {k for k in keys if client.get_node_from_key(f"radixkv:{ns}:{k}").port == victim.port}
    assert 0 < len(on_victim) < 24
    victim.stop()
    t0 = time.monotonic()
    outs = empty(24)
    hits = tier.get_many(ns, keys, outs)
    assert time.monotonic() - t0 < 1.5
    assert not any(h for k, h in zip(keys, hits) if k in on_victim)
    assert all(h for k, h in zip(keys, hits) if k not in on_victim)  # live nodes still answered
    assert all(torch.equal(o, p) for h, o, p in zip(hits, outs, payloads) if h)
    assert tier.put_many(ns, ["new"], [payload("new")]) in ([False], [True])
    assert tier.contains_many(ns, keys) <= 24 and tier.delete_many(ns, ["absent"]) == 0
    assert time.monotonic() - t0 < 3.0  # every call above bounded by the timeouts
    assert tier.stats().errors >= 1
    victim.start()
    redis_cluster.wait_ok()
    time.sleep(0.25)
    deadline = time.monotonic() + 10
    while tier.put_many(ns, keys, payloads) != [True] * 24:  # the client rediscovers the topology
        assert time.monotonic() < deadline, tier.stats()
        time.sleep(0.25)
    outs = empty(24)
    assert tier.get_many(ns, keys, outs) == [True] * 24
    assert all(torch.equal(o, p) for o, p in zip(outs, payloads))


def test_server_oom_is_a_failed_put_not_an_exception(make, redis_server_factory):
    """maxmemory + noeviction: once the server refuses (OOM), puts return False and count errors."""
    server = redis_server_factory(extra_args=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"])
    tier = make(server.url)
    ns = fresh_ns()
    ok = [tier.put_many(ns, [f"k{i}"], [payload(f"k{i}", 1 << 20)])[0] for i in range(12)]
    assert ok[0] and not ok[-1], ok
    assert tier.stats().errors == ok.count(False) == tier.stats().put_failures
    assert tier.usage_bytes() == sum(ok) * (HEADER_BYTES + len(ns) + 2 + (1 << 20))
    outs = empty(1, 1 << 20)
    assert tier.get_many(ns, ["k0"], outs) == [True] and torch.equal(outs[0], payload("k0", 1 << 20))


def test_value_over_the_servers_bulk_limit_is_refused_not_a_fault(make, redis_server_factory):
    """Found by an audit: a chunk larger than the server's proto-max-bulk-len made the server drop
    the connection mid-send, and the tier took that for an outage (every call a miss for
    down_backoff_s). Such a chunk is now a CapacityError naming both fixes; the server stays up."""
    server = redis_server_factory(extra_args=["--proto-max-bulk-len", "1mb"])
    tier = make(server.url, max_value_bytes="1MiB", down_backoff_s=5.0)
    ns = fresh_ns()
    assert tier.put_many(ns, ["small"], [payload("small", 1000)]) == [True]
    with pytest.raises(CapacityError, match=r"max_value_bytes=1048576 .*proto-max-bulk-len"):
        tier.put_many(ns, ["big"], [payload("big", 2 << 20)])
    outs = empty(1, 1000)
    assert tier.get_many(ns, ["small"], outs) == [True] and torch.equal(outs[0], payload("small", 1000))
    assert tier.stats().errors == 0 and tier.max_frame_bytes == 1 << 20
    with pytest.raises(ConfigError, match="max_value_bytes"):
        RedisTier(server.url, max_value_bytes=4096)
    assert make(server.url + "?max_value_bytes=2MiB").config.max_value_bytes == 2 << 20


# ------------------------------------------------------------------------------------------ capacity

def test_capacity_refuses_puts_and_is_freed_by_delete(make, redis_url):
    ns = fresh_ns()
    frame = HEADER_BYTES + len(ns) + 2 + 4096
    tier = make(redis_url, capacity_bytes=5 * frame)
    keys = [f"k{i}" for i in range(8)]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 5 + [False] * 3
    assert tier.usage_bytes() == 5 * frame
    assert tier.stats().extra["capacity_refusals"] == 3
    assert tier.delete_many(ns, keys[:2]) == 2
    assert tier.put_many(ns, keys[5:7], [payload(k) for k in keys[5:7]]) == [True, True]
    assert tier.usage_bytes() == 5 * frame
    with pytest.raises(CapacityError, match="capacity_bytes"):
        tier.put_many(ns, ["huge"], [payload("huge", 6 * frame)])


def test_capacity_bound_holds_under_eight_threads(make, redis_url):
    """8 threads put distinct chunks into a tier that fits 20: server-side bytes never pass capacity."""
    ns = fresh_ns()
    frame = HEADER_BYTES + len(ns) + 6 + 8192
    tier = make(redis_url, capacity_bytes=20 * frame)
    errors: list[BaseException] = []
    wrong: list[str] = []
    peak = [0]

    def worker(t: int) -> None:
        try:
            for i in range(10):
                key = f"t{t}c{i:03d}"
                stored = tier.put_many(ns, [key], [payload(key, 8192)])
                peak[0] = max(peak[0], tier.usage_bytes())
                if stored[0]:
                    out = empty(1, 8192)
                    if tier.get_many(ns, [key], out) == [True] and not torch.equal(out[0], payload(key, 8192)):
                        wrong.append(key)
                if i % 3 == 2:
                    tier.delete_many(ns, [key])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and not wrong, (errors, wrong)
    assert peak[0] <= 20 * frame
    r = raw_client(redis_url)
    server_bytes = sum(r.strlen(k) for k in r.scan_iter(match=f"radixkv:{ns}:*"))
    assert server_bytes == tier.usage_bytes() <= 20 * frame
    tier.clear(ns)


@pytest.mark.parametrize("which", ["redis_url", "redis_cluster_url"])
def test_more_threads_than_connections_wait_instead_of_failing(make, request, which):
    """8 threads on max_connections=2: every call succeeds (a full pool is not a dead server)."""
    tier = make(request.getfixturevalue(which), max_connections=2)
    ns = fresh_ns()
    errors: list[BaseException] = []
    results: list[bool] = []

    def worker(t: int) -> None:
        try:
            for i in range(6):
                key = f"t{t}i{i}"
                results.extend(tier.put_many(ns, [key], [payload(key)]))
                out = empty(1)
                results.extend(tier.get_many(ns, [key], out))
                results.append(torch.equal(out[0], payload(key)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and all(results) and len(results) == 8 * 6 * 3, errors
    assert tier.stats().errors == 0
    tier.clear(ns)


# ------------------------------------------------------------------------------------------ auth, TLS

def test_password_auth(make, redis_server_factory):
    server = redis_server_factory(password="s3cret:pw")
    url = f"redis://:{'s3cret%3Apw'}@127.0.0.1:{server.port}/0"
    tier = make(url)
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))
    for bad in (f"redis://:wrong@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
        denied = make(bad, down_backoff_s=0.0)
        assert denied.get_many(ns, ["k"], empty(1)) == [False]
        assert denied.put_many(ns, ["x"], [payload("x")]) == [False]
        assert denied.stats().errors >= 1


def test_acl_user(make, redis_server_factory):
    server = redis_server_factory(extra_args=["--user", "default", "off",
                                              "--user", "cache", "on", ">kv-pass", "~radixkv:*", "+@all"])
    tier = make(f"redis://cache:kv-pass@127.0.0.1:{server.port}/0")
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))
    assert tier.contains_many(ns, ["k"]) == 1 and tier.delete_many(ns, ["k"]) == 1
    outsider = make(f"redis://cache:kv-pass@127.0.0.1:{server.port}/0", key_prefix="elsewhere")
    assert outsider.put_many(ns, ["k"], [payload("k")]) == [False]  # ACL denies the key pattern
    assert outsider.stats().errors == 1


def test_tls(make, redis_server_factory):
    server = redis_server_factory(tls=True, password="tlspw")
    assert server.url.startswith("rediss://")
    tier = make(server.url)
    ns = fresh_ns()
    big = payload("k", 2 << 20)
    assert tier.put_many(ns, ["k"], [big]) == [True]
    out = empty(1, 2 << 20)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], big)
    plain = make(server.url.replace("rediss://", "redis://").split("?")[0], down_backoff_s=0.0,
                 socket_timeout_s=0.3)
    assert plain.get_many(ns, ["k"], empty(1, 2 << 20)) == [False]


def test_tls_client_certificate_and_unusable_tls_files(make, redis_server_factory, redis_tls_files, tmp_path):
    """A server that requires client certificates: the tier's ssl_certfile/ssl_keyfile round-trip.
    A TLS file the tier cannot use is a ConfigError naming the option when the tier is built: it
    made every call a miss forever, logged as the server "unreachable (... No such file or
    directory)"; ssl_keyfile alone raised a TypeError out of every call, and an encrypted key made
    every connect wait for a passphrase typed on the terminal."""
    server = redis_server_factory(tls=True, extra_args=["--tls-auth-clients", "yes"])
    files = redis_tls_files
    base = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={files.ca_file}"
    tier = make(f"{base}&ssl_certfile={files.cert_file}&ssl_keyfile={files.key_file}")
    ns = fresh_ns()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))
    anonymous = make(base, down_backoff_s=0.0, socket_timeout_s=0.3)  # no client certificate
    assert anonymous.get_many(ns, ["k"], empty(1)) == [False] and anonymous.stats().errors == 1

    other = make_tls_files(tmp_path / "other")  # a certificate whose key is not files.key_file
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted-key.pem"
    subprocess.run(["openssl", "pkey", "-in", str(files.key_file), "-out", str(encrypted), "-aes256",
                    "-passout", "pass:kv-pass"], check=True, capture_output=True, timeout=30)
    for query, fragment in [
        (f"ssl_ca_certs={tmp_path}/missing.pem", r"ssl_ca_certs=.*missing\.pem.*No such file"),
        (f"ssl_ca_certs={tmp_path}", r"ssl_ca_certs=.*Is a directory"),
        (f"ssl_ca_certs={garbage}", r"ssl_ca_certs=.*garbage\.pem"),
        ("ssl_ca_certs=", r"ssl_ca_certs= is empty"),
        (f"ssl_ca_certs={files.ca_file}&ssl_keyfile={files.key_file}", r"ssl_keyfile=.* needs ssl_certfile"),
        (f"ssl_ca_certs={files.ca_file}&ssl_certfile={files.cert_file}", r"ssl_certfile=.*client certificate"),
        (f"ssl_ca_certs={files.ca_file}&ssl_certfile={other.cert_file}&ssl_keyfile={files.key_file}",
         r"ssl_certfile=.* with ssl_keyfile=.*KEY_VALUES_MISMATCH"),
        (f"ssl_ca_certs={files.ca_file}&ssl_certfile={files.cert_file}&ssl_keyfile={encrypted}",
         r"encrypted-key\.pem' is encrypted"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            RedisTier(f"rediss://127.0.0.1:{server.port}/0?{query}", socket_timeout_s=0.3)


def test_tls_cluster(make, redis_tls_cluster):
    """rediss+cluster://: every node TLS-only (cluster bus too); chunks spread and round-trip."""
    assert redis_tls_cluster.url.startswith("rediss+cluster://")
    tier = make(redis_tls_cluster.url)
    ns, keys = fresh_ns(), [f"k{i}" for i in range(12)]
    payloads = [payload(k, 300_000) for k in keys]
    assert tier.put_many(ns, keys, payloads) == [True] * 12
    outs = empty(12, 300_000)
    assert tier.get_many(ns, keys, outs) == [True] * 12
    assert all(torch.equal(p, o) for p, o in zip(payloads, outs))
    counts = [sum(1 for _ in n.redis_connection.scan_iter(match=f"radixkv:{ns}:*"))
              for n in tier.redis_client.get_primaries()]
    assert len(counts) == 3 and min(counts) > 0, counts


# ------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("url, fragment", [
    ("http://127.0.0.1:6379", "unknown scheme"),
    ("redis://", "no host"),
    ("redis://127.0.0.1:99999", "1..65535"),
    ("redis://a:1,b:2", "2 hosts given"),
    ("redis://127.0.0.1/x", "database"),
    ("redis+cluster://127.0.0.1:7000/1", "only has database 0"),
    ("redis://127.0.0.1?ssl_ca_certs=/x", "rediss"),
    ("redis://127.0.0.1?cluster=true", "unknown option 'cluster'"),
    ("redis://127.0.0.1?capacity=lots", "capacity"),
    ("redis://127.0.0.1?ttl_s=-1", "ttl_s"),
    ("redis://127.0.0.1?ttl_s=inf", r"ttl_s=inf must be None \(no expiry\) or a number of seconds in"),
    ("redis://127.0.0.1?ttl_s=1e17", "ttl_s=1e[+]17"),  # Redis refused every put: invalid expire time
    ("rediss://127.0.0.1?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
    ("127.0.0.1:6379", "not a URL"),
])
def test_bad_url_is_a_config_error(url, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RedisTier(url)


def test_url_options_and_keywords(redis_tls_files):
    ca = redis_tls_files.ca_file  # a tier loads its TLS files when it is built
    tier = RedisTier("rediss+cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001?capacity=2MiB&ttl_s=60"
                     f"&ssl_ca_certs={ca}&ssl_cert_reqs=none", socket_timeout_s=0.2)
    parsed = tier.parsed_url
    assert parsed.cluster and parsed.tls and parsed.hosts == (("10.0.0.1", 7000), ("::1", 7001))
    assert (parsed.username, parsed.password) == ("u", "p@ss")
    assert dict(parsed.tls_options) == {"ssl_ca_certs": str(ca), "ssl_cert_reqs": "none"}
    assert tier.capacity_bytes == 2 << 20 and tier.config.ttl_s == 60 and tier.config.socket_timeout_s == 0.2
    assert "p@ss" not in repr(tier)
    assert parsed.redacted() == "rediss+cluster://u:***@10.0.0.1:7000,[::1]:7001/0"  # IPv6 in brackets
    with pytest.raises(ConfigError, match="one way"):
        RedisTier("redis://h?ttl_s=5", ttl_s=6)
    with pytest.raises(ConfigError, match="unknown option"):
        RedisTier("redis://h", ttl=5)
    tier.close()


def test_bad_namespace_and_key_are_input_errors(make, redis_url):
    tier = make(redis_url)
    with pytest.raises(InputError, match="namespace"):
        tier.contains_many("has:colon", ["k"])
    with pytest.raises(InputError, match="chunk key"):
        tier.contains_many(fresh_ns(), ["has space"])
    with pytest.raises(InputError, match="empty"):
        tier.put_many(fresh_ns(), ["k"], [torch.empty(0, dtype=torch.uint8)])


def test_closed_tier_refuses_calls(redis_url):
    tier = RedisTier(redis_url)
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.get_many(fresh_ns(), ["k"], empty(1))


# ------------------------------------------------------------------------------------------ ledger

def test_ledger_bound_and_forget_ordering():
    """Reservations keep used + reserved <= capacity; evidence older than a write does not erase it."""
    ledger = ByteLedger(capacity_bytes=100, ttl_s=None)
    assert ledger.reserve("ns", ["a", "b", "c"], [40, 40, 40]) == [True, True, False]
    ledger.check_integrity()
    before_settle = time.monotonic()
    ledger.settle("ns", ["a", "b", "c"], [40, 40, 40], [True, True, False], [True, False, False])
    assert ledger.used_bytes() == 40
    ledger.forget("ns", ["a"], seen_at=before_settle)  # a GET that started before the write settled
    assert ledger.used_bytes() == 40
    ledger.forget("ns", ["a"], seen_at=time.monotonic())
    assert ledger.used_bytes() == 0
    assert ledger.reserve("ns", ["a"], [40]) == [True]
    ledger.settle("ns", ["a"], [40], [True], [True])
    assert ledger.reserve("ns", ["a"], [40]) == [True]  # a re-put needs room for both copies in flight
    ledger.settle("ns", ["a"], [40], [True], [True])
    assert ledger.used_bytes() == 40
    ledger.forget_all(None, seen_at=time.monotonic())
    assert ledger.used_bytes() == 0
    ledger.check_integrity()


def test_ledger_ttl_expiry():
    ledger = ByteLedger(capacity_bytes=100, ttl_s=0.05)
    ledger.settle("ns", ["a"], [60], ledger.reserve("ns", ["a"], [60]), [True])
    assert ledger.reserve("ns", ["b"], [60]) == [False]
    time.sleep(0.08)
    assert ledger.used_bytes() == 0
    assert ledger.reserve("ns", ["b"], [60]) == [True]
    ledger.check_integrity()


def test_ledger_expiry_queue_stays_within_the_chunks_held():
    """With a TTL, each stored chunk queues its deadline. A chunk forgotten, deleted, cleared or
    stored again before it left its deadline queued until then: the queue grew with every put of
    the last ``ttl_s`` (configuration.md's 86400), not with the chunks held: ~72 B each, so a full
    tier storing 500 chunks/s queued 43 M deadlines, ~3 GB, whatever its capacity)."""
    ledger = ByteLedger(capacity_bytes=1 << 30, ttl_s=3600)
    for i in range(6000):
        key = f"k{i}"
        ledger.settle("ns", [key], [60], ledger.reserve("ns", [key], [60]), [True])
        if i >= 50:
            ledger.forget("ns", [f"k{i - 50}"], seen_at=time.monotonic())  # evicted by the server
        if i % 3 == 0:  # stored again
            ledger.settle("ns", [key], [60], ledger.reserve("ns", [key], [60]), [True])
    assert len(ledger._held) == 50
    assert len(ledger._expiry) <= 2 * 50 + 1024, f"{len(ledger._expiry)} deadlines queued for 50 chunks"
    ledger.forget_all(None, seen_at=time.monotonic())
    for i in range(1100):  # the queue is compacted as it grows again
        ledger.settle("ns", ["x"], [60], ledger.reserve("ns", ["x"], [60]), [True])
    assert len(ledger._expiry) <= 2 + 1024
    ledger.check_integrity()


ORDERS = {  # a put and a delete of one key; which step runs inside the other call, and the outcome
    "set-unlink-forget-settle": ("put", "after", False),
    "unlink-set-forget-settle": ("put", "before", True),
    "set-settle-unlink-forget": ("delete", "before", False),
    "unlink-set-settle-forget": ("delete", "after", True),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_ledger_is_exact_after_a_put_and_a_delete_of_one_key_overlap(make, redis_url, order):
    """Found by a fifth race hunt. Interleaving: a put's SET, then a delete's UNLINK of the same key,
    then the put settles (before or after the delete forgets): the ledger kept the deleted key's
    bytes until a later get or delete of it. Whether the SET or the UNLINK ran last only the server
    knows, so once both calls returned the ledger must match it, in every order (no undercount when
    the SET ran last)."""
    frame = HEADER_BYTES + 32 + 1 + 4096
    tier = make(redis_url, capacity_bytes=4 * frame)
    ns = fresh_ns()
    inner, when, kept = ORDERS[order]
    real_send, real_per_node = tier._send_frames, tier._per_node
    ran: list[str] = []

    def other_call() -> None:
        ran.append(inner)
        if inner == "put":  # the delete runs inside the put, before or after its SET
            assert tier.delete_many(ns, ["k"]) == (1 if when == "after" else 0)
        else:
            assert tier.put_many(ns, ["k"], [payload("k")]) == [True]

    def send(*args):
        if inner == "put" and not ran and when == "before":
            other_call()
        ok = real_send(*args)
        if inner == "put" and not ran and when == "after":
            other_call()
        return ok

    def per_node(namespace, keys, command):
        armed = inner == "delete" and command == "unlink" and not ran
        if armed and when == "before":
            other_call()
        replies = real_per_node(namespace, keys, command)
        if armed and when == "after":
            other_call()
        return replies

    tier._send_frames, tier._per_node = send, per_node
    if inner == "put":
        assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    else:
        tier.delete_many(ns, ["k"])
    assert ran == [inner]
    tier._send_frames, tier._per_node = real_send, real_per_node
    assert tier.contains_many(ns, ["k"]) == int(kept)  # the server's verdict
    assert tier.usage_bytes() == (frame if kept else 0)  # and the ledger's, exact
    tier.check_integrity()


def test_ledger_is_exact_after_a_clear_overlaps_a_put(make, redis_url):
    """The same interleaving with a clear: a put's SET, the clear's SCAN + UNLINK, the put settles."""
    frame = HEADER_BYTES + 32 + 1 + 4096
    tier = make(redis_url, capacity_bytes=4 * frame)
    ns = fresh_ns()
    real_send = tier._send_frames

    def send(*args):
        ok = real_send(*args)
        tier._send_frames = real_send
        tier.clear(ns)
        return ok

    tier._send_frames = send
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    assert tier._send_frames == real_send  # the clear ran inside the put
    assert tier.contains_many(ns, ["k"]) == 0
    assert tier.usage_bytes() == 0
    tier.check_integrity()


# ------------------------------------------------------------------------------ from a fault review

def test_a_clear_the_server_missed_is_retried_so_the_ledger_frees(make, redis_server):
    """A clear() while the server is down used to leave the byte ledger full forever (every later
    put refused once the server came back empty); it is now retried by later calls."""
    frame = HEADER_BYTES + 32 + 1 + 4096
    tier = make(redis_server.url, capacity_bytes=4 * frame, socket_timeout_s=0.5,
                socket_connect_timeout_s=0.25, down_backoff_s=0.2)
    ns = fresh_ns()
    keys = ["a", "b", "c", "d"]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 4
    redis_server.stop()
    tier.clear(ns)  # cannot reach the server
    redis_server.start()  # empty
    time.sleep(0.25)
    assert tier.put_many(ns, ["e"], [payload("e")]) == [True]  # the retried clear freed the ledger
    assert tier.usage_bytes() == frame


def test_reconcile_inside_the_fail_fast_window_forgets_nothing(redis_server):
    """One timeout opens the fail-fast window, in which contains_many answers 0 without asking the
    server; reconcile counted that as "lost" and dropped every Redis residency of a healthy server."""
    from radixkv.config import StoreConfig, TierConfig
    from radixkv.keys import Namespace
    from radixkv.store import HierarchicalStore

    cfg = StoreConfig(tiers=[TierConfig(url=redis_server.url, capacity_bytes=0,
                                        options={"socket_timeout_s": 0.3, "down_backoff_s": 30.0})],
                      metrics=False)
    ns = Namespace(model=fresh_ns(), dtype="uint8", layout="x", chunk_tokens=4)
    keys = [f"{i:064x}" for i in range(5)]
    with HierarchicalStore(cfg) as store:
        assert store.put(ns, keys, [payload(k) for k in keys]) == [True] * 5
        redis_server.pause()
        try:
            assert store.tiers[0].get_many(ns.digest, keys[:1], empty(1)) == [False]  # times out
        finally:
            redis_server.resume()
        assert store.reconcile() == 0
        assert store.lookup(ns, keys) == 5


def test_cluster_ping_needs_every_primary(make, redis_cluster):
    """ping() asked only one node, so delete retries took a cluster with a dead node for healthy
    and dropped the deletes that node had missed (their bytes stayed in the ledger)."""
    tier = make(redis_cluster.url, socket_timeout_s=0.5, socket_connect_timeout_s=0.25, down_backoff_s=0.2)
    assert tier.ping()
    default = tier.redis_client.get_default_node().port
    victim = next(n for n in redis_cluster.nodes if n.port != default)
    victim.stop()
    try:
        assert not tier.ping()
    finally:
        victim.start()
        redis_cluster.wait_ok()


def test_cluster_calls_never_raise_while_a_slot_migrates(make, redis_cluster):
    """ASK replies made one thread drop the shared cluster client while others were inside it:
    AttributeError / ValueError escaped contains_many, delete_many and clear."""
    tier = make(redis_cluster.url)
    ns, key = fresh_ns(), "k0"
    rk = f"radixkv:{ns}:{key}"
    client = tier.redis_client
    own = client.get_node_from_key(rk)
    src = next(n for n in redis_cluster.nodes if n.port == own.port)
    dst = next(n for n in redis_cluster.nodes if n is not src)
    slot = client.keyslot(rk)
    src_conn, dst_conn = client.get_redis_connection(own), redis.Redis(port=dst.port)
    dst_conn.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_conn.execute_command("CLUSTER", "MYID"))
    src_conn.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_conn.execute_command("CLUSTER", "MYID"))
    stop = threading.Event()
    escaped: list[str] = []

    def loop(fn) -> None:
        while not stop.is_set():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - what the test looks for
                escaped.append(f"{type(e).__name__}: {e}")

    fns = [lambda: tier.get_many(ns, [key], empty(1)), lambda: tier.contains_many(ns, [key, "k1", "k2"]),
           lambda: tier.delete_many(ns, [key, "k1"]), lambda: tier.clear(ns)]
    threads = [threading.Thread(target=loop, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join()
    for conn in (src_conn, dst_conn):
        conn.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    dst_conn.close()
    assert not escaped, escaped[:3]


def test_close_closes_the_connections_without_waiting_for_the_gc(redis_server):
    # Found by a fuzz: the client did not own its pool, so close() left a socket (and a server
    # client) open until the garbage collector ran; one more per attach/close cycle.
    import gc

    probe = raw_client(redis_server.url)
    before = len(probe.client_list())
    gc.disable()
    try:
        for _ in range(3):
            tier = RedisTier(redis_server.url)
            ns = fresh_ns()
            assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
            tier.close()
        time.sleep(0.2)
        assert len(probe.client_list()) == before
    finally:
        gc.enable()
        probe.close()


def test_a_namespace_with_a_pending_clear_refuses_puts_until_it_ran(make, redis_url, monkeypatch):
    # Found by a review: a retried clear ran while another thread put into the same namespace; the put
    # was acknowledged, then deleted by the clear.
    tier = make(redis_url)
    ns, other = fresh_ns(), fresh_ns()
    assert tier.put_many(ns, ["a"], [payload("a")]) == [True]
    real = tier._scan_unlink
    monkeypatch.setattr(tier, "_scan_unlink", lambda n: False)  # the server misses the clear
    tier.clear(ns)
    assert tier.put_many(ns, ["b"], [payload("b")]) == [False]  # would be deleted by the retry
    assert tier.put_many(other, ["b"], [payload("b")]) == [True]  # other namespaces are not held
    monkeypatch.setattr(tier, "_scan_unlink", real)
    assert tier.put_many(ns, ["b"], [payload("b")]) == [True]  # the retried clear ran first
    out = empty(1)
    assert tier.get_many(ns, ["b"], out) == [True] and torch.equal(out[0], payload("b"))
    assert tier.contains_many(ns, ["a"]) == 0


def test_close_runs_a_pending_clear_or_says_it_could_not(redis_url, monkeypatch, caplog):
    """Found by an audit: a clear a fault interrupted was kept in this process only, so close()
    dropped it and the next process (which adopts what the server holds) served pre-clear values.
    close() now tries it once more, and logs the namespaces it could not clear."""
    ns, ns2 = fresh_ns(), fresh_ns()
    tier = RedisTier(redis_url)
    assert tier.put_many(ns, ["a"], [payload("a")]) == [True]
    real = tier._scan_unlink
    monkeypatch.setattr(tier, "_scan_unlink", lambda n: False)  # the server misses the clear
    tier.clear(ns)
    monkeypatch.setattr(tier, "_scan_unlink", real)  # it answers again; nothing else calls the tier
    tier.close()
    reader = RedisTier(redis_url)
    assert reader.contains_many(ns, ["a"]) == 0  # cleared at close, not left for the next process
    assert reader.put_many(ns2, ["a"], [payload("a")]) == [True]
    monkeypatch.setattr(reader, "_scan_unlink", lambda n: False)
    reader.clear(ns2)
    with caplog.at_level(logging.WARNING, logger="radixkv.tiers.redis"):
        reader.close()
    assert "could not complete before close" in caplog.text and ns2 in caplog.text


def test_a_namespace_with_a_pending_clear_serves_no_pre_clear_bytes(make, redis_url, monkeypatch):
    # Found by a review: while a clear stayed pending, puts of the namespace were refused but gets
    # and contains_many still answered from the chunks the clear had not deleted yet.
    tier = make(redis_url)
    ns, other = fresh_ns(), fresh_ns()
    assert tier.put_many(ns, ["a"], [payload("a")]) == [True]
    assert tier.put_many(other, ["a"], [payload("a")]) == [True]
    real = tier._scan_unlink
    monkeypatch.setattr(tier, "_scan_unlink", lambda n: False)  # the server misses the clear
    tier.clear(ns)
    assert tier.get_many(ns, ["a"], empty(1)) == [False]
    assert tier.contains_many(ns, ["a"]) == 0
    out = empty(1)
    assert tier.get_many(other, ["a"], out) == [True] and torch.equal(out[0], payload("a"))
    assert tier.contains_many(other, ["a"]) == 1
    monkeypatch.setattr(tier, "_scan_unlink", real)
    assert tier.contains_many(ns, ["a"]) == 0  # the retried clear ran: gone for good
    assert tier.put_many(ns, ["a"], [payload("a", salt="new")]) == [True]
    assert tier.get_many(ns, ["a"], out) == [True] and torch.equal(out[0], payload("a", salt="new"))


def test_a_cluster_clear_a_dead_node_missed_serves_no_pre_clear_bytes(make, redis_cluster):
    """The same with a real cluster: one primary down, clear(ns) stays pending, and the live nodes'
    pre-clear chunks must not be served (a store would adopt them as current)."""
    for node in redis_cluster.nodes:  # a cache cluster keeps serving the slots it has
        c = redis.Redis(host="127.0.0.1", port=node.port)
        c.config_set("cluster-require-full-coverage", "no")
        c.close()
    tier = make(redis_cluster.url, socket_timeout_s=0.5, socket_connect_timeout_s=0.25, down_backoff_s=0.0)
    ns, keys = fresh_ns(), [f"{i:064x}" for i in range(24)]
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 24
    victim = redis_cluster.nodes[2]
    client = tier.redis_client
    live = [k for k in keys if client.get_node_from_key(f"radixkv:{ns}:{k}").port != victim.port]
    assert 0 < len(live) < 24
    victim.stop()
    try:
        tier.clear(ns)
        assert tier._pending_clears == {ns}
        assert tier.contains_many(ns, live[:1]) == 0
        outs = empty(len(live))
        assert tier.get_many(ns, live, outs) == [False] * len(live)
    finally:
        victim.start()
        redis_cluster.wait_ok()


def test_cluster_exists_and_unlink_after_a_reshard_refresh_the_map_and_mark_a_fault(make, redis_cluster):
    # Found by a hunt: after a slot moved, contains_many and delete_many read the MOVED replies as
    # "absent" / "not deleted" without refreshing the slot map or moving fault_mark. A store that
    # only probed (adoption, reconcile) kept missing those chunks for good, reconcile forgot chunks
    # the cluster held, and a store's delete of them was neither done nor retried (their bytes
    # stayed on the cluster and in the ledger).
    tier = make(redis_cluster.url)
    ns = fresh_ns()
    assert tier.put_many(ns, ["a", "b"], [payload("a"), payload("b")]) == [True, True]
    used = tier.usage_bytes()
    redis_cluster.move_slot(tier.redis_client.keyslot(f"radixkv:{ns}:a"))  # the tier's map is stale now
    mark = tier.fault_mark()
    assert tier.contains_many(ns, ["a"]) == 0  # MOVED: unknown, not absent ...
    assert tier.fault_mark() != mark  # ... so reconcile must not forget it
    assert tier.contains_many(ns, ["a"]) == 1  # the map was refreshed
    redis_cluster.move_slot(tier.redis_client.keyslot(f"radixkv:{ns}:b"))
    mark = tier.fault_mark()
    assert tier.delete_many(ns, ["b"]) == 0
    assert tier.fault_mark() != mark  # a store retries the delete
    assert tier.usage_bytes() == used  # still on the cluster: still counted
    assert tier.delete_many(ns, ["b"]) == 1
    assert tier.usage_bytes() == used // 2
    assert tier.contains_many(ns, ["b"]) == 0
    tier.check_integrity()


def test_cluster_calls_while_a_slot_migrates_keep_their_client(make, redis_cluster):
    # Found by a hunt: every ASK reply (a slot mid-migration) dropped the cluster client to rebuild
    # it, but the rebuilt one got ASK again; the dropped ones kept their sockets open for the grace
    # period, so a migration under live traffic opened ~2 connections per call (hundreds a second)
    # on the client and the servers.
    tier = make(redis_cluster.url)
    ns = fresh_ns()
    rk = f"radixkv:{ns}:k"
    client = tier.redis_client
    slot = client.keyslot(rk)
    src = client.get_redis_connection(client.get_node_from_key(rk))
    dst_node = next(n for n in redis_cluster.nodes if n.port != client.get_node_from_key(rk).port)
    dst = redis.Redis(port=dst_node.port)
    src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)  # k is absent here: ASK

    def connections() -> int:
        return sum(redis.Redis(port=n.port).info("clients")["connected_clients"] for n in redis_cluster.nodes)

    assert tier.get_many(ns, ["k"], empty(1)) == [False]
    before, mark = connections(), tier.fault_mark()
    for _ in range(20):
        assert tier.put_many(ns, ["k"], [payload("k")]) == [False]
        assert tier.get_many(ns, ["k"], empty(1)) == [False]
        assert tier.contains_many(ns, ["k"]) == 0
    assert tier.fault_mark() != mark  # ASK: unknown, not absent
    assert connections() <= before + 3, f"{connections() - before} new connections for 60 calls"
    assert tier.redis_client is client
    for n in redis_cluster.nodes:  # the migration ends: the slot is dst's (MOVED, then rediscovered)
        redis.Redis(port=n.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    dst.close()
    assert tier.put_many(ns, ["k"], [payload("k")]) == [False]
    assert tier.put_many(ns, ["k"], [payload("k")]) == [True]
    out = empty(1)
    assert tier.get_many(ns, ["k"], out) == [True] and torch.equal(out[0], payload("k"))
    tier.check_integrity()


def test_cluster_ping_after_a_failover_rediscovers_the_primaries(make, redis_cluster_with_replicas):
    # Found by a hunt: after a primary died and its replica took over, ping() kept asking the dead
    # node of its old slot map: an idle tier stayed unhealthy for good (and a store's delete
    # retries, which wait for a ping, never ran) until a data call happened to fault on it.
    cluster = redis_cluster_with_replicas
    tier = make(cluster.url, socket_timeout_s=0.5, socket_connect_timeout_s=0.25, down_backoff_s=0.2)
    assert tier.ping()
    victim = next(n for n in cluster.nodes if n.port == tier.redis_client.get_primaries()[0].port)
    victim.stop()
    cluster.wait_ok()  # its replica is a primary now (cluster-node-timeout 2 s)
    pings = [tier.ping() for _ in range(3)]
    assert pings[1:] == [True, True], pings  # the first may still ask the dead node
    ns = fresh_ns()
    keys = [f"k{i}" for i in range(8)]  # over every primary
    assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 8
    outs = empty(8)
    assert tier.get_many(ns, keys, outs) == [True] * 8
    assert all(torch.equal(o, payload(k)) for k, o in zip(keys, outs))


# ------------------------------------------------------------------------------------------ hostile servers

class _ScriptedServer:
    """A RESP server on loopback that answers each command with ``reply(args) -> bytes`` (HELLO with
    a RESP3 map unless ``reply`` says otherwise): a server that is not Redis, or a hostile one."""

    def __init__(self, reply) -> None:
        import socket

        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                head = f.readline()
                if not head:
                    return
                args = []
                for _ in range(int(head[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:-2])
                out = self.reply(args)
                if out is None:
                    out = b"%1\r\n$5\r\nproto\r\n:3\r\n" if args[0].upper() == b"HELLO" else b"+OK\r\n"
                conn.sendall(out)
        except (OSError, ValueError):
            return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def scripted():
    servers: list[_ScriptedServer] = []

    def start(reply) -> _ScriptedServer:
        servers.append(_ScriptedServer(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_replies_redis_py_cannot_parse_are_faults_never_exceptions(make, scripted):
    """A server that is not Redis (or a hostile one) made redis-py raise other errors than its own
    (a HELLO reply that is no map: AttributeError), which escaped every call of a standalone tier;
    they are faults like a connection error: misses, failed puts, the fail-fast window."""
    server = scripted(lambda args: b"+OK\r\n")  # HELLO answered with a simple string
    tier = make(server.url, down_backoff_s=0)
    ns = fresh_ns()
    assert tier.contains_many(ns, ["a"]) == 0
    assert tier.get_many(ns, ["a"], empty(1)) == [False]
    assert tier.put_many(ns, ["a"], [payload("a")]) == [False]
    assert tier.delete_many(ns, ["a"]) == 0
    tier.clear(ns)
    st = tier.stats()
    assert st.errors > 0 and st.misses == 1 and st.put_failures == 1, st


def test_a_clear_a_malformed_scan_reply_broke_stays_pending(make, scripted):
    """A SCAN reply that is not [cursor, keys] made clear() raise (TypeError from redis-py) without
    recording the clear as pending: the keys it never reached stayed readable, so pre-clear bytes
    were served after the clear. It is a fault now: the namespace misses until a retried clear ran."""
    from radixkv.tiers.framing import encode_header

    ns, key = fresh_ns(), "a"
    value = payload(key)
    frame = encode_header(ns, key, value.numpy()) + value.numpy().tobytes()

    def reply(args):
        cmd = args[0].upper()
        if cmd == b"SCAN":
            return b":7\r\n"  # not an array
        if cmd == b"GET":
            return b"$%d\r\n%s\r\n" % (len(frame), frame)
        return None

    tier = make(scripted(reply).url, down_backoff_s=0)
    out = empty(1)
    assert tier.get_many(ns, [key], out) == [True] and torch.equal(out[0], value)  # the frame is valid
    tier.clear(ns)
    assert tier.get_many(ns, [key], empty(1)) == [False]
    assert tier.put_many(ns, [key], [value]) == [False]  # a retried clear would delete it
    assert tier.stats().errors >= 1


def test_a_clear_the_server_refuses_keeps_only_its_namespace_unserved(redis_server_factory, caplog):
    """Found by an audit: an ACL user without +scan cannot clear; the SCAN's NOPERM was taken as a
    fault of the medium, and the pending clear, retried by every later call of any namespace,
    opened the fail-fast window each time: the whole tier served misses for good. Now only the
    cleared namespace stays unserved (its pre-clear bytes are never served), retried now and then."""
    import redis

    server = redis_server_factory()
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~radixkv:*", "+get", "+set", "+exists",
                          "+unlink", "+evalsha", "+eval", "+ping")
    admin.close()
    host_port = server.url.split("://", 1)[1].split("/", 1)[0]
    tier = RedisTier(f"redis://kv:pw@{host_port}/0", capacity_bytes=1 << 20, down_backoff_s=0.3)
    try:
        value = torch.arange(1000, dtype=torch.int32).to(torch.uint8)
        assert tier.put_many("other", ["k"], [value]) == [True]
        assert tier.put_many("old", ["k"], [value]) == [True]
        with caplog.at_level(logging.WARNING, logger="radixkv.tiers.redis"):
            tier.clear("old")
        assert "refused clear('old')" in caplog.text and "+scan" in caplog.text
        out = torch.empty(1000, dtype=torch.uint8)
        for _ in range(3):
            time.sleep(0.35)  # past the window each time
            assert tier.get_many("other", ["k"], [out]) == [True]
            assert torch.equal(out, value)
        assert tier.get_many("old", ["k"], [out]) == [False]  # pre-clear bytes are not served
        assert tier.put_many("old", ["k2"], [value]) == [False]
        assert tier.stats().extra["fast_fail_calls"] == 0
    finally:
        tier.close()


def test_a_large_payload_is_packed_in_slices_each_sent_within_the_timeout():
    """Found by an audit: redis-py sends each packed item with one sock.sendall, whose timeout
    bounds the whole call; a 12 MiB chunk over an 8 MiB/s link timed out at every put and the tier
    was taken for unreachable. The payload goes in 1 MiB views (no copy), each sent on its own."""
    from radixkv.tiers.redis_client import FramedValue, _FramePacker, _SEND_SLICE_BYTES

    payload = torch.arange(3 * _SEND_SLICE_BYTES + 123, dtype=torch.int64).to(torch.uint8).numpy()
    value = FramedValue(b"HDR", memoryview(payload))
    packer = _FramePacker(6000, lambda a: a.encode() if isinstance(a, str) else a)
    items = packer.pack("SET", "key", value)
    views = [i for i in items if isinstance(i, memoryview)]
    assert len(views) == 4 and all(v.nbytes <= _SEND_SLICE_BYTES for v in views)
    assert all(v.obj is payload or v.obj is value.payload.obj for v in views)  # views, not copies
    expect = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$%d\r\nHDR" % value.nbytes + payload.tobytes() + b"\r\n"
    assert b"".join(bytes(i) for i in items) == expect


def test_a_clear_whose_unlinks_the_server_refuses_stays_pending(redis_server_factory, caplog):
    """Found by an audit: the clear's UNLINK replies were never read, so an ACL user without
    +unlink (or, in a cluster, a node that timed out mid-pipeline) got a clear reported done, the
    ledger forgot the chunks and their pre-clear values were served as hits."""
    server = redis_server_factory()
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~radixkv:*", "+@all", "-unlink")
    host_port = server.url.split("://", 1)[1].split("/", 1)[0]
    tier = RedisTier(f"redis://kv:pw@{host_port}/0")
    try:
        ns, keys = fresh_ns(), ["a", "b", "c"]
        assert tier.put_many(ns, keys, [payload(k) for k in keys]) == [True] * 3
        used = tier.usage_bytes()
        with caplog.at_level(logging.WARNING, logger="radixkv.tiers.redis"):
            tier.clear(ns)
        assert "refused clear" in caplog.text and "unlink" in caplog.text
        assert admin.dbsize() == 3  # nothing was deleted ...
        assert tier.get_many(ns, keys, empty(3)) == [False] * 3  # ... and nothing is served
        assert tier.contains_many(ns, keys) == 0
        assert tier.usage_bytes() == used  # still on the server: still counted
        admin.execute_command("ACL", "SETUSER", "kv", "+unlink")
        tier._clear_retry_after = 0.0  # the next call retries it (no waiting for the back-off)
        assert tier.get_many(ns, keys, empty(3)) == [False] * 3
        assert admin.dbsize() == 0 and tier.usage_bytes() == 0
        tier.check_integrity()
    finally:
        tier.close()
        admin.close()


def test_commands_the_server_refuses_are_logged_once_per_kind(make, redis_server_factory, caplog):
    """Found by an audit: an ACL whose key pattern misses ``key_prefix`` refused every command, and
    the tier looked healthy and empty (ping answered, nothing logged); the first refusal of each
    kind is logged, naming the key pattern to grant."""
    server = redis_server_factory(extra_args=["--user", "default", "off",
                                              "--user", "cache", "on", ">kv-pass", "~radixkv:*", "+@all"])
    tier = make(f"redis://cache:kv-pass@127.0.0.1:{server.port}/0", key_prefix="prod")
    ns = fresh_ns()
    with caplog.at_level(logging.WARNING, logger="radixkv.tiers.redis"):
        for _ in range(3):
            assert tier.put_many(ns, ["k", "l"], [payload("k"), payload("l")]) == [False, False]
            assert tier.get_many(ns, ["k"], empty(1)) == [False]  # the direct GET path: text replies
    warned = [r.getMessage() for r in caplog.records if "refused a command" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "NOPERM" in warned[0] and "prod:*" in warned[0]
    assert tier.ping() and tier.stats().errors == 9


def test_inline_transport_faults_are_not_logged_as_refusals(redis_url, caplog):
    """A cluster pipeline returns a node's timeout inline among the replies: not a command the
    server refused (found by a review of the refusal log)."""
    tier = RedisTier(redis_url)
    try:
        with caplog.at_level(logging.WARNING, logger="radixkv.tiers.redis"):
            tier._link.note_error_replies([redis.exceptions.TimeoutError("Timeout reading from socket"),
                                           redis.exceptions.ConnectionError("Connection reset")])
        assert "refused a command" not in caplog.text
    finally:
        tier.close()


def test_a_call_inside_the_fail_fast_window_does_not_wait_for_a_client_build(redis_url, monkeypatch):
    """Found by an audit: a client was built (a cluster client reads the slot map: a socket timeout
    per seed that does not answer) under the lock that calls inside the fail-fast window take to
    count themselves, so they waited seconds for another thread's rediscovery."""
    import radixkv.tiers.redis_link as redis_link

    tier = RedisTier(redis_url, down_backoff_s=30.0)
    try:
        building, release = threading.Event(), threading.Event()
        real = redis_link.make_client

        def slow_make_client(*args, **kwargs):
            building.set()
            release.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(redis_link, "make_client", slow_make_client)
        tier._link.mark_down(OSError("injected fault"))  # the window opens ...
        tier._link.rediscover()  # ... and the client is dropped, as after a cluster fault
        builder = threading.Thread(target=tier.ping)  # ping ignores the window: it builds
        builder.start()
        assert building.wait(10)
        started = time.monotonic()
        assert tier.get_many(fresh_ns(), ["k"], empty(1)) == [False]
        assert time.monotonic() - started < 1.0
        assert tier.stats().extra["fast_fail_calls"] == 1
        release.set()
        builder.join(10)
        assert not builder.is_alive()
    finally:
        release.set()
        tier.close()


def test_a_redis_tier_needs_a_name():
    with pytest.raises(ConfigError, match="non-empty tier name"):
        RedisTier("redis://127.0.0.1:6379/0", name="")
