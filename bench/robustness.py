"""blend under other warm-up draws: the trace grid × sampling seeds, in the simulator.

The warm-up samples ~1% of a batch (a seeded draw) and the plan follows from what the sample
shows, so a planner change measured on one draw may win there and lose on the next. This runs
blend (H200 + Llama-3-8B, realistic defaults) on each mix of bench/make_traces.py for each trace
seed, once per sampling seed, and prints per mix the mean and worst fraction of the bound
max(C_eff, M + W·S_min), the runs under 0.85 and under 0.80, and the sum of makespans: a change
worth keeping moves the mean and the worst, not one run.

Traces are ROOT/traces/MIX.jsonl for trace seed 0 and ROOT/traces_sS/MIX.jsonl for seed S
(scheduler_report.py's folders), made there when missing with --requests each.

    python bench/robustness.py --trace-seeds 0,1,2,3 --seeds 0,1,2 --json-out /tmp/rob.json
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import make_traces
from bench.scheduler_report import GOAL_FRACTION, ensure_trace, simulate
from scheduler.simulate.executor import DEFAULT_MAX_STEP_TOKENS

FAR_BELOW = 0.80  # a run this far from the bound is a failure of the plan, not noise


def _run(job: tuple[str, int]) -> dict[str, Any]:
    path, seed = job
    fields = simulate(path, "blend", DEFAULT_MAX_STEP_TOKENS, {}, seed)
    return {"trace": path, "mix": Path(path).stem, "seed": seed,
            "makespan_s": fields["makespan_s"], "of_bound": fields["fraction_of_optimal"]}


def summary(runs: list[dict[str, Any]]) -> str:
    lines = [f"| mix | runs | mean of bound | worst | < {GOAL_FRACTION:.2f} | < {FAR_BELOW:.2f} | Σ makespan s |",
             "|---|---|---|---|---|---|---|"]
    by_mix: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_mix.setdefault(r["mix"], []).append(r)
    for mix, rs in [*sorted(by_mix.items()), ("all", runs)]:
        f = [r["of_bound"] for r in rs]
        lines.append(f"| {mix} | {len(rs)} | {sum(f) / len(f):.4f} | {min(f):.3f} | "
                     f"{sum(x < GOAL_FRACTION for x in f)} | {sum(x < FAR_BELOW for x in f)} | "
                     f"{sum(r['makespan_s'] for r in rs):,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path("bench/out"), help="folder of trace folders")
    ap.add_argument("--requests", type=int, default=20000, help="requests per generated trace")
    ap.add_argument("--trace-seeds", default="0,1,2,3")
    ap.add_argument("--seeds", default="0,1,2", help="blend's sampling seeds")
    ap.add_argument("--workers", type=int, default=2, help="simulations run in parallel")
    ap.add_argument("--json-out", type=Path, default=None, help="write every run here")
    args = ap.parse_args(argv)
    jobs = []
    for t in (int(s) for s in args.trace_seeds.split(",") if s):
        folder = args.root / ("traces" if t == 0 else f"traces_s{t}")
        folder.mkdir(parents=True, exist_ok=True)
        for name in sorted(make_traces.MIXES):
            ensure_trace(folder / f"{name}.jsonl", name, args.requests, t)
            jobs += [(str(folder / f"{name}.jsonl"), int(s)) for s in args.seeds.split(",") if s]
    runs = []
    with ProcessPoolExecutor(args.workers) as pool:
        for r in pool.map(_run, jobs):
            runs.append(r)
            print(f"# {r['trace']} seed {r['seed']}: {r['makespan_s']:.1f} s, "
                  f"{r['of_bound']:.3f} of bound", file=sys.stderr)
    print(summary(runs))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
