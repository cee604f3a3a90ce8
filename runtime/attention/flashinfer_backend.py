"""The `flashinfer` backend (CUDA): FlashInfer's paged prefill and decode kernels over the pool.

The pool's per-layer K and V tensors are `[pages, page_size, kv_heads, head_dim]`, FlashInfer's
NHD layout, so the kernels read the runtime's pages in place: no gather, no padding. A step is
planned once (index arrays built on the host, copied to the GPU once) and the plan serves every
layer. New K/V go into their slots with `append_paged_kv_cache` before attention, so a prefill
chunk over a cached prefix simply lists the prefix pages first in its page table.

The index arrays are built by plain functions (`paged_index`, `append_index`, `qo_indptr`) so
they are tested on any machine; flashinfer itself is imported only when the backend is built.
Two wrapper sets ("slots") exist so the two nano-batches of an overlapped step (runtime/overlap.py)
can be planned side by side and run on two streams at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import AttentionBackend, AttentionBatch, register_backend
from runtime.errors import UnknownAttentionBackend
from runtime.kv_cache import PagedKVPool

WORKSPACE_BYTES = 128 << 20  # float workspace per slot (FlashInfer's recommended size)
NUM_SLOTS = 2  # wrapper sets: one per nano-batch of an overlapped step


@dataclass(frozen=True, slots=True)
class PagedIndex:
    """Some sequences' pages in FlashInfer's CSR form (CPU int32 tensors)."""

    indptr: torch.Tensor  # [S + 1]: sequence i's pages are indices[indptr[i] : indptr[i + 1]]
    indices: torch.Tensor  # [sum of pages]: page ids, each sequence's in context order
    last_page_len: torch.Tensor  # [S]: tokens in each sequence's last page, 1..page_size


def paged_index(kv_lens: Sequence[int], page_tables: Sequence[Sequence[int]],
                page_size: int) -> PagedIndex:
    """Only the pages that hold context are listed: a table may carry a page reserved ahead."""
    indptr, indices, last = [0], [], []  # type: list[int], list[int], list[int]
    for kv, table in zip(kv_lens, page_tables):
        n = -(-kv // page_size)  # pages holding kv tokens
        if kv < 1 or len(table) < n:
            raise ValueError(f"a sequence's pages must cover its context: {kv} tokens, {len(table)} pages of {page_size}")
        indices.extend(table[:n])
        indptr.append(indptr[-1] + n)
        last.append(kv - (n - 1) * page_size)
    i32 = torch.int32
    return PagedIndex(torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32),
                      torch.tensor(last, dtype=i32))


def qo_indptr(q_lens: Sequence[int]) -> torch.Tensor:
    """[S + 1] int32: sequence i's query tokens are rows qo[i] : qo[i + 1] of the flat batch."""
    out = [0]
    for q in q_lens:
        out.append(out[-1] + q)
    return torch.tensor(out, dtype=torch.int32)


def append_index(q_lens: Sequence[int], kv_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch_indices [T], positions [T]) int32: the sequence of every new token and its position
    in that sequence's context (kv_len - q_len .. kv_len - 1), as append_paged_kv_cache wants."""
    batch: list[int] = []
    pos: list[int] = []
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        assert 1 <= q <= kv
        batch.extend([i] * q)
        pos.extend(range(kv - q, kv))
    return torch.tensor(batch, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class HostPlan:
    """Everything a step's plan needs, built on the host (see `host_plan`)."""

    append: PagedIndex  # all sequences: where append_paged_kv_cache writes
    batch_indices: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    decode: PagedIndex | None  # the leading num_decode sequences (q_len == 1)
    prefill: PagedIndex | None  # the rest
    prefill_qo: torch.Tensor | None  # [P + 1] int32 query offsets of the prefill part
    num_decode: int
    num_tokens: int


def host_plan(batch: AttentionBatch, page_size: int) -> HostPlan:
    nd = batch.num_decode
    assert all(q == 1 for q in batch.q_lens[:nd]), "decodes come first"
    q, kv, tables = batch.q_lens, batch.kv_lens, batch.page_tables
    bi, pos = append_index(q, kv)
    has_prefill = nd < len(q)
    return HostPlan(
        append=paged_index(kv, tables, page_size),
        batch_indices=bi,
        positions=pos,
        decode=paged_index(kv[:nd], tables[:nd], page_size) if nd else None,
        prefill=paged_index(kv[nd:], tables[nd:], page_size) if has_prefill else None,
        prefill_qo=qo_indptr(q[nd:]) if has_prefill else None,
        num_decode=nd,
        num_tokens=sum(q),
    )


@dataclass(frozen=True, slots=True)
class FlashInferPlan:
    num_decode: int
    num_tokens: int
    # device copies of the append index: (batch_indices, positions, indices, indptr, last_page_len)
    append: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    decode: Any  # planned BatchDecodeWithPagedKVCacheWrapper, or None
    prefill: Any  # planned BatchPrefillWithPagedKVCacheWrapper, or None
    kv_read: int  # KV tokens the decodes read


class _Slot:
    """One prefill and one decode wrapper sharing a workspace (they run one after the other)."""

    def __init__(self, fi: Any, device: torch.device, *, tensor_cores: bool) -> None:
        # zeroed: FlashInfer's decode wrapper documents its float workspace as "must be
        # initialized to 0 for its first use" (split-KV scratch; zeroed once, at start)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=tensor_cores)


@register_backend("flashinfer")
class FlashInferAttention(AttentionBackend):
    def __init__(self, pool: PagedKVPool, *, num_heads: int, scale: float) -> None:
        super().__init__(pool, num_heads=num_heads, scale=scale)
        dev, dtype = pool.data.device, pool.data.dtype
        if dev.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            raise UnknownAttentionBackend(
                f"the flashinfer backend needs a CUDA device and fp16/bf16 KV, not {dev} {dtype}")
        try:
            import flashinfer
        except ImportError as e:
            raise UnknownAttentionBackend(
                "the flashinfer backend needs flashinfer-python (pip install '.[cuda]')") from e
        self.fi = flashinfer
        # grouped-query decode is faster on the tensor-core (prefill) kernel from 4 heads per group
        tc = num_heads // pool.kv_heads >= 4
        self.slots = [_Slot(flashinfer, dev, tensor_cores=tc) for _ in range(NUM_SLOTS)]

    def plan(self, batch: AttentionBatch, slot: int = 0) -> FlashInferPlan:
        """`slot` picks the wrapper set: plans alive at the same time need different slots."""
        pool, s = self.pool, self.slots[slot]
        hp = host_plan(batch, pool.page_size)
        dev, dtype = pool.data.device, pool.data.dtype
        heads = {"num_qo_heads": self.num_heads, "num_kv_heads": pool.kv_heads}
        decode = prefill = None
        if hp.decode is not None:
            d = hp.decode
            s.decode.plan(d.indptr, d.indices, d.last_page_len, head_dim=pool.head_dim,
                          page_size=pool.page_size, sm_scale=self.scale, q_data_type=dtype,
                          kv_data_type=dtype, **heads)
            decode = s.decode
        if hp.prefill is not None:
            p = hp.prefill
            s.prefill.plan(hp.prefill_qo, p.indptr, p.indices, p.last_page_len,
                           head_dim_qk=pool.head_dim, page_size=pool.page_size, causal=True,
                           sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype, **heads)
            prefill = s.prefill
        a = hp.append
        append = tuple(t.to(dev, non_blocking=True) for t in
                       (hp.batch_indices, hp.positions, a.indices, a.indptr, a.last_page_len))
        return FlashInferPlan(hp.num_decode, hp.num_tokens, append, decode,  # type: ignore[arg-type]
                              prefill, sum(batch.kv_lens[: hp.num_decode]))

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashInferPlan
    ) -> torch.Tensor:
        cache = (self.pool.k[layer], self.pool.v[layer])  # each [pages, ps, kvh, hd] (NHD)
        bi, pos, indices, indptr, last = plan.append
        # 1. write this step's K/V into their slots (k, v: [T, kvh, hd])
        self.fi.append_paged_kv_cache(k.contiguous(), v.contiguous(), bi, pos, cache, indices,
                                      indptr, last, kv_layout="NHD")
        # 2. attend: decodes, then prefill chunks (causal, lower-right), into one output
        q = q.contiguous()  # [T, H, hd]
        out = torch.empty_like(q)
        nd = plan.num_decode
        if plan.decode is not None:
            plan.decode.run(q[:nd], cache, out=out[:nd])
        if plan.prefill is not None:
            plan.prefill.run(q[nd:], cache, out=out[nd:])
        return out.view(q.shape[0], -1)  # [T, H*hd]
