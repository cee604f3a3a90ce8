"""Synthetic trace generators: family shapes, the 2×2 grid's ρ and sharing, files the simulator
reads, and bench/robustness.py, which runs blend on them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from bench import make_traces as mt
from scheduler.cost_model import CostModel
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate import read_trace

COST = CostModel.default()


def measured(reqs: list[mt.TraceRequest]) -> tuple[float, float, float, float]:
    """(mean prompt, mean output, max sharing from a real radix tree, ρ(root)) of a trace."""
    p = np.array([len(r.prompt_token_ids) for r in reqs], dtype=float)
    d = np.array([r.output_len for r in reqs], dtype=float)
    s = PrefixTree.build([r.prompt_token_ids for r in reqs]).max_sharing_ratio()
    rho = COST.set_rho(float(COST.comp(p, d).sum()), float(COST.mem(p, d).sum()), s)
    return float(p.mean()), float(d.mean()), s, rho


@pytest.mark.parametrize(("family", "prompt", "output"), [
    ("burstgpt", 244, 27), ("azure", 2500, 23), ("openvid", 120, 3000), ("reasoning", 400, 4000)])
def test_family_lengths_follow_the_papers_traces(family: str, prompt: float, output: float) -> None:
    reqs, stats = mt.generate_family(family, 3000, seed=1)
    mean_p, mean_d, _, _ = measured(reqs)
    assert mean_p == pytest.approx(prompt, rel=0.2)
    assert mean_d == pytest.approx(output, rel=0.2)
    assert stats.mean_prompt == pytest.approx(mean_p)


def test_mmlu_shares_long_few_shot_prefixes_and_answers_in_a_few_tokens() -> None:
    reqs, _ = mt.generate_family("mmlu", 1200, seed=2)
    _, _, sharing, rho = measured(reqs)
    outs = {r.output_len for r in reqs}
    assert outs <= {1, 2, 3, 4, 5} and len(outs) == 5
    assert sharing > 0.6
    assert rho > 10  # very compute-heavy even after sharing


def test_output_lengths_depend_on_the_prefix_group() -> None:
    """Requests sharing a group prefix have correlated outputs: sampling a subtree is informative."""
    reqs, _ = mt.generate_family("reasoning", 3000, seed=3)
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    d = np.log([r.output_len for r in reqs])
    groups: dict[int, list[float]] = {}
    for i in range(len(reqs)):
        groups.setdefault(int(tree.parent[tree.leaf_node[i]]), []).append(d[i])
    sizable = [np.mean(v) for v in groups.values() if len(v) >= 5]
    assert len(sizable) > 20
    assert np.var(sizable) > 2 * np.var(d) / 10  # group means spread more than noise alone


@pytest.mark.parametrize("name", sorted(mt.MIXES))
def test_grid_mix_hits_its_density_and_sharing(name: str) -> None:
    mix = mt.MIXES[name]
    reqs, stats = mt.generate_mix(name, 1500, seed=4)
    _, _, sharing, rho = measured(reqs)
    assert len(reqs) == 1500 and len({r.id for r in reqs}) == 1500
    assert sharing == pytest.approx(mix.target_sharing, abs=0.02)
    assert rho == pytest.approx(mix.target_rho, rel=0.1)
    assert (rho > 1) == name.startswith("compute")
    assert stats.max_sharing == pytest.approx(sharing, abs=0.005)


def test_generation_is_seeded() -> None:
    a, _ = mt.generate_mix("memory_low_sharing", 300, seed=7)
    b, _ = mt.generate_mix("memory_low_sharing", 300, seed=7)
    c, _ = mt.generate_mix("memory_low_sharing", 300, seed=8)
    assert a == b
    assert a != c


def test_cli_writes_traces_the_simulator_reads(tmp_path: Path, capsys) -> None:
    assert mt.main(["--grid", "--out", str(tmp_path), "--requests", "200", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    for line in lines:
        info = json.loads(line)
        entries = read_trace(info["path"])
        assert len(entries) == 200
        assert sum(e.output_len for e in entries) == info["output_tokens"]
    assert mt.main(["--family", "azure", "--out", str(tmp_path), "--requests", "50"]) == 0
    assert len(read_trace(tmp_path / "azure.jsonl")) == 50


def test_scale_trace_streams_to_disk_with_150_prompt_tokens_a_request(tmp_path: Path) -> None:
    stats = mt.write_scale_trace(tmp_path / "scale.jsonl", n=2000, seed=0)
    entries = read_trace(tmp_path / "scale.jsonl")
    assert len(entries) == 2000 == stats.requests
    assert stats.mean_prompt == pytest.approx(150, rel=0.15)
    assert sum(e.request.prompt_len for e in entries) == stats.prompt_tokens


def test_robustness_bench_runs_blend_once_per_trace_and_draw(tmp_path: Path, capsys) -> None:
    from bench import robustness

    out = tmp_path / "runs.json"
    assert robustness.main(["--root", str(tmp_path), "--requests", "300", "--trace-seeds", "0,2",
                            "--seeds", "0,1", "--workers", "1", "--json-out", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert sorted((r["trace"], r["seed"]) for r in runs) == sorted(
        (str(tmp_path / folder / f"{name}.jsonl"), seed) for folder in ("traces", "traces_s2")
        for name in mt.MIXES for seed in (0, 1))
    assert all(0.0 < r["of_bound"] <= 1.0 for r in runs)  # no schedule beats the bound
    table = capsys.readouterr().out
    assert f"| all | {len(runs)} |" in table
    assert all(f"| {name} | 4 |" in table for name in mt.MIXES)


def test_sharing_loss_bench_splits_blends_missed_hits_over_sample_and_steps(tmp_path: Path) -> None:
    from bench import sharing_loss

    path = tmp_path / "trace.jsonl"
    mt.write_trace(path, mt.generate_mix("compute_high_sharing", 2000, 0)[0])
    out = sharing_loss.sharing_loss(path)
    (_, dfs_cached, _), (_, blend_cached, _) = out["totals"]
    (_, n_sample, lost_sample), (_, n_rest, lost_rest), *spans = out["rows"]
    assert n_sample > 0 and n_sample + n_rest == 2000
    assert lost_sample + lost_rest == dfs_cached - blend_cached  # every request counted once
    assert len(spans) == sharing_loss.PARTS
    assert sum(n for _, n, _ in spans) == n_rest and sum(t for *_, t in spans) == lost_rest


def test_scheduler_report_names_the_device_its_goals_were_judged_on() -> None:
    from bench.scheduler_report import device_label

    assert device_label({"overlap": None, "free_weights": False,
                         "step_overhead_s": None}) == "realistic defaults"
    # overlap 0 is a change (0.0 == False must not hide it)
    assert device_label({"overlap": 0.0, "free_weights": False, "step_overhead_s": 0.011}) == \
        "defaults changed: overlap 0.0, step overhead s 0.011"


def test_scheduler_report_reads_seed_lists() -> None:
    from bench.scheduler_report import parse_seeds

    assert parse_seeds("0-3") == [0, 1, 2, 3]
    assert parse_seeds("5,1-2,2") == [5, 1, 2]
    for bad in ("3-1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seeds(bad)


def test_scheduler_report_regenerates_a_trace_it_made_for_another_size_or_seed(
        tmp_path: Path) -> None:
    from bench.scheduler_report import ensure_trace

    path = tmp_path / "memory_low_sharing.jsonl"
    ensure_trace(path, "memory_low_sharing", 40, 1)
    first = path.read_text()
    ensure_trace(path, "memory_low_sharing", 40, 1)  # same size and seed: kept
    assert path.read_text() == first
    ensure_trace(path, "memory_low_sharing", 40, 2)
    assert path.read_text() != first and len(read_trace(path)) == 40
    ensure_trace(path, "memory_low_sharing", 30, 2)
    assert len(read_trace(path)) == 30
    path.with_suffix(".meta.json").unlink()  # a trace of the user's own: taken as it is
    ensure_trace(path, "memory_low_sharing", 50, 3)
    assert len(read_trace(path)) == 30


def _grid_row(trace: str, blend_s: float, best_s: float, fraction: float) -> dict:
    run = {"makespan_s": blend_s, "fraction_of_optimal": fraction, "prefix_sharing_ratio": 0.3}
    dfs = {"makespan_s": 1.3 * blend_s, "prefix_sharing_ratio": 0.3}
    return {"trace": trace, "blend": run, "nanoflow_dfs": dfs,
            "best": {"policy": "dfs@512", "makespan_s": best_s}}


def test_scheduler_report_counts_the_seeds_that_meet_each_goal() -> None:
    from bench.scheduler_report import seeds_markdown

    grids = {0: [_grid_row("a", 100.0, 110.0, 0.90), _grid_row("b", 100.0, 105.0, 0.86)],
             4: [_grid_row("a", 100.0, 99.0, 0.95), _grid_row("b", 100.0, 101.0, 0.84)]}
    text = seeds_markdown(grids)
    assert "| a | 0.990× (4) | 1 of 2 | 0.900 (0) | 2 of 2 |" in text
    assert "| b | 1.010× (4) | 2 of 2 | 0.840 (4) | 1 of 2 |" in text
    assert "best capped fcfs/dfs on each trace: 1 of 2 seeds (missed: 4)" in text
    assert "of the bound on each trace: 1 of 2 seeds (missed: 4)" in text
    assert "NanoFlow-DFS on average (lowest mean 1.300×): 2 of 2 seeds ✓" in text
