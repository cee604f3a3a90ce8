"""The `torch` backend: the CPU kernel reads the paged pool in place, else pages are gathered
for the CPU/CUDA flash SDPA kernel.

On a CPU with a C compiler, decode attention runs in `paged_decode.c` (see cpu_kernel.py): each
sequence's pages are read where they lie, with no gathered copy and no padding. Prefill chunks
run there too (`paged_prefill`: causal, a chunk's tiles of keys skipped past each query's
position, 2-3× the masked SDPA below, which computes the masked half too). Without it (no
compiler, CUDA without flashinfer) attention takes the gather + SDPA path below.

Decodes (one query each) and prefill chunks are padded apart so a 512-token chunk does not pad
every decode row to 512 queries; prefill chunks are padded in buckets of similar size, so a
1,500-token prompt in the same step as a 40-token one does not make it a 1,500 × 1,500 one. Grouped-query attention folds the query heads that share a
KV head into the query-length axis, so K/V are never repeated per head.

Decode attention is memory-bound: each step reads every running sequence's whole context. On
the gather path, when several decodes start with the same cached pages (a shared system prompt),
that prefix is gathered and attended once for the whole group (cascade attention): the group's
queries are stacked against the shared pages, each sequence attends to its own remaining pages,
and the two partial softmaxes are merged through their log-sum-exps. The kernel does not cascade:
it copies nothing, and a prefix that every row of its group reads is served from the CPU's
caches after the first (a layer's 200-token prefix of SmolLM2 is 300 KB): on a 2-core EPYC,
plain decodes took 0.95-1.02x cascade's time (0.77x with groups of 4), while the gather path
runs cascade ~2x faster than gathering the prefix once per row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.attention import cpu_kernel
from runtime.attention.base import AttentionBackend, AttentionBatch, register_backend
from runtime.kv_cache import PagedKVPool

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


PAD_WASTE = 1.5  # a prefill bucket computes at most this many times its chunks' own q·k


def prefill_buckets(q_lens: Sequence[int], kv_lens: Sequence[int]) -> list[list[int]]:
    """Chunks grouped so that padding each group to its longest chunk and longest context costs
    at most PAD_WASTE × the group's own q·k (greedy, largest first); indices into the lists."""
    order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] * kv_lens[i], reverse=True)
    buckets: list[list[int]] = []
    own = max_q = max_k = 0
    for i in order:
        q, k = q_lens[i], kv_lens[i]
        if buckets:
            n = len(buckets[-1]) + 1
            if n * max(max_q, q) * max(max_k, k) <= PAD_WASTE * (own + q * k):
                buckets[-1].append(i)
                own, max_q, max_k = own + q * k, max(max_q, q), max(max_k, k)
                continue
        buckets.append([i])
        own, max_q, max_k = q * k, q, k
    return [sorted(b) for b in buckets]


def _page_table(tables: Sequence[Sequence[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[S, max_pages]: each sequence's pages, padded with page 0."""
    max_pages = max(len(p) for p in tables)
    return torch.tensor([list(p) + [0] * (max_pages - len(p)) for p in tables], dtype=dtype)


def _paged_prefill(q_lens: Sequence[int], kv_lens: Sequence[int],
                   tables: Sequence[Sequence[int]]) -> _PagedPrefill:
    table = _page_table(tables, torch.int32)
    q_start = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    q_start[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return _PagedPrefill(table, q_start, torch.tensor(kv_lens, dtype=torch.int32))


@dataclass(frozen=True, slots=True)
class _Dense:
    """S sequences, each attending to its own pages; queries padded to max_q."""

    num_seqs: int
    max_q: int
    page_table: torch.Tensor  # [S * max_pages] long, padded with page 0
    max_pages: int
    mask: torch.Tensor  # [S, 1, max_q * g (1 for decodes), max_pages * ps] additive 0 / -inf
    pad_idx: torch.Tensor | None  # [tokens]: flat token -> row of [S * max_q]; None: no padding


@dataclass(frozen=True, slots=True)
class _Paged:
    """Decode-like sequences (all query rows after all keys) that the CPU kernel reads in place."""

    table: torch.Tensor  # [S, max_pages] int32
    lens: torch.Tensor  # [S] int32 context lengths

    @property
    def num_seqs(self) -> int:
        return len(self.lens)


@dataclass(frozen=True, slots=True)
class _PagedPrefill:
    """Prefill chunks the CPU kernel attends in place, causal, one after another in q."""

    table: torch.Tensor  # [S, max_pages] int32
    q_start: torch.Tensor  # [S + 1] int32: chunk s is q rows q_start[s] .. q_start[s + 1] - 1
    kv_lens: torch.Tensor  # [S] int32: context length with the chunk


@dataclass(frozen=True, slots=True)
class _Shared:
    """Groups of decodes sharing leading pages: the prefix part of cascade attention."""

    dense: _Dense | _Paged  # one "sequence" per group: its shared pages, queries = members × g
    members: int  # queries stacked per group (largest group; smaller ones padded)
    q_idx: torch.Tensor  # [G * members] decode index feeding each stacked row
    seqs: torch.Tensor  # [M] decodes that have a shared prefix
    rows: torch.Tensor  # [M] their row in [G * members]


@dataclass(frozen=True, slots=True)
class TorchPlan:
    slots: torch.Tensor  # [T] long: pool slot (page * page_size + offset) of each new token
    num_decode: int
    # decodes over their own (non-shared) pages, in buckets of similar length so that short
    # contexts are not padded to the longest; index = decodes in the bucket (None: all, in order)
    decode: tuple[tuple[torch.Tensor | None, _Dense | _Paged], ...]
    shared: _Shared | None
    # prefill chunks: read in place by the CPU kernel, or in buckets of similar size for padded
    # SDPA; index = token rows of q[num_decode:] (None: all)
    prefill: _PagedPrefill | tuple[tuple[torch.Tensor | None, _Dense], ...]
    kv_read: int  # KV tokens the decodes read: own pages, plus each shared group's pages once
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # page_copies' (src, dst) slots


def _slots(batch: AttentionBatch, page_size: int) -> torch.Tensor:
    """Slot of every new token: positions kv_len - q_len .. kv_len - 1 of each sequence."""
    q_lens = torch.tensor(batch.q_lens, dtype=torch.long)  # [S]
    kv_lens = torch.tensor(batch.kv_lens, dtype=torch.long)  # [S]
    table = _page_table(batch.page_tables)
    seq_of_tok = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [S]
    pos = (kv_lens - q_lens)[seq_of_tok] + torch.arange(int(q_lens.sum())) - starts[seq_of_tok]
    return table[seq_of_tok, pos // page_size] * page_size + pos % page_size  # [T]


def _copy_slots(copies: Sequence[tuple[int, int, int, int]], page_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pool slots AttentionBatch.page_copies read from and write to."""
    if not copies:
        return None
    src = [s * page_size + i for s, _, lo, hi in copies for i in range(lo, hi)]
    dst = [d * page_size + i for _, d, lo, hi in copies for i in range(lo, hi)]
    return (torch.tensor(src, dtype=torch.long, device=device),
            torch.tensor(dst, dtype=torch.long, device=device))


@register_backend("torch")
class TorchAttention(AttentionBackend):
    copies_pages = True
    min_shared_pages = 2  # cascade only when a group shares at least this many pages
    decode_buckets = 4  # at most this many length buckets of decodes (>= 16 decodes each)

    def __init__(self, pool: PagedKVPool, *, num_heads: int, scale: float) -> None:
        super().__init__(pool, num_heads=num_heads, scale=scale)
        on_cpu = pool.data.device.type == "cpu" and pool.data.dtype in cpu_kernel.DTYPES
        self.decode_kernel = cpu_kernel.load() if on_cpu else None  # decodes read pages in place
        # and prefill chunks, causal (else gather + masked SDPA)
        self.prefill_kernel = self.decode_kernel is not None and cpu_kernel.prefill_supported(
            self.decode_kernel, pool.data.dtype, pool.head_dim)

    @property
    def cascades(self) -> bool:
        """The gather path on the CPU (see the module)."""
        return self.decode_kernel is None and self.pool.data.device.type == "cpu"

    def _decode_seqs(self, kv_lens: Sequence[int], tables: Sequence[Sequence[int]]) -> _Dense | _Paged:
        """Sequences whose query rows all follow their keys: for the kernel, or padded + masked."""
        if self.decode_kernel is None:
            return self._dense([1] * len(kv_lens), kv_lens, tables, 1)
        return _Paged(_page_table(tables, torch.int32), torch.tensor(kv_lens, dtype=torch.int32))

    def _dense(self, q_lens: Sequence[int], kv_lens: Sequence[int],
               tables: Sequence[Sequence[int]], q_rows: int) -> _Dense:
        """q_rows: query rows per query token (g for prefills; 1 when the caller stacks them)."""
        ps = self.pool.page_size
        ql = torch.tensor(q_lens, dtype=torch.long)  # [S]
        kl = torch.tensor(kv_lens, dtype=torch.long)  # [S]
        table = _page_table(tables)
        max_pages = table.shape[1]
        max_q = int(ql.max())
        key = torch.arange(max_pages * ps)  # [K]
        # Lower-right causal: query i of a chunk sits at position kv_len - q_len + i and sees keys
        # at positions <= its own. Padded query rows see more; their output is dropped.
        limit = (kl - ql)[:, None] + torch.arange(max_q)[None, :]  # [S, Q]
        allowed = key[None, None, :] <= limit[:, :, None]  # [S, Q, K]
        if q_rows > 1:
            allowed = allowed.repeat_interleave(q_rows, dim=1)  # [S, Q*g, K] (head-minor)
        mask = torch.zeros(allowed.shape, dtype=self.pool.data.dtype)
        mask = mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)  # [S, 1, Q*g, K]
        ntok, s = int(ql.sum()), len(q_lens)
        pad_idx = None
        if ntok != s * max_q:
            seq_of_tok = torch.repeat_interleave(torch.arange(s), ql)
            starts = torch.cumsum(ql, 0) - ql
            pad_idx = seq_of_tok * max_q + torch.arange(ntok) - starts[seq_of_tok]
        dev = self.pool.data.device
        return _Dense(s, max_q, table.view(-1).to(dev), max_pages, mask.to(dev),
                      None if pad_idx is None else pad_idx.to(dev))

    def _shared_prefixes(self, tables: Sequence[Sequence[int]], kv_lens: Sequence[int]) -> list[int]:
        """Pages each decode shares with the other decodes that start on the same page (else 0)."""
        ps = self.pool.page_size
        by_first: dict[int, list[int]] = {}
        for i, t in enumerate(tables):
            by_first.setdefault(t[0], []).append(i)
        shared = [0] * len(tables)
        for idxs in by_first.values():
            if len(idxs) < 2:
                continue
            n = len(os.path.commonprefix([list(tables[i]) for i in idxs]))
            n = min([n] + [(kv_lens[i] - 1) // ps for i in idxs])  # keep >= 1 own key
            if n >= self.min_shared_pages:
                for i in idxs:
                    shared[i] = n
        return shared

    def _plan_shared(self, tables: Sequence[Sequence[int]], shared: list[int]) -> _Shared:
        ps = self.pool.page_size
        groups: dict[tuple[int, int], list[int]] = {}
        for i, n in enumerate(shared):
            if n:
                groups.setdefault((tables[i][0], n), []).append(i)
        members = max(len(m) for m in groups.values())
        q_idx: list[int] = []
        seqs: list[int] = []
        rows: list[int] = []
        ptabs: list[Sequence[int]] = []
        plens: list[int] = []
        for gi, ((_, n), idxs) in enumerate(groups.items()):
            q_idx.extend(idxs + [idxs[0]] * (members - len(idxs)))
            seqs.extend(idxs)
            rows.extend(gi * members + j for j in range(len(idxs)))
            ptabs.append(tables[idxs[0]][:n])
            plens.append(n * ps)
        # each group is one "sequence" of members × g stacked query rows after all its keys
        dense = self._decode_seqs(plens, ptabs)
        dev = self.pool.data.device

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        return _Shared(dense, members, lt(q_idx), lt(seqs), lt(rows))

    def plan(self, batch: AttentionBatch, slot: int = 0) -> TorchPlan:
        g = self.num_heads // self.pool.kv_heads
        nd, ps = batch.num_decode, self.pool.page_size
        shared_plan = None
        decode: list[tuple[torch.Tensor | None, _Dense | _Paged]] = []
        if nd:
            tables, kv = batch.page_tables[:nd], batch.kv_lens[:nd]
            cascade = nd > 1 and self.cascades
            shared = self._shared_prefixes(tables, kv) if cascade else [0] * nd
            if any(shared):
                shared_plan = self._plan_shared(tables, shared)
            own_lens = [k - n * ps for k, n in zip(kv, shared)]
            own_tables = [t[n:] for t, n in zip(tables, shared)]
            # the kernel reads no padding; padded SDPA takes decodes in buckets of similar length
            nb = 1 if self.decode_kernel is not None else max(1, min(self.decode_buckets, nd // 16))
            order = sorted(range(nd), key=own_lens.__getitem__) if nb > 1 else list(range(nd))
            for b in range(nb):
                idx = order[b * nd // nb : (b + 1) * nd // nb]
                d = self._decode_seqs([own_lens[i] for i in idx], [own_tables[i] for i in idx])
                decode.append((torch.tensor(idx, device=self.pool.data.device) if nb > 1 else None, d))
        in_place: _PagedPrefill | None = None
        prefill: list[tuple[torch.Tensor | None, _Dense]] = []
        if nd < len(batch.q_lens) and self.prefill_kernel:
            in_place = _paged_prefill(batch.q_lens[nd:], batch.kv_lens[nd:], batch.page_tables[nd:])
        elif nd < len(batch.q_lens):
            pq, pk, pt = batch.q_lens[nd:], batch.kv_lens[nd:], batch.page_tables[nd:]
            buckets = prefill_buckets(pq, pk)
            starts = [0]
            for q in pq:
                starts.append(starts[-1] + q)
            for members in buckets:
                rows = None if len(buckets) == 1 else torch.cat(
                    [torch.arange(starts[i], starts[i] + pq[i]) for i in members]
                ).to(self.pool.data.device)
                prefill.append((rows, self._dense([pq[i] for i in members], [pk[i] for i in members],
                                                  [pt[i] for i in members], g)))
        slots = _slots(batch, ps).to(self.pool.data.device)
        kv_read = sum(batch.kv_lens[:nd])
        if shared_plan is not None:
            groups = {(batch.page_tables[i][0], n) for i, n in enumerate(shared) if n}
            kv_read -= sum(n for n in shared) * ps - sum(n for _, n in groups) * ps
        return TorchPlan(slots, nd, tuple(decode), shared_plan, in_place or tuple(prefill), kv_read,
                         _copy_slots(batch.page_copies, ps, slots.device))

    def _attend(self, q: torch.Tensor, d: _Dense | _Paged, k_flat: torch.Tensor,
                v_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [S, kvh, rows, hd] -> (out [S, kvh, rows, hd], logsumexp [S, kvh, rows] fp32)."""
        pool = self.pool
        if isinstance(d, _Paged):
            assert self.decode_kernel is not None  # _Paged is planned only with the kernel loaded
            return cpu_kernel.paged_decode(self.decode_kernel, q, k_flat, v_flat, pool.page_size,
                                           d.table, d.lens, self.scale)
        # gather each sequence's pages: [S*pages, ps*kvh*hd] -> [S, kvh, K, hd] (a strided view)
        shape = (d.num_seqs, d.max_pages * pool.page_size, pool.kv_heads, pool.head_dim)
        kg = k_flat.index_select(0, d.page_table).view(shape).transpose(1, 2)
        vg = v_flat.index_select(0, d.page_table).view(shape).transpose(1, 2)
        if kg.device.type != "cpu":  # CUDA fallback: no log-sum-exp, so no cascade (see plan)
            return F.scaled_dot_product_attention(q, kg, vg, attn_mask=d.mask, scale=self.scale), None
        return _flash(q, kg, vg, 0.0, False, attn_mask=d.mask, scale=self.scale)

    def _attend_decodes(self, qd: torch.Tensor,
                        buckets: tuple[tuple[torch.Tensor | None, _Dense | _Paged], ...],
                        k_flat: torch.Tensor, v_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qd: [S, kvh, g, hd] -> (out [S, kvh, g, hd], logsumexp [S, kvh, g])."""
        if len(buckets) == 1 and buckets[0][0] is None:
            return self._attend(qd, buckets[0][1], k_flat, v_flat)
        o = torch.empty_like(qd)
        lse: torch.Tensor | None = torch.empty(qd.shape[:3], dtype=torch.float32, device=qd.device)
        for idx, d in buckets:
            assert idx is not None
            ob, lb = self._attend(qd.index_select(0, idx), d, k_flat, v_flat)
            o.index_copy_(0, idx, ob)
            if lse is not None and lb is not None:
                lse.index_copy_(0, idx, lb.float())
            else:
                lse = None
        return o, lse

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TorchPlan
    ) -> torch.Tensor:
        pool = self.pool
        kvh, hd = pool.kv_heads, pool.head_dim
        g = self.num_heads // kvh
        k_cache, v_cache = pool.k[layer], pool.v[layer]  # [pages, ps, kvh, hd]
        # 1. write this step's K/V into their slots
        k_cache.view(-1, kvh, hd).index_copy_(0, plan.slots, k)
        v_cache.view(-1, kvh, hd).index_copy_(0, plan.slots, v)
        if plan.copies is not None:  # shared partial pages, once this step's K/V are in
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, kvh, hd)
                flat.index_copy_(0, plan.copies[1], flat.index_select(0, plan.copies[0]))
        k_flat = k_cache.view(pool.num_pages, -1)  # [pages, ps*kvh*hd]
        v_flat = v_cache.view(pool.num_pages, -1)
        outs = []
        nd = plan.num_decode
        if plan.decode:
            # 2. decodes: own pages by length bucket, then merge in the shared prefixes
            qd = q[:nd].view(nd, kvh, g, hd)  # [S, kvh, g, hd]
            o, lse = self._attend_decodes(qd, plan.decode, k_flat, v_flat)
            if plan.shared is not None and lse is not None:
                o = self._merge_shared(qd, o, lse, plan.shared, k_flat, v_flat)
            outs.append(o.reshape(nd, -1))
        if isinstance(plan.prefill, _PagedPrefill):
            # 3. prefill chunks, read in place by the CPU kernel (causal, no padding, no gather)
            pp = plan.prefill
            assert self.decode_kernel is not None  # planned only with the kernel loaded
            outs.append(cpu_kernel.paged_prefill(self.decode_kernel, q[nd:], k_cache, v_cache,
                                                 pool.page_size, pp.table, pp.q_start, pp.kv_lens,
                                                 self.scale, kvh))
        elif plan.prefill:
            # 3. prefill chunks: by bucket, padded to the bucket's longest, lower-right causal mask
            qp = q[nd:]  # [Tp, H, hd]
            rows, d = plan.prefill[0]
            if rows is None:
                outs.append(self._attend_prefill(qp, d, k_flat, v_flat))
            else:
                o = qp.new_empty((qp.shape[0], self.num_heads * hd))
                for rows, d in plan.prefill:
                    assert rows is not None
                    o.index_copy_(0, rows, self._attend_prefill(qp.index_select(0, rows), d,
                                                                k_flat, v_flat))
                outs.append(o)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [T, H*hd]

    def _attend_prefill(self, qp: torch.Tensor, d: _Dense, k_flat: torch.Tensor,
                        v_flat: torch.Tensor) -> torch.Tensor:
        """qp: [tokens, H, hd] of d's chunks, in order -> [tokens, H*hd]."""
        kvh, hd = self.pool.kv_heads, self.pool.head_dim
        g = self.num_heads // kvh
        s, mq = d.num_seqs, d.max_q
        if d.pad_idx is not None:
            padded = qp.new_zeros((s * mq, self.num_heads, hd))
            padded.index_copy_(0, d.pad_idx, qp)
            qp = padded  # [S*Q, H, hd]
        # [S, Q, kvh, g, hd] -> [S, kvh, Q*g, hd]
        qp = qp.view(s, mq, kvh, g, hd).permute(0, 2, 1, 3, 4).reshape(s, kvh, mq * g, hd)
        o, _ = self._attend(qp, d, k_flat, v_flat)
        # [S, kvh, Q*g, hd] -> [S*Q, H*hd]
        o = o.view(s, kvh, mq, g, hd).permute(0, 2, 1, 3, 4).reshape(s * mq, -1)
        return o if d.pad_idx is None else o.index_select(0, d.pad_idx)

    def _merge_shared(self, qd: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, sh: _Shared,
                      k_flat: torch.Tensor, v_flat: torch.Tensor) -> torch.Tensor:
        """Combine each decode's own-pages attention with its group's shared-prefix attention."""
        kvh, hd = self.pool.kv_heads, self.pool.head_dim
        g, gn, m = self.num_heads // kvh, sh.dense.num_seqs, sh.members
        # stack the members' queries: [G*m, kvh, g, hd] -> [G, kvh, m*g, hd]
        qs = qd.index_select(0, sh.q_idx).view(gn, m, kvh, g, hd).permute(0, 2, 1, 3, 4)
        po, plse = self._attend(qs.reshape(gn, kvh, m * g, hd), sh.dense, k_flat, v_flat)
        assert plse is not None, "cascade is planned only where the kernel returns log-sum-exp"
        po = po.view(gn, kvh, m, g, hd).permute(0, 2, 1, 3, 4).reshape(gn * m, kvh, g, hd)
        plse = plse.view(gn, kvh, m, g).permute(0, 2, 1, 3).reshape(gn * m, kvh, g)
        a, la = po.index_select(0, sh.rows).float(), plse.index_select(0, sh.rows).float()
        b, lb = o.index_select(0, sh.seqs).float(), lse.index_select(0, sh.seqs).float()
        mx = torch.maximum(la, lb)  # [M, kvh, g]
        wa, wb = (la - mx).exp().unsqueeze(-1), (lb - mx).exp().unsqueeze(-1)
        merged = (a * wa + b * wb) / (wa + wb)  # [M, kvh, g, hd]
        return o.contiguous().index_copy_(0, sh.seqs, merged.to(o.dtype))
