"""Nano-batch overlap: one step's batch as two halves on two streams (NanoFlow-style).

Each layer of each half is three phases: `pre` (norm + QKV GEMM + RoPE), `attn` (KV append +
attention, memory-bound for decodes) and `post` (O projection + MLP GEMMs). The compute phases of
the two halves take turns (A.pre, B.pre, A.post, B.post, ...): each waits for the other lane's
previous compute phase, while attention only follows its own lane. So A's attention runs under
B's GEMMs and B's under A's, and two GEMMs never fight for the tensor cores.

`split_batch` decides, `run_overlapped` applies. The orchestration is written against `Lane`
(a stream that launches work, records events and waits on them) so that tests drive it with a
fake lane that runs the work at once and records the order; `CudaLane` is the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.attention.base import AttentionBackend, AttentionBatch

# Below this many tokens a step runs whole. Each half's GEMMs read all the weights, so a split
# pays only while both halves stay compute-bound: rows above the device's FLOP-per-byte ridge
# (~200 in bf16 on an H100/H200). A decode-only step of 256 reads the weights once, not twice.
MIN_TOKENS = 512


@dataclass(frozen=True, slots=True)
class NanoSplit:
    """Two disjoint, non-empty lists of sequence indices (each ascending: decodes stay first)."""

    parts: tuple[tuple[int, ...], tuple[int, ...]]


def _dependent_groups(batch: AttentionBatch, page_size: int) -> list[list[int]]:
    """Sequences that must share a half: one reads a page another writes in this step (a prompt
    started this step over a prefix whose chunk is still being prefilled). Others stand alone."""
    parent = list(range(len(batch.q_lens)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writer: dict[int, int] = {}
    for i, (q, kv, table) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
        for p in range((kv - q) // page_size, -(-kv // page_size)):
            writer[table[p]] = i
    for i, (q, kv, table) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
        for page in table[: -(-(kv - q) // page_size)]:  # pages holding its cached context
            w = writer.get(page)
            if w is not None and w != i:
                parent[find(i)] = find(w)
    groups: dict[int, list[int]] = {}
    for i in range(len(parent)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def split_batch(batch: AttentionBatch, page_size: int, *, kv_token_cost: float = 0.01,
                min_tokens: int | None = None) -> NanoSplit | None:
    """Two halves of about equal work, or None when the step is too small to split.

    A sequence's work is its new tokens (GEMM rows) plus, for a decode, its context times
    `kv_token_cost` (one KV token read in units of one token's GEMMs: ~2·KV bytes per token per
    layer over bandwidth against 2·params FLOPs over compute; the cost model gives it). Groups
    that must stay together are placed as units, heaviest first, each on the lighter half.
    """
    least = MIN_TOKENS if min_tokens is None else min_tokens
    if len(batch.q_lens) < 2 or sum(batch.q_lens) < least:
        return None
    nd = batch.num_decode

    def work(i: int) -> float:
        q = batch.q_lens[i]
        return q + (batch.kv_lens[i] * kv_token_cost if i < nd else 0.0)

    units = sorted(_dependent_groups(batch, page_size),
                   key=lambda g: (-sum(work(i) for i in g), g[0]))
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0.0, 0.0]
    for g in units:
        h = 0 if load[0] <= load[1] else 1
        halves[h].extend(g)
        load[h] += sum(work(i) for i in g)
    if not halves[0] or not halves[1]:
        return None
    return NanoSplit((tuple(sorted(halves[0])), tuple(sorted(halves[1]))))


def sub_batch(batch: AttentionBatch, idx: Sequence[int]) -> AttentionBatch:
    return AttentionBatch(q_lens=[batch.q_lens[i] for i in idx],
                          kv_lens=[batch.kv_lens[i] for i in idx],
                          page_tables=[batch.page_tables[i] for i in idx],
                          num_decode=sum(1 for i in idx if i < batch.num_decode))


class Lane(Protocol):
    """A stream: work launched on it runs in order; events order it against other lanes."""

    def launch(self, name: str, fn: Callable[[], None]) -> None: ...

    def record(self) -> Any: ...  # an event: everything launched on this lane so far

    def wait(self, event: Any) -> None: ...  # later launches start after `event`


class CudaLane:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def launch(self, name: str, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)


@dataclass(slots=True)
class NanoInputs:
    """One half's flat inputs, already on the device, and its attention plan."""

    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    rows: torch.Tensor  # [R] long: rows to project to logits
    plan: Any
    x: torch.Tensor | None = None  # the residual stream as the phases advance
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: [T, 1, hd/2]
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    o: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def run_overlapped(model: Any, attn: AttentionBackend, halves: Sequence[NanoInputs],
                   lanes: Sequence[Lane], main: Lane) -> list[torch.Tensor]:
    """Run the model over each half on its own lane; returns each half's logits [R, V].

    Inputs are made on `main`, so the lanes first wait for it, and `main` waits for both lanes
    at the end. `model` is a LlamaModel (embed, rope, layer_pre, layer_post, logits).
    """
    start = main.record()
    for lane in lanes:
        lane.wait(start)
    last_compute: list[Any] = [None] * len(lanes)  # each lane's latest compute event

    def compute(k: int, name: str, fn: Callable[[], None]) -> None:
        other = last_compute[1 - k]
        if other is not None:
            lanes[k].wait(other)  # take turns on the tensor cores
        lanes[k].launch(name, fn)
        last_compute[k] = lanes[k].record()

    for k, h in enumerate(halves):
        def embed(h: NanoInputs = h) -> None:
            h.x, h.rope = model.embed[h.ids], model.rope(h.positions)

        lanes[k].launch("embed", embed)
    for i in range(len(model.layers)):
        for k, h in enumerate(halves):
            def pre(h: NanoInputs = h, i: int = i) -> None:
                assert h.rope is not None
                h.qkv = model.layer_pre(i, h.x, *h.rope)

            def att(h: NanoInputs = h, i: int = i) -> None:
                assert h.qkv is not None
                h.o = attn.forward(i, *h.qkv, h.plan)
                h.qkv = None

            compute(k, f"pre{i}", pre)
            lanes[k].launch(f"attn{i}", att)
        for k, h in enumerate(halves):
            def post(h: NanoInputs = h, i: int = i) -> None:
                h.x, h.o = model.layer_post(i, h.x, h.o), None

            compute(k, f"post{i}", post)
    for k, h in enumerate(halves):
        def head(h: NanoInputs = h) -> None:
            h.logits = model.logits(h.x, h.rows)

        compute(k, "logits", head)
    for lane in lanes:
        main.wait(lane.record())
    return [h.logits for h in halves]  # type: ignore[misc]


def forward_split(model: Any, batch: AttentionBatch, split: NanoSplit, ids: Sequence[int],
                  positions: Sequence[int], rows: Sequence[int],
                  plan: Callable[[AttentionBatch, int], Any], attn: AttentionBackend,
                  lanes: Sequence[Lane], main: Lane) -> torch.Tensor:
    """The whole step's logits [R, V] (rows in `rows` order) from its two halves.

    ids, positions: the flat batch [T]; rows: flat indices of the tokens to sample, ascending;
    plan(sub_batch, half) plans one half's attention (each half on its own plan slot).
    """
    starts = [0]
    for q in batch.q_lens:
        starts.append(starts[-1] + q)
    dev = model.device
    row_of = {t: r for r, t in enumerate(rows)}  # flat token -> its row in the output
    halves, where = [], []
    for k, idx in enumerate(split.parts):
        flat = [t for i in idx for t in range(starts[i], starts[i + 1])]
        mine = [j for j, t in enumerate(flat) if t in row_of]  # rows within this half
        where.append([row_of[flat[j]] for j in mine])

        def lt(x: Sequence[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        halves.append(NanoInputs(lt([ids[t] for t in flat]), lt([positions[t] for t in flat]),
                                 lt(mine), plan(sub_batch(batch, idx), k)))
    logits = run_overlapped(model, attn, halves, lanes, main)
    out = torch.empty((len(rows), logits[0].shape[1]), dtype=logits[0].dtype, device=dev)
    for part, w in zip(logits, where):
        if w:
            out[torch.tensor(w, device=dev)] = part
    return out


class StepOverlap:
    """The engine's two CUDA streams (its current stream is `main`)."""

    def __init__(self, device: torch.device) -> None:
        self.lanes = [CudaLane(torch.cuda.Stream(device)) for _ in range(2)]
        self.main = CudaLane(torch.cuda.current_stream(device))
