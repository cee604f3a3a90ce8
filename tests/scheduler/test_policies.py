import itertools

import pytest

from scheduler.errors import UnknownNameError
from scheduler.policies import POLICY_NAMES, make_policy
from scheduler.types import AdmissionPolicy
from tests.scheduler.factories import make_budget, make_request


def _reqs():
    shared = [9] * 30
    return [make_request(40, 5, prefix=shared if i % 2 else []) for i in range(20)]


def _drain(policy, capacity=1_000_000):
    out = []
    while policy.has_pending():
        got = policy.admit(make_budget(capacity))
        assert got, "a policy with pending requests and an idle executor must admit"
        for r in got:
            out.append(r.id)
            policy.on_finish(r.id, 5)
    return out


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_admits_each_request_once(name):
    reqs = _reqs()
    policy = make_policy(name, reqs, kv_capacity_tokens=1_000_000)
    assert isinstance(policy, AdmissionPolicy)
    assert sorted(_drain(policy)) == sorted(r.id for r in reqs)


def test_fcfs_consumes_requests_lazily():
    pulled = []

    def stream():
        for i in range(100):
            pulled.append(i)
            yield make_request(10, 5)

    policy = make_policy("fcfs", stream(), kv_capacity_tokens=50)
    policy.admit(make_budget(50))
    assert len(pulled) < 10


def test_fcfs_keeps_file_order_and_stops_when_kv_is_full():
    reqs = [make_request(100, 100) for _ in range(10)]
    policy = make_policy("fcfs", reqs, kv_capacity_tokens=600)
    got = policy.admit(make_budget(600))
    assert [r.id for r in got] == [r.id for r in reqs[: len(got)]] and len(
        got
    ) == 4  # 150 tokens each
    assert policy.prefill_budget(make_budget(600)) is None


@pytest.mark.parametrize("name", ["fcfs", "dfs"])
def test_the_baselines_count_a_prompt_prefix_their_running_requests_share_once(name):
    """96 few-shot prompts on one 1,280-token prefix, 32 tokens each of their own and 8 out: the
    engine's prefix cache holds the prefix once, so all of them fit 6,000 tokens of KV (counted
    a prompt each, 4)."""
    shared = [7] * 1280
    reqs = [make_request(1312, 8, prefix=shared) for _ in range(96)]
    policy = make_policy(name, reqs, kv_capacity_tokens=6000)
    got = policy.admit(make_budget(6000))
    assert len(got) == 96


def test_a_shared_prefix_stays_counted_until_the_last_request_holding_it_finishes():
    shared = [7] * 1280
    few = [make_request(1312, 8, prefix=shared) for _ in range(4)]
    big = make_request(4700, 8)  # fits beside one few-shot request's own tokens, not its prefix
    policy = make_policy("fcfs", few + [big], kv_capacity_tokens=6000)
    assert policy.admit(make_budget(6000)) == few
    for r in few[:3]:
        policy.on_finish(r.id, 8)
    assert policy.admit(make_budget(6000, running=1)) == []  # 1,280 + 36 + 4,704 > 6,000
    policy.on_finish(few[3].id, 8)
    assert policy.admit(make_budget(6000)) == [big]


def test_fcfs_admits_one_oversized_request_when_idle():
    policy = make_policy("fcfs", [make_request(5000, 10)], kv_capacity_tokens=100)
    assert len(policy.admit(make_budget(100))) == 1


def test_dfs_groups_requests_that_share_a_prefix():
    reqs_list = _reqs()
    order = _drain(make_policy("dfs", reqs_list, kv_capacity_tokens=1_000_000))
    flags = [next(r for r in reqs_list if r.id == rid).prompt_token_ids[0] == 9 for rid in order]
    assert sum(a != b for a, b in itertools.pairwise(flags)) == 1


def test_balance_is_a_seeded_random_order():
    reqs = _reqs()
    a = _drain(make_policy("balance", reqs, kv_capacity_tokens=10**6, seed=1))
    b = _drain(make_policy("balance", reqs, kv_capacity_tokens=10**6, seed=1))
    c = _drain(make_policy("balance", reqs, kv_capacity_tokens=10**6, seed=2))
    assert a == b and a != c and a != [r.id for r in reqs]


def test_unknown_policy_names_are_rejected():
    with pytest.raises(UnknownNameError, match="blend"):
        make_policy("lifo", [], kv_capacity_tokens=10)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_withdraw_returns_exactly_the_requests_not_yet_admitted(name):
    reqs = _reqs()
    policy = make_policy(name, reqs, kv_capacity_tokens=1_000_000)
    first = policy.admit(make_budget(1_000_000, running=0))
    left = policy.withdraw()
    assert not policy.has_pending() and policy.withdraw() == []
    assert sorted(r.id for r in first + left) == sorted(r.id for r in reqs)
    assert not {r.id for r in first} & {r.id for r in left}
    for r in first:  # the admitted ones still finish normally
        policy.on_finish(r.id, 5)
    assert not policy.has_pending() and policy.admit(make_budget(1_000_000)) == []


def test_ordered_policies_guess_structured_lengths_from_their_own_group():
    from dataclasses import replace

    from scheduler.policies import OutputLenGuess

    guess = OutputLenGuess(prior=256)
    free, shaped = make_request(10), replace(make_request(10), length_group="s", output_prior=20)
    assert guess.guess(free) == 256 and guess.guess(shaped) == 20
    guess.observe(100)
    guess.observe(8, "s")
    assert guess.guess(free) == 100 and guess.guess(shaped) == 8
