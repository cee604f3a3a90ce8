"""Compute and memory utilisation per step, the paper's picture of a balanced schedule."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scheduler.simulate.executor import SimResult


def utilisation(result: SimResult) -> tuple[np.ndarray, ...]:
    """(step start times, compute utilisation, memory utilisation), each [steps], in [0, 1]."""
    comp, mem, dt = result.step_compute_s, result.step_memory_s, result.step_time_s
    safe = np.where(dt > 0, dt, 1.0)
    start = np.concatenate(([0.0], np.cumsum(dt)[:-1]))
    return start, np.where(dt > 0, comp / safe, 0.0), np.where(dt > 0, mem / safe, 0.0)


def plot_utilisation(result: SimResult, path: str | Path, *, title: str,
                     bins: int = 2000) -> None:
    """Write a PNG of utilisation over time; steps are averaged into at most `bins` time bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, cu, mu = utilisation(result)
    dt = np.diff(np.append(start, result.makespan_s))
    edges = np.linspace(0.0, max(result.makespan_s, 1e-12), bins + 1)
    which = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, bins - 1)
    weight = np.bincount(which, dt, bins)
    safe = np.where(weight > 0, weight, 1.0)
    comp_bin = np.bincount(which, cu * dt, bins) / safe
    mem_bin = np.bincount(which, mu * dt, bins) / safe
    mid = (edges[:-1] + edges[1:]) / 2
    keep = weight > 0
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(mid[keep], comp_bin[keep], lw=0.8, label="compute")
    ax.plot(mid[keep], mem_bin[keep], lw=0.8, label="memory")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("utilisation")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(loc="lower left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
