"""Experiment (not part of radixkv): would a path-compressed key index meet the tree targets of #2?

Run from a checkout with radixkv installed: ``python docs/experiments/path_compressed_index.py 16 s``
(page size 16 or 64; workload ``s`` = shared-prefix, ``m`` = multiturn, the workloads of
``python -m radixkv.bench tree``). Prints insert and match microseconds per call, 3 repeats.

The prototype keeps the node columns of :class:`radixkv.tree.RadixTree` (key, namespace, parent, depth,
child counts, residency, tokens, size) but **no per-page index**: one dict entry per *run* (the chain
of pages one insert creates, extended in place when an insert continues a run's last page). A match
walks runs: it compares the query's keys with a run's stored keys (bisection inside the run, valid
because keys are chain hashes) and probes the run-head dict once per run boundary. It has no residency
per tier, no policy, no ``lookup(key)`` and no detection of a key that appears elsewhere in the tree,
all of which the real tree needs, so it is a lower bound on what this design could cost.

Measured 2026-11-29 on the 2-core dev VM (docs/benchmarks.md, "Why the misses"), shared-prefix page 16:
insert 27-34 us, match 7.4-9.3 us; the real tree 66-76 us and 4.8-5.6 us; SGLang's Rust core 43-53 us
and ~11-14 us. Comparing two distinct 64-character key objects costs about what a dict probe costs,
so match gets slower, and insert stays above the 2x target (<= 22-26 us) even without any index.
"""

from __future__ import annotations

import gc
import sys
import time

from radixkv.bench.tree import multiturn, shared_prefix
from radixkv.keys import sglang_page_keys


class RunIndexedTree:
    def __init__(self) -> None:
        self.key: list[str] = []
        self.ns: list[str] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.nchild: list[int] = []
        self.tchild: list[int] = []
        self.mask: list[int] = []
        self.tokens: list[int] = []
        self.size: list[int] = []
        self.run: list[int] = []  # node -> its run
        self.roff: list[int] = []  # node -> offset in its run
        self.run_keys: list[list[str]] = []
        self.run_ids: list[list[int]] = []
        self.run_len: list[int] = []  # alive prefix of each run
        self.heads: dict[str, int] = {}  # first key of a run -> its node

    def match(self, keys: list[str]) -> tuple[int, int]:
        n = len(keys)
        x = self.heads.get(keys[0])
        if x is None:
            return 0, -1
        i, r, j = 0, self.run[x], self.roff[x]
        rk, ri, rlen, parent = self.run_keys, self.run_ids, self.run_len, self.parent
        while True:
            run_keys, alive = rk[r], rlen[r]
            span = min(alive - 1 - j, n - 1 - i)
            if span > 0:
                if run_keys[j + span] == keys[i + span]:
                    i, j = i + span, j + span
                else:  # the query leaves this run inside it: bisect for the last shared page
                    lo, hi = 0, span - 1
                    while lo < hi:
                        mid = (lo + hi + 1) >> 1
                        if run_keys[j + mid] == keys[i + mid]:
                            lo = mid
                        else:
                            hi = mid - 1
                    i, j = i + lo, j + lo
            if i == n - 1:
                return n, ri[r][j]
            c = self.heads.get(keys[i + 1])
            if c is None or parent[c] != ri[r][j]:
                return i + 1, ri[r][j]
            i, r, j = i + 1, self.run[c], self.roff[c]

    def insert(self, keys: list[str], chunk_tokens: int = 16, size_bytes: int = 0) -> list[int]:
        hit, last = self.match(keys)
        m = len(keys) - hit
        if not m:
            return []
        new = keys[hit:] if hit else keys
        start = len(self.key)
        ids = list(range(start, start + m))
        extend = False
        if last >= 0:
            r, j = self.run[last], self.roff[last]
            extend = j == self.run_len[r] - 1
            d0 = self.depth[last] + 1
        else:
            d0 = 1
        if extend:
            if len(self.run_keys[r]) > self.run_len[r]:
                del self.run_keys[r][self.run_len[r]:]
                del self.run_ids[r][self.run_len[r]:]
            o0 = len(self.run_keys[r])
            self.run_keys[r].extend(new)
            self.run_ids[r].extend(ids)
            self.run_len[r] += m
        else:
            r, o0 = len(self.run_keys), 0
            self.run_keys.append(list(new))
            self.run_ids.append(ids)
            self.run_len.append(m)
            self.heads[new[0]] = start
        self.run.extend([r] * m)
        self.roff.extend(range(o0, o0 + m))
        self.key.extend(new)
        self.ns.extend(["bench"] * m)
        self.parent.append(last)
        self.parent.extend(ids[:-1])
        self.depth.extend(range(d0, d0 + m))
        children = [1] * (m - 1) + [0]
        self.nchild.extend(children)
        self.tchild.extend(children)
        self.mask.extend([1] * m)
        self.tokens.extend([chunk_tokens] * m)
        self.size.extend([size_bytes] * m)
        if last >= 0:
            self.nchild[last] += 1
            self.tchild[last] += 1
        return ids


def main() -> None:
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    wl = sys.argv[2] if len(sys.argv) > 2 else "s"
    w = shared_prefix(10_000) if wl == "s" else multiturn(500)
    ins = [sglang_page_keys(s, page) for s in w.inserts]
    q = ins if w.interleaved else [sglang_page_keys(s, page) for s in w.queries]

    def run() -> tuple[float, float]:
        tree = RunIndexedTree()
        gc.collect()
        gc.disable()
        try:
            if w.interleaved:
                tm = ti = 0.0
                for k in ins:
                    t0 = time.perf_counter()
                    tree.match(k)
                    t1 = time.perf_counter()
                    tree.insert(k, page)
                    t2 = time.perf_counter()
                    tm, ti = tm + t1 - t0, ti + t2 - t1
                return ti / len(ins) * 1e6, tm / len(ins) * 1e6
            t0 = time.perf_counter()
            for k in ins:
                tree.insert(k, page)
            t1 = time.perf_counter()
            for k in q:
                tree.match(k)
            t2 = time.perf_counter()
            return (t1 - t0) / len(ins) * 1e6, (t2 - t1) / len(q) * 1e6
        finally:
            gc.enable()

    r = [run() for _ in range(3)]
    print(f"{w.name} page {page}: insert us", " ".join(f"{a:.1f}" for a, _ in r),
          " match us", " ".join(f"{b:.2f}" for _, b in r))


if __name__ == "__main__":
    main()
