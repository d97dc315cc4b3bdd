"""Does LayerPipeline overlap layer i+1's load with layer i's compute? Wall time of a 32-layer
"forward" whose layers each wait for their KV: loads issued in line vs through LayerPipeline.

Run by scripts/gpu_check.sh on a lent GPU machine (a development measurement, not a test). The
compute is a bf16 matmul per layer; each layer's load moves that layer's slab of 16 pinned host
chunks (4096 tokens) into a vLLM-shaped cache, two ways: the zero-copy scatter kernel reading host
memory (it needs SMs, which the matmul holds), or a copy-engine upload of each chunk's slab into a
device staging buffer followed by the device-to-device scatter (SMs only for the short scatter).
"""

from __future__ import annotations

import sys
import time

import torch

from radixkv.kernels import LayerPipeline, PagedLayout, alloc_chunks, scatter_chunks

L, P, H, D, CHUNKS, PPC = 32, 16, 8, 128, 16, 16
dev = "cuda" if torch.cuda.is_available() else "cpu"
n = int(sys.argv[1]) if len(sys.argv) > 1 else (6144 if dev == "cuda" else 256)
storage = torch.zeros(L, 2 * CHUNKS * PPC, P, H, 2 * D, dtype=torch.bfloat16, device=dev)
layout = PagedLayout.from_vllm([storage[i].permute(0, 2, 1, 3) for i in range(L)])
ids = torch.randperm(2 * CHUNKS * PPC)[: CHUNKS * PPC].view(CHUNKS, PPC)
host = alloc_chunks(layout, CHUNKS, PPC, device="cpu", pin_memory=dev == "cuda")
host.view(torch.int16).random_(-(2**15), 2**15)
a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
out = torch.empty_like(a)


def sync() -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


staging = alloc_chunks(layout, CHUNKS, PPC, device=dev) if dev == "cuda" else host.clone()


def load_zero_copy(layer: int) -> None:
    scatter_chunks(layout, ids, host, layers=layer)


def load_staged(layer: int) -> None:
    for c in range(CHUNKS):  # contiguous [components, tokens, heads, dim] slab: one copy-engine copy
        staging[c, layer].copy_(host[c, layer], non_blocking=True)
    scatter_chunks(layout, ids, staging, layers=layer)


load = load_zero_copy


def compute(layer: int) -> None:
    torch.matmul(a, a, out=out)


def timed(fn, reps: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def compute_only() -> None:
    for i in range(L):
        compute(i)


def loads_only() -> None:
    for i in range(L):
        load(i)


def in_line() -> None:  # each layer's load, then its compute, on one stream
    for i in range(L):
        load(i)
        compute(i)


pipe = LayerPipeline(dev, lookahead_layers=1)


def pipelined() -> None:
    pipe.start_loads([lambda i=i: load(i) for i in range(L)])
    for i in range(L):
        pipe.wait_layer(i)
        compute(i)
    pipe.wait_all()


c = timed(compute_only)
print(f"device {dev}, {L} layers, matmul {n}x{n} per layer ({c:.2f} ms in all), load "
      f"{layout.page_bytes * 2 * CHUNKS * PPC / 2**20:.0f} MiB per layer from pinned host")
for load in (load_zero_copy, load_staged):
    ld, s, p = timed(loads_only), timed(in_line), timed(pipelined)
    pipe.check_integrity()
    hidden = (s - p) / min(c, ld) if min(c, ld) else float("nan")
    print(f"  {load.__name__}: loads only {ld:.2f} ms | in line {s:.2f} ms | LayerPipeline {p:.2f} ms"
          f" | hidden {s - p:.2f} ms = {hidden:.0%} of the smaller of compute and loads")
