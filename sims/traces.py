"""Request traces: the value types the simulator replays and the readers that produce them.

A :class:`Trace` is an ordered list of :class:`Request` s. Each request carries the chain keys of its
prompt's blocks (``block_keys``: key i names block i *and its whole prefix*, so equal keys mean equal
prefixes), its arrival time, prompt and output lengths, and an optional tenant / session label.

Readers (each returns a :class:`Trace`; :func:`read_trace` picks one by sniffing the first record):

* Mooncake JSONL (FAST'25 release): ``{"timestamp": ms, "input_length": n, "output_length": m,
  "hash_ids": [ints]}``, one id per 512-token block, chained. The last block may be partial.
* radixkv JSONL: an optional header line ``{"radixkv_trace": 1, "block_tokens": 256}`` (fields
  ``radixkv_trace``, ``block_tokens`` and ``name`` only; any other is an error) and then one
  record per request::

      {"arrival_s": 0.25, "output_tokens": 64, "block_keys": ["a1", "a2"], "input_tokens": 600,
       "tenant": "acme", "session": "chat-17"}
      {"arrival_s": 0.50, "output_tokens": 64, "token_ids": [1, 2, 3, ...]}

  ``block_keys`` are opaque chain keys (strings or ints); ``token_ids`` are hashed with the chunk-key
  scheme (:func:`radixkv.keys.chunk_keys`, full chunks only: a partial trailing chunk is never stored,
  as in the runtime). ``input_tokens`` defaults to ``len(token_ids)`` or ``len(block_keys) *
  block_tokens``; when given it must agree with them: ``input_tokens == len(token_ids)``, and
  ``len(block_keys)`` is ``ceil(input_tokens / block_tokens)`` (the last block may be partial) or
  ``floor(...)`` (full blocks only, as a trace written from token ids has).

  ``tenant`` means different things in the two kinds of record. For ``token_ids`` it is the
  request's ``cache_salt``: it seeds the key chain, so two tenants with the same tokens share no
  block (as a salted runtime isolates them). For ``block_keys`` it is only a label: the keys are
  used as given, so tenants share whatever keys they have in common; isolate them in the keys.

  The header's ``block_tokens`` (default 256) is the block size. A ``block_tokens`` argument
  (``--block-tokens``) replaces it for ``token_ids`` records, which are hashed here, but must equal
  it for ``block_keys`` records: those keys were cut by the trace's writer and cannot be re-cut.

Keys of every trace are strings (the tree's key type); Mooncake integer ids become their decimal text.
Files ending in ``.xz`` or ``.gz`` are read compressed.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
import os
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, Protocol

from radixkv.errors import InputError
from radixkv.keys import chunk_keys

__all__ = [
    "Request",
    "Trace",
    "TraceReader",
    "read_trace",
    "read_mooncake",
    "read_radixkv",
    "write_radixkv",
]

_MAX_BLOCK_TOKENS = 1 << 48  # the tree's bound on a chunk's tokens (a 48-bit field)
# The fields a radixkv_trace header may have (write_radixkv writes all three); any other is an error.
_HEADER_FIELDS = frozenset({"radixkv_trace", "block_tokens", "name"})


@dataclass(slots=True)
class Request:
    """One request of a trace. ``block_keys`` are the prompt's chain keys, root first."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_keys: list[str]
    tenant: str | None = None
    session: str | None = None


@dataclass(slots=True)
class Trace:
    """An ordered request trace with ``block_tokens`` tokens per block (the last may be partial)."""

    name: str
    block_tokens: int
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or not 0 < self.block_tokens < _MAX_BLOCK_TOKENS:
            # Refused here, before a sweep starts, rather than by the tree mid-sweep without the
            # trace's name.
            raise InputError(f"block_tokens={self.block_tokens!r} must be a positive integer below 2**48")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def block_references(self) -> int:
        """Total block references (sum of blocks over requests)."""
        return sum(len(r.block_keys) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        seen: set[str] = set()
        for r in self.requests:
            seen.update(r.block_keys)
        return len(seen)

    def infinite_hit_blocks(self) -> int:
        """Block hits of an infinite cache (leading run of keys seen before, per request)."""
        seen: set[str] = set()
        hits = 0
        for r in self.requests:
            keys = r.block_keys
            k = 0
            while k < len(keys) and keys[k] in seen:
                k += 1
            hits += k
            seen.update(keys[k:])
        return hits

    def check_prefix_closed(self) -> None:
        """Raise InputError if one key appears under two different parents (not a prefix chain)."""
        parent_of: dict[str, str | None] = {}
        for i, r in enumerate(self.requests):
            prev: str | None = None
            for key in r.block_keys:
                known = parent_of.setdefault(key, prev)
                if known != prev:
                    raise InputError(
                        f"trace {self.name!r}, request {i}: block key {key!r} follows {prev!r} here but "
                        f"{known!r} earlier; block keys must be chained (equal key = equal whole prefix)"
                    )
                prev = key

    def check_integrity(self) -> None:
        for i, r in enumerate(self.requests):
            assert r.input_tokens >= 0 and r.output_tokens >= 0, (i, r.input_tokens, r.output_tokens)
            assert len(r.block_keys) <= -(-r.input_tokens // self.block_tokens) or r.input_tokens == 0, (
                i,
                len(r.block_keys),
                r.input_tokens,
            )
        self.check_prefix_closed()


class TraceReader(Protocol):
    """Anything that turns a path into a :class:`Trace`."""

    def __call__(self, path: str, *, block_tokens: int | None = None, limit: int | None = None) -> Trace: ...


def _open_trace(path: str) -> IO[bytes]:
    """The trace's bytes; ``.xz`` and ``.gz`` files are decompressed on the fly (published traces are
    usually shipped compressed; the repo's copy of the Mooncake trace is ``.xz``)."""
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _iter_json_lines(path: str, limit: int | None) -> Iterable[tuple[int, dict]]:
    if os.path.isdir(path):
        raise InputError(f"trace {path!r} is a directory; pass --trace PATH to a JSONL trace file")
    if not os.path.exists(path):
        raise InputError(f"trace file {path!r} does not exist; pass --trace PATH to a JSONL trace")
    if not os.path.isfile(path):  # /dev/null, a FIFO: not "does not exist"
        raise InputError(f"trace {path!r} is not a regular file; pass --trace PATH to a JSONL trace file")
    _check_limit(limit)
    try:
        f = _open_trace(path)
    except OSError as e:  # unreadable (permissions), or gone since the checks above
        raise InputError(f"cannot read trace {path!r}: {e.strerror or e}; check the file and its "
                         "permissions") from None
    with f:
        n = 0
        for lineno, line in _numbered(path, f):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to decode
                raise InputError(f"{path}:{lineno}: not valid JSON ({e}); traces are JSON Lines") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{lineno}: each line must be a JSON object, got {type(record).__name__}")
            yield lineno, record
            n += 1
            if limit is not None and n >= limit:
                return


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise InputError(f"limit={limit!r} must be a positive number of requests")


def _numbered(path: str, f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    try:
        yield from enumerate(f, 1)
    except (lzma.LZMAError, EOFError, OSError) as e:  # gzip raises BadGzipFile (an OSError)
        raise InputError(f"{path}: cannot decompress ({e}); is the file complete?") from None


def _int_field(path: str, lineno: int, record: dict, name: str, default: int | None = None) -> int:
    value = record.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{path}:{lineno}: field {name!r}={value!r} must be a non-negative integer")
    return value


def read_mooncake(path: str, *, block_tokens: int | None = None, limit: int | None = None) -> Trace:
    """Read a Mooncake FAST'25 JSONL trace (``timestamp`` ms, ``hash_ids`` per 512-token block)."""
    bt = 512 if block_tokens is None else block_tokens
    trace = Trace(name=os.path.basename(path), block_tokens=bt)
    # Intern keys: equal ids share one str object (fewer allocations, faster dict hits in the tree).
    interned: dict[int, str] = {}
    for lineno, rec in _iter_json_lines(path, limit):
        ids = rec.get("hash_ids")
        if not isinstance(ids, list):
            raise InputError(f"{path}:{lineno}: 'hash_ids' must be a list of block ids (Mooncake format)")
        keys: list[str] = []
        for h in ids:
            # Type first: a list id is unhashable (the lookup would raise TypeError), and True / 1.0
            # equal 1 as dict keys, so an earlier id 1 would silently accept them. `type(h) is int`
            # also rejects bool (an int subclass) and is cheap on the 288k ids of the trace.
            if type(h) is not int or h < 0:
                raise InputError(
                    f"{path}:{lineno}: hash id {h!r} must be a non-negative integer (Mooncake block id)"
                )
            s = interned.get(h)
            if s is None:
                s = interned[h] = str(h)
            keys.append(s)
        input_tokens = _int_field(path, lineno, rec, "input_length", len(ids) * bt)
        if len(ids) != -(-input_tokens // bt):  # one id per started block of the prompt
            raise InputError(
                f"{path}:{lineno}: input_length={input_tokens} makes {-(-input_tokens // bt)} blocks of {bt} "
                f"tokens but hash_ids has {len(ids)}; is the block size right (Mooncake: 512, "
                "--block-tokens)?"
            )
        ts = rec.get("timestamp", 0)
        # isfinite: Python's json accepts NaN and Infinity, which would order nothing.
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
            raise InputError(f"{path}:{lineno}: 'timestamp'={ts!r} must be finite non-negative milliseconds")
        trace.requests.append(
            Request(
                arrival_s=ts / 1000.0,
                input_tokens=input_tokens,
                output_tokens=_int_field(path, lineno, rec, "output_length", 0),
                block_keys=keys,
            )
        )
    return trace


def read_radixkv(path: str, *, block_tokens: int | None = None, limit: int | None = None) -> Trace:
    """Read radixkv's own JSONL trace format (see the module docstring)."""
    bt = block_tokens
    header_bt: int | None = None  # the header's block_tokens: the block size its block keys were cut at
    trace: Trace | None = None
    interned: dict[object, str] = {}
    _check_limit(limit)
    # No limit on the lines: the header is optional, so the loop stops after the limit-th request
    # (a line past it is never parsed, as in read_mooncake).
    for lineno, rec in _iter_json_lines(path, None):
        if "radixkv_trace" in rec:
            if trace is not None:
                raise InputError(f"{path}:{lineno}: the radixkv_trace header must be the first line")
            if rec["radixkv_trace"] != 1:
                raise InputError(f"{path}:{lineno}: radixkv_trace={rec['radixkv_trace']!r} is not a version "
                                 "this reader knows (1)")
            # A misspelt key (say 'block_token') would silently mean the default 256 tokens per block.
            unknown = sorted(set(rec) - _HEADER_FIELDS)
            if unknown:
                raise InputError(
                    f"{path}:{lineno}: unknown header field(s) {', '.join(map(repr, unknown))}; a radixkv_trace "
                    f"header has only {', '.join(map(repr, sorted(_HEADER_FIELDS)))} (is a name misspelt?)"
                )
            if "name" in rec and not isinstance(rec["name"], str):
                raise InputError(f"{path}:{lineno}: header field 'name'={rec['name']!r} must be a string")
            if "block_tokens" in rec:
                # Checked even when block_tokens is given: it is what the header's keys were cut at.
                header_bt = _int_field(path, lineno, rec, "block_tokens")
                if not 0 < header_bt < _MAX_BLOCK_TOKENS:
                    raise InputError(f"{path}:{lineno}: header field 'block_tokens'={header_bt} must be a "
                                     "positive integer below 2**48 (tokens per block)")
                if bt is None:
                    bt = header_bt
            trace = Trace(name=os.path.basename(path), block_tokens=256 if bt is None else bt)
            continue
        if trace is None:
            trace = Trace(name=os.path.basename(path), block_tokens=256 if bt is None else bt)
        b = trace.block_tokens
        if "block_keys" in rec and "token_ids" in rec:
            raise InputError(f"{path}:{lineno}: a request has 'block_keys' or 'token_ids', not both")
        if "block_keys" in rec:
            if header_bt is not None and header_bt != b:
                # Block keys are opaque: they cannot be re-cut, so another block size would only rescale
                # the prompt lengths (TTFT, token hits, byte capacities) without a word. Token ids can.
                raise InputError(
                    f"{path}:{lineno}: block_tokens={b} (--block-tokens) differs from the header's "
                    f"block_tokens={header_bt}: this trace's block_keys were cut at {header_bt} tokens per block "
                    f"by its writer and cannot be re-cut; drop --block-tokens (or give {header_bt}). Only "
                    "token_ids records can be replayed at another block size"
                )
            raw = rec["block_keys"]
            if not isinstance(raw, list):
                raise InputError(f"{path}:{lineno}: 'block_keys' must be a list of chain keys")
            keys = []
            for k in raw:
                # An empty key is no key: the tree refuses it, but only mid-sweep and without the line.
                if not isinstance(k, (str, int)) or isinstance(k, bool) or k == "":
                    raise InputError(f"{path}:{lineno}: block key {k!r} must be a non-empty string or an integer")
                s = interned.get(k)
                if s is None:
                    s = interned[k] = str(k)
                keys.append(s)
            input_tokens = _int_field(path, lineno, rec, "input_tokens", len(keys) * b)
            # One key per started block (ceil), or per full block only (floor: what write_radixkv
            # writes for a token-id trace, whose partial tail has no key). Anything else contradicts
            # the prompt length and would skew token hits and the TTFT model.
            if len(keys) not in (-(-input_tokens // b), input_tokens // b):
                raise InputError(
                    f"{path}:{lineno}: input_tokens={input_tokens} makes {-(-input_tokens // b)} blocks of {b} "
                    f"tokens but block_keys has {len(keys)}; is the block size right (the header's "
                    "block_tokens, --block-tokens)?"
                )
        elif "token_ids" in rec:
            tokens = rec["token_ids"]
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in tokens
            ):
                raise InputError(f"{path}:{lineno}: 'token_ids' must be a list of integers in [0, 2**63)")
            # Validated before hashing: the tenant is the chain's cache_salt, and chunk_keys expects a
            # string (anything else would fail deep inside the hash, not here naming the line).
            tenant = _opt_str(path, lineno, rec, "tenant")
            keys = chunk_keys(tokens, b, cache_salt=tenant)
            input_tokens = _int_field(path, lineno, rec, "input_tokens", len(tokens))
            if input_tokens != len(tokens):
                raise InputError(
                    f"{path}:{lineno}: input_tokens={input_tokens} but token_ids has {len(tokens)} tokens; "
                    "drop input_tokens (it defaults to len(token_ids)) or make them agree"
                )
        else:
            raise InputError(f"{path}:{lineno}: a request needs 'block_keys' or 'token_ids'")
        arrival = rec.get("arrival_s", 0.0)
        # isfinite: Python's json accepts NaN and Infinity.
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival) \
                or arrival < 0:
            raise InputError(f"{path}:{lineno}: 'arrival_s'={arrival!r} must be finite non-negative seconds")
        trace.requests.append(
            Request(
                arrival_s=float(arrival),
                input_tokens=input_tokens,
                output_tokens=_int_field(path, lineno, rec, "output_tokens", 0),
                block_keys=keys,
                tenant=_opt_str(path, lineno, rec, "tenant"),
                session=_opt_str(path, lineno, rec, "session"),
            )
        )
        if limit is not None and len(trace.requests) >= limit:
            break
    if trace is None:
        trace = Trace(name=os.path.basename(path), block_tokens=256 if bt is None else bt)
    return trace


def _opt_str(path: str, lineno: int, rec: dict, name: str) -> str | None:
    value = rec.get(name)
    if value is not None and not isinstance(value, str):
        raise InputError(f"{path}:{lineno}: {name!r}={value!r} must be a string")
    return value


def write_radixkv(trace: Trace, path: str) -> None:
    """Write ``trace`` in radixkv JSONL (block keys), readable by :func:`read_radixkv`."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"radixkv_trace": 1, "block_tokens": trace.block_tokens, "name": trace.name}) + "\n")
        for r in trace.requests:
            rec: dict[str, object] = {
                "arrival_s": r.arrival_s,
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                "block_keys": r.block_keys,
            }
            if r.tenant is not None:
                rec["tenant"] = r.tenant
            if r.session is not None:
                rec["session"] = r.session
            f.write(json.dumps(rec) + "\n")


def read_trace(path: str, *, block_tokens: int | None = None, limit: int | None = None) -> Trace:
    """Read a Mooncake or radixkv JSONL trace, choosing the reader from the first record's fields."""
    for _, rec in _iter_json_lines(path, 1):
        if "hash_ids" in rec:
            return read_mooncake(path, block_tokens=block_tokens, limit=limit)
        if "radixkv_trace" in rec or "block_keys" in rec or "token_ids" in rec:
            return read_radixkv(path, block_tokens=block_tokens, limit=limit)
        raise InputError(
            f"{path}: cannot tell the trace format: the first record has fields {sorted(rec)}; expected "
            "Mooncake ('hash_ids') or radixkv ('block_keys' / 'token_ids', optional 'radixkv_trace' header)"
        )
    raise InputError(f"{path}: the trace is empty")
