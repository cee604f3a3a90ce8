"""Latest-start packing of a KV-bound batch (scheduler.dual_scan.stagger) and the `blend` policy
that follows it where the lengths left are known or may all be max_tokens."""

import numpy as np
import pytest

from scheduler.dual_scan import BlendPolicy, KvPeak
from scheduler.dual_scan.run_lengths import EARLY_ENDS, SURVIVAL_MIN_EVENTS, RunLengths
from scheduler.dual_scan.stagger import BLOCK, REPACK_STEPS, Stagger, latest_starts
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.executor import SimConfig, simulate
from scheduler.simulate.trace import TraceEntry
from tests.scheduler.factories import make_request, toy_cost

NOTHING_RUNS = KvPeak(np.zeros(0), np.zeros(0))


def _kv_held(starts: np.ndarray, own: np.ndarray | float, steps: int) -> np.ndarray:
    """KV held at each step by requests holding `own` tokens (each, or all alike) and decoding
    `steps` each when started at `starts` (a token more each step, from the first)."""
    used = np.zeros(int(starts.max()) + steps)
    for s, p in zip(starts.astype(int), np.broadcast_to(own, starts.shape)):
        used[s:s + steps] += p + np.arange(1, steps + 1)
    return used


# 40 requests of 80 KV tokens + 256 output, in a KV where one wave holds 35: admitting
# whenever the peak fits runs a second 256-step wave for the last 5 (512 steps).
N, HELD, STEPS = 40, 80.0, 256
CAPACITY = 35 * (HELD + STEPS)


def _packed_past_the_kv() -> tuple[np.ndarray, float]:
    packed = latest_starts(NOTHING_RUNS, np.full(N, HELD), np.full(N, float(STEPS)), CAPACITY)
    assert packed is not None
    return packed


def test_a_batch_just_past_the_kv_starts_a_few_requests_now_and_the_rest_staggered():
    starts, makespan = _packed_past_the_kv()
    assert np.all(np.diff(starts) >= 0) and starts[0] == 0  # plan order; the first now
    assert 0 < np.count_nonzero(starts == 0) < N / 2
    assert makespan < 0.8 * 2 * STEPS and starts.max() + STEPS <= makespan
    assert _kv_held(starts, HELD, STEPS).max() <= CAPACITY


def test_each_request_starts_as_soon_as_the_cache_has_room_within_the_makespan():
    # Packed backwards, the first requests started alone, one a block apart; each now starts
    # where one block sooner would overflow the KV (or pass the one before it), so more of
    # them start now and early ends show sooner. The makespan stays.
    starts, makespan = _packed_past_the_kv()
    assert np.count_nonzero(starts == 0) > 1 and starts.max() + STEPS <= makespan
    for j in np.flatnonzero(starts > 0):
        sooner = starts.copy()
        sooner[j] -= BLOCK
        assert sooner[j] < starts[j - 1] or _kv_held(sooner, HELD, STEPS).max() > CAPACITY


def test_no_packing_far_from_the_end_of_the_batch():
    # Ten waves' worth: what a packing gains is the last waves', and it costs time in the
    # number of requests (quadratic over a batch), so the requests start as they fit.
    n, held, steps = 350, 80.0, 256
    capacity = 35 * (held + steps)
    assert latest_starts(NOTHING_RUNS, np.full(n, held), np.full(n, float(steps)), capacity) is None


def test_requests_that_all_fit_are_not_held_back():
    stagger = Stagger()
    prompt = np.full(10, 64.0)
    stagger.pack(0, 7, NOTHING_RUNS, prompt, prompt, np.full(10, 100.0), 10_000.0)
    assert stagger.due(0) == 17


def test_no_stagger_where_starting_as_soon_as_each_fits_is_as_short():
    # Long prompts, one-token outputs: each holds the same KV throughout, waves are optimal.
    prompt, output = np.full(30, 1_000.0), np.ones(30)
    assert latest_starts(NOTHING_RUNS, prompt, output, 10_100.0) is None
    stagger = Stagger()
    stagger.pack(0, 0, NOTHING_RUNS, prompt, prompt, output, 10_100.0)
    assert stagger.due(0) == 30  # each starts as soon as it fits


def test_requests_pack_around_the_running_ones():
    # 30 running hold 200 tokens and decode 100 more; 30 waiting (80 + 256) cannot all fit
    # until they finish.
    running = KvPeak(np.full(30, 200.0), np.full(30, 100.0))
    capacity = 36 * 336.0
    n, held, steps = 30, 80.0, 256
    packed = latest_starts(running, np.full(n, held), np.full(n, float(steps)), capacity)
    assert packed is not None
    starts, _ = packed
    used = _kv_held(starts, held, steps)
    used[:100] += 30 * 200.0 + 30 * np.arange(1, 101)
    assert used.max() <= capacity


def _held_with_prefix(starts: np.ndarray, prompt: np.ndarray, steps: int, prefix: float) -> float:
    """The most KV held at once when the first two requests share `prefix` tokens of their
    prompts (held until both have ended) and each holds its own part plus a token a step."""
    used = _kv_held(starts, prompt - np.array([prefix, prefix, 0.0]), steps)
    used[int(starts[0]):int(starts[:2].max()) + steps] += prefix
    return float(used.max())


def test_a_shared_prefix_stays_held_until_the_last_request_sharing_it_ends(monkeypatch):
    # B shares A's 1,000-token prefix and adds 100; C (2,000) shares nothing. Packed as if
    # each held only its own tokens, C ends with B past the KV: A has ended, its prefix not.
    monkeypatch.setattr("scheduler.dual_scan.stagger.MAX_SHARED_SHARE", 0.25)
    prompt, output = np.array([1116.0, 1116, 2016]), np.full(3, 500.0)  # a page of slack each
    held, shared = prompt - np.array([0.0, 1000, 0]), np.array([0.0, 1000, 0])
    unshared = latest_starts(NOTHING_RUNS, held, output, 4_000.0)
    assert unshared is not None and _held_with_prefix(unshared[0], prompt, 500, 1000) > 4_000
    packed = latest_starts(NOTHING_RUNS, held, output, 4_000.0, shared=shared)
    assert packed is not None and _held_with_prefix(packed[0], prompt, 500, 1000) <= 4_000
    assert packed[1] < 0.98 * 1_000  # waves: A and B, then C after 500 steps


def test_no_packing_where_shared_prefixes_would_hold_much_of_the_kv():
    # 40 requests in groups of 4 on 400-token prefixes, in a KV that holds 88% of them at
    # their peak: the 4,000 tokens the groups share, counted as held throughout, are a quarter
    # of it, and the packing would rest on that. It does not pack.
    n, steps = 40, 256
    shared = np.array([0.0 if i % 4 == 0 else 400.0 for i in range(n)])
    held, output = 480.0 - shared, np.full(n, float(steps))
    capacity = 0.88 * float(np.sum(held + steps))
    assert latest_starts(NOTHING_RUNS, held, output, capacity) is not None
    assert latest_starts(NOTHING_RUNS, held, output, capacity, shared=shared) is None


def test_the_packing_is_followed_until_stale():
    n, held, steps = 40, 80.0, 256
    stagger = Stagger()
    prompt = np.full(n, held - 16)  # and a page of slack each (page_slack)
    stagger.pack(100, 0, NOTHING_RUNS, prompt, prompt, np.full(n, float(steps)),
                 35 * (held + steps))
    due = [stagger.due(100 + t) for t in range(0, 200, BLOCK)]
    assert 0 < due[0] < n and due == sorted(due) and due[-1] > due[0]
    assert not stagger.stale(100 + REPACK_STEPS - 1, 0) and stagger.stale(100 + REPACK_STEPS, 0)
    assert stagger.stale(101, n)  # every request of the packing has started


def test_outputs_may_all_run_to_max_tokens_until_the_run_shows_them_ending_early():
    n = 40
    lengths = RunLengths(np.full(n, -1), np.full(n, 100))
    assert lengths.may_all_run_to_max  # nothing has run
    for req in range(n):
        lengths.started(req, 0, 100.0)
    for req in range(EARLY_ENDS - 1):
        lengths.finished(req, 30)
    for req in range(10, 30):
        lengths.finished(req, 100)
    assert lengths.may_all_run_to_max  # three early ends of 40: what a run mostly to max shows
    lengths.finished(n - 1, 30)
    assert lengths.may_all_run_to_max  # four, under a fifth of those started
    for req in (n - 2, n - 3, n - 4):
        lengths.finished(req, 30)
    assert lengths.may_all_run_to_max  # seven
    lengths.finished(n - 5, 30)
    assert not lengths.may_all_run_to_max  # eight of 40: a fifth


def test_early_ends_past_the_survival_threshold_end_the_bet_on_max_tokens():
    n = 200
    lengths = RunLengths(np.full(n, -1), np.full(n, 100))
    for req in range(n):
        lengths.started(req, 0, 100.0)
    for req in range(SURVIVAL_MIN_EVENTS):
        lengths.finished(req, 30)  # 16 of 200: under a fifth, but a survival curve
    assert not lengths.may_all_run_to_max


def _run_to_max_tokens(known: bool, n: int = 80) -> tuple[int, int]:
    """Simulate n requests that run to their max_tokens of 256 (64-token prompts; the length
    known, or not) on a device with no overlap, in a KV that holds 90% of them at their peak:
    (steps, preemptions)."""
    reqs = [make_request(64, 256 if known else None, max_tokens=256) for _ in range(n)]
    result = _simulate_blend(reqs, [256] * n, toy_cost(), int(0.9 * n * (64 + 16 + 256)))
    return result.steps, result.preemptions


def _simulate_blend(reqs: list, outs: list[int], cost, kv: int):
    """blend on `reqs` whose outputs run `outs` tokens, in `kv` KV tokens at 2048-token steps."""
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    pol = BlendPolicy(reqs, tree=tree, cost_model=cost, kv_capacity_tokens=kv, step_tokens=2048)
    return simulate([TraceEntry(r, o) for r, o in zip(reqs, outs)], pol, cost, SimConfig(kv, 2048),
                    tree)


@pytest.mark.parametrize("known", [True, False], ids=["known", "unknown"])
def test_blend_staggers_a_batch_just_past_the_kv_that_runs_to_max_tokens(monkeypatch, known):
    # Unknown lengths: the bet on max_tokens holds, as no output ends early.
    steps, preempted = _run_to_max_tokens(known)
    assert preempted == 0 and steps < 0.8 * 512
    monkeypatch.setattr("scheduler.dual_scan.stagger.MIN_GAIN", 1.0)  # never stagger
    waves, preempted = _run_to_max_tokens(known)
    assert preempted == 0 and waves == pytest.approx(512, abs=8)


def _bimodal_run(cost, n: int = 120) -> tuple[int, int, float]:
    """Simulate n requests of 64-token prompts and max_tokens 256 of unknown length, half of
    them ending within 30 tokens and half running to 256, in a KV that holds 70% of their
    peaks: (steps, preemptions, seconds)."""
    rng = np.random.default_rng(0)
    outs = [int(rng.integers(5, 31)) if rng.random() < 0.5 else 256 for _ in range(n)]
    reqs = [make_request(64, None, max_tokens=256) for _ in range(n)]
    result = _simulate_blend(reqs, outs, cost, int(0.7 * sum(64 + 16 + o for o in outs)))
    return result.steps, result.preemptions, result.makespan_s


def _started_and_held(cost) -> tuple[int, int, float, int, float]:
    """_bimodal_run as blend runs it (steps, preemptions, seconds), then with no tail ever
    started (TAIL_SHARE 0: steps, seconds)."""
    steps, preempted, seconds = _bimodal_run(cost)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("scheduler.dual_scan.memory.TAIL_SHARE", 0.0)
        held, _, held_seconds = _bimodal_run(cost)
    return steps, preempted, seconds, held, held_seconds


def test_a_small_tail_starts_where_a_preemption_costs_less_than_its_steps():
    # Steps that cost 100x a token (a weights read; a CPU's are ~30x): the forecast would hold
    # the last requests until the long half ends, then they decode alone (512 steps); started,
    # a few are preempted, recompute and keep what they generated.
    steps, preempted, seconds, held, held_seconds = _started_and_held(toy_cost(bandwidth=1e10))
    assert steps < 0.7 * 512 and preempted <= 4
    assert held > 480 and seconds < 0.95 * held_seconds
    # Steps that cost 4x a token (a slow CPU's recompute is ~0.3 of the steps held): still.
    steps, preempted, seconds, held, held_seconds = _started_and_held(toy_cost(bandwidth=2.5e11))
    assert steps < 0.7 * 512 and preempted <= 4 and held > 480 and seconds < held_seconds
    # Steps that cost about a token: the preemptions would cost more than the steps saved.
    steps, preempted, _ = _bimodal_run(toy_cost())
    assert steps > 480 and preempted == 0
