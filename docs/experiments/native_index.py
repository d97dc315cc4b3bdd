"""Experiment (not part of the package): a native chunk-key index on the tree benchmark's shared-prefix
workload, next to a Python dict doing the same index work, in one process.

    python docs/experiments/native_index.py [PAGE]      (default page 16)

It compiles native_index.c with gcc (ctypes; each key list is passed as one bytes buffer joined
before timing, as a CPython extension would read the str objects in place; the ctypes call itself,
~1 us, is included) and times, per sequence of
the workload (``radixkv.bench.tree.shared_prefix(10_000)``): inserting its page keys into the index
(present keys found, new ones added) and matching the query keys (binary search). Only the index:
no tree columns, policy or result objects.
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time

from radixkv.bench.tree import shared_prefix
from radixkv.keys import sglang_page_keys


def build() -> ctypes.CDLL:
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(tempfile.mkdtemp(), "native_index.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", out, os.path.join(here, "native_index.c")], check=True)
    lib = ctypes.CDLL(out)
    lib.idx_insert.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]
    lib.idx_match.argtypes = [ctypes.c_char_p, ctypes.c_int32]
    return lib


def main() -> None:
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    w = shared_prefix(10_000)
    ins = [sglang_page_keys(s, page) for s in w.inserts]
    qry = [sglang_page_keys(s, page) for s in w.queries]
    # One bytes buffer per key list, made before timing: a CPython extension would read the str
    # objects' ASCII data in place, so the join is not part of the index's cost.
    ins_buf = ["".join(ks).encode() for ks in ins]
    qry_buf = ["".join(ks).encode() for ks in qry]
    lib = build()
    assert lib.idx_init(2_000_000) == 0
    ids = (ctypes.c_int32 * 512)()
    gc.disable()
    t_nat, t_py, m_nat, m_py = [], [], [], []
    d: dict[str, int] = {}
    for ks, buf in zip(ins, ins_buf):
        t0 = time.perf_counter_ns()
        lib.idx_insert(buf, len(ks), ids)
        t1 = time.perf_counter_ns()
        new = [k for k in ks if k not in d]
        d.update(zip(new, range(len(d), len(d) + len(new))))
        t2 = time.perf_counter_ns()
        t_nat.append(t1 - t0)
        t_py.append(t2 - t1)
    for ks, buf in zip(qry, qry_buf):
        t0 = time.perf_counter_ns()
        h_nat = lib.idx_match(buf, len(ks))
        t1 = time.perf_counter_ns()
        lo, hi = 0, len(ks)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if ks[mid - 1] in d:
                lo = mid
            else:
                hi = mid - 1
        t2 = time.perf_counter_ns()
        assert h_nat == lo
        m_nat.append(t1 - t0)
        m_py.append(t2 - t1)
    p50 = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
    print(f"page {page}: {len(d):,} keys")
    print(f"insert p50: native {p50(t_nat):.1f} us, dict {p50(t_py):.1f} us")
    print(f"match  p50: native {p50(m_nat):.1f} us, dict {p50(m_py):.1f} us")


if __name__ == "__main__":
    main()
