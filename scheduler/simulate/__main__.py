"""`python -m scheduler.simulate TRACE.jsonl --policy blend --json`: plan, simulate, print one line.

Fields: policy, requests, makespan_s, optimal_makespan_s, fraction_of_optimal, device_floor_s
and fraction_of_device_floor (a tighter bound: the device's overlap, the KV capacity's steps),
prefix_sharing_ratio, max_prefix_sharing_ratio, throughput_tokens_per_s (prompt + output tokens
per second), plan_seconds, leaves_split, and run details (steps, preemptions, utilisation, …);
with --dp K the batch figures plus one entry per shard under `shards`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.cost_model import CostModel, HardwareProfile, ModelShape
from scheduler.errors import SchedulerError
from scheduler.policies import POLICY_NAMES
from scheduler.simulate.executor import DEFAULT_MAX_STEP_TOKENS, SimResult
from scheduler.simulate.run import RunConfig, run_trace
from scheduler.simulate.sharded import run_sharded
from scheduler.simulate.trace import read_trace

_PROFILES = ("h200", "h100", "a100")
DEFAULT_SHAPE = "llama-3-8b"


def cost_model(hardware: str, shape: str | None = None, *, free_weights: bool = False,
               overlap: float | None = None, step_overhead_s: float | None = None) -> CostModel:
    """A named datasheet profile, or the path of a profile JSON (`blendserve profile`'s, whose
    model shape is the profiled model's unless `shape` names another); idealisations opt-in;
    `step_overhead_s`: launch and host time per step (an engine's, measured), instead of the
    profile's."""
    hw = HardwareProfile.named(hardware) if hardware in _PROFILES else HardwareProfile.from_json(hardware)
    if step_overhead_s is not None:
        if step_overhead_s < 0 or hw.measured is not None:
            raise SchedulerError("a step overhead is at least 0 seconds, and for a datasheet "
                                 "profile (a measured one's fixed cost already holds it)")
        hw = replace(hw, step_overhead_s=step_overhead_s)
    if shape is None and hw.model_config is not None:
        model = ModelShape.from_hf_config(hw.model_config, name=hw.name.split(":")[-1])
    else:
        model = ModelShape.named(shape or DEFAULT_SHAPE)
    return CostModel(model, hw.idealised(overlap=overlap, free_steps=free_weights))


def write_steps_csv(result: SimResult, path: Path) -> None:
    """One row per step, for looking at what a policy did when (pacing, memory, queue)."""
    c, m, dt = result.step_compute_s, result.step_memory_s, result.step_time_s
    start = np.concatenate(([0.0], np.cumsum(dt)[:-1]))
    cols = (start, dt, c, m, result.step_prefill_tokens, result.step_decoding,
            result.step_queued, result.step_kv_used)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write("step,start_s,dt_s,compute_s,memory_s,prefill_tokens,decoding,queued,kv_used\n")
        for i, row in enumerate(zip(*cols)):
            f.write(f"{i},{row[0]:.6g},{row[1]:.6g},{row[2]:.6g},{row[3]:.6g},"
                    f"{row[4]},{row[5]},{row[6]},{row[7]}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scheduler.simulate", description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="trace JSONL: id, prompt_token_ids, output_len")
    ap.add_argument("--policy", choices=POLICY_NAMES, required=True)
    ap.add_argument("--hardware", default="h200",
                    help="h200 | h100 | a100 | a profile JSON (`blendserve profile --out FILE`)")
    ap.add_argument("--model-shape", default=None,
                    help=f"a named shape (default: the profiled model's, else {DEFAULT_SHAPE})")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV capacity (default: the device's)")
    ap.add_argument("--sample-rate", type=float, default=0.01)
    over = ap.add_mutually_exclusive_group()
    over.add_argument("--no-overlap", action="store_true",
                      help="compute and memory one after the other (the device's own overlap "
                           "is the default: 0.9 on the GPU profiles, 0 on a measured CPU)")
    over.add_argument("--perfect-overlap", action="store_true",
                      help="idealisation: the smaller of compute and memory hides entirely")
    over.add_argument("--overlap", type=float, default=None,
                      help="share of the smaller of compute and memory hidden, in [0, 1]")
    ap.add_argument("--free-weights", action="store_true",
                    help="idealisation: steps cost no fixed time (weight reads, launches)")
    ap.add_argument("--step-overhead-s", type=float, default=None,
                    help="launch and host seconds every step pays on top of its weights read "
                         "(an engine's, measured; the datasheet GPUs have 0)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel shards, one device each")
    ap.add_argument("--dp-cut", choices=("stratified", "sampled"), default="stratified",
                    help="shard by prefix-tree branches, or by a plan from a warm-up sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="tokens (decode + prefill) a step holds at most, as the engine's "
                         "max_batch_tokens / `blendserve run --max-step-tokens` (default: the "
                         f"profile's device default, 8192 on a CPU; else {DEFAULT_MAX_STEP_TOKENS})")
    ap.add_argument("--weight-reads", action="store_true",
                    help="no-op: weights are read every step by default (see --free-weights)")
    ap.add_argument("--sampled-share", type=float, default=0.0,
                    help="share of the requests drawn at a temperature > 0: their rows pay a "
                         "measured profile's sampling time (s_per_sampled_row)")
    ap.add_argument("--plan-only", action="store_true", help="plan and time it; no simulation")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of utilisation per step")
    ap.add_argument("--steps-csv", type=Path, default=None,
                    help="per-step CSV: time, compute/memory seconds, prefill, decoding, queue, KV")
    ap.add_argument("--json", action="store_true", help="print one JSON line (the only format)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_step_tokens is not None and args.max_step_tokens < 1:
            raise SchedulerError("--max-step-tokens must be at least 1")
        overlap = 0.0 if args.no_overlap else 1.0 if args.perfect_overlap else args.overlap
        cost = cost_model(args.hardware, args.model_shape, free_weights=args.free_weights,
                          overlap=overlap, step_overhead_s=args.step_overhead_s)
        step_tokens = (args.max_step_tokens or cost.hardware.default_step_tokens
                       or DEFAULT_MAX_STEP_TOKENS)
        kv_tokens = args.kv_tokens or cost.kv_capacity_tokens
        if not 0.0 <= args.sampled_share <= 1.0:
            raise SchedulerError("--sampled-share must be between 0 and 1")
        cfg = RunConfig(args.policy, kv_tokens, args.sample_rate, args.seed,
                        step_tokens, args.plan_only, args.sampled_share)
        entries = read_trace(args.trace)
        report: dict[str, Any] = {"policy": args.policy, "trace": str(args.trace),
                                  "hardware": cost.hardware.name, "model_shape": cost.shape.name,
                                  "kv_capacity_tokens": kv_tokens, "overlap": cost.overlap,
                                  "step_fixed_s": cost.step_fixed_s,
                                  "max_step_tokens": step_tokens}
        if args.dp > 1:
            report.update(run_sharded(entries, cost, cfg, args.dp, args.dp_cut == "sampled"))
        else:
            fields, result = run_trace(entries, cost, cfg)
            report.update(fields)
            if args.steps_csv and result is not None:
                write_steps_csv(result, args.steps_csv)
            if args.plot and result is not None:
                from scheduler.simulate.plot import plot_utilisation

                plot_utilisation(result, args.plot, title=f"{args.policy} on {args.trace.name}")
    except (SchedulerError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
