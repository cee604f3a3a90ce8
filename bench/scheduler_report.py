"""Benchmark the four policies on the 2×2 grid of traces and print a Markdown table.

Per trace: ρ(root) and s_max, every policy's fraction of optimal (T_opt / makespan), blend's
speed-up over DFS, the prefix sharing blend keeps relative to DFS, leaves split, blend against a
tighter bound (T_opt discounts decode compute by 1 − s_max too; the tight bound computes each
distinct prompt token and every output token once), planning seconds, preemptions; then
averages, the issue's goals, and (--scale) the planning time of a 200k-request, ~30M-token trace.

    python bench/scheduler_report.py --traces bench/out/traces --requests 20000 --scale
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import make_traces
from scheduler.cost_model import CostModel
from scheduler.policies import POLICY_NAMES
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.run import RunConfig, run_trace
from scheduler.simulate.sharded import run_sharded
from scheduler.simulate.trace import read_trace

GOAL_FRACTION = 0.92  # blend, every trace
GOAL_SPEEDUP = 1.20  # blend over DFS, on average
GOAL_SHARING = 0.98  # blend's prefix sharing / DFS's
GOAL_PLAN_SECONDS = 60.0  # 200k requests, ~30M tokens


def ensure_trace(path: Path, name: str, n: int, seed: int) -> None:
    if path.exists():
        return
    if name == "scale":
        make_traces.write_scale_trace(path, n, seed)
    else:
        make_traces.write_trace(path, make_traces.generate_mix(name, n, seed)[0])


def run_grid(trace_dir: Path, n: int, seed: int, cost: CostModel, sample_rate: float,
             plots: Path | None, dp: int, weight_reads: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(make_traces.MIXES):
        path = trace_dir / f"{name}.jsonl"
        ensure_trace(path, name, n, seed)
        entries = read_trace(path)
        tree = PrefixTree.build([e.request.prompt_token_ids for e in entries])
        runs = {}
        for policy in POLICY_NAMES:
            cfg = RunConfig(policy, cost.kv_capacity_tokens, sample_rate=sample_rate, seed=seed,
                            weight_reads=weight_reads)
            fields, result = run_trace(entries, cost, cfg, tree)
            runs[policy] = fields
            if plots is not None and policy in ("dfs", "blend") and result is not None:
                from scheduler.simulate.plot import plot_utilisation

                plot_utilisation(result, plots / f"{name}-{policy}.png", title=f"{policy} on {name}")
            print(f"# {name} {policy}: {fields['fraction_of_optimal']:.3f} of optimal "
                  f"({fields['simulate_seconds']:.1f}s simulated)", file=sys.stderr)
        row: dict[str, Any] = {"trace": name, "runs": runs}
        if dp > 1:
            cfg = RunConfig("blend", cost.kv_capacity_tokens, sample_rate=sample_rate, seed=seed,
                            weight_reads=weight_reads)
            row["dp"] = run_sharded(entries, cost, cfg, dp)
        rows.append(row)
    return rows


def _row_figures(row: dict[str, Any]) -> dict[str, float]:
    runs = row["runs"]
    blend, dfs = runs["blend"], runs["dfs"]
    return {
        "speedup": dfs["makespan_s"] / blend["makespan_s"],
        "sharing_kept": (blend["prefix_sharing_ratio"] / dfs["prefix_sharing_ratio"]
                         if dfs["prefix_sharing_ratio"] else 1.0),
        **{f"frac_{p}": runs[p]["fraction_of_optimal"] for p in POLICY_NAMES},
        # against max(every distinct prompt token + every output token once, ΣMem)
        "tight": max(blend["compute_bound_s"], blend["optimal_makespan_s"]) / blend["makespan_s"],
    }


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def markdown(rows: list[dict[str, Any]], scale: dict[str, Any] | None) -> str:
    head = ("| trace | ρ(root) | s_max | fcfs | dfs | balance | blend | blend/DFS | "
            "sharing kept | leaves split | blend vs tight bound | blend plan s | "
            "preemptions (dfs / blend) |")
    lines = [head, "|" + "---|" * 13]
    figures = []
    for row in rows:
        f = _row_figures(row)
        figures.append(f)
        b, d = row["runs"]["blend"], row["runs"]["dfs"]
        lines.append(
            f"| {row['trace']} | {b['rho_root']:.2f} | {b['max_prefix_sharing_ratio']:.3f} | "
            + " | ".join(f"{f['frac_' + p]:.3f}" for p in POLICY_NAMES)
            + f" | {f['speedup']:.3f}× | {f['sharing_kept']:.3f} | {b['leaves_split']} | "
            f"{f['tight']:.3f} | {b['plan_seconds']:.2f} | {d['preemptions']} / {b['preemptions']} |")
    if figures:
        mean = {k: sum(f[k] for f in figures) / len(figures) for k in figures[0]}
        lines.append("| **average** | | | " + " | ".join(f"{mean['frac_' + p]:.3f}" for p in POLICY_NAMES)
                     + f" | {mean['speedup']:.3f}× | {mean['sharing_kept']:.3f} | | "
                     f"{mean['tight']:.3f} | | |")
        worst = min(f["frac_blend"] for f in figures)
        kept = min(f["sharing_kept"] for f in figures)
        lines += [
            "",
            "Goals (H200 + Llama-3-8B):",
            f"- blend ≥ {GOAL_FRACTION} of optimal on every trace: worst {worst:.3f} {_mark(worst >= GOAL_FRACTION)}",
            f"- blend ≥ {GOAL_SPEEDUP}× DFS on average: {mean['speedup']:.3f}× {_mark(mean['speedup'] >= GOAL_SPEEDUP)}",
            f"- blend keeps ≥ {GOAL_SHARING:.0%} of DFS's prefix sharing: {kept:.3f} (worst) {_mark(kept >= GOAL_SHARING)}",
        ]
    if scale is not None:
        ok = scale["plan_seconds"] <= GOAL_PLAN_SECONDS
        lines.append(f"- planning {scale['requests']} requests / {scale['prompt_tokens'] / 1e6:.1f}M "
                     f"prompt tokens (blend, --plan-only): {scale['plan_seconds']:.1f} s "
                     f"(≤ {GOAL_PLAN_SECONDS:.0f} s {_mark(ok)}; trace load "
                     f"{scale['load_seconds']:.1f} s not counted)")
    dp_lines: list[str] = []
    dp_rows = [r for r in rows if "dp" in r]
    if dp_rows:
        dp_lines += ["", ("| trace | blend, dp shards | fraction of optimal (T_opt / k) | "
                     "slowest / fastest shard |"), "|---|---|---|---|"]
        for r in dp_rows:
            spans = [s["makespan_s"] for s in r["dp"]["shards"]]
            dp_lines.append(f"| {r['trace']} | {r['dp']['dp']} | "
                            f"{r['dp']['fraction_of_optimal']:.3f} | {max(spans) / min(spans):.2f} |")
    return "\n".join(lines + dp_lines)


def run_scale(trace_dir: Path, seed: int, cost: CostModel, sample_rate: float) -> dict[str, Any]:
    path = trace_dir / "scale.jsonl"
    ensure_trace(path, "scale", 200_000, seed)
    t0 = time.perf_counter()
    entries = read_trace(path)
    load = time.perf_counter() - t0
    cfg = RunConfig("blend", cost.kv_capacity_tokens, sample_rate=sample_rate, seed=seed, plan_only=True)
    fields, _ = run_trace(entries, cost, cfg)
    fields["prompt_tokens"] = sum(e.request.prompt_len for e in entries)
    fields["load_seconds"] = load
    return fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=Path, default=Path("bench/out/traces"),
                    help="folder of grid traces (generated there when missing)")
    ap.add_argument("--requests", type=int, default=20000, help="requests per generated trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-rate", type=float, default=0.01)
    ap.add_argument("--scale", action="store_true", help="also time planning the 200k-request trace")
    ap.add_argument("--no-grid", action="store_true", help="skip the grid (with --scale)")
    ap.add_argument("--dp", type=int, default=1, help="also run blend on k data-parallel shards")
    ap.add_argument("--weight-reads", action="store_true",
                    help="simulate with the weights read once per step (P·bytes / B)")
    ap.add_argument("--plots", type=Path, default=None, help="folder for DFS / blend utilisation PNGs")
    ap.add_argument("--json-out", type=Path, default=None, help="write every run's fields here")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    args = ap.parse_args(argv)
    cost = CostModel.default()
    args.traces.mkdir(parents=True, exist_ok=True)
    rows = [] if args.no_grid else run_grid(args.traces, args.requests, args.seed, cost,
                                             args.sample_rate, args.plots, args.dp,
                                             args.weight_reads)
    scale = run_scale(args.traces, args.seed, cost, args.sample_rate) if args.scale else None
    text = markdown(rows, scale)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"grid": rows, "scale": scale}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
