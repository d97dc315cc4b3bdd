"""Seeded synthetic workloads for users without traces.

Each generator returns a :class:`~radixkv.sims.traces.Trace` whose block keys are chained exactly like a
real trace's (equal key = equal whole prefix), built from the *content* of each block: a prompt is a
sequence of named segments (system prompt, document, user turn, tool output, ...) and a block's key
hashes its parent key with the (segment, token range) pieces it holds. The last block of a prompt may
be partial, as in the Mooncake traces (``len(block_keys) == ceil(input_tokens / block_tokens)``).

Workloads (all deterministic for a given ``seed``):

* ``chat``: multi-turn conversations; each turn's prompt is the whole history (shared system prompt,
  earlier user turns and answers) plus a new user message; users think between turns.
* ``rag``: a shared system prompt, then ``docs_per_request`` documents drawn from a pool with Zipf
  popularity, then a question.
* ``agentic``: agent loops with a long shared system prompt (tool definitions) plus a task, then
  step after step of tool output appended to the context, with short pauses.
* ``mix`` (the default workload of ``radixkv sim``): the three above interleaved, labelled by tenant:
  a third of the requests each (``burst``), or each at its own rate over one window (``steady``).

Sessions (conversations, agent tasks) start as a Poisson process. ``WorkloadConfig.arrivals`` says
for how long: ``burst`` (the default) starts them until their requests number ``requests``, so the
trace ends in a stretch where the started sessions play out and none begins (chat, 1,500 requests:
every conversation starts within the first 455); ``steady`` keeps starting them until the trace's
last request, a window of a service under constant load (after a warm-up from an empty service).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from radixkv.errors import ConfigError
from radixkv.sims.traces import Request, Trace

__all__ = ["ARRIVALS", "WorkloadConfig", "WORKLOADS", "generate", "DEFAULT_WORKLOAD"]

DEFAULT_WORKLOAD = "mix"

# How sessions (conversations, agent tasks) arrive; see WorkloadConfig.arrivals.
ARRIVALS = ("burst", "steady")


@dataclass(slots=True)
class WorkloadConfig:
    """Size and shape of a synthetic workload (times in seconds, lengths in tokens)."""

    requests: int = 6000
    block_tokens: int = 256
    seed: int = 0
    rate_per_s: float = 4.0  # new conversations / queries per second; agent tasks at half of it
    arrivals: str = "burst"  # or "steady": when sessions stop starting (see the module docstring)

    def __post_init__(self) -> None:
        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"WorkloadConfig.arrivals={self.arrivals!r} must be one of {', '.join(ARRIVALS)} "
                              "(burst: sessions start until their requests suffice; steady: they keep starting)")
        if not isinstance(self.requests, int) or self.requests <= 0:
            raise ConfigError(f"WorkloadConfig.requests={self.requests!r} must be a positive integer")
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise ConfigError(f"WorkloadConfig.block_tokens={self.block_tokens!r} must be a positive integer")
        if not 0 < self.rate_per_s < math.inf:  # an infinite rate would start sessions at t=0 forever
            raise ConfigError(f"WorkloadConfig.rate_per_s={self.rate_per_s!r} must be a finite number of sessions "
                              "per second > 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"WorkloadConfig.seed={self.seed!r} must be a non-negative integer")


class _Prompt:
    """An append-only token sequence of named segments with incrementally computed block keys."""

    __slots__ = ("block_tokens", "tokens", "_keys", "_pieces", "_fill", "_prefix")

    def __init__(self, block_tokens: int, prefix: str) -> None:
        self.block_tokens = block_tokens
        self.tokens = 0
        self._keys: list[str] = []  # keys of the full blocks so far
        self._pieces: list[str] = []  # content of the current partial block
        self._fill = 0
        self._prefix = prefix  # namespace of the chain (e.g. tenant)

    def copy(self) -> _Prompt:
        p = _Prompt(self.block_tokens, self._prefix)
        p.tokens, p._keys, p._pieces, p._fill = self.tokens, list(self._keys), list(self._pieces), self._fill
        return p

    def _key(self, pieces: list[str]) -> str:
        parent = self._keys[-1] if self._keys else self._prefix
        return hashlib.blake2b(f"{parent}|{';'.join(pieces)}".encode(), digest_size=10).hexdigest()

    def append(self, segment: str, n_tokens: int) -> None:
        start = 0
        while start < n_tokens:
            take = min(self.block_tokens - self._fill, n_tokens - start)
            self._pieces.append(f"{segment}:{start}:{start + take}")
            self._fill += take
            start += take
            if self._fill == self.block_tokens:
                self._keys.append(self._key(self._pieces))
                self._pieces, self._fill = [], 0
        self.tokens += n_tokens

    def block_keys(self) -> list[str]:
        if self._fill:
            return self._keys + [self._key(self._pieces)]
        return list(self._keys)


def _lengths(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _sessions(
    cfg: WorkloadConfig, rng: np.random.Generator, n: int, mean_start_gap_s: float, start: Callable[[], int],
    pause_s: float, mean_extra_s: float,
) -> list[tuple[float, int, int]]:
    """The first ``n`` requests in time order, as ``(arrival_s, session, request number in it)``.

    Sessions start as a Poisson process (``mean_start_gap_s`` apart); ``start()`` draws one (the
    caller keeps what else it draws) and returns its number of requests, the first at its start, each
    next ``pause_s`` plus an exponential time of mean ``mean_extra_s`` later. ``cfg.arrivals`` says
    when starting stops: ``burst``, once the sessions' requests number ``n``; ``steady``, once ``n``
    requests lie before the next start, so every session of the window is in (none starts after it)."""
    events: list[tuple[float, int, int]] = []
    steady = cfg.arrivals == "steady"
    pending: list[float] = []  # steady: times of requests not yet passed by a start, a heap
    passed = 0  # steady: requests before the last start
    t = 0.0
    s_id = 0
    while True:
        if not steady and len(events) >= n:
            break
        t += rng.exponential(mean_start_gap_s)
        if steady:
            while pending and pending[0] < t:
                heapq.heappop(pending)
                passed += 1
            if passed >= n:
                break
        at = t
        for k in range(start()):
            events.append((at, s_id, k))
            if steady:
                heapq.heappush(pending, at)
            at += pause_s + rng.exponential(mean_extra_s)
        s_id += 1
    events.sort()
    return events[:n]


def _chat(cfg: WorkloadConfig, rng: np.random.Generator, n: int, tenant: str) -> list[Request]:
    """Conversations start as a Poisson process; turns follow after a think time."""
    systems = [(f"{tenant}.sys{i}", _lengths(rng, 1200, 0.5, 200, 4000)) for i in range(4)]
    sessions: list[tuple[int, int]] = []  # (system index, number of turns)

    def start() -> int:
        turns = int(min(rng.geometric(0.25), 30))
        sessions.append((int(rng.integers(len(systems))), turns))
        return turns

    # turns 10 s + Exp(90 s) apart: reading and typing time
    events = _sessions(cfg, rng, n, 1.0 / cfg.rate_per_s, start, 10.0, 90.0)
    prompts: dict[int, _Prompt] = {}
    out: list[Request] = []
    for at, s_id, turn in events:
        sys_i, _ = sessions[s_id]
        p = prompts.get(s_id)
        if p is None:
            p = prompts[s_id] = _Prompt(cfg.block_tokens, tenant)
            p.append(*systems[sys_i])
        p.append(f"{tenant}.u{s_id}.{turn}", _lengths(rng, 150, 1.0, 5, 4000))
        answer = _lengths(rng, 300, 0.7, 10, 2000)
        out.append(Request(at, p.tokens, answer, p.block_keys(), tenant, f"{tenant}.c{s_id}"))
        p.append(f"{tenant}.a{s_id}.{turn}", answer)
    return out


def _rag(cfg: WorkloadConfig, rng: np.random.Generator, n: int, tenant: str) -> list[Request]:
    """Queries over a document pool with Zipf(1.1) popularity; documents are prefix-ordered."""
    pool_docs, docs_per_request = 3000, 3
    doc_tokens = [_lengths(rng, 1500, 0.5, 200, 6000) for _ in range(pool_docs)]
    ranks = np.arange(1, pool_docs + 1, dtype=np.float64)
    popularity = ranks**-1.1
    popularity /= popularity.sum()
    system = (f"{tenant}.sys", 600)
    base = _Prompt(cfg.block_tokens, tenant)
    base.append(*system)
    out: list[Request] = []
    t = 0.0
    for i in range(n):
        t += rng.exponential(1.0 / cfg.rate_per_s)
        docs = rng.choice(pool_docs, size=docs_per_request, replace=False, p=popularity)
        p = base.copy()
        for d in docs:
            p.append(f"{tenant}.doc{d}", doc_tokens[d])
        p.append(f"{tenant}.q{i}", _lengths(rng, 60, 0.6, 5, 500))
        out.append(Request(t, p.tokens, _lengths(rng, 200, 0.6, 10, 1500), p.block_keys(), tenant, None))
    return out


def _agentic(cfg: WorkloadConfig, rng: np.random.Generator, n: int, tenant: str) -> list[Request]:
    """Agent loops: long shared tool prompt + task, then a tool output per step, seconds apart."""
    systems = [(f"{tenant}.tools{i}", _lengths(rng, 6000, 0.3, 2000, 16000)) for i in range(2)]
    tasks: list[tuple[int, int]] = []

    def start() -> int:
        steps = int(np.clip(rng.geometric(0.08), 2, 60))
        tasks.append((int(rng.integers(len(systems))), steps))
        return steps

    # steps 1 s + Exp(6 s) apart: decode and tool latency
    events = _sessions(cfg, rng, n, 2.0 / cfg.rate_per_s, start, 1.0, 6.0)
    prompts: dict[int, _Prompt] = {}
    out: list[Request] = []
    for at, a_id, step in events:
        p = prompts.get(a_id)
        if p is None:
            p = prompts[a_id] = _Prompt(cfg.block_tokens, tenant)
            p.append(*systems[tasks[a_id][0]])
            p.append(f"{tenant}.task{a_id}", _lengths(rng, 300, 0.8, 20, 3000))
        else:
            p.append(f"{tenant}.obs{a_id}.{step}", _lengths(rng, 700, 1.0, 20, 8000))
        action = _lengths(rng, 120, 0.6, 10, 1000)
        out.append(Request(at, p.tokens, action, p.block_keys(), tenant, f"{tenant}.a{a_id}"))
        p.append(f"{tenant}.act{a_id}.{step}", action)
    return out


def _mix(cfg: WorkloadConfig, rng: np.random.Generator, n: int, tenant: str) -> list[Request]:
    if cfg.arrivals == "steady":
        # Each part at its own rate over the same window: n requests of each, the first n of all.
        # (A third each would end each part at another time, and the mix in the shortest one's.)
        sizes = (n, n, n)
    else:
        third = n // 3
        sizes = (third, third, n - 2 * third)
    parts = [
        _chat(cfg, rng, sizes[0], "chat"),
        _rag(cfg, rng, sizes[1], "rag"),
        _agentic(cfg, rng, sizes[2], "agent"),
    ]
    merged = [r for part in parts for r in part]
    merged.sort(key=lambda r: r.arrival_s)  # stable: equal times keep generator order
    return merged[:n]


WORKLOADS = {"chat": _chat, "rag": _rag, "agentic": _agentic, "mix": _mix}


def generate(name: str, config: WorkloadConfig | None = None) -> Trace:
    """Generate workload ``name`` (one of :data:`WORKLOADS`) as a trace; same config, same trace."""
    cfg = config or WorkloadConfig()
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}"
        ) from None
    rng = np.random.default_rng(cfg.seed)
    requests = gen(cfg, rng, cfg.requests, name)
    t0 = requests[0].arrival_s if requests else 0.0
    for r in requests:
        r.arrival_s -= t0
    shape = "" if cfg.arrivals == "burst" else f",arrivals={cfg.arrivals}"
    return Trace(name=f"{name}(seed={cfg.seed},n={cfg.requests}{shape})", block_tokens=cfg.block_tokens,
                 requests=requests)
