"""The simulator's accounting: exact lone-request times, KV bounds, cache hits, finishes, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scheduler.cost_model import CostModel, StepCoefficients
from scheduler.policies import make_policy
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate import (
    SimConfig,
    SimulationError,
    TraceEntry,
    executor,
    read_trace,
    run,
    simulate,
)
from scheduler.simulate.__main__ import main
from scheduler.types import PlanRequest, StepBudget

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {"policy", "requests", "makespan_s", "optimal_makespan_s", "fraction_of_optimal",
                 "prefix_sharing_ratio", "max_prefix_sharing_ratio", "throughput_tokens_per_s",
                 "plan_seconds", "leaves_split"}
COST = CostModel.default()


def make_entry(rid: str, prompt: list[int], d: int) -> TraceEntry:
    return TraceEntry(PlanRequest(rid, prompt, max_tokens=32768), d)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 100000, n).tolist()


def random_trace(n: int, seed: int = 0) -> list[TraceEntry]:
    """Requests in a few prefix groups with mixed output lengths."""
    rng = np.random.default_rng(seed)
    groups = [tokens(100 + g, int(rng.integers(20, 200))) for g in range(4)]
    out = []
    for i in range(n):
        prompt = groups[int(rng.integers(0, 4))] + tokens(1000 + i, int(rng.integers(1, 300)))
        out.append(make_entry(f"r{i}", prompt, int(rng.integers(1, 400))))
    return out


class OneAtATime:
    """A minimal local policy: admits the next request only when nothing runs (file order)."""

    def __init__(self, requests: list[PlanRequest], budget: int | None = None) -> None:
        self.pending = list(requests)
        self.running = 0
        self.budget = budget
        self.finished: list[tuple[str, int]] = []
        self.progress: list[tuple[str, int]] = []

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        if self.running or not self.pending:
            return []
        self.running = 1
        return [self.pending.pop(0)]

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return self.budget

    def on_finish(self, request_id: str, output_len: int) -> None:
        self.running = 0
        self.finished.append((request_id, output_len))

    def on_progress(self, request_id: str, generated: int) -> None:
        self.progress.append((request_id, generated))

    def has_pending(self) -> bool:
        return bool(self.pending)


class Counting:
    """Wraps a real policy and records every on_finish."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.finished: list[tuple[str, int]] = []

    def admit(self, budget):
        return self.inner.admit(budget)

    def prefill_budget(self, budget):
        return self.inner.prefill_budget(budget)

    def on_finish(self, request_id, output_len):
        self.finished.append((request_id, output_len))
        self.inner.on_finish(request_id, output_len)

    def on_progress(self, request_id, generated):
        self.inner.on_progress(request_id, generated)

    def has_pending(self):
        return self.inner.has_pending()


def run_alone(p: int, d: int, cost: CostModel = COST, step_tokens: int = 8192):
    entry = make_entry("a", tokens(1, p), d)
    policy = OneAtATime([entry.request])
    return simulate([entry], policy, cost, SimConfig(10**7, step_tokens))


def engine_steps(p: int, d: int, cap: int) -> list[tuple[int, int, int, int]]:
    """(tokens, rows, pairs, kv read) of each step the engine runs for a lone request: prompt
    chunks of `cap` tokens (the last samples the first token), then d − 1 one-token decodes
    reading the prompt and every token generated so far."""
    out, done = [], 0
    while done < p:
        q = min(cap, p - done)
        out.append((q, int(done + q == p), q * done + q * (q + 1) // 2, 0))
        done += q
    out += [(1, 1, 0, p + k) for k in range(1, d)]
    return out


def engine_time(cost: CostModel, p: int, d: int, cap: int) -> float:
    return sum(cost.step_time(t, kv, rows, pairs) for t, rows, pairs, kv in engine_steps(p, d, cap))


@pytest.mark.parametrize(("p", "d"), [(1000, 50), (20000, 3), (7, 1), (300, 2000)])
@pytest.mark.parametrize("overlap", [0.0, 0.8, 1.0])
def test_a_lone_request_costs_exactly_the_steps_the_engine_runs(p: int, d: int,
                                                                overlap: float) -> None:
    cost = CostModel(COST.shape, COST.hardware.idealised(overlap=overlap))
    result = run_alone(p, d, cost)
    assert result.steps == len(engine_steps(p, d, 8192)) == -(-p // 8192) + d - 1
    assert result.makespan_s == pytest.approx(engine_time(cost, p, d, 8192), rel=1e-9)


def test_without_overlap_a_lone_request_costs_its_comp_plus_mem_plus_a_weight_read_per_step():
    cost = CostModel(COST.shape, COST.hardware.idealised(overlap=0.0))
    p, d = 1000, 30
    result = run_alone(p, d, cost)
    # CostModel.mem counts d decode reads of p + k − ½; the engine reads p + k for k < d.
    mem = sum(p + k for k in range(1, d)) * cost.seconds_per_kv_token
    comp = cost.comp(p, d) - cost.seconds_per_token + p / 2 * cost.seconds_per_pair
    assert result.makespan_s == pytest.approx(comp + mem + d * cost.step_fixed_s, rel=1e-9)


def test_every_step_pays_the_weights_read_unless_idealised_away() -> None:
    assert COST.step_fixed_s == pytest.approx(8.03e9 * 2 / 4.8e12, rel=1e-3)  # 3.3 ms
    serial = COST.hardware.idealised(overlap=0.0)
    real = run_alone(1000, 30, CostModel(COST.shape, serial))
    ideal = run_alone(1000, 30, CostModel(COST.shape, serial.idealised(free_steps=True)))
    assert real.makespan_s - ideal.makespan_s == pytest.approx(30 * COST.step_fixed_s, rel=1e-9)
    overlapped = run_alone(1000, 30)  # the H200's own overlap hides part of it
    assert ideal.makespan_s < overlapped.makespan_s < real.makespan_s


@pytest.mark.parametrize("overlap", [0.0, 0.9])
def test_the_device_floor_bounds_every_order_and_counts_the_kv_capacitys_steps(
        overlap: float) -> None:
    cost = CostModel(COST.shape, COST.hardware.idealised(overlap=overlap))
    trace = random_trace(120, seed=5)
    tree = PrefixTree.build([e.request.prompt_token_ids for e in trace])
    for cap in (3000, 200_000):
        for policy in ("fcfs", "dfs", "blend"):
            fields, _ = run.run_trace(trace, cost, run.RunConfig(policy, cap, max_step_tokens=512))
            assert fields["device_floor_s"] <= fields["makespan_s"]
            assert 0 < fields["fraction_of_device_floor"] <= 1.0
    s_min = max(e.output_len for e in trace)
    roomy = run.device_floor(trace, cost, tree, s_min, 200_000)
    tight = run.device_floor(trace, cost, tree, s_min, 3000)  # the capacity forces more steps
    assert tight > roomy


def test_a_lone_requests_device_floor_is_within_a_step_of_its_time() -> None:
    cost = CostModel(COST.shape, COST.hardware.idealised(overlap=0.0))
    p, d = 1000, 30
    floor = run.device_floor([make_entry("a", tokens(1, p), d)], cost,
                             PrefixTree.build([tokens(1, p)]), d, 10**6)
    result = run_alone(p, d, cost)
    assert result.makespan_s - cost.step_fixed_s <= floor <= result.makespan_s


def test_policy_prefill_budget_paces_chunks() -> None:
    entry = make_entry("a", tokens(1, 1000), 5)
    result = simulate([entry], OneAtATime([entry.request], budget=256), COST, SimConfig(10**6))
    assert result.steps == 4 + 4  # 256 · 3 + 232 (which samples token 1), then four decodes
    assert result.prefill_tokens == 1000


def test_a_step_holds_at_most_max_step_tokens_decodes_included() -> None:
    trace = random_trace(60, seed=2)
    policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=10**6)
    result = simulate(trace, policy, COST, SimConfig(10**6, 256))
    held = result.step_prefill_tokens + result.step_decoding
    assert held.max() <= 256 and (held == 256).any()


def test_prefix_hit_is_counted_and_lru_eviction_drops_it() -> None:
    x, y = tokens(10, 100), tokens(11, 100)
    trace = [make_entry("a", x + tokens(12, 10), 1), make_entry("b", y + tokens(13, 10), 1),
             make_entry("c", x + tokens(14, 10), 1)]
    roomy = simulate(trace, OneAtATime([e.request for e in trace]), COST, SimConfig(1000))
    assert roomy.cached_prompt_tokens == 100
    assert roomy.request_cached_tokens.tolist() == [0, 0, 100]  # c's hit, in trace order
    first = roomy.request_first_step.tolist()
    assert first[0] == 0 and first[0] < first[1] < first[2] < roomy.steps  # one at a time
    assert roomy.prefill_tokens == 330 - 100
    assert roomy.prefix_sharing_ratio == pytest.approx(100 / 330)
    # Room for one prompt and its decode only: b evicts a's segments, so c misses.
    tight = simulate(trace, OneAtATime([e.request for e in trace]), COST, SimConfig(150))
    assert tight.cached_prompt_tokens == 0 and not tight.request_cached_tokens.any()
    assert tight.peak_kv_tokens <= 150


def test_a_prefix_a_waiting_request_needs_outlives_newer_unneeded_leaves() -> None:
    # The engine's eviction (runtime/radix_cache.py): a and d share x; b and b2 cache leaves no
    # waiting request needs; c needs room. LRU alone would drop x (the oldest); d waits for it.
    x = tokens(10, 100)
    trace = [make_entry("a", x + tokens(12, 10), 1), make_entry("b", tokens(11, 110), 1),
             make_entry("b2", tokens(13, 110), 1), make_entry("c", tokens(14, 110), 1),
             make_entry("d", x + tokens(15, 10), 1)]
    result = simulate(trace, OneAtATime([e.request for e in trace]), COST, SimConfig(400))
    assert result.request_cached_tokens.tolist() == [0, 0, 0, 0, 100]
    assert result.peak_kv_tokens <= 400


def test_dfs_with_a_large_cache_reaches_the_trees_max_sharing() -> None:
    trace = random_trace(200)
    tree = PrefixTree.build([e.request.prompt_token_ids for e in trace])
    policy = make_policy("dfs", [e.request for e in trace], kv_capacity_tokens=10**6)
    result = simulate(trace, policy, COST, SimConfig(10**6))
    assert result.prefix_sharing_ratio == pytest.approx(tree.max_sharing_ratio(), abs=1e-12)


@pytest.mark.parametrize("name", ["fcfs", "dfs", "balance", "blend"])
def test_every_request_finishes_exactly_once_with_its_true_length(name: str) -> None:
    trace = random_trace(300, seed=3)
    policy = Counting(make_policy(name, [e.request for e in trace], kv_capacity_tokens=20000,
                                  cost_model=COST, sample_rate=0.05))
    result = simulate(trace, policy, COST, SimConfig(20000))
    assert sorted(policy.finished) == sorted((e.request.id, e.output_len) for e in trace)
    assert result.output_tokens == sum(e.output_len for e in trace)


class InTurns:
    """Admits one request a step, in file order; the last `ahead` of them ahead of the queue."""

    def __init__(self, requests: list[PlanRequest], ahead: int, budget: int) -> None:
        self.pending, self.ahead, self.budget = list(requests), ahead, budget
        self.finished: list[str] = []
        self._ahead = 0

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        self._ahead = int(len(self.pending) <= self.ahead)
        return [self.pending.pop(0)] if self.pending else []

    def ahead_of_queue(self) -> int:
        return self._ahead

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return self.budget

    def on_finish(self, request_id: str, output_len: int) -> None:
        self.finished.append(request_id)

    def on_progress(self, request_id: str, generated: int) -> None:
        pass

    def has_pending(self) -> bool:
        return bool(self.pending)


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_request_the_policy_puts_ahead_prefills_before_the_queued_prompts(ahead: int) -> None:
    # a, b and c queue one a step behind each other, 100 prefill tokens a step; c, the last,
    # goes before b (still waiting) when the policy says so, never before a (part-way in)
    entries = [make_entry("a", tokens(1, 300), 1), make_entry("b", tokens(2, 300), 1),
               make_entry("c", tokens(3, 50), 1)]
    policy = InTurns([e.request for e in entries], ahead, budget=100)
    simulate(entries, policy, COST, SimConfig(10**6, 8192))
    assert policy.finished == (["a", "c", "b"] if ahead else ["a", "b", "c"])


def test_kv_capacity_is_never_exceeded_and_preempted_requests_recompute() -> None:
    trace = random_trace(120, seed=5)
    cap = 3000
    seen: list[int] = []
    original = executor._Run.after_step

    def spy(self) -> None:
        original(self)
        seen.append(self.used())

    executor._Run.after_step = spy
    try:
        policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=cap)
        result = simulate(trace, policy, COST, SimConfig(cap))
    finally:
        executor._Run.after_step = original
    assert max(seen) <= cap and result.peak_kv_tokens == max(seen)
    assert result.preemptions > 0  # fcfs guesses 256 output tokens; many need more
    computed = result.prompt_tokens - result.cached_prompt_tokens
    assert result.prefill_tokens > computed  # recomputation shows up as extra prefill


def test_fast_forward_changes_nothing_but_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = random_trace(150, seed=7)

    def run():
        policy = make_policy("dfs", [e.request for e in trace], kv_capacity_tokens=6000)
        return simulate(trace, policy, COST, SimConfig(6000))

    fast = run()
    monkeypatch.setattr(executor._Run, "fast_forward", lambda self: False)
    slow = run()
    assert fast.steps == slow.steps and fast.preemptions == slow.preemptions
    assert fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-12)
    np.testing.assert_allclose(fast.step_memory_s, slow.step_memory_s, rtol=1e-12)


def test_progress_reports_grow_and_stay_below_the_output_length() -> None:
    entry = make_entry("a", tokens(1, 50), 700)
    policy = OneAtATime([entry.request])
    simulate([entry], policy, COST, SimConfig(10**5))
    assert [g for _, g in policy.progress] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


@pytest.mark.parametrize(("p", "d"), [(500, 1), (300, 200)])
def test_request_larger_than_the_cache_is_an_error(p: int, d: int) -> None:
    entry = make_entry("a", tokens(1, p), d)
    with pytest.raises(SimulationError):
        simulate([entry], OneAtATime([entry.request]), COST, SimConfig(400))


def write_trace(path: Path, trace: list[TraceEntry]) -> None:
    with path.open("w") as f:
        for e in trace:
            f.write(json.dumps({"id": e.request.id, "prompt_token_ids": list(e.request.prompt_token_ids),
                                "output_len": e.output_len}) + "\n")


def test_trace_round_trip_hides_the_output_length_from_the_planner(tmp_path: Path) -> None:
    trace = random_trace(20)
    write_trace(tmp_path / "t.jsonl", trace)
    back = read_trace(tmp_path / "t.jsonl")
    assert [(e.request.id, list(e.request.prompt_token_ids), e.output_len) for e in back] == \
        [(e.request.id, list(e.request.prompt_token_ids), e.output_len) for e in trace]
    assert all(e.request.known_output_len is None for e in back)


def test_cli_prints_one_json_line_with_the_required_keys(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(200))
    assert main([str(tmp_path / "t.jsonl"), "--policy", "blend", "--sample-rate", "0.05",
                 "--plot", str(tmp_path / "u.png"), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert REQUIRED_KEYS <= report.keys()
    assert 0 < report["fraction_of_optimal"] <= 1.0
    assert report["prefix_sharing_ratio"] <= report["max_prefix_sharing_ratio"] + 1e-12
    assert (tmp_path / "u.png").stat().st_size > 0


def test_cli_plan_only_leaves_simulation_fields_null(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(200))
    assert main([str(tmp_path / "t.jsonl"), "--policy", "blend", "--plan-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["makespan_s"] is None and report["fraction_of_optimal"] is None
    assert report["plan_seconds"] >= 0 and isinstance(report["leaves_split"], int)


def test_module_entry_point_and_no_overlap(tmp_path: Path) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(50))
    runs = {}
    for flag in ([], ["--no-overlap"]):
        proc = subprocess.run([sys.executable, "-m", "scheduler.simulate", str(tmp_path / "t.jsonl"),
                               "--policy", "dfs", *flag, "--json"], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        runs[bool(flag)] = json.loads(proc.stdout)
    assert runs[True]["makespan_s"] > runs[False]["makespan_s"]
    assert REQUIRED_KEYS <= runs[True].keys()


def test_cli_reads_a_measured_hardware_profile(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(30))
    profile = {"name": "measured", "flops": 1e12, "bandwidth_bytes_per_s": 1e11,
               "kv_capacity_bytes": 131072 * 5000}
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    assert main([str(tmp_path / "t.jsonl"), "--policy", "fcfs", "--hardware",
                 str(tmp_path / "hw.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"] == "measured" and report["kv_capacity_tokens"] == 5000
    assert report["peak_kv_tokens"] <= 5000


def test_the_step_cap_is_the_profiles_device_default_unless_given(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(30))
    profile = {"name": "measured", "flops": 1e12, "bandwidth_bytes_per_s": 1e11,
               "kv_capacity_bytes": 131072 * 5000, "default_step_tokens": 8192}
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    for flags, cap in (([], 8192), (["--max-step-tokens", "512"], 512)):
        assert main([str(tmp_path / "t.jsonl"), "--policy", "fcfs", "--hardware",
                     str(tmp_path / "hw.json"), *flags, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["max_step_tokens"] == cap
    assert main([str(tmp_path / "t.jsonl"), "--policy", "fcfs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_step_tokens"] == 2048  # the GPU profiles'


def test_a_step_overhead_costs_every_step_once_and_a_measured_profile_refuses_it(
        tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(60))
    runs = []
    for flags in ([], ["--step-overhead-s", "0.011"]):
        assert main([str(tmp_path / "t.jsonl"), "--policy", "dfs", *flags, "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    plain, slow = runs
    assert slow["steps"] == plain["steps"]  # the same schedule, each step 11 ms dearer
    assert slow["makespan_s"] == pytest.approx(plain["makespan_s"] + 0.011 * plain["steps"])
    assert slow["step_fixed_s"] == pytest.approx(plain["step_fixed_s"] + 0.011)
    profile = {"name": "measured", "flops": 1e12, "bandwidth_bytes_per_s": 1e11,
               "kv_capacity_bytes": 131072 * 5000,
               "step_model": {"step_fixed_s": 0.02, "s_per_token": 1e-4, "s_per_row": 1e-4,
                              "s_per_kv_token": 1e-6}}
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    hw = [str(tmp_path / "t.jsonl"), "--policy", "dfs", "--hardware", str(tmp_path / "hw.json")]
    assert main([*hw, "--json"]) == 0  # its fitted fixed cost holds the overhead already
    capsys.readouterr()
    assert main([*hw, "--step-overhead-s", "0.011", "--json"]) == 2
    assert "datasheet" in capsys.readouterr().err


@pytest.mark.parametrize("cut", ["stratified", "sampled"])
def test_dp_shards_cover_the_batch_once_and_the_slowest_sets_the_makespan(
        tmp_path: Path, capsys, cut: str) -> None:
    trace = random_trace(300, seed=11)
    write_trace(tmp_path / "t.jsonl", trace)
    assert main([str(tmp_path / "t.jsonl"), "--policy", "blend", "--dp", "3", "--dp-cut", cut,
                 "--sample-rate", "0.05", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    shards = report["shards"]
    assert REQUIRED_KEYS <= report.keys() and len(shards) == 3
    assert all(REQUIRED_KEYS <= s.keys() for s in shards)
    assert sum(s["requests"] for s in shards) == 300
    assert sum(s["output_tokens"] for s in shards) == sum(e.output_len for e in trace)
    assert report["makespan_s"] == max(s["makespan_s"] for s in shards)
    comp, mem = run.trace_totals(trace, COST)
    s_min = max(s["min_steps"] for s in shards)
    assert report["optimal_makespan_s"] == pytest.approx(
        COST.optimal_makespan(comp / 3, mem / 3, report["max_prefix_sharing_ratio"], s_min))


def test_per_step_records_add_up_and_go_to_csv(tmp_path: Path, capsys) -> None:
    trace = random_trace(100, seed=13)
    cap = 8000
    policy = make_policy("dfs", [e.request for e in trace], kv_capacity_tokens=cap)
    result = simulate(trace, policy, COST, SimConfig(cap))
    assert result.step_prefill_tokens.sum() == result.prefill_tokens
    # the step that completes a prompt samples its first token; a preempted request's
    # recompute samples one more, so each preemption saves one decode step
    assert result.step_decoding.sum() == result.output_tokens - result.requests - result.preemptions
    assert result.step_kv_used.max() <= cap
    write_trace(tmp_path / "t.jsonl", trace)
    assert main([str(tmp_path / "t.jsonl"), "--policy", "dfs", "--kv-tokens", str(cap),
                 "--steps-csv", str(tmp_path / "s.csv"), "--json"]) == 0
    rows = (tmp_path / "s.csv").read_text().splitlines()
    assert rows[0].startswith("step,start_s,dt_s") and len(rows) == result.steps + 1
    assert json.loads(capsys.readouterr().out)["steps"] == result.steps


def test_with_cascade_attention_decodes_read_a_shared_prefix_once() -> None:
    shared = tokens(5, 64)  # four pages of 16
    trace = [make_entry(f"c{i}", shared + tokens(40 + i, 10), 5) for i in range(3)]

    def first_decode_read(cascade: bool) -> float:
        cost = CostModel(COST.shape, COST.hardware.idealised(overlap=0.0))
        if cascade:
            cost = CostModel(cost.shape, replace(cost.hardware, cascade=True))
        policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=10**5)
        result = simulate(trace, policy, cost, SimConfig(10**5))
        return (result.step_memory_s[1] - cost.weights_read_s) / cost.seconds_per_kv_token

    plain = 3 * (74 + 1)  # each decode reads its prompt and its first token
    assert first_decode_read(False) == pytest.approx(plain)
    assert first_decode_read(True) == pytest.approx(plain - 2 * 64)


def test_where_a_profile_prices_shared_reads_apart_nested_prefixes_count_page_by_page() -> None:
    # As the CPU runtime logs them (tests/runtime/test_engine.py): four prompts on 64 tokens,
    # two of them on 32 more; each page another decode reads too costs the shared rate.
    shared, more = tokens(5, 64), tokens(6, 32)
    trace = [make_entry(f"n{i}", shared + more + tokens(40 + i, 10), 5) for i in range(2)] + [
        make_entry(f"s{i}", shared + tokens(50 + i, 10), 5) for i in range(2)]
    step = StepCoefficients(step_fixed_s=0.01, s_per_token=1e-4, s_per_row=0.0, s_per_pair=0.0,
                            s_per_kv_token=2e-6, s_per_shared_kv_token=5e-7)
    cost = CostModel(COST.shape, replace(COST.hardware.idealised(overlap=0.0), measured=step))
    policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=10**5)
    result = simulate(trace, policy, cost, SimConfig(10**5))
    reads, again = 2 * (106 + 1) + 2 * (74 + 1), 3 * 64 + 32
    assert result.step_memory_s[1] == pytest.approx((reads - again) * 2e-6 + again * 5e-7)


def test_the_share_of_requests_drawn_at_random_pays_the_sampling_time_of_their_rows() -> None:
    trace = [make_entry(f"r{i}", tokens(i, 40), 6) for i in range(4)]
    step = StepCoefficients(step_fixed_s=0.01, s_per_token=1e-4, s_per_row=0.0, s_per_pair=0.0,
                            s_per_kv_token=1e-6, s_per_sampled_row=1e-3)
    cost = CostModel(COST.shape, replace(COST.hardware.idealised(overlap=0.0), measured=step))

    def compute(share: float) -> np.ndarray:
        policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=10**5)
        return simulate(trace, policy, cost, SimConfig(10**5, sampled_share=share)).step_compute_s

    # 6 steps of 4 rows: half of them drawn at random, 1 ms each
    assert compute(0.5) - compute(0.0) == pytest.approx([2e-3] * 6)


def test_cascade_groups_are_the_decodes_on_the_same_first_page_as_in_the_runtime() -> None:
    # Two system prompts behind a common 8-token header (a chat template's): the runtime groups
    # decodes by their first KV page, so each system prompt's pair reads its 72 shared tokens
    # (4 whole pages) once. Grouping by the header's tree node saw one group sharing 8 tokens.
    header = tokens(7, 8)
    trace = [make_entry(f"c{i}", header + tokens(5 + i % 2, 64) + tokens(40 + i, 10), 5)
             for i in range(4)]
    cost = CostModel(COST.shape, replace(COST.hardware.idealised(overlap=0.0), cascade=True))
    policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=10**5)
    result = simulate(trace, policy, cost, SimConfig(10**5))
    read = (result.step_memory_s[1] - cost.weights_read_s) / cost.seconds_per_kv_token
    assert read == pytest.approx(4 * (82 + 1) - 2 * 64)


def test_a_cached_prefix_that_would_start_a_prompt_is_not_also_counted_as_free() -> None:
    # As the engine: "x" leaves 40 tokens cached and unpinned; "b" shares them and needs 8 more,
    # but once it starts they are pinned, so beside "a" (growing to 90) they are no room for it.
    x = tokens(3, 40)
    trace = [make_entry("x", x, 1), make_entry("a", tokens(1, 60), 30),
             make_entry("b", x + tokens(2, 8), 4)]
    policy = OneAtATime([e.request for e in trace])
    policy.admit = lambda budget: [policy.pending.pop(0)] if policy.pending else []  # one a step
    result = simulate(trace, policy, COST, SimConfig(104, 64))
    assert result.preemptions == 0 and result.prefill_aborts == 0


def test_a_prompt_waits_until_it_fits_beside_the_decodes_instead_of_being_torn_down() -> None:
    # As the engine (tests/runtime/test_engine.py): "a" grows to 90 of 96 tokens, and "b"'s
    # 40-token prompt, started beside it, would be torn down as a's decodes need the room.
    trace = [make_entry("a", tokens(1, 60), 30), make_entry("b", tokens(2, 40), 4)]
    policy = OneAtATime([e.request for e in trace])
    policy.admit = lambda budget: [policy.pending.pop(0)] if policy.pending else []  # one a step
    result = simulate(trace, policy, COST, SimConfig(96, 64))
    assert result.preemptions == 0 and result.prefill_aborts == 0
    assert result.prefill_tokens == 100


def test_until_the_kv_pool_is_full_every_token_written_pays_a_first_write() -> None:
    from scheduler.cost_model import StepCoefficients

    step = StepCoefficients(step_fixed_s=0.01, s_per_token=1e-4, s_per_row=1e-5, s_per_pair=1e-8,
                            s_per_kv_token=1e-6)
    warm = CostModel(COST.shape, replace(COST.hardware, overlap=0.0, measured=step))
    fresh = CostModel(COST.shape, replace(warm.hardware, measured=replace(
        step, s_per_fresh_kv_token=5e-5)))
    trace, cap = random_trace(120, seed=5), 3000

    def run(cost: CostModel):
        policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=cap)
        return simulate(trace, policy, cost, SimConfig(cap))

    a, b = run(warm), run(fresh)
    assert a.steps == b.steps and a.preemptions == b.preemptions > 0
    # the KV a run writes is many times the pool: once it is full, pages are used again
    assert a.prefill_tokens + a.output_tokens > 3 * cap
    assert b.makespan_s - a.makespan_s == pytest.approx(cap * 5e-5, rel=1e-9)
    policy = make_policy("fcfs", [e.request for e in trace], kv_capacity_tokens=cap)
    used_before = simulate(trace, policy, fresh, SimConfig(cap, fresh_kv_tokens=0))  # a worker's
    assert used_before.makespan_s == pytest.approx(a.makespan_s, rel=1e-12)  # later batch
    small = trace[:3]  # a run that never fills the pool pays for every token it writes
    policy = make_policy("fcfs", [e.request for e in small], kv_capacity_tokens=10**6)
    c = simulate(small, policy, fresh, SimConfig(10**6))
    policy = make_policy("fcfs", [e.request for e in small], kv_capacity_tokens=10**6)
    d = simulate(small, policy, warm, SimConfig(10**6))
    written = c.prefill_tokens + c.output_tokens - len(small)  # the prefill samples the first
    assert c.makespan_s - d.makespan_s == pytest.approx(written * 5e-5, rel=1e-9)


def test_cli_sampled_share_costs_a_measured_profiles_sampling(tmp_path: Path, capsys) -> None:
    write_trace(tmp_path / "t.jsonl", random_trace(30))
    step = {"step_fixed_s": 0.01, "s_per_token": 1e-4, "s_per_kv_token": 1e-6,
            "s_per_sampled_row": 1e-3}
    profile = {"name": "measured", "flops": 1e12, "bandwidth_bytes_per_s": 1e11,
               "kv_capacity_bytes": 131072 * 5000, "step_model": step}
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    makespan = {}
    for share in ("0", "1"):
        assert main([str(tmp_path / "t.jsonl"), "--policy", "fcfs", "--hardware",
                     str(tmp_path / "hw.json"), "--sampled-share", share, "--json"]) == 0
        makespan[share] = json.loads(capsys.readouterr().out)["makespan_s"]
    assert makespan["1"] > makespan["0"]
    assert main([str(tmp_path / "t.jsonl"), "--policy", "fcfs", "--sampled-share", "2"]) == 2
    assert "--sampled-share must be between 0 and 1" in capsys.readouterr().err
