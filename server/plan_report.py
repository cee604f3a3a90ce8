"""The plan report of one run: what the planner did and how the run went, as JSON and a PNG.

Written by `blendserve run --report FILE` and, per batch, by the worker (DATA_DIR/reports/,
served at GET /v1/batches/{id}/report and .../report.png). Two predictions sit beside the
measured time: the device profile's step model over the steps as they ran (how well the cost
model knows this device), and the simulator replaying the batch with its true output lengths
(how well the whole simulation predicts a run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.types import EngineRequest, RequestOutput, StepRecord
    from scheduler.cost_model import CostModel
    from scheduler.simulate import TraceEntry

REPORT_VERSION = 1


def report_path(data_dir: Path, batch_id: str) -> Path:
    """DATA_DIR/reports/<batch id>.json (the PNG beside it)."""
    return data_dir / "reports" / f"{batch_id}.json"


def step_split(cost: CostModel, log: Sequence[StepRecord]) -> tuple[np.ndarray, np.ndarray]:
    """([steps] compute, [steps] memory) seconds the step model gives each logged step."""
    comp = np.array([cost.step_compute_time(r.tokens, r.rows, r.pairs, r.fresh_kv, r.sampled)
                     for r in log])
    mem = np.array([cost.step_memory_time(r.kv_read, r.kv_shared) for r in log])
    return comp, mem


def build_report(
    engine: Engine,
    policy: str,
    finished: Sequence[tuple[EngineRequest, RequestOutput]],
    *,
    wall_seconds: float,
    simulate: bool = True,
) -> dict[str, Any]:
    """The report of the engine's latest generate() run over `finished` (request, output)."""
    cost = engine.cost_model
    log = engine.step_log
    pol = engine.last_policy
    seconds = np.array([r.seconds for r in log], dtype=np.float64)
    comp, mem = step_split(cost, log)
    model = cost.step_overhead_s + np.asarray(cost.combine(comp, mem), dtype=np.float64) \
        if len(log) else np.zeros(0)
    ok = [(q, o) for q, o in finished if o.error is None]
    prompt = sum(o.prompt_tokens for _, o in ok)
    cached = sum(o.cached_tokens for _, o in ok)
    output = sum(o.completion_tokens for _, o in ok)
    warm_steps = getattr(pol, "warmup_steps", None)
    measured = float(seconds.sum())
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "created_at": int(time.time()),
        "policy": policy,
        "mode": None if pol is None or not hasattr(pol, "blending")
        else ("blend" if pol.blending else "sharing order, full steps"),
        "requests": len(finished),
        "failed": len(finished) - len(ok),
        "sampled": len(getattr(pol, "warmup_request_ids", []) or []),
        "censored": getattr(pol, "censored", 0),
        "warmup_steps": warm_steps,
        "warmup_seconds": float(seconds[:warm_steps].sum()) if warm_steps is not None else 0.0,
        "steps": len(log),
        "engine_seconds": measured,
        "wall_seconds": wall_seconds,
        "step_model_seconds": float(model.sum()),
        "simulated_seconds": None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "output_tokens_per_s": output / wall_seconds if wall_seconds > 0 else None,
        "tokens_per_s": (prompt + output) / wall_seconds if wall_seconds > 0 else None,
        "preemptions": engine.stats.preemptions,
        "max_step_tokens": engine.config.max_batch_tokens,
        "profile": {"path": engine.profile_path, "device": cost.hardware.name,
                    "overlap": cost.overlap, "step_fixed_s": cost.step_fixed_s},
        "plan": _plan_fields(pol),
    }
    if simulate and ok:
        report["simulated_seconds"] = _simulate(engine, policy, ok)
    return report


def _plan_fields(pol: Any) -> dict[str, Any] | None:
    plan = getattr(pol, "plan", None)
    if plan is None:
        return None
    return {"planned_requests": len(plan), "leaves_split": plan.leaves_moved,
            "sharing_kept": plan.sharing_kept, "rho_target": plan.rho_target}


def trace_entries(engine: Engine,
                  ok: Sequence[tuple[EngineRequest, RequestOutput]]) -> list[TraceEntry]:
    """The batch as the simulator replays it: each of a request's n choices a request of its
    own on the same prompt (the engine forks them off the cached prompt), with its length."""
    from dataclasses import replace

    from scheduler.simulate import TraceEntry

    entries = []
    for req, out in ok:
        plan = engine.plan_request(req)
        for i, choice in enumerate(out.choices):
            entries.append(TraceEntry(replace(plan, id=f"{plan.id}#{i}") if i else plan,
                                      max(len(choice.token_ids), 1)))
    return entries


def _simulate(engine: Engine, policy: str,
              ok: Sequence[tuple[EngineRequest, RequestOutput]]) -> float:
    """The simulator's makespan for this batch with its true output lengths."""
    from scheduler.policies import make_policy
    from scheduler.simulate import SimConfig, simulate

    entries = trace_entries(engine, ok)
    cap, step = engine.kv_capacity_tokens, engine.config.max_batch_tokens
    pol = make_policy(policy, [e.request for e in entries], kv_capacity_tokens=cap,
                      cost_model=engine.cost_model, step_tokens=step)
    pool = engine.pool  # the KV slots this run found never written, as the engine counted them
    fresh = ((pool.num_pages - pool.pages_ever_taken) * pool.page_size
             + sum(r.fresh_kv for r in engine.step_log))
    # the rows drawn at random, as the engine counted them
    share = sum(r.sampled for r in engine.step_log) / max(sum(r.rows for r in engine.step_log), 1)
    return simulate(entries, pol, engine.cost_model, SimConfig(cap, step, fresh, share)).makespan_s


def write_report(report: dict[str, Any], path: Path, engine: Engine | None = None) -> Path:
    """Write the JSON at `path` and, given the engine, the per-step PNG beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if engine is not None and engine.step_log:
        png = path.with_suffix(".png")
        plot_steps(engine, png, title=f"{report['policy']}: {report['requests']} requests")
        report = {**report, "steps_png": png.name}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    return path


def plot_steps(engine: Engine, path: Path, *, title: str, bins: int = 1500) -> None:
    """Compute and memory time of each step (the cost model's split) against the measured time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = engine.step_log
    comp, mem = step_split(engine.cost_model, log)
    measured = np.array([r.seconds for r in log])
    step = np.arange(len(log))
    if len(log) > bins:  # average runs of steps so the lines stay readable
        edges = np.linspace(0, len(log), bins + 1).astype(np.int64)
        step = (edges[:-1] + edges[1:]) // 2
        comp, mem, measured = (np.add.reduceat(a, edges[:-1]) / np.diff(edges)
                               for a in (comp, mem, measured))
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(step, comp * 1e3, lw=0.8, label="compute (model)")
    ax.plot(step, mem * 1e3, lw=0.8, label="memory (model)")
    ax.plot(step, measured * 1e3, lw=0.8, alpha=0.7, label="step, measured")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
