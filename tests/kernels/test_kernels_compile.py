"""Compile the kernel for an H100-class GPU (sm_90) on CPU, from the launcher's real arguments.

The interpreter does not model Triton's compiled-mode rules (integer arguments equal to 1 become
constexprs, alignment drives vectorisation), so these tests run the real compiler front end and
back end (PTX via LLVM, cubin via the bundled ptxas) without a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from _kernel_cases import make_case
from radixkv.kernels import PagedLayout, alloc_chunks, paged_copy

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older triton
    pytest.skip("triton without ASTSource/GPUTarget", allow_module_level=True)


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overrides the directory fixture: these tests compile, they do not interpret."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(
        "TRITON_DEFAULT_FP_FUSION", "0"
    )  # copies have no FP math; silences a warning


_WORDS = {torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


def _compile_ptx(layout: PagedLayout, ids, chunks, *, to_chunk: bool) -> str:
    """Specialise like Triton's launcher: ints == 1 -> constexpr; values % 16 == 0 -> hint."""
    plan = paged_copy._plan(layout, ids, chunks, None, to_chunk=to_chunk)
    _, args, meta_params = paged_copy._launch_args(layout, plan, to_chunk=to_chunk)
    options = {k: meta_params.pop(k) for k in ("num_warps", "num_stages") if k in meta_params}
    kernel = paged_copy._kernel(interpret=False)  # the JITFunction, whatever TRITON_INTERPRET was
    names = kernel.arg_names
    signature, constexprs, attrs = {}, dict(meta_params), {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _WORDS[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
            continue
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in meta_params:
        signature[name] = "constexpr"
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # pragma: no cover - broken toolchain, not a kernel bug
        if "ptxas" in str(exc) and "not found" in str(exc):
            pytest.skip(f"no ptxas: {exc}")
        raise
    return compiled.asm["ptx"]


def _ops(ptx: str, kind: str) -> set[str]:
    return set(re.findall(kind + r"\.global[\.\w]*", ptx))


@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
def test_llama_shaped_vllm_layout_compiles_to_16_byte_accesses(to_chunk: bool) -> None:
    """LBNHC, 8 KV heads x 128 dims, bf16: aligned offsets -> 128-bit loads and stores."""
    base = torch.zeros(2, 4, 16, 8, 256, dtype=torch.bfloat16)  # [L, B, N, H, 2D]
    layout = PagedLayout.from_vllm([base[i].permute(0, 2, 1, 3) for i in range(2)])
    assert layout.views_aligned
    ptx = _compile_ptx(layout, [[0, 1], [2, -1]], alloc_chunks(layout, 2, 2), to_chunk=to_chunk)
    assert "ld.global.v4.b32" in _ops(ptx, "ld"), _ops(ptx, "ld")
    assert "st.global.v4.b32" in _ops(ptx, "st"), _ops(ptx, "st")


@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
def test_size_one_arguments_compile(to_chunk: bool) -> None:
    """page_tokens = heads = components = pages_per_chunk = 1 (SGLang page 1, MLA): constexprs."""
    pool = torch.zeros(8, 1, 24, dtype=torch.float16)
    layout = PagedLayout.from_sglang_device([pool, pool[:, :, :]], None, page_tokens=1)
    ids = [[3], [5]]
    _compile_ptx(layout, ids, alloc_chunks(layout, 2, 1), to_chunk=to_chunk)


@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
def test_streaming_cache_hints_compile(to_chunk: bool) -> None:
    """The --tune variant with evict-first loads and .cs stores reaches the PTX."""
    base = torch.zeros(2, 4, 16, 8, 256, dtype=torch.bfloat16)
    layout = PagedLayout.from_vllm([base[i].permute(0, 2, 1, 3) for i in range(2)])
    with paged_copy._tile_config(8192, 8, streaming=True):
        ptx = _compile_ptx(layout, [[0, 1], [2, -1]], alloc_chunks(layout, 2, 2), to_chunk=to_chunk)
    assert any(".cs" in op for op in _ops(ptx, "st")), _ops(ptx, "st")


def test_unaligned_layout_still_compiles() -> None:
    case = make_case("strided_dim", torch.float32)
    assert not case.layout.views_aligned or case.layout.page_strides[-1] != 1
    _compile_ptx(case.layout, [[0, 1, 2]], alloc_chunks(case.layout, 1, 3), to_chunk=True)
