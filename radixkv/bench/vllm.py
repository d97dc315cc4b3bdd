"""``python -m radixkv.bench vllm``: the vLLM connector's worker data path vs plain copies of the bytes.

Run it inside the vLLM test environment (``.envs/vllm/bin/python -m radixkv.bench vllm``): the worker
half imports vLLM's connector base classes. On a vLLM-layout KV cache (LBNHC per-layer views made by
vLLM's ``create_kv_cache_views``, Llama-3.1-8B shape by default, scaled down with ``--layers``), per
batch of chunks:

* save: ``RadixKVConnector``'s worker half (``bind`` a save plan, ``wait_for_save``: gather every
  layer's blocks into chunk buffers, ``put`` into a ``mem://`` tier) against the
  baseline, a torch ``index_select`` of the same blocks into one contiguous buffer per layer;
* load: lookup + prefetch from the ``mem://`` tier into staging, then ``start_load_kv`` (scatter into
  fresh blocks) against the baseline, a torch ``index_copy_`` of the same bytes back into the blocks.

Prints GB/s of each and the ratio (connector / baseline). The loaded bytes are checked against the
saved ones (a benchmark that moved wrong bytes would report nothing useful).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixkv.bench import positive_int

__all__ = ["main"]


def _prepare_imports() -> None:
    """The worker half imports vLLM: without it, a hint (as bench sglang gives), not a traceback."""
    import importlib.metadata

    # Asks for the installed distribution (imports nothing). Not find_spec("vllm"): a source
    # checkout's tests/vllm is a namespace package of that name when tests/ is on sys.path.
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("vllm==0.33.0 is not installed here: run `bash scripts/setup_vllm_env.sh` and use "
                         ".envs/vllm/bin/python -m radixkv.bench vllm")


def _views(layers: int, blocks: int, heads: int, head_dim: int, block: int, dtype: torch.dtype):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=dtype)
    names = [f"layers.{i}" for i in range(layers)]
    lay = KVCacheLayout.LBNHC
    strides = compute_layout_strides(spec, blocks, layers, lay)
    size = spec.page_size_bytes * blocks * layers
    raw = torch.randint(-128, 127, (size,), dtype=torch.int8)
    kvt = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    return spec, dict(zip(names, create_kv_cache_views(raw, spec, blocks, lay, kvt)))


def _worker(spec, names, chunk_tokens: int, capacity_bytes: int):
    from radixkv.adapters.vllm_options import GroupGeometry, VllmConnectorOptions
    from radixkv.adapters.vllm_worker import WorkerSide

    geo = GroupGeometry(
        0,
        spec.block_size,
        tuple(names),
        "full",
        spec.head_size,
        str(spec.dtype).removeprefix("torch."),
    )
    opts = VllmConnectorOptions(
        chunk_tokens=chunk_tokens,
        store={"tiers": [{"url": "mem://", "capacity_bytes": capacity_bytes}]},
        sync_load_wait_s=10.0,
        max_staging_bytes=capacity_bytes,
    )
    return WorkerSide(opts, [geo], chunk_tokens, "bench-model", "LBNHC", 0, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m radixkv.bench vllm", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--layers", type=positive_int, default=8, help="attention layers (Llama-3.1-8B has 32)")
    ap.add_argument("--kv-heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--block", type=positive_int, default=16, help="vLLM block size (tokens)")
    ap.add_argument("--chunk-tokens", type=positive_int, default=256)
    ap.add_argument("--chunks", type=positive_int, default=4, help="chunks per batch")
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)
    if args.chunk_tokens % args.block:
        ap.error(f"--chunk-tokens {args.chunk_tokens} is not a multiple of --block {args.block}; a chunk "
                 "is whole blocks")
    _prepare_imports()

    from radixkv.adapters.vllm_meta import LoadOp, LookupOp, RadixKVMetadata, SaveOp

    ppc = args.chunk_tokens // args.block
    blocks = 1 + 2 * args.chunks * ppc  # block 0 is vLLM's null block
    spec, kv = _views(args.layers, blocks, args.kv_heads, args.head_dim, args.block, torch.bfloat16)
    names = list(kv)
    chunk_bytes = spec.page_size_bytes * ppc * args.layers
    batch_bytes = chunk_bytes * args.chunks
    src_ids = list(range(1, 1 + args.chunks * ppc))
    dst_ids = list(range(1 + args.chunks * ppc, blocks))
    idx_src, idx_dst = torch.tensor(src_ids), torch.tensor(dst_ids)

    def rows(ids: list[int]) -> list[list[int]]:
        return [ids[c * ppc : (c + 1) * ppc] for c in range(args.chunks)]

    t_save, t_load, t_bsave, t_bload = [], [], [], []
    for rep in range(args.repeats):
        w = _worker(spec, names, args.chunk_tokens, 4 * batch_bytes)
        w.register_kv_caches(kv)
        keys = [f"{rep:08x}{c:056x}" for c in range(args.chunks)]
        t0 = time.perf_counter()
        w.bind(RadixKVMetadata(saves=[SaveOp("r", keys, None, [rows(src_ids)])]))
        w.wait_for_save()
        t_save.append(time.perf_counter() - t0)
        assert w.stats["saved_chunks"] == args.chunks, w.stats

        t0 = time.perf_counter()
        w.bind(RadixKVMetadata(lookups=[LookupOp("r", 1, keys, 0)]))
        meta = w.build_worker_meta()
        assert (
            meta is not None
            and meta.lookups["r"].hit_chunks == args.chunks
            and meta.lookups["r"].ready
        )
        w.bind(RadixKVMetadata(loads=[LoadOp("r", 1, 0, [rows(dst_ids)], False)]))
        w.start_load_kv()
        w.wait_for_save()
        t_load.append(time.perf_counter() - t0)
        for name in names:
            # compare bits: random bf16 bytes include NaNs, which never compare equal as floats
            assert torch.equal(
                kv[name][idx_dst].view(torch.int16), kv[name][idx_src].view(torch.int16)
            ), name
        w.shutdown()

        bufs = []
        t0 = time.perf_counter()
        for name in names:
            bufs.append(kv[name].index_select(0, idx_src))
        t_bsave.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for name, b in zip(names, bufs):
            kv[name].index_copy_(0, idx_dst, b)
        t_bload.append(time.perf_counter() - t0)

    def gbs(ts: list[float]) -> float:
        return batch_bytes / statistics.median(ts) / 1e9

    print(
        f"vLLM connector worker path, CPU, {args.layers} layers x {args.kv_heads} heads x {args.head_dim} dims bf16, "
        f"block {args.block}, chunk {args.chunk_tokens} tokens ({chunk_bytes / 2**20:.1f} MiB), "
        f"{args.chunks} chunks/batch, median of {args.repeats}"
    )
    print(f"{'path':<8}{'connector GB/s':>16}{'baseline GB/s':>16}{'ratio':>8}")
    for label, ours, base in (("save", t_save, t_bsave), ("load", t_load, t_bload)):
        print(f"{label:<8}{gbs(ours):>16.2f}{gbs(base):>16.2f}{gbs(ours) / gbs(base):>8.2f}")
    return 0
