"""``python -m radixkv.bench tree [--vs sglang]``: insert and match throughput of the radix tree.

Workloads (seeded, identical for every implementation in the run):

* ``shared-prefix``: 10k sequences of 1-4k tokens drawn from 20 roots x 10 branches; inserts all of
  them, then matches 10k queries (half exact repeats, half new sequences sharing a branch prefix).
* ``multiturn``: 500 conversations x 20 turns (+50-200 tokens a turn), interleaved; each turn matches
  its history, then inserts it.

radixkv is timed matching/inserting from precomputed page keys (what SGLang and vLLM hand over) and,
separately, from tokens with SGLang-compatible SHA-256 hashing included. ``--vs sglang`` times SGLang
0.5.23's RadixCache and UnifiedRadixCache (Python and Rust tree cores) on the same token sequences in
the same process (run it in the SGLang environment: ``.envs/sglang/bin/python -m radixkv.bench tree
--vs sglang``) and prints radixkv's speed as a multiple of the fastest SGLang tree.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from radixkv.bench import build_line, positive_int, positive_list
from radixkv.keys import sglang_page_keys
from radixkv.tree import RadixTree

NS = "bench"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    inserts: list[list[int]]  # token sequences inserted, in order
    queries: list[list[int]]  # token sequences matched (after all inserts, or interleaved)
    interleaved: bool  # multiturn: query i is matched right before insert i


def shared_prefix(n_seqs: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    roots = [[rng.randrange(1, 128_000) for _ in range(512)] for _ in range(20)]
    branches = [[r + [rng.randrange(1, 128_000) for _ in range(512)] for _ in range(10)] for r in roots]

    def seq() -> list[int]:
        base = rng.choice(rng.choice(branches))
        length = rng.randint(1024, 4096)
        return base[: min(length, len(base))] + [rng.randrange(1, 128_000) for _ in range(max(0, length - len(base)))]

    inserts = [seq() for _ in range(n_seqs)]
    queries = [rng.choice(inserts) if i % 2 == 0 else seq() for i in range(n_seqs)]
    return Workload("shared-prefix", inserts, queries, interleaved=False)


def multiturn(n_conv: int, turns: int = 20, seed: int = 1) -> Workload:
    rng = random.Random(seed)
    system = [rng.randrange(1, 128_000) for _ in range(256)]
    history = [list(system) for _ in range(n_conv)]
    order: list[int] = []
    for _ in range(turns):
        convs = list(range(n_conv))
        rng.shuffle(convs)
        order.extend(convs)
    seqs = []
    for c in order:
        history[c] = history[c] + [rng.randrange(1, 128_000) for _ in range(rng.randint(50, 200))]
        seqs.append(list(history[c]))
    return Workload("multiturn", seqs, seqs, interleaved=True)


@dataclass(slots=True)
class Row:
    impl: str
    workload: str
    page: int
    insert_ops_s: float
    match_ops_s: float
    insert_p50_us: float
    match_p50_us: float
    hit_rate: float


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def run_impl(
    name: str,
    w: Workload,
    page: int,
    insert: Callable[[int], None],
    match: Callable[[int], int],
    prepare: Callable[[], None] | None = None,
) -> Row:
    """Time insert(i) and match(i) callbacks over the workload (gc off, as in SGLang's own bench)."""
    if prepare:
        prepare()
    gc.collect()
    gc.disable()
    ins_us: list[float] = []
    mat_us: list[float] = []
    hit_tokens = query_tokens = 0
    try:
        if w.interleaved:
            for i in range(len(w.inserts)):
                t0 = time.perf_counter_ns()
                h = match(i)
                t1 = time.perf_counter_ns()
                insert(i)
                t2 = time.perf_counter_ns()
                mat_us.append((t1 - t0) / 1e3)
                ins_us.append((t2 - t1) / 1e3)
                hit_tokens += h
                query_tokens += len(w.queries[i]) // page * page
        else:
            for i in range(len(w.inserts)):
                ins_us.append(_timed(lambda: insert(i)))
            for i in range(len(w.queries)):
                t0 = time.perf_counter_ns()
                h = match(i)
                mat_us.append((time.perf_counter_ns() - t0) / 1e3)
                hit_tokens += h
                query_tokens += len(w.queries[i]) // page * page
    finally:
        gc.enable()
    return Row(
        impl=name,
        workload=w.name,
        page=page,
        insert_ops_s=len(ins_us) / (sum(ins_us) / 1e6),
        match_ops_s=len(mat_us) / (sum(mat_us) / 1e6),
        insert_p50_us=statistics.median(ins_us),
        match_p50_us=statistics.median(mat_us),
        hit_rate=hit_tokens / max(1, query_tokens),
    )


def radixkv_rows(w: Workload, page: int) -> list[Row]:
    ins_keys = [sglang_page_keys(s, page) for s in w.inserts]
    q_keys = ins_keys if w.interleaved else [sglang_page_keys(s, page) for s in w.queries]
    rows = []
    tree = RadixTree(("mem",), "lru")

    def insert_keys(i: int) -> None:
        tree.insert(NS, ins_keys[i], "mem", page, 0)

    def match_keys(i: int) -> int:
        return tree.match(NS, q_keys[i]).hit_chunks * page

    rows.append(run_impl("radixkv (keys)", w, page, insert_keys, match_keys))

    tree2 = RadixTree(("mem",), "lru")

    def insert_tokens(i: int) -> None:
        tree2.insert(NS, sglang_page_keys(w.inserts[i], page), "mem", page, 0)

    def match_tokens(i: int) -> int:
        return tree2.match(NS, sglang_page_keys(w.queries[i], page)).hit_chunks * page

    rows.append(run_impl("radixkv (tokens+sha256)", w, page, insert_tokens, match_tokens))
    return rows


def sglang_rows(w: Workload, page: int) -> list[Row]:
    """SGLang's own trees on the same token sequences (needs sglang==0.5.23 importable)."""
    from radixkv.bench import _sglang_trees

    return [run_impl(name, w, page, ins, mat, prep) for name, ins, mat, prep in _sglang_trees.impls(w, page)]


def print_rows(rows: Sequence[Row]) -> None:
    print(build_line())
    hdr = f"{'impl':<40} {'workload':<14} {'page':>4} {'insert ops/s':>13} {'match ops/s':>12} {'ins p50 us':>10} {'match p50 us':>12} {'hit':>5}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r.impl:<40} {r.workload:<14} {r.page:>4} {r.insert_ops_s:>13,.0f} {r.match_ops_s:>12,.0f} "
            f"{r.insert_p50_us:>10.1f} {r.match_p50_us:>12.1f} {r.hit_rate:>5.2f}"
        )


def print_ratios(rows: Sequence[Row]) -> None:
    print("\nradixkv (keys) as a multiple of the fastest SGLang tree (targets: match >= 5x, insert >= 2x):")
    for (wl, page) in sorted({(r.workload, r.page) for r in rows}):
        ours = next(r for r in rows if r.impl == "radixkv (keys)" and r.workload == wl and r.page == page)
        theirs = [r for r in rows if r.impl.startswith("sglang") and r.workload == wl and r.page == page]
        if not theirs:
            continue
        best_ins = max(theirs, key=lambda r: r.insert_ops_s)
        best_mat = max(theirs, key=lambda r: r.match_ops_s)
        # Median-latency ratios are steadier than throughput ratios on a shared, noisy machine.
        p50_ins = min(r.insert_p50_us for r in theirs) / ours.insert_p50_us
        p50_mat = min(r.match_p50_us for r in theirs) / ours.match_p50_us
        print(
            f"  {wl:<14} page {page:>3}: insert {ours.insert_ops_s / best_ins.insert_ops_s:5.2f}x "
            f"(vs {best_ins.impl}), match {ours.match_ops_s / best_mat.match_ops_s:5.2f}x (vs {best_mat.impl}); "
            f"by p50 latency: insert {p50_ins:5.2f}x, match {p50_mat:5.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixkv.bench tree", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vs", choices=["sglang"], help="also time SGLang's trees in the same process")
    ap.add_argument("--seqs", type=positive_int, default=10_000, help="shared-prefix sequences (default 10000)")
    ap.add_argument("--convs", type=positive_int, default=500, help="multiturn conversations (default 500)")
    ap.add_argument("--pages", type=positive_list, default=[16, 64], help="page sizes, comma separated (default 16,64)")
    args = ap.parse_args(argv)
    pages = args.pages
    workloads = [shared_prefix(args.seqs), multiturn(args.convs)]
    rows: list[Row] = []
    for w in workloads:
        for page in pages:
            rows.extend(radixkv_rows(w, page))
            if args.vs == "sglang":
                rows.extend(sglang_rows(w, page))
            print(f"done: {w.name} page {page}", flush=True)
    print()
    print_rows(rows)
    if args.vs:
        print_ratios(rows)
    return 0
