"""Options, chunk geometry and keys; connector creation through vLLM's factory; a cheap import."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from vllm_harness import make_kv_cache_config, make_vllm_config

from radixkv.adapters.vllm_options import (
    VllmConnectorOptions,
    chunk_keys_from_block_hashes,
    resolve_chunk_tokens,
)
from radixkv.errors import ConfigError

pytestmark = pytest.mark.vllm


def test_options_validate():
    assert VllmConnectorOptions.from_extra_config({}) == VllmConnectorOptions()
    with pytest.raises(ConfigError, match="unknown radixkv option.*chunk_token"):
        VllmConnectorOptions.from_extra_config({"chunk_token": 64})
    with pytest.raises(ConfigError, match="chunk_tokens=0"):
        VllmConnectorOptions(chunk_tokens=0)
    with pytest.raises(ConfigError, match="either 'store' or 'store_config_file'"):
        VllmConnectorOptions(store={"tiers": []}, store_config_file="x.yaml")
    with pytest.raises(ConfigError, match="save_generated"):
        VllmConnectorOptions(save_generated="yes")
    # Once plain TypeErrors at worker startup, or silently accepted:
    for bad, match in [({"model_name": 123}, "model_name=123"), ({"model_name": ""}, "model_name=''"),
                       ({"store_config_file": 5}, "store_config_file=5"),
                       ({"lookup_min_chunks": True}, "not true/false"),
                       ({"store": {}}, "tiers"),  # validated on the scheduler side too
                       ({"store": {"tiers": ["mem://?capacity=1GiB"], "colour": 1}}, "colour")]:
        with pytest.raises(ConfigError, match=match):
            VllmConnectorOptions.from_extra_config(bad)


def test_max_staging_bytes_takes_a_size_string_as_store_sizes_do():
    # It took only integers: "1GiB", accepted by every store size, was refused.
    assert VllmConnectorOptions.from_extra_config({"max_staging_bytes": "1GiB"}).max_staging_bytes == 1 << 30
    assert VllmConnectorOptions.from_extra_config({"max_staging_bytes": 4096}).max_staging_bytes == 4096
    for bad in ("lots", "-1GiB", True):
        with pytest.raises(ConfigError, match="max_staging_bytes"):
            VllmConnectorOptions.from_extra_config({"max_staging_bytes": bad})


def test_chunk_geometry():
    assert resolve_chunk_tokens(None, [16], 16) == 256
    assert resolve_chunk_tokens(None, [16, 48], 16) == 288  # lcm 48, first multiple >= 256
    assert resolve_chunk_tokens(None, [1024], 32) == 1024
    assert resolve_chunk_tokens(64, [16], 16) == 64
    with pytest.raises(ConfigError, match="multiple of 48"):
        resolve_chunk_tokens(64, [16, 48], 16)


def test_keys_name_the_prefix():
    hashes = [bytes([i]) * 32 for i in range(8)]
    keys = chunk_keys_from_block_hashes(hashes, 16, 64, 2)  # chunk i <- hash of its 4th block
    assert len(keys) == 2 and all(len(k) == 64 for k in keys)
    assert keys == chunk_keys_from_block_hashes(
        hashes[:4] + [b"x" * 32] * 3 + hashes[7:], 16, 64, 2
    )
    with pytest.raises(ValueError):
        chunk_keys_from_block_hashes(hashes, 16, 64, 3)


def test_factory_builds_both_roles_and_hma(model_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

    cfg = make_vllm_config(model_dir, {"chunk_tokens": 32})
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # HMA forced on: needs SupportsHMA
    kcc = make_kv_cache_config(sliding_window=32)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    assert supports_hma(sched) and type(sched).__name__ == "RadixKVConnector"
    assert not sched.requires_kv_delivery
    assert sched._worker is None and worker._scheduler is None
    assert [g.kind for g in sched.groups] == ["full", "sliding_window32"]
    assert type(sched).requires_piecewise_for_cudagraph({"layerwise": True})
    assert not type(sched).requires_piecewise_for_cudagraph({})


def test_bad_option_fails_at_construction(model_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = make_vllm_config(model_dir, {"chunk_tokens": 24})
    with pytest.raises(ConfigError, match="multiple of 16"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config())


def test_decode_context_parallel_is_refused(model_dir):
    """Found by the cache-identity hunt: under DCP vLLM's scheduler block stands for block_size x DCP
    tokens (each rank holds its interleaved share), but the connector mapped a chunk to
    chunk_tokens / block_size blocks and named the shard by TP/PP rank only. With DCP=2 and a
    100-token prompt the save planned chunk 0 (key of tokens 0-31) as blocks [1, 2] and chunk 1 as
    [3, 4], i.e. the bytes of tokens 0-63 and 64-127: a key stored with KV its prefix does not name
    (in a chunked prefill, of tokens not yet computed). The connector now refuses DCP at construction
    (a ConfigError naming the setting), in both roles."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = make_vllm_config(model_dir, {"chunk_tokens": 32})
    cfg.parallel_config.tensor_parallel_size = 2
    cfg.parallel_config.decode_context_parallel_size = 2
    kcc = make_kv_cache_config()  # block_size 16 per rank
    # vLLM's own geometry (no connector): 100 tokens take 4 blocks, 32 tokens each, not 7 of 16.
    plain = copy.deepcopy(cfg)
    plain.kv_transfer_config = None
    init_none_hash(sha256)
    sched = Scheduler(vllm_config=plain, kv_cache_config=kcc, log_stats=False, block_size=32,
                      structured_output_manager=StructuredOutputManager(plain))
    sp = SamplingParams(max_tokens=1)
    sp.update_from_generation_config({}, 2)
    sched.add_request(Request(request_id="a", prompt_token_ids=list(range(10, 110)), sampling_params=sp,
                              pooling_params=None, mm_features=None,
                              block_hasher=get_request_block_hasher(32, sha256)))
    sched.schedule()
    assert len(sched.kv_cache_manager.get_block_ids("a")[0]) == 4
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
            KVConnectorFactory.create_connector(cfg, role, kcc)


def test_import_is_cheap():
    """The API server imports the module: no CUDA init, no kernels/Triton of ours, no store."""
    code = (
        "import sys, torch\n"
        "import radixkv.adapters.vllm as m\n"
        "assert m.RadixKVConnector\n"
        "bad = [n for n in ('radixkv.kernels', 'radixkv.store', 'radixkv.adapters.vllm_worker') if n in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
