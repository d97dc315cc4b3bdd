"""``python -m radixkv.bench kernels``: GB/s of paged gather/scatter vs copies of the same bytes.

On CUDA, per (page size, chunk size) on a Llama-3.1-8B-shaped vLLM cache (32 layers, 8 KV heads,
head dim 128, bf16, LBNHC), one batch of chunks at a time:

* gather / scatter, device <-> device: `gather_chunks` / `scatter_chunks` into device chunk buffers,
  against ``dst.copy_(src)`` of the same bytes between two contiguous device buffers (the ceiling);
* gather to host / scatter from host: the zero-copy kernels writing/reading pinned host chunks,
  against torch's pinned-memory ``copy_`` of the same bytes (copy engine, the ceiling).

Each row reports both GB/s, their ratio (target >= 0.85) and the launches per batch (target 1).
On CPU it runs the torch reference path against a contiguous CPU copy of the same bytes, with
smaller defaults (8 layers, 2 chunks per batch), and says so: the GPU targets do not apply there.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixkv.bench import positive_int
from radixkv.kernels import PagedLayout, alloc_chunks, gather_chunks, scatter_chunks

TARGET_RATIO = 0.85


@dataclass(slots=True)
class BenchConfig:
    """What to measure. Sizes in tokens. One call moves ``chunks_per_batch`` chunks, or when that is
    None, as many chunks as make ``batch_tokens`` (the same bytes per call for every chunk size)."""

    device: str
    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: tuple[int, ...]
    chunk_tokens: tuple[int, ...]
    chunks_per_batch: int | None
    batch_tokens: int
    iters: int
    warmup: int

    def __post_init__(self) -> None:
        # field -> the flag that sets it (chunks_per_batch is --chunks)
        flags = {"chunks_per_batch": "chunks"}
        for name in ("layers", "kv_heads", "head_dim", "chunks_per_batch", "batch_tokens", "iters"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                flag = flags.get(name, name).replace("_", "-")
                raise ValueError(f"--{flag} must be >= 1; got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0; got {self.warmup}")
        # Sizes before the multiple checks: a 0 chunk passed `chunk % page == 0` and then divided
        # --batch-tokens by zero (a negative one gave a negative chunk count).
        for flag, sizes in (
            ("--page-tokens", self.page_tokens),
            ("--chunk-tokens", self.chunk_tokens),
        ):
            if not sizes or min(sizes) < 1:
                raise ValueError(
                    f"{flag} must be one or more sizes >= 1 (comma-separated); got "
                    f"{','.join(map(str, sizes))!r}"
                )
        for page in self.page_tokens:
            for chunk in self.chunk_tokens:
                if chunk % page:
                    raise ValueError(
                        f"chunk size {chunk} is not a multiple of page size {page}; choose sizes "
                        "with chunk % page == 0"
                    )
        if self.chunks_per_batch is None:
            for chunk in self.chunk_tokens:
                if self.batch_tokens % chunk:
                    raise ValueError(
                        f"--batch-tokens {self.batch_tokens} is not a multiple of chunk size "
                        f"{chunk}; choose a multiple, or give --chunks"
                    )

    def chunks_for(self, chunk_tokens: int) -> int:
        """Chunks moved per call for this chunk size."""
        if self.chunks_per_batch is not None:
            return self.chunks_per_batch
        return self.batch_tokens // chunk_tokens


@dataclass(slots=True)
class Row:
    op: str
    page_tokens: int
    chunk_tokens: int
    chunks: int
    batch_bytes: int
    kernel_gbps: float
    ceiling_gbps: float
    launches: int

    @property
    def ratio(self) -> float:
        return self.kernel_gbps / self.ceiling_gbps if self.ceiling_gbps else float("nan")


def _median_s(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per call. On CUDA: ``iters`` calls back to back between two events (the sustained
    rate an engine issuing batch after batch sees: the host's launch work overlaps the copies, as
    it does in serving), the median of 5 such runs. On CPU: the median of ``iters`` single calls."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(runs)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _vllm_cache(cfg: BenchConfig, page_tokens: int, num_blocks: int) -> PagedLayout:
    """Per-layer [blocks, heads, block_size, 2*dim] views over one LBNHC buffer, as vLLM builds."""
    dev = torch.device(cfg.device)
    storage = torch.empty(
        cfg.layers,
        num_blocks,
        page_tokens,
        cfg.kv_heads,
        2 * cfg.head_dim,
        dtype=torch.bfloat16,
        device=dev,
    )
    storage.view(torch.int16).random_(-(2**15), 2**15)
    return PagedLayout.from_vllm([storage[i].permute(0, 2, 1, 3) for i in range(cfg.layers)])


def _measure(cfg: BenchConfig, page_tokens: int, chunk_tokens: int) -> list[Row]:
    dev = torch.device(cfg.device)
    pages_per_chunk = chunk_tokens // page_tokens
    num_chunks = cfg.chunks_for(chunk_tokens)
    num_pages = num_chunks * pages_per_chunk
    layout = _vllm_cache(cfg, page_tokens, 2 * num_pages)  # half the pool used, scattered
    ids = torch.randperm(2 * num_pages)[:num_pages].view(num_chunks, pages_per_chunk)
    chunks = alloc_chunks(layout, num_chunks, pages_per_chunk)
    nbytes = chunks.numel() * chunks.element_size()
    # Both filled: an untouched CPU source maps the kernel's shared zero page, which stays in cache
    # and inflated the ceiling by 15-40% (found by a benchmark review).
    flat_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    flat_dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)

    def timed(fn: Callable[[], object]) -> float:
        return nbytes / _median_s(fn, dev, cfg.iters, cfg.warmup) / 1e9

    ceiling = timed(lambda: flat_dst.copy_(flat_src))
    launches = gather_chunks(layout, ids, chunks).launches
    rows = [
        Row(
            "gather d2d" if dev.type == "cuda" else "gather cpu",
            page_tokens,
            chunk_tokens,
            num_chunks,
            nbytes,
            timed(lambda: gather_chunks(layout, ids, chunks)),
            ceiling,
            launches,
        ),
        Row(
            "scatter d2d" if dev.type == "cuda" else "scatter cpu",
            page_tokens,
            chunk_tokens,
            num_chunks,
            nbytes,
            timed(lambda: scatter_chunks(layout, ids, chunks)),
            ceiling,
            launches,
        ),
    ]
    if dev.type == "cuda":
        host = alloc_chunks(
            layout, num_chunks, pages_per_chunk, device="cpu", pin_memory=True
        )
        host_flat = host.view(-1).view(torch.uint8)
        d2h = timed(lambda: host_flat.copy_(flat_src, non_blocking=True))
        h2d = timed(lambda: flat_dst.copy_(host_flat, non_blocking=True))
        rows += [
            Row(
                "gather d2h (zero-copy)",
                page_tokens,
                chunk_tokens,
                num_chunks,
                nbytes,
                timed(lambda: gather_chunks(layout, ids, host)),
                d2h,
                launches,
            ),
            Row(
                "scatter h2d (zero-copy)",
                page_tokens,
                chunk_tokens,
                num_chunks,
                nbytes,
                timed(lambda: scatter_chunks(layout, ids, host)),
                h2d,
                launches,
            ),
        ]
    return rows


# (max tile elements, warps, K and V in one program, streaming cache hints) tried by --tune; the
# first is the launcher's default.
TUNE_CONFIGS = (
    (8192, 8, True, False),
    (8192, 8, True, True),
    (16384, 8, True, False),
    (16384, 8, True, True),
    (4096, 4, True, False),
    (8192, 4, True, False),
    (8192, 8, False, False),
    (16384, 8, False, False),
)


def tune(cfg: BenchConfig) -> str:
    """GB/s of each kernel row under every `TUNE_CONFIGS` entry, as a markdown table (CUDA only)."""
    from radixkv.kernels import paged_copy

    cfg = dataclasses.replace(cfg, iters=min(cfg.iters, 5))  # 8 configs x 4 shapes: keep it short
    lines = [
        "| page tokens | chunk tokens | tile elems | warps | K+V fused | streaming hints "
        "| gather d2d | scatter d2d | gather d2h | scatter h2d |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for page in cfg.page_tokens:
        for chunk in cfg.chunk_tokens:
            for elems, warps, fuse, streaming in TUNE_CONFIGS:
                with paged_copy._tile_config(elems, warps, fuse, streaming):
                    rows = _measure(cfg, page, chunk)
                cells = " | ".join(f"{r.kernel_gbps:.1f} ({r.ratio:.2f})" for r in rows)
                lines.append(
                    f"| {page} | {chunk} | {elems} | {warps} | {fuse} | {streaming} | {cells} |"
                )
                print(lines[-1], flush=True)
    return "\n".join(lines)


def format_table(rows: list[Row], on_gpu: bool) -> str:
    ceiling = "torch copy_ GB/s (ceiling)"
    lines = [
        "| op | page tokens | chunk tokens | chunks | batch MiB | radixkv GB/s "
        f"| {ceiling} | ratio | launches |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mark = "" if not on_gpu else (" ok" if r.ratio >= TARGET_RATIO else " MISS")
        lines.append(
            f"| {r.op} | {r.page_tokens} | {r.chunk_tokens} | {r.chunks} | "
            f"{r.batch_bytes / 2**20:.0f} | "
            f"{r.kernel_gbps:.1f} | {r.ceiling_gbps:.1f} | {r.ratio:.2f}{mark} | "
            f"{r.launches if on_gpu else 'n/a (torch)'} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixkv.bench kernels", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", type=_device, default="auto",
                   help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--layers", type=int, default=None, help="default 32 on GPU, 8 on CPU")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-tokens", default="16,64", help="comma-separated page sizes")
    p.add_argument("--chunk-tokens", default="256,1024", help="comma-separated chunk sizes")
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="chunks per call (overrides --batch-tokens); default on CPU 2 unless --batch-tokens",
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens moved per call, as chunks of each size (GPU default 4096: a long prefix hit)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed iterations; default 20 GPU, 3 CPU"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations; default 3 GPU, 1 CPU"
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="GPU only: also time every kernel row under each tile size and warp count",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="CPU runs: torch threads (default 1: stable on shared machines)",
    )
    return p


def _device(text: str) -> str:
    """argparse ``type=`` of --device: auto, cpu, cuda or cuda:N (anything else, e.g. meta, has no
    kernels to time: a usage error, not a traceback after the banner)."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device to time; choose auto, cpu, cuda or cuda:N")
    return text


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers; got {text!r}") from None


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        print(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})", file=sys.stderr)
        return 2
    on_gpu = device.startswith("cuda")
    if not on_gpu:
        torch.set_num_threads(args.threads)
    try:
        cfg = BenchConfig(
            device=device,
            layers=_default(args.layers, 32 if on_gpu else 8),
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            page_tokens=_ints(args.page_tokens, "--page-tokens"),
            chunk_tokens=_ints(args.chunk_tokens, "--chunk-tokens"),
            # CPU: 2 chunks per call unless a batch size is given (the torch path is slow there).
            chunks_per_batch=(
                args.chunks if on_gpu or args.batch_tokens is not None else _default(args.chunks, 2)
            ),
            batch_tokens=_default(args.batch_tokens, 4096),
            iters=_default(args.iters, 20 if on_gpu else 3),
            warmup=_default(args.warmup, 3 if on_gpu else 1),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(torch.device(device)) if on_gpu else "CPU"
    print(
        f"radixkv kernels benchmark on {where}: vLLM LBNHC cache, {cfg.layers} layers x "
        f"{cfg.kv_heads} KV heads x {cfg.head_dim} dims, bf16, "
        + (
            f"{cfg.chunks_per_batch} chunks per call, "
            if cfg.chunks_per_batch is not None
            else f"{cfg.batch_tokens} tokens per call, "
        )
        + (
            f"median of 5 runs of {cfg.iters} back-to-back calls (warm-up {cfg.warmup})"
            if on_gpu
            else f"median of {cfg.iters} calls (warm-up {cfg.warmup})"
        )
    )
    if not on_gpu:
        print(
            f"NOTE: ran on CPU ({torch.get_num_threads()} torch thread(s)): the torch reference "
            "path "
            "(index_select / index_put_) against a contiguous CPU copy_ of the same bytes; no "
            "host<->device rows; the GPU targets (>= 0.85 of each ceiling, 1 launch per batch) "
            "apply to CUDA runs only."
        )
        if args.tune:
            print("NOTE: --tune times the CUDA kernels' tile sizes; ignored on CPU")
    rows: list[Row] = []
    for page in cfg.page_tokens:
        for chunk in cfg.chunk_tokens:
            rows += _measure(cfg, page, chunk)
    print(format_table(rows, on_gpu))
    if on_gpu:
        missed = [r for r in rows if r.ratio < TARGET_RATIO or r.launches != 1]
        print(
            f"targets: {len(rows) - len(missed)}/{len(rows)} rows at >= {TARGET_RATIO:.2f} of "
            "ceiling with 1 launch per batch"
        )
        if args.tune:
            print("tuning: GB/s (ratio to its ceiling) per tile size and warp count")
            tune(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
