import numpy as np

from scheduler.partition import partition_plan, partition_requests, partition_stratified
from scheduler.prefix_tree import PrefixTree
from scheduler.split import build_plan
from scheduler.types import PlanRequest
from tests.scheduler.factories import h200_8b

# 60 compute-heavy requests sharing a long prefix and 20 memory-heavy ones.
PROMPTS = [[1] * 500 + [100 + i] * 20 for i in range(60)] + [
    [2] * 10 + [300 + i] * 40 for i in range(20)
]
OUT = np.array([3.0] * 60 + [2000.0] * 20)
TREE = PrefixTree.build(PROMPTS)


def test_shards_cover_every_request_once():
    part = partition_plan(build_plan(TREE, OUT, h200_8b()), 3)
    assert sorted(np.concatenate(list(part)).tolist()) == list(range(len(PROMPTS)))


def test_shards_have_equal_work_and_density_near_the_target():
    part = partition_plan(build_plan(TREE, OUT, h200_8b()), 4)
    assert part.imbalance() < 1.15
    for shard in part.shards:
        assert 0.5 < shard.rho / part.rho_target < 2.0


def test_one_shard_is_the_whole_plan():
    plan = build_plan(TREE, OUT, h200_8b())
    (shard,) = partition_plan(plan, 1).shards
    assert len(shard.requests) == len(plan) and np.isclose(shard.rho, plan.rho_target)


def test_without_lengths_each_shard_gets_the_same_share_of_every_branch():
    parts = partition_stratified(TREE, 2)
    for part in parts:
        assert (part < 60).sum() == 30 and (part >= 60).sum() == 10


def test_partition_requests_uses_observed_lengths_when_given():
    reqs = [PlanRequest(f"q{i}", p, 4096) for i, p in enumerate(PROMPTS)]
    observed = {"q0": 3, "q1": 3, "q70": 2000, "q71": 2000}
    part = partition_requests(reqs, 2, cost_model=h200_8b(), output_lens=observed)
    assert len(part) == 2 and part.imbalance() < 1.2
    blind = partition_requests(reqs, 2, cost_model=h200_8b())
    assert sorted(np.concatenate(list(blind)).tolist()) == list(range(len(reqs)))
