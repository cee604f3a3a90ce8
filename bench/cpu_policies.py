"""`blendserve run` policy by policy on this machine, and the simulator's prediction of each run.

For each workload of bench/cpu_workloads.py (chat, long_short, low_sharing, fewshot) it runs,
one after the other in this process's machine: an untimed warm-up run (--warmup), then `blend`
with the default flags (what a user gets), then `fcfs` and `dfs` at each step cap of --caps
(`--max-step-tokens`). The warm-up is there because the first `blendserve run` after other work
(the last workload's model load and simulations) ran slower than the next run of the same steps
in 6 of 7 sequences on a 2-core VM, by 6-25%. Where every order takes the same steps (a
batch that fits the KV pool on a CPU), blend's one run against the fastest of six runs of about
the same work is one draw against the best of six: host noise decides the wall ratio, and the
step-model column is the comparison without it. Every run writes its plan
report (`--report`); the table shows the run's wall time (first request in to last result out,
model load excluded), output tokens/s, cached prompt tokens and steps, blend against the best
baseline, the simulator's prediction of each run from the measured device profile, and the
step model's seconds over the steps the run took (the device profile applied to each step's
tokens, rows, pairs and KV reads): what the schedules cost without the machine's timing noise.
Each run's prediction uses the profile as that run loaded it (copied beside its report).
`other load` is the share of the CPUs that other processes (and other guests of a VM) took
while the run ran (runtime/host_load.py): a run past 5% was slowed by it, often by more than
that share, and so was a profile measured under load (the table says so under it).

The prediction is the simulator CLI itself: the workload becomes a trace per run (prompt token
ids with the chat template applied, the output lengths that run produced: the engine is
batch-invariant on a CPU, so every run of a workload generates the same tokens unless a
preemption's recompute rounds one differently) and
`python -m scheduler.simulate TRACE --hardware PROFILE --policy P --max-step-tokens N --kv-tokens K`
replays it.

    python bench/cpu_policies.py                          # all four workloads (~10 min on a
    # 2-core AMX Xeon in bfloat16, ~17 on a 2-core Zen 4 EPYC in bfloat16, ~40 on a 2-core
    # AVX2 EPYC in float32, ~36 with the warm-up runs on a 2-core AVX-512 Xeon in float32)
    python bench/cpu_policies.py --workloads chat --caps 2048
    python bench/cpu_policies.py --workloads chat --kv-memory 300000000   # KV-bound
    python bench/cpu_policies.py --workloads chat --scale 4 --caps 2048,8192  # 256 requests
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench import cpu_workloads
from runtime.host_load import DISTURBED, HostLoad, LoadMeter, disturbance, load_fields

BLENDSERVE = str(Path(sys.executable).with_name("blendserve"))


def run_one(inp: Path, out_dir: Path, policy: str | None, cap: int | None,
            kv_memory: int | None = None) -> dict[str, Any]:
    """One `blendserve run`; returns its plan report plus the process's own wall time."""
    tag = f"{inp.stem}-{policy or 'default'}-{cap or 'default'}"
    report = out_dir / f"{tag}.report.json"
    cmd = [BLENDSERVE, "run", str(inp), "-o", str(out_dir / f"{tag}.out.jsonl"), "--report", str(report)]
    if policy:
        cmd += ["--policy", policy]
    if cap:
        cmd += ["--max-step-tokens", str(cap)]
    if kv_memory:
        cmd += ["--kv-memory", str(kv_memory)]
    started = time.monotonic()
    with LoadMeter() as meter:  # what others took of the machine while it ran
        subprocess.run(cmd, check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
    data = json.loads(report.read_text())
    data["process_seconds"] = time.monotonic() - started
    data["host_load"] = load_fields(meter.load)
    # The profile as this run used it (a `blendserve profile` between runs replaces the cache).
    used = out_dir / f"{tag}.profile.json"
    shutil.copyfile(data["profile"]["path"], used)
    if kv_memory:  # the simulator's KV capacity is the profile's: make it this run's
        profile = json.loads(used.read_text())
        used.write_text(json.dumps({**profile, "kv_capacity_bytes": kv_memory}, indent=1))
    data["profile"]["cached_path"] = data["profile"]["path"]
    data["profile"]["path"] = str(used)
    data["output_file"] = str(out_dir / f"{tag}.out.jsonl")
    data["label"] = f"{policy or 'blend (default flags)'}" + (f" @{cap}" if cap else "")
    return data


def workload_prompts(inp: Path) -> list[dict[str, Any]]:
    """The workload's requests as the engine sees them: chat-templated prompt ids, max_tokens."""
    from runtime.loader import DEFAULT_MODEL, load_model
    from runtime.openai_adapter import to_engine_request

    model = load_model(DEFAULT_MODEL, data_dir=ROOT / "data")
    prompts = []
    for raw in inp.read_text().splitlines():
        item = json.loads(raw)
        req = to_engine_request(item["custom_id"], item["url"], item["body"], model.tokenizer,
                                served_model=model.name, max_model_len=8192)
        if isinstance(req, Exception) or not hasattr(req, "prompt_token_ids"):
            continue
        prompts.append({"id": item["custom_id"], "prompt_token_ids": list(req.prompt_token_ids),
                        "max_tokens": req.params.max_tokens,
                        "ignore_eos": bool(req.params.ignore_eos)})
    return prompts


def write_trace(prompts: list[dict[str, Any]], output_file: Path, trace: Path) -> None:
    """The workload as a simulator trace with one run's output lengths (runs differ in them
    where the model's EOS ends a request: see the module docstring)."""
    produced = {}
    for line in output_file.read_text().splitlines():
        rec = json.loads(line)
        produced[rec["custom_id"]] = rec["response"]["body"]["usage"]["completion_tokens"]
    with trace.open("w") as f:
        for p in prompts:
            f.write(json.dumps({**p, "output_len": max(produced[p["id"]], 1)}) + "\n")


def simulate(trace: Path, report: dict[str, Any], policy: str) -> float:
    """The simulator CLI's makespan for this run: same profile (its KV capacity and model shape
    included), same policy, same step cap."""
    cmd = [sys.executable, "-m", "scheduler.simulate", str(trace), "--policy", policy,
           "--hardware", report["profile"]["path"],
           "--max-step-tokens", str(report["max_step_tokens"]), "--json"]
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    return float(json.loads(out)["makespan_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(cpu_workloads.WORKLOADS))
    ap.add_argument("--caps", default="512,2048,8192", help="step caps of the fcfs/dfs baselines")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cpu")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every run, interleaved, each round starting one "
                         "configuration later; the table shows each one's fastest")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of each workload before its rounds (the first "
                         "`blendserve run` after other work tends to run slower)")
    ap.add_argument("--predict-from", type=Path, default=None,
                    help="a --json-out of an earlier run: predict its runs again with the "
                         "profile now cached (after `blendserve profile`), without re-running")
    ap.add_argument("--kv-memory", type=int, default=None,
                    help="KV pool bytes of every run (`blendserve run --kv-memory`): a small "
                         "pool makes a workload KV-bound")
    ap.add_argument("--scale", type=int, default=1,
                    help="multiply every workload's request count (4: beyond the default KV pool)")
    args = ap.parse_args(argv)
    if args.predict_from:
        for name, runs in json.loads(args.predict_from.read_text()).items():
            for r in runs:
                r["profile"]["path"] = str(_profile_now(r, args.out))
                trace = Path(r.get("trace") or args.out / f"{name}.trace.jsonl")
                r["predicted_seconds"] = simulate(trace, r, r["policy"])
            print_table(name, runs)
        return 0
    paths = cpu_workloads.write(args.out, scale=args.scale)
    caps = [int(c) for c in args.caps.split(",") if c]
    results: dict[str, list[dict[str, Any]]] = {}
    configs = [(None, None)] + [(p, c) for p in ("fcfs", "dfs") for c in caps]
    for name in args.workloads.split(","):
        inp = paths[name]
        for _ in range(args.warmup):  # discarded: no configuration takes the cold first slot
            run_one(inp, args.out, *configs[0], args.kv_memory)
        rounds = [_round(inp, args.out, configs, k, args.kv_memory) for k in range(args.repeat)]
        runs = [_best_run([r[i] for r in rounds]) for i in range(len(configs))]
        prompts = workload_prompts(inp)
        for r in runs:
            r["trace"] = str(Path(r["output_file"]).with_suffix(".trace.jsonl"))
            write_trace(prompts, Path(r["output_file"]), Path(r["trace"]))
            r["predicted_seconds"] = simulate(Path(r["trace"]), r, r["policy"])
        results[name] = runs
        print_table(name, runs)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


def _profile_now(run: dict[str, Any], out_dir: Path) -> Path:
    """The profile cached now for `run`'s model and device (its step model measured anew),
    with the KV capacity that run had, written beside its report."""
    used = json.loads(Path(run["profile"]["path"]).read_text())
    cached = run["profile"].get("cached_path")
    if cached is None:  # an older --json-out: the newest profile of the same model
        same = [p for p in (ROOT / "data" / "profiles").glob("*.json")
                if json.loads(p.read_text()).get("model") == used.get("model")]
        cached = max(same, key=lambda p: p.stat().st_mtime)
    now = json.loads(Path(cached).read_text())
    path = Path(run["profile"]["path"]).with_suffix(".now.json")
    path.write_text(json.dumps({**now, "kv_capacity_bytes": used["kv_capacity_bytes"]}, indent=1))
    return path


def _round(inp: Path, out_dir: Path, configs: list[tuple[str | None, int | None]],
           k: int, kv_memory: int | None = None) -> list[dict[str, Any]]:
    """Every configuration once, starting at the k-th (so no policy always runs first in a
    round); the reports come back in `configs` order."""
    n = len(configs)
    done = {i: run_one(inp, out_dir, *configs[i], kv_memory) for i in [(k + j) % n for j in range(n)]}
    return [done[i] for i in range(n)]


def _best_run(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds: the fastest round's report (other load on a shared machine
    only ever adds time), with every round's wall time beside it."""
    best = dict(min(reports, key=lambda r: r["wall_seconds"]))
    best["walls"] = [round(r["wall_seconds"], 1) for r in reports]
    # Every round's own reading, so a slow one can be told apart: the others' load while it
    # ran, and how much of its wall time the engine's steps took (the rest: setup, the plan).
    best["rounds"] = [{"wall_seconds": r["wall_seconds"], "engine_seconds": r["engine_seconds"],
                       "steps": r["steps"], "host_load": r["host_load"]} for r in reports]
    return best


def _rounds(run: dict[str, Any]) -> str:
    """The rounds' wall times, each slowed by others' load marked with that load."""
    out = []
    for r in run.get("rounds") or [{"wall_seconds": w} for w in run["walls"]]:
        load = HostLoad.from_fields(r.get("host_load") or {})
        mark = f" ({load.taken:.0%} load)" if load is not None and load.disturbed else ""
        out.append(f"{r['wall_seconds']:.1f}{mark}")
    return "[" + ", ".join(out) + "]"


def print_table(name: str, runs: list[dict[str, Any]]) -> None:
    blend, base = runs[0], runs[1:]
    best = min(base, key=lambda r: r["wall_seconds"])
    print(f"\n### {name}: {blend['requests']} requests, {blend['prompt_tokens']} prompt tokens, "
          f"{blend['output_tokens']} output tokens\n")
    print("| policy | wall s (best) | rounds | other load | output tok/s | cached tokens | "
          "steps | predicted s | error | step-model s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        err = r["predicted_seconds"] / r["wall_seconds"] - 1
        print(f"| {r['label']} | {r['wall_seconds']:.1f} | {_rounds(r)} | {_load(r)} | "
              f"{r['output_tokens_per_s']:.1f} | {r['cached_tokens']} | {r['steps']} | "
              f"{r['predicted_seconds']:.1f} | {err:+.1%} | {r['step_model_seconds']:.1f} |")
    model_best = min(base, key=lambda r: r["step_model_seconds"])
    print(f"\nblend vs best baseline ({best['label']}): "
          f"{best['wall_seconds'] / blend['wall_seconds']:.3f}x wall, cached tokens "
          f"{blend['cached_tokens']} vs {best['cached_tokens']}; by the step model over the steps "
          f"each run took (no timing noise): {model_best['step_model_seconds'] / blend['step_model_seconds']:.3f}x "
          f"the best ({model_best['label']})")
    same = [r for r in runs if _same_work(r, blend)]
    if len(same) > 1:  # their wall times differ by the host's noise alone
        walls = [r["wall_seconds"] for r in same]
        print(f"\nruns of the same steps as blend ({', '.join(r['label'] for r in same)}: "
              f"{blend['steps']} steps, {blend['step_model_seconds']:.1f} s by the step model) "
              f"spread by {max(walls) / min(walls) - 1:.1%} in wall time: the host's noise, "
              "which a one-run ratio carries")
    outputs = [r["output_tokens"] for r in runs]
    if min(outputs) != max(outputs):  # a recompute after preemption rounded differently
        fastest = max(base, key=lambda r: r["output_tokens_per_s"])
        print(f"\noutput tokens differ between runs ({min(outputs)}-{max(outputs)}), so wall "
              f"times compare different work: by output tokens/s, blend is "
              f"{blend['output_tokens_per_s'] / fastest['output_tokens_per_s']:.3f}x the best "
              f"baseline ({fastest['label']})")
    disturbed = [r["label"] for r in runs if (load := _host_load(r)) and load.disturbed]
    if disturbed:
        print(f"\nother processes took more than {DISTURBED:.0%} of the CPUs during: "
              f"{', '.join(disturbed)}: those wall times are slowed by it")
    profile = json.loads(Path(blend["profile"]["path"]).read_text())
    if warning := disturbance(profile.get("fit", {}), "\nthe device profile"):
        print(warning)


def _same_work(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same steps, tokens and cached prefixes, to the step model's 0.1%."""
    return (a["steps"] == b["steps"] and a["output_tokens"] == b["output_tokens"]
            and a["cached_tokens"] == b["cached_tokens"]
            and abs(a["step_model_seconds"] / b["step_model_seconds"] - 1) < 1e-3)


def _host_load(run: dict[str, Any]) -> HostLoad | None:
    """What others took of the CPUs while the run ran (None: not recorded)."""
    return HostLoad.from_fields(run.get("host_load") or {})


def _load(run: dict[str, Any]) -> str:
    load = _host_load(run)
    return "?" if load is None else f"{load.taken:.0%}"


if __name__ == "__main__":
    sys.exit(main())
