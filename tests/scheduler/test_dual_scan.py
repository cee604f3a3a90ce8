import itertools
from dataclasses import replace

import numpy as np
import pytest

from scheduler.dual_scan import (
    FILLER_KV_SHARE,
    PACE_LEAN_PAST,
    BlendPolicy,
    KvPeak,
    split_memory,
    steady_prefill,
)
from scheduler.dual_scan.policy import CRIT, KV_SHORT_OVERCOMMIT, RIGHT, RIGHT_MAX_SHARE
from scheduler.prefix_tree import PrefixTree
from scheduler.split import DEFAULT_KEEP_SHARING
from scheduler.types import PlanRequest, ahead_of_queue
from tests.scheduler.factories import h200_8b, make_budget, make_request, toy_cost


def _policy(reqs, capacity=200_000, sample_rate=0.0, cost=None):
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    return BlendPolicy(
        reqs,
        tree=tree,
        cost_model=cost or h200_8b(),
        kv_capacity_tokens=capacity,
        sample_rate=sample_rate,
    )


def _mix(n_compute=30, n_memory=10):
    compute = [make_request(2000, 8, prefix=[7] * 1500) for _ in range(n_compute)]
    memory = [make_request(100, 3000 + 100 * i) for i in range(n_memory)]
    return compute + memory


def _drive(policy, reqs, capacity=200_000, true_len=None, max_steps=100_000, finished_at=None):
    """A toy executor: admitted requests decode one token per step; returns the admission order
    (and fills `finished_at`: request -> admissions made before it finished)."""
    lens = true_len or {r.id: r.known_output_len or 1 for r in reqs}
    running: dict[str, int] = {}
    order: list[str] = []
    finished_at = {} if finished_at is None else finished_at
    for _ in range(max_steps):
        if not policy.has_pending() and not running:
            return order
        used = sum(
            len(next(r for r in reqs if r.id == i).prompt_token_ids) + g for i, g in running.items()
        )
        for r in policy.admit(make_budget(capacity, capacity - used, len(running), 0)):
            order.append(r.id)
            running[r.id] = 0
        policy.prefill_budget(make_budget(capacity, capacity - used, len(running), 0))
        for rid in list(running):
            running[rid] += 1
            policy.on_progress(rid, running[rid])
            if running[rid] >= lens[rid]:
                del running[rid]
                finished_at[rid] = len(order)
                policy.on_finish(rid, lens[rid])
    raise AssertionError("toy executor did not finish")


def test_memory_split_follows_the_density_formula():
    m_left, m_right = split_memory(rho_left=10.0, rho_right=0.5, rho_target=2.4, capacity=1000)
    assert m_left == pytest.approx(1000 * (2.4 - 0.5) / (10.0 - 0.5))
    assert m_left + m_right == 1000


def test_memory_split_is_clamped_to_the_capacity():
    assert split_memory(10.0, 0.5, 20.0, 1000) == (1000.0, 0.0)
    assert split_memory(10.0, 0.5, 0.1, 1000) == (0.0, 1000.0)


def test_equal_densities_give_all_memory_to_one_cursor():
    assert split_memory(1.0, 1.0, 1.0, 500) == (500.0, 0.0)


def test_steady_state_prefill_replaces_finishers():
    # M = 10_000 tokens of requests needing 100 + 50 → N = 66.7; C = N·p̄/d̄ = 66.7
    assert steady_prefill(10_000, 100, 100) == pytest.approx(10_000 / 150)


def _warm_batch(n=1000, max_tokens=32):
    # ~100 unique tokens + 32 out each in 256-token steps: ~400 predicted steps, a 20-step deadline
    return [make_request(140, prefix=[1] * 40 if i % 2 else [2] * 30, max_tokens=max_tokens)
            for i in range(n)]


def _warm_policy(reqs, sample_rate=0.01):
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    return BlendPolicy(reqs, tree=tree, cost_model=h200_8b(), kv_capacity_tokens=200_000,
                       sample_rate=sample_rate, step_tokens=256)


def test_the_sample_runs_beside_filler_work_and_the_plan_waits_for_its_lengths():
    reqs = _warm_batch()
    pol = _warm_policy(reqs)
    first = pol.admit(make_budget(200_000))
    samples = set(pol.warmup_request_ids)
    assert len(samples) == 10 and {r.id for r in first} == samples  # 1400 tokens queued
    filler = pol.admit(make_budget(200_000, running=10))  # the queue drained: fill the step
    assert filler and 256 <= sum(len(r.prompt_token_ids) for r in filler) < 256 + 140
    assert not samples & {r.id for r in filler} and pol.plan is None
    pol.prefill_budget(make_budget(200_000, running=len(first)))
    first = first + filler
    for r in first:
        if r.id not in samples:
            pol.on_finish(r.id, 7)
    more = pol.admit(make_budget(200_000, running=10))
    assert more and not samples & {r.id for r in more} and pol.plan is None
    for r in first[:10]:
        pol.on_finish(r.id, 20)
    pol.admit(make_budget(200_000, running=len(more)))
    assert pol.plan is not None and pol.warmup_steps == 1 and pol.censored == 0
    started = {r.id for r in first + more}
    planned = {reqs[i].id for i in pol.plan.order}
    assert not planned & started and len(planned) + len(started) == len(reqs)
    assert (pol.plan.output == 20).all()


def test_the_plan_does_not_wait_past_the_deadline_for_a_long_sample():
    reqs = _warm_batch()
    pol = _warm_policy(reqs)
    first = pol.admit(make_budget(200_000))
    samples = set(pol.warmup_request_ids)
    for step in range(1, 40):
        pol.prefill_budget(make_budget(200_000, running=len(first)))
        for r in first:
            if r.id in samples:
                pol.on_progress(r.id, step)
        pol.admit(make_budget(200_000, running=len(first)))
        if pol.plan is not None:
            break
    assert pol.plan is not None and pol.censored == 10
    assert pol.warmup_steps == pol.deadline_steps <= 0.05 * pol.predicted_steps + 1
    assert (pol.plan.output == 32).all()  # censored at g: at least 2g, capped by max_tokens


def _decode_until_planned(pol, running, decoding):
    """Steps of the warm-up in which `decoding` (of the `running` requests) each decode a
    token, until the policy plans."""
    step = 0
    while pol.plan is None:
        step += 1
        pol.prefill_budget(make_budget(200_000, running=len(running)))
        for r in decoding:
            pol.on_progress(r.id, step)
        pol.admit(make_budget(200_000, running=len(running)))


def test_a_censored_sample_outgrowing_its_estimate_triggers_a_replan():
    reqs = _warm_batch(max_tokens=4096)
    pol = _warm_policy(reqs)
    first = pol.admit(make_budget(200_000))
    samples = [r for r in first if r.id in set(pol.warmup_request_ids)]
    _decode_until_planned(pol, first, samples)
    planned = float(pol.plan.output.max())  # censored at g: 2g
    for r in samples[: pol.censored // 4]:  # a quarter run past their estimate (the prior)
        pol.on_progress(r.id, 256)
    assert pol.replans == 1 and pol.plan.output.max() > planned


def test_while_censored_samples_run_compute_leads_only_past_their_possible_overruns():
    reqs = _warm_batch(max_tokens=4096)
    pol = _warm_policy(reqs)
    first = pol.admit(make_budget(200_000))
    samples = [r for r in first if r.id in set(pol.warmup_request_ids)]
    short, long_ = samples[:5], samples[5:]
    for r, n in zip(short, (1, 1, 1, 1, 12)):  # one sample runs 12x its neighbours
        pol.on_finish(r.id, n)
    _decode_until_planned(pol, first, long_)
    assert pol.censored == 5 and pol.overrun > 2
    r_mem = 1.0
    r_comp = r_mem * (1 + pol.overrun) / 2  # more than the estimates' memory work, less than
    assert pol.compute_leads(r_comp, r_mem, 0)  # what the censored samples may overrun to
    assert not pol.compute_leads(r_comp, r_mem, 0, censored=True)


def test_where_kv_is_short_the_memory_side_reads_all_the_kv_its_peak_allows():
    # One 20k-token decode sets the steps; spreading the KV reads over them would leave
    # most of this KV unread, and every step reads the weights again.
    capacity = 100_000
    reqs = [make_request(100, 20_000, max_tokens=32_768)]
    reqs += [make_request(100, 2000) for _ in range(200)]
    cost = h200_8b()
    pol = _policy(reqs, capacity=capacity, cost=cost)
    r_comp, r_mem, steps = pol.remaining(0, capacity)
    assert steps == 20_000 and r_mem / (capacity * cost.seconds_per_kv_token) < steps / 2
    w = cost.weights_read_s
    read_budget = (max(r_comp, r_mem + w * steps) / steps - w) / cost.seconds_per_kv_token
    out = pol.admit(make_budget(capacity))
    assert {pol.side_of(r.id) for r in out} == {1}
    assert pol.kv_read_tokens == 100 * len(out)  # nothing decoded yet
    steady_read = sum(100 + (r.known_output_len or 0) / 2 for r in out)  # Σ (p + d/2)
    assert steady_read > 1.5 * read_budget  # the read budget did not bound it
    peak = KvPeak(np.full(len(out), 100.0), np.array([float(r.known_output_len) for r in out]))
    assert peak.with_request(0.0, 0.0) <= capacity < peak.with_request(100.0, 2000.0)  # the KV did


def test_where_kv_is_short_an_estimated_peak_may_pass_the_capacity_a_known_one_not():
    # Estimated lengths are means: as many finish early as late, so the memory side admits
    # until their peak at the estimates is KV_SHORT_OVERCOMMIT past the capacity (a request
    # preempted when it comes true recomputes on idle compute). Known lengths are exact.
    capacity = 100_000

    def admitted(known: bool) -> tuple[list, BlendPolicy]:
        reqs = [make_request(100, 20_000, max_tokens=32_768)]  # sets the steps: KV is short
        reqs += [make_request(100, 2000) if known
                 else replace(make_request(100, max_tokens=4096), output_prior=2000)
                 for _ in range(200)]
        pol = _policy(reqs, capacity=capacity, cost=h200_8b())  # no sample: estimated at 2000
        return pol.admit(make_budget(capacity)), pol

    def peak(out: list, extra: float = 0.0) -> float:
        return KvPeak(np.full(len(out), 100.0), np.array([20_000.0] + [2000.0] * (len(out) - 1))
                      ).with_request(100.0 if extra else 0.0, extra)

    exact, _ = admitted(known=True)
    est, pol = admitted(known=False)
    assert pol.plan is not None and all(pol.side_of(r.id) == 1 for r in est)
    assert peak(exact) <= capacity < peak(exact, 2000.0)
    limit = capacity * (1 + KV_SHORT_OVERCOMMIT)
    assert capacity < peak(est) <= limit < peak(est, 2000.0) and len(est) > len(exact)


def test_warm_up_paces_the_filler_once_the_sample_has_prefilled():
    # full filler steps are compute-bound; a memory-bound batch pays for every one of them
    reqs = _warm_batch()
    pol = _warm_policy(reqs)
    samples = pol.admit(make_budget(200_000))
    assert pol.prefill_budget(make_budget(200_000, waiting=1400)) is None  # the sample: full
    for r in samples:
        pol.on_progress(r.id, 1)
    assert pol.admit(make_budget(200_000, running=len(samples)))  # filler joins
    budget = pol.prefill_budget(make_budget(200_000, running=len(samples), waiting=5000))
    cost = h200_8b()
    memory = pol.kv_read_tokens * cost.seconds_per_kv_token + cost.weights_read_s
    want = memory * (1 + PACE_LEAN_PAST) - len(samples) * cost.seconds_per_token
    assert budget == int(want / cost.seconds_per_token)
    assert 0 < budget < 256 and pol.plan is None


def _admit_filler(pol, capacity, rounds=400):
    """Warm-up admissions with the prefill queue drained each step and nothing finishing."""
    out = pol.admit(make_budget(capacity))
    for _ in range(rounds):
        got = pol.admit(make_budget(capacity, running=len(out)))
        if not got:
            break
        out += got
    return out


def test_warm_up_filler_of_unknown_length_counts_as_decoding_twice_the_warm_up():
    # generations whose lengths nobody knows yet: on the 256-token prior alone the filler would
    # take over twice as many of them, and their real growth could fill the KV before the plan; one
    # still running at the plan is expected to run as long again, like a censored sample
    reqs = _warm_batch(n=4000, max_tokens=4096)
    capacity = 200_000
    pol = _warm_policy(reqs)
    assert pol.deadline_steps > 200
    samples = set(pol.warmup_request_ids)
    filler = [r for r in _admit_filler(pol, capacity) if r.id not in samples]
    held = len(filler) * (140 + 2 * pol.deadline_steps)  # prompt + decoding, twice to the plan
    assert filler and held <= FILLER_KV_SHARE * capacity
    assert len(filler) < 0.5 * FILLER_KV_SHARE * capacity / (140 + 256 / 2)


def test_filler_started_late_in_the_warm_up_reserves_as_much_as_filler_started_first():
    # when a request starts says nothing about its length: counted to twice what is left of the
    # warm-up, filler started near the deadline looked short and the KV filled with it
    reqs = _warm_batch(n=4000, max_tokens=4096)
    pol = _warm_policy(reqs)
    samples = pol.admit(make_budget(200_000))
    assert {r.id for r in samples} == set(pol.warmup_request_ids)
    for _ in range(pol.deadline_steps - 10):
        pol.prefill_budget(make_budget(200_000, running=len(samples)))
    before = pol.reserved_kv[0]
    filler = pol.admit(make_budget(200_000, running=len(samples)))
    assert filler and pol.plan is None
    each = (pol.reserved_kv[0] - before) / len(filler)
    assert each == pytest.approx(140 + 2 * pol.deadline_steps)


def test_running_filler_takes_its_subtrees_estimate_at_the_plan():
    reqs = _warm_batch(max_tokens=4096)
    pol = _warm_policy(reqs)
    started = _admit_filler(pol, 200_000, rounds=3)
    samples = set(pol.warmup_request_ids)
    filler = [r for r in started if r.id not in samples]
    assert filler and pol.plan is None
    for r in started:
        if r.id in samples:
            pol.on_finish(r.id, 2000)  # the whole subtree generates long
    before = pol.reserved_kv[0]  # the filler's (left side)
    assert pol.admit(make_budget(200_000, free=0, running=len(filler))) == []  # plans, no room
    assert pol.plan is not None and (pol.plan.output == 2000).all()
    # each running filler request now reserves for 2000 tokens instead of the 256 prior
    assert pol.reserved_kv[0] - before == pytest.approx(len(filler) * (2000 - 256))
    assert pol.remaining(0, 200_000, cautious=False)[2] >= 2000


def test_prompts_take_free_kv_that_the_raised_estimates_of_running_filler_reserve():
    # The filler started on the prior; the plan raises it to its subtree's 16k-token estimate,
    # reserved at once though it holds only its prompts. Short compute-heavy prompts still go
    # into the KV the executor has free: they finish long before the filler has grown.
    long_ = [make_request(140, prefix=[1] * 40, max_tokens=16_384) for _ in range(2000)]
    short = [make_request(1500, prefix=[2] * 30, max_tokens=16_384) for _ in range(2000)]
    capacity = 200_000
    pol = _warm_policy(long_ + short)
    started = _admit_filler(pol, capacity)
    samples = set(pol.warmup_request_ids)
    is_long = {r.id for r in long_}
    filler = [r for r in started if r.id not in samples]
    assert filler and all(r.id in is_long for r in filler)
    for r in started:
        if r.id in samples:
            pol.on_finish(r.id, 16_000 if r.id in is_long else 4)
    held = sum(len(r.prompt_token_ids) for r in filler)
    got = pol.admit(make_budget(capacity, free=capacity - held, running=len(filler)))
    assert pol.plan is not None and sum(pol.reserved_kv) > capacity  # more than it holds
    assert got and all(r.id not in is_long for r in got)  # the short prompts, not more filler


def test_a_batch_too_small_for_sampling_to_pay_is_planned_at_once_from_the_prior():
    reqs = [make_request(50, prefix=[1] * 40, max_tokens=100) for _ in range(300)]
    pol = _policy(reqs, sample_rate=0.02)
    assert pol.planned and pol.warmup_request_ids == []
    assert (pol.plan.output == 100).all()  # min(max_tokens, prior 256)


def test_every_request_is_admitted_exactly_once_and_the_cursors_meet():
    reqs = _mix()
    pol = _policy(reqs)
    order = _drive(pol, reqs)
    assert sorted(order) == sorted(r.id for r in reqs) and not pol.has_pending()


def test_the_longest_decodes_start_first():
    reqs = _mix()
    order = _drive(_policy(reqs), reqs)
    longest = max(reqs, key=lambda r: r.known_output_len or 0)
    assert order[0] == longest.id


def test_a_long_decode_kept_mid_plan_by_its_shared_prefix_starts_first_ahead_of_the_queue():
    # The long decode shares a prefix too long to split off with compute-heavy requests, so the
    # plan keeps it mid-order; it would outlast everything else and must start at once: its
    # prompt goes before those queued earlier, the rest of the admission after them.
    shared = [7] * 3000
    compute = [make_request(23_000, 8, prefix=shared) for _ in range(50)]
    long_decode = make_request(3500, 14_000, prefix=shared, max_tokens=32_000)
    memory = [make_request(2000, 3000, prefix=[9] * 1990) for _ in range(10)]
    pol = _policy(compute + [long_decode] + memory)
    assert 0 < pol.plan.order.tolist().index(len(compute)) < len(pol.plan) - 1
    first = pol.admit(make_budget(200_000))
    assert first[0].id == long_decode.id and len(first) > 1
    assert pol.ahead_of_queue() == ahead_of_queue(pol) == 1
    assert ahead_of_queue(object()) == 0  # a policy without the method: none


def _critical_crowd(memory_side_held: float) -> BlendPolicy:
    """Six subtrees, each of 100 compute-heavy prompts and 10 decodes of unknown length sharing
    a prefix: the plan keeps the decodes mid-order, and the samples (2,000 and 14,000 tokens)
    make every one of them a critical-path candidate at its overrun allowance. Returns the
    policy after its first planned admission, the memory side holding `memory_side_held` KV."""
    reqs = []
    for g in range(6):
        shared = [100 + g] * 400
        reqs += [make_request(12_000, 8, prefix=shared) for _ in range(100)]
        reqs += [make_request(500, prefix=shared, max_tokens=32_000) for _ in range(10)]
    pol = _policy(reqs, capacity=800_000, sample_rate=0.05)
    samples = set(pol.warmup_request_ids)
    lengths = itertools.cycle([2000, 14_000])
    for r in pol.admit(make_budget(800_000)):
        if r.id in samples:
            pol.on_finish(r.id, next(lengths))
    pol._used[RIGHT] = memory_side_held  # as if memory-side requests held it
    pol.admit(make_budget(800_000, 750_000))
    return pol


def test_critical_path_starts_fit_the_memory_sides_share_of_kv():
    # Estimates come by subtree, so a crowd of requests crosses the critical-path line at once;
    # started regardless of the memory side's share M_R they filled the KV with long decodes.
    free_share = _critical_crowd(0.0)
    m_right = min(free_share.memory_split(800_000).mem_right, RIGHT_MAX_SHARE * 800_000)
    assert free_share.ahead_of_queue() > 5 and free_share._used[RIGHT] <= m_right
    assert _critical_crowd(m_right).ahead_of_queue() == 0  # the warm-up's filler still runs


def test_kv_peak_comes_just_before_a_running_request_finishes():
    peak = KvPeak(np.array([100.0, 50.0]), np.array([10.0, 30.0]))
    # With a third request holding 0 now and decoding 100 more: at t = 10 all three hold
    # 110 + 60 + 10 tokens; later the first has finished.
    assert peak.with_request(0.0, 100.0) == 180.0
    peak.add(0.0, 100.0)
    assert peak.with_request(0.0, 0.0) == 180.0


def test_the_steps_left_cover_the_kv_reads_at_full_capacity():
    reqs = [make_request(100, 3000) for _ in range(200)]
    pol = _policy(reqs, capacity=50_000)
    _, mem, steps = pol.remaining(0, 50_000)
    assert steps >= mem / (50_000 * h200_8b().seconds_per_kv_token) > 3000


def test_compute_heavy_requests_are_admitted_while_long_decodes_run():
    reqs = _mix()
    finished_at: dict[str, int] = {}
    order = _drive(_policy(reqs), reqs, finished_at=finished_at)
    memory_ids = {r.id for r in reqs[30:]}
    first_memory_done = min(finished_at[rid] for rid in memory_ids)
    compute_admitted = [i for i, rid in enumerate(order) if rid not in memory_ids]
    assert max(compute_admitted) < first_memory_done  # blended, not one family after the other


def test_admission_never_deadlocks_when_a_request_exceeds_the_memory_share():
    reqs = [make_request(5000, 20_000) for _ in range(3)]
    pol = _policy(reqs, capacity=6000)
    assert len(pol.admit(make_budget(6000))) == 1


def test_early_finishers_free_memory_for_more_admissions():
    reqs = [make_request(100, 4000) for _ in range(40)]
    pol = _policy(reqs, capacity=10_000)
    first: list[PlanRequest] = []
    for _ in range(10):  # until the memory is full, whatever the prefill pacing
        first += pol.admit(make_budget(10_000, running=len(first)))
    assert 0 < len(first) < 10 and pol.admit(make_budget(10_000, running=len(first))) == []
    for r in first:
        pol.on_finish(r.id, 10)
    assert len(pol.admit(make_budget(10_000))) > 0


def test_an_overrunning_request_is_charged_to_the_memory_side():
    reqs = [make_request(2000, None, max_tokens=5000) for _ in range(30)] + [
        make_request(100, 3000)
    ]
    pol = _policy(reqs, sample_rate=0.04)
    for r in pol.admit(make_budget()):
        pol.on_finish(r.id, 4)  # the sample says: short outputs
    admitted: list[PlanRequest] = []
    while not any(r.known_output_len is None for r in admitted):
        admitted += pol.admit(make_budget())
    short = next(r for r in admitted if r.known_output_len is None)
    assert pol.side_of(short.id) == 0  # admitted from the compute-heavy side
    right_before = pol.reserved_kv[1]
    pol.on_progress(short.id, 64)
    assert pol.side_of(short.id) == 1 and pol.reserved_kv[1] > right_before


def _beside_prompts(n_decodes, d, n_prompts):
    """Known-length decodes of 100-token prompts beside 3000-token prompts with a 10-token
    shared prefix, on an H200 with 800k KV tokens: (requests, policy, cost, first admission)."""
    reqs = [make_request(100, d) for _ in range(n_decodes)] + [
        make_request(3000, 2, prefix=[3] * 10) for _ in range(n_prompts)
    ]
    cost = h200_8b()
    pol = _policy(reqs, capacity=800_000, cost=cost)
    return reqs, pol, cost, pol.admit(make_budget(800_000))


def _memory_fill(pol, cost, running, lean=1.0):
    """Prefill tokens of the next 2990-token prompts that bring a step's compute up to `lean`
    times its memory time (its KV reads plus one read of the weights); a prefill token also
    carries its share of the prompt's attention."""
    memory = pol.kv_read_tokens * cost.seconds_per_kv_token + cost.weights_read_s
    per_token = cost.seconds_per_token + (3000**2 - 10**2) / 2 / 2990 * cost.seconds_per_pair
    return (memory * lean - running * cost.seconds_per_token) / per_token


def test_prefill_budget_fills_compute_up_to_the_steps_memory_time():
    reqs, pol, cost, admitted = _beside_prompts(5, 8000, 50)
    for i in range(5):
        pol.on_progress(reqs[i].id, 4000)
    running = len(admitted)
    budget = pol.prefill_budget(make_budget(800_000, running=running, waiting=100_000))
    assert budget is not None and abs(budget - _memory_fill(pol, cost, running)) <= 128


def test_prefill_budget_keeps_up_with_the_critical_path_only_once_every_sample_is_in():
    # Far more compute than the short decodes' steps could hide, even at their overrun
    # allowances: with every sample's length in, the budget keeps up with remaining compute /
    # steps (whole steps, not the step's memory time); while a censored sample runs, the
    # lengths behind that pace may be short, and it fills only to the memory time (leaning past).
    _, pol, cost, admitted = _beside_prompts(4, 200, 400)
    for r in admitted:
        pol.on_progress(r.id, 1)
    running = len(admitted)
    comp, _, steps = pol.remaining(100_000, 800_000, cautious=True)
    memory = pol.kv_read_tokens * cost.seconds_per_kv_token + cost.weights_read_s
    assert comp / steps > 10 * memory
    budget = make_budget(800_000, running=running, waiting=100_000)
    pace = _memory_fill(pol, cost, running, comp / steps / memory)  # compute of comp / steps
    assert pol.prefill_budget(budget) == pytest.approx(pace, abs=128)
    pol._warm_left = {0}  # a sample cut off at the deadline still runs
    pol._credit = 0.0
    assert pol.prefill_budget(budget) <= _memory_fill(pol, cost, running, 1 + PACE_LEAN_PAST) + 128


def _leans(monkeypatch):
    """`_beside_prompts` decoding, each step's lean (compute leads?) noted in place of its
    prefill: (policy, first admission, leans, a step's budget)."""
    _, pol, _, admitted = _beside_prompts(4, 200, 400)
    for r in admitted:
        pol.on_progress(r.id, 1)
    leans: list[bool] = []
    monkeypatch.setattr(pol, "_prefill_tokens",
                        lambda decoding, leads, *_: leans.append(leads) or 0.0)
    return pol, admitted, leans, make_budget(800_000, running=len(admitted), waiting=100_000)


def test_where_the_estimates_disagree_the_lean_follows_the_steps_paced_so_far(monkeypatch):
    # Compute leads with the longest decode at its estimate; at its overrun allowance (a
    # million steps here, each reading the weights) memory does: the steps paced so far decide.
    pol, _, leans, budget = _leans(monkeypatch)
    pol.prefill_budget(budget)
    assert leans == [True]  # the estimates agree
    assert pol._paced[0] > 0 and pol._paced[1] > 0  # the step counted: its decodes, its reads
    longest = pol._longest_running
    monkeypatch.setattr(pol, "_longest_running",
                        lambda col=CRIT: 1e6 if col == CRIT else longest(col))
    pol._paced = [1.0, 2.0]  # memory-bound so far
    pol.prefill_budget(budget)
    pol._paced = [2.0, 1.0]  # compute-bound so far
    pol.prefill_budget(budget)
    assert leans[1:] == [False, True]


def test_while_censored_samples_run_the_pace_leans_short_only_where_both_bounds_say_memory(
        monkeypatch):
    # Compute leads at the estimates. A sample censored at the deadline still runs: memory
    # may lead at r_mem times the overrun factor, and with the steps counted to the sample's
    # max_tokens (a weights read each); the pace leans short only where both say so.
    pol, admitted, leans, budget = _leans(monkeypatch)
    r_mem, steps = 1.0, 1000.0
    r_comp = 2.0 + pol._weights * steps  # twice the memory work, and the weights read
    monkeypatch.setattr(pol, "remaining", lambda *_, **__: (r_comp, r_mem, steps))
    sample = pol._index[admitted[0].id]
    for overrun, max_tokens, censored in [(3.0, 10_000, {sample}),  # memory at both
                                          (3.0, 2, {sample}),  # at the overrun bound only
                                          (1.5, 10_000, {sample}),  # at max_tokens only
                                          (3.0, 10_000, set())]:  # every length is in
        pol._overrun, pol._warm_left = overrun, censored
        pol._max_tokens[sample] = max_tokens
        pol.prefill_budget(budget)
    assert leans == [False, True, True, True]


def test_a_plan_with_known_lengths_needs_no_warm_up():
    reqs = [make_request(10, 5) for _ in range(50)]
    pol = _policy(reqs, sample_rate=0.5)
    assert pol.planned and pol.warmup_request_ids == []


def test_duplicate_ids_are_rejected():
    reqs = [PlanRequest("a", [1], 5), PlanRequest("a", [2], 5)]
    with pytest.raises(ValueError):
        _policy(reqs)


def test_sharing_is_kept_by_dfs_within_each_side():
    reqs = _mix()
    pol = _policy(reqs)
    assert pol.plan is not None and pol.plan.sharing_kept >= DEFAULT_KEEP_SHARING
    assert np.isclose(pol.plan.sharing_ratio, 1 - pol.plan.computed.sum() / pol.plan.prompt.sum())


def test_blend_plans_structured_requests_from_their_own_samples():
    reqs = _warm_batch(n=600)
    reqs = [replace(r, length_group="schema", output_prior=12.0) if i % 3 == 0 else r
            for i, r in enumerate(reqs)]
    pol = _warm_policy(reqs)
    samples = set(pol.warmup_request_ids)
    grouped = {r.id for r in reqs if r.length_group is not None}
    assert samples & grouped and samples - grouped  # both kinds are sampled
    first = pol.admit(make_budget(200_000))
    for r in first:
        pol.on_finish(r.id, 9 if r.id in grouped else 30)
    pol.admit(make_budget(200_000))
    assert pol.plan is not None
    out = {reqs[i].id: float(d) for i, d in zip(pol.plan.order, pol.plan.output)}
    assert {out[i] for i in out if i in grouped} == {9.0}
    assert {out[i] for i in out if i not in grouped} == {30.0}


def test_blend_uses_a_schema_prior_before_any_sample():
    reqs = [replace(make_request(50, prefix=[1] * 40, max_tokens=100), length_group="s",
                    output_prior=17.0) for _ in range(300)]
    pol = _policy(reqs, sample_rate=0.02)
    assert pol.planned and (pol.plan.output == 17).all()


def test_without_overlap_blend_keeps_the_sharing_order_longest_decodes_first_and_full_steps():
    short = [make_request(200, 4, prefix=[5] * 150) for _ in range(6)]
    long = [make_request(200, 900, prefix=[6] * 150) for _ in range(3)]
    mixed = [make_request(60, d) for d in (30, 40)]
    reqs = short + mixed + long
    pol = _policy(reqs, cost=toy_cost())  # a device with no overlap (one stream, like a CPU)
    assert not pol.blending and pol.plan is not None
    assert pol.plan.leaves_moved == 0 and pol.plan.sharing_kept == 1.0
    order = [reqs[i].id for i in pol.plan.order]
    assert order[:3] == [r.id for r in long]  # the subtree holding the longest decodes first
    assert order.index(short[0].id) in (5, 6) and order.index(short[-1].id) in (10, 11)
    got = pol.admit(make_budget(100_000))
    assert [r.id for r in got] == order  # everything fits: all at once, in that order
    assert pol.prefill_budget(make_budget(100_000, running=len(got), waiting=2000)) is None


def test_once_memory_leads_the_compute_side_takes_memory_heavy_requests_longest_first():
    # Nothing here is compute-heavy: in plan order the compute side would start the shortest
    # decodes first and leave the longest to decode alone at the end.
    reqs = [make_request(100, 3000 + 50 * i) for i in range(60)]  # Comp / Mem < 0.4 each
    pol = _policy(reqs, capacity=100_000)
    assert pol.remaining(0, 100_000)[0] < pol.remaining(0, 100_000)[1]  # memory leads
    order = _drive(pol, reqs, capacity=100_000)
    length = {r.id: r.known_output_len for r in reqs}
    lengths = [length[rid] for rid in order]
    assert lengths == sorted(lengths, reverse=True)


def test_without_overlap_the_kv_peak_counts_the_tokens_decoded_since_the_last_report():
    # A (100 + 400 tokens) last reported 1 token, 100 steps ago: it holds 201 now and 500 in
    # 299 steps. B (100 + 300) would finish a step after it: together 899 at the peak, past
    # 850. Taken as reported, A would peak at 800 with B, and B would start, to be preempted.
    a, b = make_request(100, 400), make_request(100, 300, seed=9)
    pol = _policy([a, b], capacity=850, cost=toy_cost())
    assert not pol.blending and [r.id for r in pol.admit(make_budget(850, free=150))] == [a.id]
    pol.on_progress(a.id, 1)
    for _ in range(100):
        pol.prefill_budget(make_budget(850, running=1))
    assert pol.admit(make_budget(850, free=649, running=1)) == []
    pol.on_progress(a.id, 101)  # the report catches up: the same answer
    assert pol.admit(make_budget(850, free=649, running=1)) == []
    for _ in range(299):
        pol.prefill_budget(make_budget(850, running=1))
    assert [r.id for r in pol.admit(make_budget(850, free=350, running=1))] == [b.id]


def test_without_overlap_blend_admits_what_fits_at_the_kv_peak_not_on_average(monkeypatch):
    # Each holds 1,000 + 1,500 tokens on average but 4,000 at its end: four fit on average in
    # 10,000 tokens, and would then outgrow them together (the newest preempted, recomputed).
    # In waves: staggered (test_stagger.py), the second would start 1,344 steps later.
    monkeypatch.setattr("scheduler.dual_scan.stagger.MIN_GAIN", 1.0)
    reqs = [make_request(1000, 3000) for _ in range(4)]
    pol = _policy(reqs, capacity=10_000, cost=toy_cost())
    assert not pol.blending
    assert len(pol.admit(make_budget(10_000))) == 2
    # A shared prefix is held once: the second of two requests adds only its own 100 tokens.
    shared = [make_request(1000, 3000, prefix=[9] * 900) for _ in range(3)]
    pol = _policy(shared, capacity=7_200, cost=toy_cost())
    assert len(pol.admit(make_budget(7_200))) == 2  # 1,000 + 100 + 2 × 3,000


def test_without_overlap_a_shared_prefix_counts_once_against_the_free_kv():
    # 96 few-shot prompts on one 1,280-token prefix, 32 tokens each of their own and 8 out:
    # 1,312 + 95 × 32 + 96 × 8 = 5,120 tokens at the peak, 6,656 with a page of slack each
    # (page_slack), so all start in 6,700 tokens of free KV (counted a whole prompt each, 5
    # would, and the batch would take 20 admissions).
    shared = [7] * 1280
    reqs = [make_request(1312, 8, prefix=shared) for _ in range(96)]
    pol = _policy(reqs, capacity=6_700, cost=toy_cost())
    assert not pol.blending
    assert len(pol.admit(make_budget(6_700))) == 96


def test_without_overlap_a_shared_prefix_stays_counted_after_its_first_holder_finishes():
    # A and B share a 1,000-token prefix, A holding it at its peak, B adding its own 100;
    # C (2,000 + 500) does not fit beside them in 4,000. Once A finishes, B alone holds its
    # 100 tokens and the 1,000 the executor still keeps for it: 4,100 with C, still past.
    a, b = (make_request(1100, 500, prefix=[5] * 1000) for _ in range(2))
    c = make_request(2000, 500)
    pol = _policy([a, b, c], capacity=4_000, cost=toy_cost())
    assert [r.id for r in pol.admit(make_budget(4_000))] == [a.id, b.id]
    pol.on_finish(a.id, 500)
    assert pol.admit(make_budget(4_000, free=2_900, running=1)) == []
    pol.on_finish(b.id, 500)
    assert [r.id for r in pol.admit(make_budget(4_000))] == [c.id]
