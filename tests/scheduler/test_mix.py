"""MixPolicy: requests that join a running plan, leave it, and priority levels."""

from __future__ import annotations

from scheduler.mix import MixPolicy
from scheduler.policies import make_policy
from scheduler.types import PlanRequest
from tests.scheduler.factories import h200_8b, make_budget, make_request


def _mix(name: str = "dfs") -> MixPolicy:
    return MixPolicy(lambda reqs: make_policy(name, reqs, kv_capacity_tokens=1_000_000))


def _admit_all(mix: MixPolicy) -> list[PlanRequest]:
    out = []
    while mix.has_pending():
        got = mix.admit(make_budget(1_000_000))
        assert got
        out += got
    return out


def test_requests_that_join_are_planned_with_what_is_left() -> None:
    shared = [7] * 20
    first = [make_request(30, 4, prefix=shared if i % 2 else []) for i in range(6)]
    later = [make_request(30, 4, prefix=shared) for _ in range(3)]
    mix = _mix("dfs")
    mix.add(first)
    # two fit now: 30 tokens, then 14 (its first 16 the first's, held once)
    started = mix.admit(make_budget(1_000_000, free=45))
    assert len(started) == 2
    mix.add(later)
    rest = _admit_all(mix)
    assert {r.id for r in started + rest} == {r.id for r in first + later}
    # one plan over both batches: the shared-prefix requests come out together
    with_prefix = [i for i, r in enumerate(rest) if list(r.prompt_token_ids[:20]) == shared]
    assert with_prefix == list(range(with_prefix[0], with_prefix[0] + len(with_prefix)))
    assert mix.replans == 1


def test_a_higher_level_is_admitted_before_a_lower_one() -> None:
    mix = _mix("fcfs")
    low = [make_request(10, 4) for _ in range(3)]
    high = [make_request(10, 4) for _ in range(2)]
    mix.add(low, level=0)
    mix.add(high, level=3)
    got = mix.admit(make_budget(1_000_000))
    assert [r.id for r in got] == [r.id for r in high + low]


def test_removed_requests_never_start_and_running_ones_are_released() -> None:
    mix = _mix("fcfs")
    reqs = [make_request(10, 4) for _ in range(5)]
    mix.add(reqs)
    running = mix.admit(make_budget(1_000_000, free=25))  # two start
    assert len(running) == 2
    mix.remove([running[0].id, reqs[4].id])
    left = _admit_all(mix)
    assert [r.id for r in left] == [r.id for r in reqs[2:4]]
    for r in [running[1], *left]:
        mix.on_finish(r.id, 4)
    assert not mix.has_pending() and mix.pending_ids == set()


def test_blend_replans_as_batches_join() -> None:
    mix = MixPolicy(lambda reqs: make_policy("blend", reqs, kv_capacity_tokens=10_000))
    a = [make_request(40, 8, prefix=[1] * 16) for _ in range(8)]
    b = [make_request(40, 8, prefix=[1] * 16) for _ in range(8)]
    mix.add(a)
    first = mix.admit(make_budget(10_000))
    mix.add(b)
    assert {r.id for r in first + _admit_all(mix)} == {r.id for r in a + b}


def test_the_critical_path_starts_of_the_first_level_that_admits_lead_the_queue() -> None:
    # test_dual_scan's long decode kept mid-plan: blend starts it ahead of the queue, and so
    # does the mix it runs in; a plain order puts none ahead
    shared = [7] * 3000
    long_decode = make_request(3500, 14_000, prefix=shared, max_tokens=32_000)
    reqs = ([make_request(23_000, 8, prefix=shared) for _ in range(50)] + [long_decode]
            + [make_request(2000, 3000, prefix=[9] * 1990) for _ in range(10)])
    mix = MixPolicy(lambda rs: make_policy("blend", rs, kv_capacity_tokens=200_000,
                                           cost_model=h200_8b()))
    mix.add(reqs, level=0)
    got = mix.admit(make_budget(200_000))
    assert got[0].id == long_decode.id and mix.ahead_of_queue() == 1
    fcfs = _mix("fcfs")
    fcfs.add([make_request(10, 4) for _ in range(3)])
    assert fcfs.admit(make_budget(1_000_000)) and fcfs.ahead_of_queue() == 0
