"""What the run shows about lengths: re-planning from it (RunLengths), the survival of the lengths
seen (Survival, Kaplan-Meier) and the KV forecast built on it (KvForecast)."""

import numpy as np
import pytest

from scheduler.dual_scan import BlendPolicy, KvPeak
from scheduler.dual_scan.memory import KvForecast
from scheduler.dual_scan.run_lengths import RunLengths, Survival
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.executor import SimConfig, simulate
from scheduler.simulate.run import TimedPolicy
from scheduler.simulate.trace import TraceEntry
from tests.scheduler.factories import h200_8b, make_request, toy_cost


class _PlanLog(TimedPolicy):
    """Forwards the AdmissionPolicy calls (as the simulator's run does), noting the mean
    estimate of each new plan."""

    def __init__(self, inner: BlendPolicy) -> None:
        super().__init__(inner)
        self.means: list[float] = []
        self._last = None

    def _note(self) -> None:
        plan = self.inner.plan
        if plan is not None and plan is not self._last and len(plan):
            self._last = plan
            self.means.append(float(plan.output.mean()))

    def admit(self, budget):
        out = super().admit(budget)
        self._note()
        return out

    def on_finish(self, request_id, output_len):
        super().on_finish(request_id, output_len)
        self._note()


def _plans_of_a_run(lengths, n=600, kv=8_000):
    """Simulate n requests of one family (too few for a warm-up sample: planned on the prior)
    whose request i outputs lengths[i % len(lengths)], in a KV that holds ~30 at a time; the
    mean estimate of every plan."""
    reqs = [make_request(64, prefix=[5] * 16, max_tokens=1024) for _ in range(n)]
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    pol = BlendPolicy(reqs, tree=tree, cost_model=h200_8b(), kv_capacity_tokens=kv,
                      step_tokens=2048)
    assert not pol.warmup_request_ids
    log = _PlanLog(pol)
    entries = [TraceEntry(r, lengths[i % len(lengths)]) for i, r in enumerate(reqs)]
    simulate(entries, log, h200_8b(), SimConfig(kv, 2048), tree)
    return log.means


def test_the_lengths_the_run_shows_re_plan_what_has_not_started():
    means = _plans_of_a_run([200])
    assert means[0] == 256 and len(means) >= 3  # the prior, then the run's lengths
    assert means[-1] == pytest.approx(200, rel=0.02)


def test_the_run_learns_from_old_starts_only_once_they_have_mostly_finished():
    # The 10-token requests finish first. Counting them with the long ones still running at the
    # plan's guess fed that guess back: 256, 247, 89, 69, then 332.
    means = _plans_of_a_run([10, 10, 1000])
    assert len(means) >= 2 and min(means[1:]) > 300
    assert means[-1] == pytest.approx(340, rel=0.05)


def test_run_lengths_count_only_requests_started_as_long_ago_as_the_longest_output():
    known = np.full(14, -1)
    known[13] = 7
    lengths = RunLengths(known, np.full(14, 1000))
    for req in range(14):
        lengths.started(req, {10: 10, 11: 90, 12: 20}.get(req, 0), 100.0)
    for req in range(10):
        lengths.finished(req, 50)
    lengths.finished(11, 3)  # started 10 steps ago: among the late starts the short finish first
    lengths.finished(13, 7)  # known length: not a sample
    old = dict.fromkeys(range(10), 50)
    assert lengths.samples(100, {10: 400.0}) == {**old, 10: 400}  # running: at its estimate
    # two of twelve still running: mostly the plan's own guesses, no samples
    assert lengths.samples(100, {10: 400.0, 12: 300.0}) == {}
    lengths.finished(10, 500)  # now the longest: nothing started 500 steps before step 100
    assert lengths.samples(100, {}) == {}


def test_kaplan_meier_counts_censored_lengths_at_risk_until_they_are_cut_off():
    # Ended at 1, 2 and 3; cut off at 2 and 4. At 2 four are at risk (2, 2, 3, 4), one ends.
    s = Survival.kaplan_meier(np.array([1.0, 2, 2, 3, 4]), np.array([1, 1, 0, 1, 0], dtype=bool))
    assert s(np.array([0.5, 1, 2, 2.5, 3, 9])) == pytest.approx([1, 0.8, 0.6, 0.6, 0.3, 0.3])


def test_run_survival_is_free_of_survivor_bias_and_trusts_only_outputs_the_model_ended():
    # 20 ended after 10 tokens while 80 still run at 50: the finished ones alone would say 10.
    n = 101
    lengths = RunLengths(np.full(n, -1), np.full(n, 100))
    for req in range(n):
        lengths.started(req, 0, 100.0)
    for req in range(15):
        lengths.finished(req, 10)
    lengths.finished(100, 100)  # reached max_tokens: cut off there, not an event
    running = np.arange(20, 100), np.full(80, 50.0)
    assert lengths.survival(*running) is None  # 15 events: too few to trust
    for req in range(15, 20):
        lengths.finished(req, 10)
    s = lengths.survival(*running)  # at 0.1: 20 of 101 at risk end (the cut-off one counts)
    assert s is not None and s(np.array([0.05, 0.1, 0.5, 0.99])) == pytest.approx([1] + [81 / 101] * 3)


def test_a_kv_forecast_of_known_lengths_is_the_kv_peak():
    # Lengths known: no uncertainty, the forecast's curve peaks where KvPeak's does.
    s = Survival(np.array([]), np.array([]))
    held, left = np.array([100.0, 40, 300]), np.array([50.0, 80, 20])
    forecast = KvForecast(s, 100.0, z=2.0)
    forecast.add(held, np.zeros(3), np.ones(3), left, np.ones(3, dtype=bool))
    peak = KvPeak(held, left)
    step_ahead = 4  # a token each: the executor keeps the next step's decode tokens free
    assert forecast.with_request(10.0, 60.0, 60.0, True) == peak.with_request(10.0, 60.0) + step_ahead
    # Far out, steps are taken in intervals: a request counts the KV it holds at an interval's
    # end, never more than its length allows.
    far = KvForecast(s, 20_000.0, z=2.0)
    far.add(np.array([100.0]), np.zeros(1), np.ones(1), np.array([5_000.0]), np.ones(1, dtype=bool))
    assert far.with_request(0.0, 1.0, 1.0, True) == 5_100.0 + 2


def test_a_kv_forecast_expects_uncertain_lengths_to_end_and_keeps_a_margin():
    # Half end after 10 tokens, the rest after 20 (in units of their estimate, 1 token).
    s = Survival(np.array([10.0, 20.0]), np.array([0.5, 0.0]))
    bounds = []
    for z in (0.0, 2.0):
        forecast = KvForecast(s, 40.0, z=z)
        forecast.add(np.zeros(100), np.zeros(100), np.ones(100), np.full(100, 40.0),
                     np.zeros(100, dtype=bool))
        bounds.append(forecast.with_request(0.0, 1.0, 1.0, False) - 101)  # a step ahead
    # 100 hold t + 1 tokens up to t = 9, and 50 of them to t = 19, each with p = 1/2
    assert bounds[0] == 1000 and bounds[1] == pytest.approx(1000 + 2 * np.sqrt(100 * 20**2 / 4))


def _cpu_run(lengths, n=400, kv=8_000):
    """Simulate n requests of unknown length (64-token prompts, max_tokens 256; request i
    outputs lengths[i % len(lengths)]) on a device with no overlap, in a KV far smaller than
    the batch: (steps, preemptions)."""
    reqs = [make_request(64, max_tokens=256) for _ in range(n)]
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    cost = toy_cost()
    pol = BlendPolicy(reqs, tree=tree, cost_model=cost, kv_capacity_tokens=kv, step_tokens=2048)
    entries = [TraceEntry(r, lengths[i % len(lengths)]) for i, r in enumerate(reqs)]
    result = simulate(entries, pol, cost, SimConfig(kv, 2048), tree)
    return result.steps, result.preemptions


def test_without_overlap_the_lengths_the_run_shows_let_more_requests_run_at_once(monkeypatch):
    # At max_tokens each request may hold 320 tokens: 25 fit. The outputs are 40-240 tokens.
    lengths = [40 + (i * 37) % 201 for i in range(50)]
    steps, preempted = _cpu_run(lengths)
    monkeypatch.setattr("scheduler.dual_scan.run_lengths.SURVIVAL_MIN_EVENTS", 10**9)
    steps_at_max, preempted_at_max = _cpu_run(lengths)
    assert preempted == preempted_at_max == 0
    assert steps < 0.85 * steps_at_max
