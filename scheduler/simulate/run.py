"""One planned and simulated run of a trace, reported as the CLI's JSON fields.

The only clock reads on the planner's path are here, around policy code: `plan_seconds` is
make_policy plus the policy's own time until it reports `planned` (a sampling planner builds its
plan when the warm-up lengths come in, inside a call made during the run); `policy_seconds` is
all time spent inside the policy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.cost_model import CostModel, min_steps
from scheduler.policies import make_policy
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.executor import DEFAULT_MAX_STEP_TOKENS, SimConfig, SimResult, simulate
from scheduler.simulate.trace import TraceEntry
from scheduler.types import AdmissionPolicy, PlanRequest, StepBudget, ahead_of_queue

NULL_SIMULATION = dict.fromkeys(("makespan_s", "optimal_makespan_s", "fraction_of_optimal",
                                 "device_floor_s", "fraction_of_device_floor",
                                 "prefix_sharing_ratio", "max_prefix_sharing_ratio",
                                 "throughput_tokens_per_s"))


@dataclass(frozen=True, slots=True)
class RunConfig:
    policy: str  # fcfs | dfs | balance | blend
    kv_capacity_tokens: int
    sample_rate: float = 0.01
    seed: int = 0
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS  # decode + prefill tokens a step holds
    plan_only: bool = False
    sampled_share: float = 0.0  # SimConfig.sampled_share


class TimedPolicy:
    """Forwards AdmissionPolicy calls, adding up the seconds spent inside the policy."""

    def __init__(self, inner: AdmissionPolicy) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.until_planned: float | None = None  # policy seconds when `planned` first held

    def _timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            if self.until_planned is None and getattr(self.inner, "planned", True):
                self.until_planned = self.seconds

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        return self._timed(self.inner.admit, budget)

    def ahead_of_queue(self) -> int:
        return ahead_of_queue(self.inner)

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return self._timed(self.inner.prefill_budget, budget)

    def on_finish(self, request_id: str, output_len: int) -> None:
        self._timed(self.inner.on_finish, request_id, output_len)

    def on_progress(self, request_id: str, generated: int) -> None:
        self._timed(self.inner.on_progress, request_id, generated)

    def has_pending(self) -> bool:
        return self._timed(self.inner.has_pending)

    def withdraw(self) -> list[PlanRequest]:
        return self._timed(self.inner.withdraw)


def trace_lengths(entries: Sequence[TraceEntry]) -> tuple[np.ndarray, np.ndarray]:
    """([entries] prompt lengths, [entries] true output lengths), as floats."""
    p = np.fromiter((e.request.prompt_len for e in entries), np.float64, len(entries))
    d = np.fromiter((e.output_len for e in entries), np.float64, len(entries))
    return p, d


def trace_totals(entries: Sequence[TraceEntry], cost: CostModel) -> tuple[float, float]:
    """(ΣComp, ΣMem) in seconds with the true output lengths."""
    p, d = trace_lengths(entries)
    return float(np.sum(cost.comp(p, d))), float(np.sum(cost.mem(p, d)))


def device_floor(entries: Sequence[TraceEntry], cost: CostModel, tree: PrefixTree,
                  s_min: float, kv_capacity_tokens: int) -> float:
    """CostModel.device_floor with what no order avoids. Compute: every distinct prompt token
    once, every decode, a sampled row per output token, and each prompt's causal pairs past
    the prefix it shares with another request. KV reads: decode k = 1 … d − 1 reads p + k tokens
    (the prefill step samples the first), those of the shared prefix at the shared rate.
    Steps: S_min, and (without cascade) the steps the KV capacity forces: a decode's tokens past
    its shared prefix sit in slots of its own, and one step reads at most the capacity of them."""
    p, d = trace_lengths(entries)
    shared = tree.depth[tree.parent[tree.leaf_node]].astype(np.float64)  # prefix another holds
    decodes = np.maximum(d - 1.0, 0.0)
    compute = cost.step_compute_time(tree.unique_tokens + decodes.sum(), d.sum(),
                                     float(np.sum(p * p - shared * shared)) / 2.0)
    generated = decodes * (decodes + 1.0) / 2.0  # reads of the decode's own new tokens
    reads = p * decodes + generated
    own_reads = (p - shared) * decodes + generated
    kv_steps = 0.0 if cost.hardware.cascade else float(own_reads.sum()) / max(kv_capacity_tokens, 1)
    # a read of the shared prefix may be one another decode makes too (at most what that costs)
    kv_s = (float(own_reads.sum()) * cost.seconds_per_kv_token + float((reads - own_reads).sum())
            * min(cost.seconds_per_kv_token, cost.seconds_per_shared_kv_token))
    return cost.device_floor(compute, kv_s, max(s_min, kv_steps))


def leaves_split(policy: AdmissionPolicy) -> int | None:
    """Leaves node splitting moved (blend); None for policies that do not split."""
    for attr in ("leaves_split", "leaves_moved"):
        value = getattr(policy, attr, None)
        if value is not None:
            return int(value)
    return None


def finish_planning(policy: AdmissionPolicy, entries: Sequence[TraceEntry], kv_tokens: int) -> None:
    """Plan without simulating: the warm-up sample "finishes" at once with its true lengths.

    A sampling planner admits its warm-up requests first and plans when their lengths are in;
    baselines have planned in make_policy already and report `planned` by not having the flag.
    """
    true_len = {e.request.id: e.output_len for e in entries}
    while getattr(policy, "planned", True) is False:
        warm = policy.admit(StepBudget(kv_tokens, kv_tokens, 0, 0))
        if not warm:
            break
        for req in warm:
            policy.on_finish(req.id, true_len[req.id])


def run_trace(entries: Sequence[TraceEntry], cost: CostModel, cfg: RunConfig,
              tree: PrefixTree | None = None) -> tuple[dict[str, Any], SimResult | None]:
    """Plan (timed) and simulate; returns the report fields and the run (None with plan_only)."""
    requests = [e.request for e in entries]
    t0 = time.perf_counter()
    policy = make_policy(cfg.policy, requests, kv_capacity_tokens=cfg.kv_capacity_tokens,
                         cost_model=cost, sample_rate=cfg.sample_rate, seed=cfg.seed,
                         step_tokens=cfg.max_step_tokens)
    if cfg.plan_only:
        finish_planning(policy, entries, cfg.kv_capacity_tokens)
    plan_seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"requests": len(entries)}
    if cfg.plan_only:
        out.update(plan_seconds=plan_seconds, **NULL_SIMULATION, leaves_split=leaves_split(policy))
        return out, None
    tree = tree or PrefixTree.build([r.prompt_token_ids for r in requests])
    comp, mem = trace_totals(entries, cost)
    s_max = tree.max_sharing_ratio()
    timed = TimedPolicy(policy)
    t1 = time.perf_counter()
    result = simulate(entries, timed, cost, SimConfig(cfg.kv_capacity_tokens, cfg.max_step_tokens,
                                                      sampled_share=cfg.sampled_share), tree)
    sim_seconds = time.perf_counter() - t1
    s_min = min_steps(max(e.output_len for e in entries),
                      tree.unique_tokens + result.output_tokens, cfg.max_step_tokens)
    opt = cost.optimal_makespan(comp, mem, s_max, s_min)
    floor = device_floor(entries, cost, tree, s_min, cfg.kv_capacity_tokens)
    c, m = result.step_compute_s, result.step_memory_s
    busy = float(result.step_time_s.sum())
    span = result.makespan_s
    out.update(
        makespan_s=span,
        optimal_makespan_s=opt,
        fraction_of_optimal=opt / span if span > 0 else None,
        device_floor_s=floor,
        fraction_of_device_floor=floor / span if span > 0 else None,
        prefix_sharing_ratio=result.prefix_sharing_ratio,
        max_prefix_sharing_ratio=s_max,
        throughput_tokens_per_s=(result.prompt_tokens + result.output_tokens) / span if span > 0 else None,
        plan_seconds=plan_seconds + (timed.until_planned or 0.0),
        leaves_split=leaves_split(policy),
        rho_root=cost.set_rho(comp, mem, s_max),
        # T_opt scales decode compute by (1 − s_max) too; this bound prefills each distinct
        # prompt token once and computes every output token: no order can beat it.
        compute_bound_s=(tree.unique_tokens + result.output_tokens) * cost.seconds_per_token,
        min_steps=s_min,
        step_fixed_s=cost.step_fixed_s,
        overlap=cost.overlap,
        steps=result.steps,
        preemptions=result.preemptions,
        prefill_aborts=result.prefill_aborts,
        prompt_tokens=result.prompt_tokens,
        output_tokens=result.output_tokens,
        prefill_tokens=result.prefill_tokens,
        peak_kv_tokens=result.peak_kv_tokens,
        compute_utilisation=float(c.sum()) / busy if busy else None,
        memory_utilisation=float(m.sum()) / busy if busy else None,
        policy_seconds=plan_seconds + timed.seconds,
        simulate_seconds=sim_seconds,
    )
    return out, result
