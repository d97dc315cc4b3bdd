"""SGLang 0.5.23's own radix trees as callbacks for ``python -m radixkv.bench tree --vs sglang``.

``impls(w, page)`` returns ``(name, insert, match, prepare)`` tuples for:

* ``sglang RadixCache``: the legacy tree, ``RadixCache.create_simulated(page_size=page)``.
* ``sglang Unified (python core)`` / ``sglang Unified (rust core)``: ``UnifiedRadixCache`` with
  ``tree_components=(FULL,)`` and ``tree_core_backend="python"`` / ``"rust"``. SGLang silently falls
  back to the Python core when the Rust one cannot load; we check the core class and refuse to
  label a Python core "rust".

The calls mirror the scheduler: match is ``match_prefix(MatchPrefixParams(key=RadixKey(tokens)))``
(``mem_cache/common.py::match_kv_cache``) and returns ``device_prefix_len``; a fourth row,
``sglang Unified (rust core, length only)``, matches with the core's ``match_full_device_prefix``
(a count and a node, no result object: like radixkv's timed match, which reads only ``hit_chunks``); insert is
``insert(InsertParams(key=RadixKey(tokens).page_aligned(page), value=int64 KV indices))``
(``UnifiedRadixCache.checkpoint_into_tree``). What the engine builds outside the tree — the
RadixKey objects over ``array('q')`` token ids and the int64 index tensors — is built here, before
timing, so only the tree's own insert/match work is timed. Nothing is evicted.

Value tensors are views into one ``arange`` so every inserted token has a distinct KV slot, as in a
real pool. The Unified tree frees the slots of duplicate (already cached) tokens during insert
through ``token_to_kv_pool_allocator.free_segment``; the legacy tree leaves that to its caller
(``_insert_cache``). To time the trees alike, the Unified caches get ``_SlotSink``, which only
counts freed tokens (the allocator's own cost is not tree work, and it is excluded for the
legacy tree too). Run in the SGLang env:
``.envs/sglang/bin/python -m radixkv.bench tree --vs sglang``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from array import array
from typing import Any, Callable, Optional

_STUBS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "_stubs")


def _import_sglang() -> None:
    # sglang.srt.configs imports torchvision, whose PyPI wheels are CUDA-linked; the SGLang env
    # uses the repo's import stub (scripts/setup_sglang_env.sh). Add it only when it is missing.
    if importlib.util.find_spec("torchvision") is None:
        stubs = os.path.abspath(_STUBS)
        if not os.path.isdir(stubs):
            raise RuntimeError(
                f"torchvision is not importable and the stub directory {stubs} is missing; "
                "run scripts/setup_sglang_env.sh from a radixkv checkout"
            )
        sys.path.insert(0, stubs)
    try:
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"--vs sglang needs sglang==0.5.23 importable ({e}); run it with "
            ".envs/sglang/bin/python (scripts/setup_sglang_env.sh builds that env)"
        ) from e


class _SlotSink:
    """Allocator stand-in for the Unified tree: counts the duplicate slots insert frees."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed_tokens = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed_tokens += len(indices) - start_pos


Impl = tuple[str, Callable[[int], None], Callable[[int], int], Optional[Callable[[], None]]]


def impls(w: Any, page: int) -> list[Impl]:
    """The SGLang trees over workload ``w`` (``.inserts``, ``.queries`` token lists) at ``page``."""
    _import_sglang()
    import torch

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # Built once per (workload, page), shared by the three trees (none of them mutates keys).
    q_keys = [RadixKey(array("q", s)) for s in w.queries]
    raw_ins = q_keys if w.inserts is w.queries else [RadixKey(array("q", s)) for s in w.inserts]
    ins_keys = [k.page_aligned(page) for k in raw_ins]
    del raw_ins
    slots = torch.arange(sum(len(k) for k in ins_keys), dtype=torch.int64)
    ins_values = []
    offset = 0
    for k in ins_keys:
        ins_values.append(slots[offset : offset + len(k)])
        offset += len(k)
    match_params = [MatchPrefixParams(key=k) for k in q_keys]

    def tree_impl(name: str, build: Callable[[], Any], length_only: bool = False) -> Impl:
        state: dict[str, Any] = {}

        def prepare() -> None:
            state["tree"] = build()
            # Fresh params per run: insert may record results on them.
            state["params"] = [InsertParams(key=k, value=v) for k, v in zip(ins_keys, ins_values)]

        def insert(i: int) -> None:
            state["tree"].insert(state["params"][i])

        def match(i: int) -> int:
            return state["tree"].match_prefix(match_params[i]).device_prefix_len

        def match_length(i: int) -> int:
            return state["tree"].tree_core.match_full_device_prefix(q_keys[i])[0]

        return name, insert, match_length if length_only else match, prepare

    def unified(backend: str) -> Any:
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=_SlotSink(),
            page_size=page,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=backend,
        )
        cache = UnifiedRadixCache(params)
        core = type(cache.tree_core).__name__
        if (backend == "rust") != (core == "RustUnifiedTreeCore"):
            raise RuntimeError(f"asked SGLang for the {backend} tree core, got {core} (fallback)")
        return cache

    return [
        tree_impl("sglang RadixCache", lambda: RadixCache.create_simulated(page_size=page)),
        tree_impl("sglang Unified (python core)", lambda: unified("python")),
        tree_impl("sglang Unified (rust core)", lambda: unified("rust")),
        # The core's length-only match (what SGLang's scheduler uses to rank waiting requests,
        # ``supports_fast_match_prefix``): no MatchResult, no cache actions. radixkv's timed match
        # returns only a count too (its MatchResult computes the rest lazily), so this is the
        # like-for-like baseline for match; its insert is the rust core's again.
        tree_impl("sglang Unified (rust core, length only)", lambda: unified("rust"), length_only=True),
    ]
