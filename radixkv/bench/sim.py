"""``python -m radixkv.bench sim``: replay speed of the simulator, per policy, vs a dict-LRU baseline.

The simulator drives the real RadixTree and policies. The baseline, run in the same process on the
same trace, is the plain-Python prefix LRU of the research notes (an OrderedDict over block keys,
leaf-first ties): the speed of a dedicated, tree-free simulator. Rates are block accesses per
CPU-second of this process (``time.process_time``), so other load on a shared machine does not skew
them; wall seconds are printed too.

    python -m radixkv.bench sim [--trace PATH] [--capacity 1%,10%] [--policy lru,opt,...] [--repeat 3] [--sweep]

Each row is the fastest of ``--repeat`` runs (default 3), its runs interleaved with the other rows'
and the baseline's, so a slow minute of a shared machine slows every row alike and the best of each
is compared.

``--sweep`` also times the issue's 5-capacity x 4-policy sweep (lru, s3fifo, cost, opt) on 2 processes.
OPT's next-use table is computed once per trace, timed on its own, and shared by the ``opt`` rows, as
the sweep shares it; an ``opt+table`` row times a replay that computes it too.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import OrderedDict

from radixkv.bench import build_line, machine_line
from radixkv.errors import InputError
from radixkv.policies import make_policy
from radixkv.sims.opt import next_use_table  # also registers "opt"
from radixkv.sims.replay import TierCapacity, replay
from radixkv.sims.sweep import parse_capacity, run_sweep
from radixkv.sims.traces import Trace, read_trace
from radixkv.sims.workloads import WorkloadConfig, generate

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The Mooncake conversation trace: the copy shipped in the repo (compressed), else the workspace's.
# Only a source checkout has them (an installed radixkv ships no tests/data): without --trace the
# benchmark then times the synthetic mix workload instead, and says so.
_TRACES = (
    os.path.join(_REPO, "tests", "data", "mooncake_conversation.jsonl.xz"),
    os.path.join(_REPO, "..", "shared", "traces", "mooncake_conversation.jsonl"),
)


def dict_lru(trace: Trace, capacity_blocks: int) -> int:
    """Baseline: prefix LRU-leaf over an OrderedDict; returns block hits."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    move = cache.move_to_end
    for r in trace.requests:
        keys = r.block_keys
        k = 0
        for key in keys:
            if key not in cache:
                break
            k += 1
        hits += k
        # Touch leaf first so that, at equal time, deeper blocks are older (evicted first).
        for key in reversed(keys):
            if key in cache:
                move(key)
            else:
                cache[key] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def _timed(fn):
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="trace (default: the Mooncake conversation trace of a source "
                    "checkout, tests/data/; else the synthetic mix workload)")
    ap.add_argument("--capacity", default="1%,10%")
    ap.add_argument("--policy", default="lru,s3fifo,sieve,lfu,cost,agedref,oddsref,opt")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row, interleaved; the fastest is "
                    "printed (default 3)")
    ap.add_argument("--sweep", action="store_true", help="also time the 5 x 4 sweep on 2 processes")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        raise InputError(f"--repeat {args.repeat}: give at least 1 run per row")
    policies = [p.strip() for p in args.policy.split(",")]
    # a bad name fails now, not after the baselines ran
    offline = {pol for pol in policies if getattr(make_policy(pol), "offline", False)}
    if args.trace is not None and not os.path.isfile(args.trace):
        # A given trace is never swapped for another workload: its numbers would be read as the trace's.
        raise InputError(f"--trace {args.trace!r} is not a file; omit --trace for the default workload")
    path = args.trace or next((p for p in _TRACES if os.path.isfile(p)), None)
    if path is not None:
        trace = read_trace(path)
    else:
        print("(no --trace, and no Mooncake trace here: it ships only in a source checkout, tests/data/; "
              "using the synthetic mix workload)")
        trace = generate("mix", WorkloadConfig(requests=6000))
    caps = [(c.strip(), parse_capacity(c, trace.unique_blocks, None)) for c in args.capacity.split(",")]
    refs = trace.block_references
    print(f"{trace.name}: {len(trace):,} requests, {refs:,} block accesses, {trace.unique_blocks:,} unique blocks")
    print(build_line())
    print(machine_line())
    next_use = None
    if offline:
        # OPT's oracle: computed once per trace and shared by its replays, as the sweep does (the
        # issue's "precomputed next-use arrays"); its cost is printed on its own, and an opt+table
        # row times a replay that computes it as well.
        next_use, nu_cpu, _ = _timed(lambda: next_use_table(trace))
        print(f"next-use table (opt's oracle, once per trace): {nu_cpu * 1000:.0f} ms CPU")
    print(f"{'policy':>9} {'capacity':>9} {'hit rate':>9} {'cpu s':>7} {'wall s':>7} {'M acc/s':>8} {'vs dict-LRU':>11}")
    for cap_text, cap in caps:
        # label -> (hit rate, best CPU s, wall s of that run), in printing order (the baseline first)
        best: dict[str, tuple[float, float, float]] = {}

        def keep(label: str, hit_rate: float, cpu: float, wall: float) -> None:
            if label not in best or cpu < best[label][1]:
                best[label] = (hit_rate, cpu, wall)

        for _ in range(args.repeat):
            hits, cpu, wall = _timed(lambda: dict_lru(trace, cap.blocks))
            keep("dict-lru", hits / refs, cpu, wall)
            for pol in policies:
                runs = [(pol, next_use)] + ([(f"{pol}+table", None)] if pol in offline else [])
                for label, nu in runs:
                    r, cpu, wall = _timed(lambda: replay(trace, pol, [TierCapacity("mem", cap.blocks)], next_use=nu))
                    keep(label, r.block_hit_rate, cpu, wall)
        base_rate = refs / best["dict-lru"][1]
        for label, (hit_rate, cpu, wall) in best.items():
            rate = refs / cpu
            print(f"{label:>9} {cap_text:>9} {hit_rate * 100:8.2f}% {cpu:7.2f} {wall:7.2f} "
                  f"{rate / 1e6:8.3f} {rate / base_rate:10.2f}x")
    if args.sweep:
        caps = [parse_capacity(c, trace.unique_blocks, None) for c in ["1%", "5%", "10%", "25%", "50%"]]
        t0 = time.perf_counter()
        run_sweep(trace, ["lru", "s3fifo", "cost", "opt"], caps, jobs=2)
        print(f"5 capacities x 4 policies (lru, s3fifo, cost, opt) on 2 processes: "
              f"{time.perf_counter() - t0:.1f} s wall")
    return 0
