"""Where a launch's host time goes on CUDA: cProfile of back-to-back gather/scatter calls.

Run by scripts/gpu_check.sh on a lent GPU machine (a development aid, not a benchmark).
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from radixkv.kernels import PagedLayout, alloc_chunks, gather_chunks, scatter_chunks

L, P, H, D, CHUNKS, PPC = 32, 16, 8, 128, 4, 16
storage = torch.empty(L, 2 * CHUNKS * PPC, P, H, 2 * D, dtype=torch.bfloat16, device="cuda")
layout = PagedLayout.from_vllm([storage[i].permute(0, 2, 1, 3) for i in range(L)])
ids = torch.randperm(2 * CHUNKS * PPC)[: CHUNKS * PPC].view(CHUNKS, PPC)
chunks = alloc_chunks(layout, CHUNKS, PPC)
host = alloc_chunks(layout, CHUNKS, PPC, device="cpu", pin_memory=True)
for fn, name in ((gather_chunks, "gather"), (scatter_chunks, "scatter")):
    for dst, where in ((chunks, "device"), (host, "pinned host")):
        for _ in range(20):
            fn(layout, ids, dst)
        torch.cuda.synchronize()
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            fn(layout, ids, dst)  # host cost only: the GPU runs behind (100 launches fit the queue)
        host_us = (time.perf_counter() - t0) / n * 1e6
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        gpu_tail_ms = (time.perf_counter() - t1) * 1e3
        print(f"{name} -> {where}: {host_us:.1f} us host per call; GPU finished {gpu_tail_ms:.1f} ms later")
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    gather_chunks(layout, ids, chunks)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
