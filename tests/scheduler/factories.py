"""Small shared builders for scheduler tests: requests, trees, budgets, a toy cost model."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from scheduler.cost_model import CostModel, HardwareProfile, ModelShape
from scheduler.types import PlanRequest, StepBudget

_ids = itertools.count()


def make_request(
    p: int = 16,
    d: int | None = None,
    *,
    prefix: Sequence[int] = (),
    max_tokens: int = 4096,
    rid: str | None = None,
    seed: int | None = None,
) -> PlanRequest:
    """A request with `p` prompt tokens (starting with `prefix`); `d` sets a known output length."""
    n = next(_ids)
    base = 1_000_000 + 10_000 * (n if seed is None else seed)
    tail = [base + i for i in range(max(0, p - len(prefix)))]
    return PlanRequest(
        id=rid or f"r{n}",
        prompt_token_ids=list(prefix)[:p] + tail,
        max_tokens=max_tokens,
        known_output_len=d,
    )


def make_budget(
    capacity: int = 100_000, free: int | None = None, running: int = 0, waiting: int = 0
) -> StepBudget:
    return StepBudget(capacity, capacity if free is None else free, running, waiting)


def h200_8b() -> CostModel:
    return CostModel(ModelShape.named("llama-3-8b"), HardwareProfile.named("h200"))


def toy_cost(flops: float = 1e12, bandwidth: float = 1e12, multiple: int = 1) -> CostModel:
    """A tiny model on a made-up device, for hand-checkable arithmetic (P = 1e6, 1 KiB KV/token)."""
    shape = ModelShape(
        "toy",
        params=1_000_000,
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=64,
        dtype_bytes=2,
    )
    hw = HardwareProfile(
        "toy", flops=flops, bandwidth=bandwidth, kv_capacity_bytes=1 << 30, batch_multiple=multiple
    )
    return CostModel(shape, hw)
