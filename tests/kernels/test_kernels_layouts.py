"""PagedLayout validation, engine layout builders and chunk-buffer helpers."""

from __future__ import annotations

import pytest
import torch
from _kernel_cases import CASE_NAMES, LAYERS, MLA_DIM, PAGES, make_case
from radixkv.kernels import (
    PagedLayout,
    alloc_chunks,
    chunk_from_payload,
    chunk_payload,
    pages_from_token_indices,
    word_dtype,
)

from radixkv.errors import InputError


@pytest.mark.parametrize("name", CASE_NAMES)
def test_builders_describe_every_page(name: str) -> None:
    case = make_case(name, torch.bfloat16)
    lay = case.layout
    lay.check_integrity()
    assert lay.num_layers == LAYERS and lay.num_pages == PAGES
    assert lay.num_components == (1 if "mla" in name else 2)
    assert lay.head_dim == (MLA_DIM if "mla" in name else 8)
    for layer in range(lay.num_layers):
        for comp in range(lay.num_components):
            for page in range(lay.num_pages):
                # the layout's view of a page aliases exactly the engine memory the oracle names
                view = lay.views[layer][comp][page]
                want = case.oracle(layer, comp, page)
                assert view.data_ptr() == want.data_ptr() and view.stride() == want.stride()
                assert view.shape == want.shape


def test_sizes_llama_shaped() -> None:
    """Llama-3.1-8B: 32 layers, 8 KV heads, dim 128, bf16 -> 128 KiB per token."""
    pages = torch.empty(4, 32, 8, 16, 256, dtype=torch.bfloat16)  # [B, L, H, N, C] (BLHNC)
    lay = PagedLayout.from_vllm([pages[:, i] for i in range(32)])
    assert lay.page_bytes == 16 * 8 * 128 * 2
    assert lay.chunk_bytes(16) == 256 * 128 * 1024  # 256 tokens
    assert lay.chunk_shape(16) == (32, 2, 256, 8, 128)


def test_from_views_rejects_inconsistent_views() -> None:
    a = torch.zeros(4, 2, 2, 8, dtype=torch.float16)
    cases = [
        ([], "at least one layer"),
        ([[a, a, a]], "2 components"),
        ([[a[0]]], "4-D"),
        ([[a, a], [a]], "layer 1 has 1 components"),
        ([[a, a], [a, a.float()]], "dtype"),
        ([[a, a], [a, a.transpose(1, 2).contiguous().transpose(1, 2)]], "strides"),
        ([[a, a], [a, torch.zeros(5, 2, 2, 8, dtype=torch.float16)]], "shape"),
        ([[a, a], [a, a.to("meta")]], "device"),
        ([[a[:, :0], a[:, :0]]], "non-empty"),
        ([[torch.zeros(2, 2, 2, 2, dtype=torch.complex128)] * 2], "16-byte"),
    ]
    for views, match in cases:
        with pytest.raises(InputError, match=match):
            PagedLayout.from_views(views)


def test_views_that_overlap_themselves_are_refused() -> None:
    # A page stride shorter than a page, or an expanded dim, maps two pages (tokens) to one
    # address: scatter_chunks(layout, [[0]], ...) wrote page 1's first token too (torch and
    # interpreter alike), outside its destination page, and the one-page-once check could not help.
    buf = torch.zeros(64, dtype=torch.float16)
    shingled = buf.as_strided((4, 2, 1, 8), (8, 8, 8, 1))  # page p = elements [8p, 8p + 16)
    expanded = torch.zeros(4, 1, 2, 8, dtype=torch.float16).expand(4, 3, 2, 8)
    for view in (shingled, expanded):
        with pytest.raises(InputError, match="overlap themselves"):
            PagedLayout.from_views([[view]])
    # Nested strides with gaps (K and V halves of a K||V row, a stride-2 dim) and size-1 dims
    # of any stride stay valid.
    kv = torch.zeros(4, 2, 2, 16, dtype=torch.float16)
    PagedLayout.from_views([[kv[..., :8], kv[..., 8:]]])
    PagedLayout.from_views([[kv[..., ::2]]])
    PagedLayout.from_views([[buf.as_strided((4, 2, 1, 8), (16, 8, 0, 1))]])


def test_vllm_builder_errors() -> None:
    with pytest.raises(InputError, match="empty"):
        PagedLayout.from_vllm({})
    with pytest.raises(InputError, match="2\\*head_size"):
        PagedLayout.from_vllm([torch.zeros(4, 2, 16, 24)], head_size=8)
    with pytest.raises(InputError, match="1 KV head"):
        PagedLayout.from_vllm([torch.zeros(4, 2, 16, 24)], mla=True)
    with pytest.raises(InputError, match="4-D"):
        PagedLayout.from_vllm([torch.zeros(4, 16, 24)])


def test_sglang_builder_errors() -> None:
    k = torch.zeros(10, 2, 8)
    with pytest.raises(InputError, match="2 K buffers but 1 V"):
        PagedLayout.from_sglang_device([k, k], [k], page_tokens=4)
    with pytest.raises(InputError, match="fewer than one page"):
        PagedLayout.from_sglang_device([k], None, page_tokens=16)
    with pytest.raises(InputError, match="page_tokens must be a positive int"):
        PagedLayout.from_sglang_device([k], [k], page_tokens=0)
    with pytest.raises(InputError, match="unsupported SGLang host layout 'page_unified'"):
        PagedLayout.from_sglang_host(
            torch.zeros(2, 2, 8, 2, 8), layout="page_unified", page_tokens=4
        )
    with pytest.raises(InputError, match="'page_head' for MLA"):
        PagedLayout.from_sglang_host(
            torch.zeros(2, 2, 8, 2, 8), layout="page_head", page_tokens=4, mla=True
        )
    with pytest.raises(InputError, match="page_head kv_buffer has page_size 4"):
        PagedLayout.from_sglang_host(
            torch.zeros(2, 3, 2, 4, 2, 8), layout="page_head", page_tokens=8
        )
    with pytest.raises(InputError, match="5-D"):
        PagedLayout.from_sglang_host(torch.zeros(2, 8, 2, 8), layout="layer_first", page_tokens=4)
    with pytest.raises(InputError, match="page_size 4 but page_tokens=8"):
        PagedLayout.from_sglang_host(
            torch.zeros(2, 3, 2, 4, 2, 8), layout="page_first_direct", page_tokens=8
        )


def test_sglang_mla_builders_refuse_multi_head_buffers() -> None:
    """An MHA pool's k_buffer is 3-D like an MLA pool's kv_buffer: leaving out v_buffers (or passing
    mla=True for an MHA host pool) built a K-only layout, so a round trip left V unrestored. MLA
    means 1 KV head, as the vLLM builder already checks."""
    k = torch.zeros(16, 4, 8)
    with pytest.raises(InputError, match=r"v_buffers=None means an MLA pool.*k_buffers\[0\] has 4 heads"):
        PagedLayout.from_sglang_device([k], None, page_tokens=4)
    assert PagedLayout.from_sglang_device([torch.zeros(16, 1, 8)], None, page_tokens=4).num_layers == 1
    for layout, shape in (("layer_first", (2, 16, 4, 8)), ("page_first", (16, 2, 4, 8)),
                          ("page_first_direct", (4, 2, 4, 4, 8))):
        with pytest.raises(InputError, match="mla=True needs a latent kv_buffer"):
            PagedLayout.from_sglang_host(torch.zeros(shape), layout=layout, page_tokens=4, mla=True)


def test_check_integrity_notices_moved_views() -> None:
    case = make_case("sglang_device", torch.float16)
    lay = case.layout
    lay.view_offsets()
    lay.check_integrity()
    lay.views = ((lay.views[0][0].clone(), lay.views[0][1]),) + lay.views[1:]
    with pytest.raises(RuntimeError, match="cached view offsets"):
        lay.check_integrity()


def test_check_integrity_notices_a_moved_base_before_any_launch() -> None:
    """The kernels' base pointer (word_base) is cached at construction: a replaced views[0][0] is
    reported even when no launch has cached the offset table yet, and offsets stay measured from
    the base the kernel adds them to (they were measured from the new views[0][0])."""
    lay = make_case("sglang_device", torch.float16).layout
    base = lay.word_base.data_ptr()
    lay.views = ((lay.views[0][0].clone(), lay.views[0][1]),) + lay.views[1:]
    other = torch.zeros(4, dtype=torch.float16)
    assert lay.element_offset(other.data_ptr()) == (other.data_ptr() - base) // 2
    with pytest.raises(RuntimeError, match="views moved: views\\[0\\]\\[0\\]"):
        lay.check_integrity()


def test_check_integrity_notices_views_that_lost_their_alignment() -> None:
    """views_aligned is cached too (it lets the kernel promise 16-element offsets): a V view moved
    to an 8-element offset must be reported."""
    s = torch.zeros(2, 4, 4, 2, 32, dtype=torch.float16)  # [L, B, N, H, 2D], D = 16
    lay = PagedLayout.from_vllm([s[i].permute(0, 2, 1, 3) for i in range(2)])
    assert lay.views_aligned
    lay.check_integrity()
    # the same shape and strides, 8 elements into another allocation (allocations: 64-byte aligned)
    moved = torch.zeros(s.numel() + 8, dtype=torch.float16)[8:].view(s.shape)
    lay.views = ((lay.views[0][0], moved[0][..., 16:]),) + lay.views[1:]  # [B, N, H, D] V view
    with pytest.raises(RuntimeError, match="no longer multiples of 16"):
        lay.check_integrity()


def test_view_offsets_are_element_offsets_from_the_first_view() -> None:
    lay = make_case("vllm_lbnhc", torch.bfloat16).layout
    table = lay.view_offsets()
    base = lay.views[0][0].data_ptr()
    assert table.dtype == torch.int64 and table.shape == (LAYERS * 2,)
    assert table.tolist() == [(v.data_ptr() - base) // 2 for layer in lay.views for v in layer]
    assert table.tolist()[:2] == [0, 8]  # V starts head_dim=8 elements after K
    assert lay.view_offsets() is table  # cached
    assert not lay.views_aligned  # 8-element offsets: the kernel must not promise 16
    other = torch.zeros(4, dtype=torch.bfloat16)
    assert lay.element_offset(other.data_ptr()) == (other.data_ptr() - base) // 2
    with pytest.raises(InputError, match="not aligned"):
        lay.element_offset(base + 1)


def test_views_aligned_when_offsets_are_multiples_of_16() -> None:
    s = torch.zeros(2, 4, 4, 2, 32, dtype=torch.float16)  # [L, B, N, H, 2D], D = 16
    assert PagedLayout.from_vllm([s[i].permute(0, 2, 1, 3) for i in range(2)]).views_aligned


def test_alloc_and_payload_views_alias() -> None:
    lay = make_case("vllm_lbnhc", torch.bfloat16).layout
    chunks = alloc_chunks(lay, 3, 2)
    assert chunks.shape == (3, *lay.chunk_shape(2)) and chunks.dtype == torch.bfloat16
    payload = chunk_payload(chunks[1])
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == lay.chunk_bytes(2) and payload.data_ptr() == chunks[1].data_ptr()
    typed = chunk_from_payload(payload, lay, 2)
    assert typed.shape == lay.chunk_shape(2) and typed.data_ptr() == chunks[1].data_ptr()
    typed[0, 1, 0, 0, 0] = 3.5
    assert chunks[1, 0, 1, 0, 0, 0].item() == 3.5


def test_payload_errors() -> None:
    lay = make_case("vllm_lbnhc", torch.bfloat16).layout
    good = torch.zeros(lay.chunk_bytes(2), dtype=torch.uint8)
    with pytest.raises(InputError, match="has 10 bytes"):
        chunk_from_payload(good[:10], lay, 2)
    with pytest.raises(InputError, match="1-D torch.uint8"):
        chunk_from_payload(good.view(torch.int16), lay, 2)
    with pytest.raises(InputError, match="aligned"):
        chunk_from_payload(torch.zeros(lay.chunk_bytes(2) + 1, dtype=torch.uint8)[1:], lay, 2)
    with pytest.raises(InputError, match="pages_per_chunk"):
        lay.chunk_bytes(0)
    with pytest.raises(InputError, match="not contiguous"):
        chunk_payload(alloc_chunks(lay, 2, 2).transpose(0, 1))
    with pytest.raises(InputError, match="pin_memory=True needs a CPU"):
        alloc_chunks(lay, 1, 1, device="meta", pin_memory=True)
    with pytest.raises(InputError, match="num_chunks"):
        alloc_chunks(lay, 0, 1)


@pytest.mark.parametrize("bad", [None, 5, [5], [[None]]], ids=repr)
def test_views_that_are_not_nested_sequences_are_an_input_error(bad) -> None:
    """from_views(None) and PagedLayout(None) raised a bare TypeError."""
    for build in (PagedLayout.from_views, PagedLayout):
        with pytest.raises(InputError, match="views must be|4-D tensor"):
            build(bad)


def test_meta_views_are_refused() -> None:
    """Meta tensors have no memory: a layout over them was accepted, and its copies then blamed the
    chunk buffers for aliasing the engine (every address is 0)."""
    base = torch.empty(1, 2, 4, 2, 1, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(InputError, match="meta tensors"):
        PagedLayout.from_views([[base[0, 0], base[0, 1]]])
    with pytest.raises(InputError, match="meta tensors"):
        PagedLayout.from_sglang_host(torch.empty(2, 2, 8, 1, 4, device="meta"), layout="layer_first",
                                     page_tokens=4)


def test_pin_memory_without_cuda_is_an_input_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning works")
    lay = make_case("vllm_lbnhc", torch.bfloat16).layout
    with pytest.raises(InputError, match="pin_memory=True needs CUDA.*pin_memory=False"):
        alloc_chunks(lay, 1, 1, pin_memory=True)


@pytest.mark.parametrize(
    "build",
    [
        lambda pt: PagedLayout.from_sglang_host(torch.zeros(2, 2, 8, 1, 4), layout="layer_first",
                                                page_tokens=pt),
        lambda pt: PagedLayout.from_sglang_host(torch.zeros(2, 2, 2, 1, 1, 4), layout="page_first_direct",
                                                page_tokens=pt),
        lambda pt: PagedLayout.from_sglang_host(torch.zeros(2, 2, 1, 1, 2, 4), layout="page_head",
                                                page_tokens=pt),
        lambda pt: PagedLayout.from_sglang_device([torch.zeros(8, 1, 4)], None, page_tokens=pt),
    ],
    ids=["layer_first", "page_first_direct", "page_head", "device"],
)
@pytest.mark.parametrize("bad", [True, 1.0, 0])
def test_page_tokens_must_be_a_positive_int_not_a_bool(build, bad) -> None:
    """page_tokens=True was taken as pages of 1 token (chunk_shape / alloc_chunks refuse bools)."""
    with pytest.raises(InputError, match="page_tokens must be a positive int"):
        build(bad)
    assert build(1).page_tokens == 1


def test_word_dtype() -> None:
    assert word_dtype(torch.bfloat16) == torch.int16
    assert word_dtype(torch.float8_e4m3fn) == torch.int8
    assert word_dtype(torch.float32) == torch.int32
    assert word_dtype(torch.float64) == torch.int64


def test_pages_from_token_indices() -> None:
    idx = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23])
    assert pages_from_token_indices(idx, 4).tolist() == [2, 0, 5]
    assert pages_from_token_indices([5, 6], 1).tolist() == [5, 6]
    for bad, match in [
        ([8, 9, 10], "whole pages"),
        ([], "whole pages"),
        ([9, 10, 11, 12], "token index 9 does not start a page"),
        ([8, 9, 11, 10], "consecutive"),
        ([-4, -3, -2, -1], "token index -4"),
    ]:
        with pytest.raises(InputError, match=match):
            pages_from_token_indices(torch.tensor(bad, dtype=torch.int64), 4)
    for bad in (None, "0123", object(), [[0, 1], [2]]):  # torch.as_tensor raised raw errors
        with pytest.raises(InputError, match="token_indices must be"):
            pages_from_token_indices(bad, 2)


@pytest.mark.parametrize(
    "shape, layout_name",
    [
        ((1, 2, 8, 1, 4), "layer_first"),
        ((3, 2, 8, 1, 4), "layer_first"),
        ((3, 8, 2, 1, 4), "page_first"),
        ((1, 2, 2, 4, 1, 4), "page_first_direct"),
        ((3, 2, 1, 4, 2, 4), "page_head"),
    ],
)
def test_sglang_host_mha_needs_k_and_v_in_the_first_dim(shape, layout_name) -> None:
    """A K/V dim other than 2 was an IndexError (1) or silently dropped the extra slices (3)."""
    with pytest.raises(InputError, match="must have 2 \\(K, V\\) in its first dim"):
        PagedLayout.from_sglang_host(torch.zeros(shape), layout=layout_name, page_tokens=4)
