"""Nano-batch overlap: the split, the two-lane ordering (fake lanes), and the same outputs."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runtime import overlap
from runtime.attention import AttentionBatch
from runtime.overlap import NanoInputs, run_overlapped, split_batch
from tests.runtime.test_engine import greedy, make_engine, prompts, run, tiny_model


class FakeLane:
    """Runs work at once and logs (what, lane, detail) for every launch, record and wait."""

    def __init__(self, name: str, log: list[tuple[str, str, str]]) -> None:
        self.name, self.log, self.events = name, log, 0

    def launch(self, name: str, fn: Callable[[], None]) -> None:
        self.log.append(("launch", self.name, name))
        fn()

    def record(self) -> str:
        self.events += 1
        event = f"{self.name}{self.events}"
        self.log.append(("record", self.name, event))
        return event

    def wait(self, event: str) -> None:
        self.log.append(("wait", self.name, event))


def lanes(log: list[tuple[str, str, str]]) -> tuple[list[FakeLane], FakeLane]:
    return [FakeLane("A", log), FakeLane("B", log)], FakeLane("main", log)


def batch(q: list[int], kv: list[int], tables: list[list[int]]) -> AttentionBatch:
    return AttentionBatch(q_lens=q, kv_lens=kv, page_tables=tables,
                          num_decode=sum(1 for x in q if x == 1))


def test_a_small_step_is_not_split() -> None:
    assert split_batch(batch([1, 1], [5, 9], [[0, 1], [2, 3, 4]]), 4) is None
    assert split_batch(batch([100], [100], [list(range(25))]), 4) is None  # one sequence


def test_decodes_balance_a_prefill_chunk_by_tokens_and_kv_reads() -> None:
    # a 96-token chunk against 64 decodes of 400-token contexts: each decode weighs 1 + 400 * 0.1
    q = [1] * 64 + [96]
    kv = [400] * 64 + [96]
    tables = [[1000 + 100 * i + p for p in range(100)] for i in range(64)] + [list(range(24))]
    split = split_batch(batch(q, kv, tables), 4, kv_token_cost=0.1, min_tokens=1)
    assert split is not None
    a, b = split.parts
    assert 64 in a and all(i < 64 for i in b)  # the chunk sits with some of the decodes
    work = [sum(q[i] + (kv[i] * 0.1 if i < 64 else 0) for i in part) for part in (a, b)]
    assert abs(work[0] - work[1]) <= 41 + 1e-9  # within one decode's weight
    assert list(a) == sorted(a) and list(b) == sorted(b)  # decodes stay first in each half


def test_a_prompt_reading_pages_another_writes_this_step_stays_in_its_half() -> None:
    # seq 0 prefills pages 1, 2 now; seq 1 starts over them (its tree prefix) in the same step;
    # seq 2 and 3 are unrelated chunks
    b = batch([8, 40, 40, 40], [8, 48, 40, 40],
              [[1, 2], [1, 2] + list(range(10, 20)), list(range(20, 30)), list(range(30, 40))])
    split = split_batch(b, 4, min_tokens=1)
    assert split is not None
    assert any({0, 1} <= set(p) for p in split.parts)


class PhaseModel:
    """Two layers of no-op phases: only the order of launches matters here."""

    def __init__(self) -> None:
        self.layers = [None, None]
        self.embed = torch.zeros(4, 2)
        self.device = torch.device("cpu")

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pos, pos

    def layer_pre(self, i: int, x: torch.Tensor, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
        return x, x, x

    def layer_post(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return x

    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x[rows]


def test_compute_phases_take_turns_and_attention_runs_under_the_other_lanes_gemms() -> None:
    log: list[tuple[str, str, str]] = []
    (a, b), main = lanes(log)
    attn = SimpleNamespace(forward=lambda i, q, k, v, plan: q)
    halves = [NanoInputs(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([1]), None)
              for _ in range(2)]
    out = run_overlapped(PhaseModel(), attn, halves, [a, b], main)  # type: ignore[arg-type]
    assert [t.shape for t in out] == [torch.Size([1, 2])] * 2
    launches = [(lane, what) for kind, lane, what in log if kind == "launch"]
    compute = [(lane, w) for lane, w in launches if not w.startswith(("attn", "embed"))]
    assert [lane for lane, _ in compute] == ["A", "B"] * 5  # pre0 pre0 post0 post0 ... logits
    assert [w for _, w in compute[:4]] == ["pre0", "pre0", "post0", "post0"]
    # every compute launch but the first waits for the other lane's latest compute event
    last_event: dict[str, str] = {}
    for n, (kind, lane, what) in enumerate(log):
        if kind == "launch" and not what.startswith(("attn", "embed")):
            other = "B" if lane == "A" else "A"
            if other in last_event:
                assert log[n - 1] == ("wait", lane, last_event[other]), (n, log[n - 1])
            assert log[n + 1][0] == "record"
            last_event[lane] = log[n + 1][2]
        if kind == "launch" and what.startswith("attn"):
            assert log[n - 1][0] != "wait"  # attention follows its own lane only
    # A's attention is launched before B's first GEMM, so it can run under it
    assert launches.index(("A", "attn0")) < launches.index(("B", "pre0"))
    # the lanes start after the main stream's inputs; main waits for both at the end
    assert log[0][:2] == ("record", "main") and log[1] == ("wait", "A", log[0][2])
    assert [e[1] for e in log[-4:]] == ["A", "main", "B", "main"]


def test_the_engine_gives_the_same_greedy_outputs_with_overlap_on_fake_lanes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap, "MIN_TOKENS", 2)
    model = tiny_model()
    ps = prompts(12, prefix=9, lo=3, hi=30, seed=3)  # a shared prefix: dependent chunks
    reqs = greedy(ps, max_tokens=10)
    plain = run(make_engine(model, max_batch_tokens=96), reqs)
    eng = make_engine(model, max_batch_tokens=96)
    log: list[tuple[str, str, str]] = []
    two, main = lanes(log)
    eng._overlap = SimpleNamespace(lanes=two, main=main)  # type: ignore[assignment]
    split = run(eng, reqs)
    assert any(what == "attn0" and lane == "B" for kind, lane, what in log if kind == "launch")
    assert {k: o.choices[0].token_ids for k, o in split.items()} == \
        {k: o.choices[0].token_ids for k, o in plain.items()}
    assert eng.pool.num_free + eng.cache.evictable_pages == eng.pool.num_pages


# ---- on CUDA ---------------------------------------------------------------------------------

HAS_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs CUDA and flashinfer-python (the `cuda` extra)")
def test_flashinfer_engine_agrees_with_torch_and_with_itself_overlapped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.engine import Engine, EngineConfig
    from tests.runtime.test_engine import tiny_hf

    # head_dim 64 (FlashInfer's smallest); a wide init makes greedy choices far from ties
    hf = tiny_hf(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.2)
    model = tiny_model(hf)
    reqs = greedy(prompts(24, prefix=40, lo=5, hi=120, seed=5), max_tokens=24)
    outs = {}
    for name, backend, ov in (("torch", "torch", False), ("fi", "flashinfer", False),
                              ("fi+overlap", "flashinfer", True)):
        eng = Engine(model, EngineConfig(max_batch_tokens=256, kv_memory_bytes=64 << 20,
                                         page_size=16, device="cuda", dtype="bfloat16",
                                         attention_backend=backend, overlap=ov))
        monkeypatch.setattr(overlap, "MIN_TOKENS", 2)
        outs[name] = {k: o.choices[0].token_ids for k, o in run(eng, reqs).items()}
    # bf16 kernels round differently and a random model has near-ties (about 1 token in 100
    # has a top-2 gap under 0.01), so a request may part ways; most must not
    for other in ("fi", "fi+overlap"):
        same = sum(outs[other][k] == outs["torch"][k] for k in outs["torch"])
        assert same >= 0.75 * len(reqs), f"{other}: {same}/{len(reqs)} requests token-identical"
