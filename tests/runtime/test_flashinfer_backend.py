"""The flashinfer backend: index arrays on any machine (hand-worked), kernels against torch on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from runtime.attention import AttentionBatch, make_backend, resolve_backend
from runtime.attention.flashinfer_backend import append_index, host_plan, paged_index, qo_indptr
from runtime.errors import UnknownAttentionBackend
from runtime.kv_cache import PagedKVPool


def ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32
    return t.tolist()


def test_decode_only_lists_each_sequences_pages_and_last_page_fill() -> None:
    # page size 4: 5 tokens = one full page + 1; 8 tokens = two full pages (a third is reserved)
    idx = paged_index([5, 8], [[7, 3], [1, 2, 9]], 4)
    assert ints(idx.indptr) == [0, 2, 4]
    assert ints(idx.indices) == [7, 3, 1, 2]
    assert ints(idx.last_page_len) == [1, 4]


def test_prefill_only_appends_from_position_zero() -> None:
    hp = host_plan(AttentionBatch(q_lens=[3, 6], kv_lens=[3, 6], page_tables=[[5], [0, 8]],
                                  num_decode=0), 4)
    assert hp.decode is None and hp.prefill is not None and hp.prefill_qo is not None
    assert ints(hp.prefill_qo) == [0, 3, 9]
    assert ints(hp.prefill.indices) == [5, 0, 8]
    assert ints(hp.prefill.last_page_len) == [3, 2]
    assert ints(hp.batch_indices) == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert ints(hp.positions) == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert hp.num_tokens == 9 and hp.num_decode == 0


def test_mixed_step_plans_decodes_and_prefills_apart_but_appends_all() -> None:
    # two decodes (contexts 6 and 4), then a 3-token prefill chunk of a new prompt
    b = AttentionBatch(q_lens=[1, 1, 3], kv_lens=[6, 4, 3], page_tables=[[2, 4], [6], [1]],
                       num_decode=2)
    hp = host_plan(b, 4)
    assert hp.decode is not None and hp.prefill is not None and hp.prefill_qo is not None
    assert ints(hp.decode.indptr) == [0, 2, 3]
    assert ints(hp.decode.indices) == [2, 4, 6]
    assert ints(hp.decode.last_page_len) == [2, 4]
    assert ints(hp.prefill.indptr) == [0, 1]
    assert ints(hp.prefill_qo) == [0, 3]
    assert ints(hp.append.indices) == [2, 4, 6, 1]
    assert ints(hp.batch_indices) == [0, 1, 2, 2, 2]
    assert ints(hp.positions) == [5, 3, 0, 1, 2]


def test_prefill_over_a_cached_prefix_reads_the_prefix_pages() -> None:
    # 8 tokens cached in pages 4 and 5 (the radix tree's), 2 new ones start page 6
    hp = host_plan(AttentionBatch(q_lens=[2], kv_lens=[10], page_tables=[[4, 5, 6]],
                                  num_decode=0), 4)
    assert hp.prefill is not None and hp.prefill_qo is not None
    assert ints(hp.prefill.indices) == [4, 5, 6]
    assert ints(hp.prefill.last_page_len) == [2]
    assert ints(hp.prefill_qo) == [0, 2]
    assert ints(hp.positions) == [8, 9]


def test_a_chunk_that_fills_its_last_page_exactly_has_a_full_last_page() -> None:
    bi, pos = append_index([4], [12])
    assert ints(bi) == [0, 0, 0, 0] and ints(pos) == [8, 9, 10, 11]
    assert ints(paged_index([12], [[3, 1, 2]], 4).last_page_len) == [4]
    assert ints(qo_indptr([1, 1, 4])) == [0, 1, 2, 6]


def test_too_few_pages_for_the_context_is_a_bug() -> None:
    with pytest.raises(ValueError, match="cover its context"):
        paged_index([9], [[1, 2]], 4)


def test_auto_backend_is_torch_on_cpu_and_flashinfer_on_cuda_when_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("flashinfer", "cpu") == "flashinfer"
    monkeypatch.setattr("runtime.attention.base.find_spec", lambda name: object())
    assert resolve_backend("auto", "cuda:0") == "flashinfer"
    monkeypatch.setattr("runtime.attention.base.find_spec", lambda name: None)
    assert resolve_backend("auto", "cuda") == "torch"


def test_flashinfer_on_a_cpu_pool_is_refused() -> None:
    pool = PagedKVPool(num_layers=1, num_pages=4, page_size=4, kv_heads=1, head_dim=64,
                       dtype=torch.bfloat16)
    with pytest.raises(UnknownAttentionBackend):
        make_backend("flashinfer", pool, num_heads=2, scale=0.125)


# ---- on CUDA ---------------------------------------------------------------------------------

HAS_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
on_cuda = pytest.mark.skipif(not HAS_FLASHINFER,
                             reason="needs CUDA and flashinfer-python (the `cuda` extra)")


@pytest.mark.gpu
@on_cuda
# 4 heads a group decode on the tensor-core kernel, 1 on the CUDA-core one; the head dims are
# those bench/gpu_agreement.py compiles first (each new FlashInfer module costs ~100 s of nvcc)
@pytest.mark.parametrize("heads,kv_heads,hd", [(8, 2, 128), (4, 4, 64)])
def test_flashinfer_attention_matches_torch_on_a_mixed_step(heads: int, kv_heads: int, hd: int) -> None:
    torch.manual_seed(0)
    ps, dev = 16, "cuda"

    def pool() -> PagedKVPool:
        return PagedKVPool(num_layers=1, num_pages=64, page_size=ps, kv_heads=kv_heads,
                           head_dim=hd, dtype=torch.bfloat16, device=dev)

    p_fi, p_t = pool(), pool()
    p_fi.data.normal_()  # cached prefixes and old decode context: the same random K/V in both
    p_t.data.copy_(p_fi.data)
    # 3 decodes (one on a page boundary), a fresh prompt, a chunk over a 2-page cached prefix
    b = AttentionBatch(q_lens=[1, 1, 1, 37, 20], kv_lens=[17, 33, 100, 37, 52],
                       page_tables=[[0, 1], [2, 3, 4], list(range(5, 12)), [12, 13, 14],
                                    [15, 16, 17, 18]], num_decode=3)
    t = sum(b.q_lens)
    q = torch.randn(t, heads, hd, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn(t, kv_heads, hd, device=dev, dtype=torch.bfloat16)
    fi = make_backend("flashinfer", p_fi, num_heads=heads, scale=hd**-0.5)
    tb = make_backend("torch", p_t, num_heads=heads, scale=hd**-0.5)
    out_fi = fi.forward(0, q, k, v, fi.plan(b))
    out_t = tb.forward(0, q, k, v, tb.plan(b))
    torch.testing.assert_close(p_fi.data, p_t.data)  # the same slots written
    torch.testing.assert_close(out_fi.float(), out_t.float(), atol=2e-2, rtol=2e-2)
