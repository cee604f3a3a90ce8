"""Data parallelism in the simulator: cut the batch into k shards, one simulated device each.

The cut is the planner's (scheduler.partition); each shard is then planned and simulated on its
own, like a worker on its own GPU. The batch ends with its slowest shard, and its optimum is the
single-device T_opt spread evenly over k devices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from scheduler.cost_model import CostModel
from scheduler.estimate import select_warmup_samples
from scheduler.partition import partition_requests
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.run import NULL_SIMULATION, RunConfig, run_trace, trace_totals
from scheduler.simulate.trace import TraceEntry


def cut_shards(entries: Sequence[TraceEntry], cost: CostModel, cfg: RunConfig, k: int,
               sampled: bool = False) -> list[list[TraceEntry]]:
    """The planner's cut (scheduler.partition), stratified by default.

    `sampled`: first a batch-wide warm-up sample (estimate.py's choice, ~sample_rate) reports
    its true lengths, as a worker pool's warm-up would, and the plan is cut by the dual scan.
    Sampled requests still run, inside whichever shard they land in.
    """
    requests = [e.request for e in entries]
    observed: dict[str, int] | None = None
    if sampled:
        tree = PrefixTree.build([r.prompt_token_ids for r in requests])
        known = np.array([r.known_output_len is not None for r in requests], dtype=bool)
        sample = select_warmup_samples(tree, known, rate=cfg.sample_rate, seed=cfg.seed)
        observed = {entries[int(i)].request.id: entries[int(i)].output_len for i in sample}
    parts = partition_requests(requests, k, cost_model=cost,
                               kv_capacity_tokens=cfg.kv_capacity_tokens,
                               sample_rate=cfg.sample_rate, seed=cfg.seed, output_lens=observed)
    return [[entries[int(i)] for i in part] for part in parts]


def run_sharded(entries: Sequence[TraceEntry], cost: CostModel, cfg: RunConfig, k: int,
                sampled_cut: bool = False) -> dict[str, Any]:
    """Batch-level report fields plus `shards`, one report per shard."""
    t0 = time.perf_counter()
    shards = cut_shards(entries, cost, cfg, k, sampled_cut)
    cut_seconds = time.perf_counter() - t0
    reports = [{"shard": j, "policy": cfg.policy, **run_trace(part, cost, cfg)[0]}
               for j, part in enumerate(shards) if part]
    for shard, report in zip(shards, reports):
        comp, mem = trace_totals(shard, cost)
        report["rho_true"] = comp / mem if mem > 0 else None  # ΣComp/ΣMem, true lengths
    out: dict[str, Any] = {"requests": len(entries), "dp": k,
                           "dp_cut": "sampled" if sampled_cut else "stratified",
                           "plan_seconds": cut_seconds + sum(r["plan_seconds"] for r in reports)}
    splits = [r["leaves_split"] for r in reports]
    if cfg.plan_only:
        out.update(NULL_SIMULATION)
    else:
        comp, mem = trace_totals(entries, cost)
        s_max = PrefixTree.build([e.request.prompt_token_ids for e in entries]).max_sharing_ratio()
        makespan = max(r["makespan_s"] for r in reports)
        longest = max(e.output_len for e in entries)
        s_min = max(float(longest), max(r["min_steps"] for r in reports))
        opt = cost.optimal_makespan(comp / k, mem / k, s_max, s_min)
        prompt = sum(r["prompt_tokens"] for r in reports)
        cached = sum(r["prefix_sharing_ratio"] * r["prompt_tokens"] for r in reports)
        tokens = prompt + sum(r["output_tokens"] for r in reports)
        out.update(makespan_s=makespan, optimal_makespan_s=opt,
                   fraction_of_optimal=opt / makespan if makespan > 0 else None,
                   prefix_sharing_ratio=cached / prompt if prompt else 0.0,
                   max_prefix_sharing_ratio=s_max,
                   throughput_tokens_per_s=tokens / makespan if makespan > 0 else None)
    out["leaves_split"] = None if any(s is None for s in splits) else sum(splits)
    out["shards"] = reports
    return out
