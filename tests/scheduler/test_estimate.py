import numpy as np
import pytest

from scheduler.estimate import (
    OVERRUN_CAP,
    corrected_estimate,
    estimate_output_lengths,
    length_dispersion,
    overrun_factor,
    select_warmup_samples,
    shrink_weight,
)
from scheduler.prefix_tree import PrefixTree

# Three families: A (100 requests under prefix [1,1,1]), B (100 under [2,2]), C (20 singletons).
PROMPTS = (
    [[1, 1, 1, i] for i in range(100)]
    + [[2, 2, i] for i in range(100)]
    + [[3 + i] for i in range(20)]
)
N = len(PROMPTS)
TREE = PrefixTree.build(PROMPTS)
UNKNOWN = np.full(N, -1)
CAPS = np.full(N, 10_000)


def test_about_one_percent_is_sampled_by_default():
    picked = select_warmup_samples(
        PrefixTree.build([[i, 0] for i in range(1000)]), np.zeros(1000, bool)
    )
    assert len(picked) == 10


def test_every_large_subtree_gets_a_sample():
    picked = set(select_warmup_samples(TREE, np.zeros(N, bool), rate=0.01, min_large=50).tolist())
    assert picked & set(range(100)) and picked & set(range(100, 200))


def test_a_top_level_family_the_stride_missed_gets_a_sample():
    # 1,000 requests under one prefix and a family of 20 under another: the 1% stride (every
    # 100th leaf) can miss the family, whose requests would then be estimated from unrelated
    # prompts of similar length. A top-level subtree needs only min_family requests.
    prompts = [[1, 1, i // 10, i] for i in range(1000)] + [[2, 2, i] for i in range(20)]
    tree = PrefixTree.build(prompts)
    known = np.zeros(len(prompts), bool)  # every length unknown
    family = set(range(1000, 1020))
    stride = set(select_warmup_samples(tree, known, min_family=64).tolist())
    assert not stride & family
    picked = set(select_warmup_samples(tree, known).tolist())
    assert len(picked & family) == 1 and picked - family == stride
    # a subtree of 20 below the top level is covered by its family's samples: none added
    nested = PrefixTree.build(prompts[:1000] + [[1, 2, i] for i in range(20)])
    nested_picked = select_warmup_samples(nested, known).tolist()
    assert not set(nested_picked) & family
    assert nested_picked == select_warmup_samples(nested, known, min_family=64).tolist()


def test_samples_are_capped():
    assert len(select_warmup_samples(TREE, np.zeros(N, bool), rate=0.5, cap=7, min_large=10)) <= 7


def test_requests_with_known_lengths_are_never_sampled():
    known = np.zeros(N, bool)
    known[:150] = True
    picked = select_warmup_samples(TREE, known, rate=0.05)
    assert len(picked) and (picked >= 150).all()


def test_unsampled_requests_get_their_subtree_mean():
    est = estimate_output_lengths(
        TREE, CAPS, UNKNOWN, np.array([0, 1, 100]), np.array([10.0, 30.0, 500.0])
    )
    assert est[50] == 20.0 and est[150] == 500.0


def test_a_subtree_without_samples_falls_back_to_samples_of_similar_prompt_length():
    est = estimate_output_lengths(
        TREE, CAPS, UNKNOWN, np.array([0, 100, 205]), np.array([10.0, 500.0, 7.0])
    )
    # request 210 ([13]) has no sampled ancestor below the root; the nearest-length samples win
    assert est[210] == 7.0
    short = estimate_output_lengths(
        PrefixTree.build([[9] * 50, [8] * 50, [7], [6]]),
        np.full(4, 999),
        np.full(4, -1),
        np.array([0, 2]),
        np.array([100.0, 5.0]),
    )
    assert short[3] < short[1]


def test_without_any_sample_the_prior_is_used():
    est = estimate_output_lengths(TREE, CAPS, UNKNOWN, np.array([], int), np.array([]), prior=77)
    assert (est == 77).all()


def test_estimates_are_capped_by_max_tokens_and_known_lengths_win():
    caps = CAPS.copy()
    caps[5] = 12
    known = UNKNOWN.copy()
    known[6] = 3
    est = estimate_output_lengths(TREE, caps, known, np.array([0]), np.array([400.0]))
    assert est[5] == 12 and est[6] == 3 and est[7] == 400


def test_an_overrunning_request_is_re_estimated_within_its_cap():
    assert corrected_estimate(100, 50, 1000) == 100
    assert corrected_estimate(100, 100, 1000) == 200
    assert corrected_estimate(100, 900, 1000) == 1000


def test_dispersion_and_overrun_factor_are_one_when_lengths_match_their_subtree():
    sampled = np.array([0, 1, 2, 100, 101])
    lens = np.array([10.0, 10.0, 10.0, 50.0, 50.0])
    assert length_dispersion(TREE, sampled, lens) == pytest.approx(1.0)
    assert overrun_factor(TREE, sampled, lens) == pytest.approx(1.0)


def test_spread_lengths_raise_dispersion_and_overrun_factor():
    sampled = np.array([0, 1, 2, 3])
    lens = np.array([10.0, 10.0, 10.0, 100.0])
    assert length_dispersion(TREE, sampled, lens) > 1.5
    assert overrun_factor(TREE, sampled, lens) == OVERRUN_CAP  # 100 / 10, capped


def _grouped(groups_of: dict[int, str], priors_of: dict[int, float] | None = None):
    from dataclasses import replace

    from scheduler.estimate import length_groups
    from scheduler.types import PlanRequest

    reqs = [PlanRequest(f"r{i}", p, 10_000) for i, p in enumerate(PROMPTS)]
    reqs = [replace(r, length_group=groups_of.get(i), output_prior=(priors_of or {}).get(i))
            for i, r in enumerate(reqs)]
    return length_groups(reqs)


def test_length_groups_number_the_formats_and_keep_their_priors():
    priors, groups = _grouped({5: "schema-a", 6: "schema-b", 7: "schema-a"}, {5: 40.0, 7: 40.0})
    assert groups[5] == groups[7] == 0 and groups[6] == 1 and (np.delete(groups, [5, 6, 7]) < 0).all()
    assert priors[5] == 40.0 and priors[6] == 256 and priors[0] == 256


def test_structured_requests_are_estimated_apart_from_free_text_in_their_subtree():
    from scheduler.estimate import estimate_grouped

    # 0-49 free text, 50-99 one schema, all under the same prefix [1, 1, 1]
    priors, groups = _grouped({i: "s" for i in range(50, 100)}, {i: 30.0 for i in range(50, 100)})
    sampled, lens = np.array([0, 1, 60]), np.array([400.0, 600.0, 24.0])
    est = estimate_grouped(TREE, CAPS, UNKNOWN, sampled, lens, priors=priors, groups=groups)
    assert est[10] == 500.0  # free text: its free-text samples only
    assert est[70] == 24.0  # the schema's own sample, not the 500 of its neighbours
    no_sample = estimate_grouped(TREE, CAPS, UNKNOWN, sampled[:2], lens[:2], priors=priors,
                                 groups=groups)
    assert no_sample[70] == 30.0 and no_sample[10] == 500.0  # the schema's prior
    capped = estimate_grouped(TREE, np.full(N, 20), UNKNOWN, sampled, lens, priors=priors,
                              groups=groups)
    assert capped[70] == 20.0


def test_every_large_length_group_gets_a_warmup_sample():
    from scheduler.estimate import add_group_samples

    groups = np.full(N, -1)
    groups[100:170] = 0  # 70 requests of one schema
    groups[200:210] = 1  # too few to pay for a sample
    picked = add_group_samples(np.array([3]), groups, UNKNOWN, min_large=64)
    assert picked.tolist() == [3, 135]
    assert add_group_samples(np.array([3, 120]), groups, UNKNOWN).tolist() == [3, 120]
    assert add_group_samples(np.array([3]), groups, UNKNOWN, cap=1).tolist() == [3]


def _groups(n_groups, per_group):
    """One family (a shared header) of prefix groups; request g * per_group + j is group g's j-th."""
    return PrefixTree.build([[7, 7, 7, 100 + g, 100 + g, 10_000 + g * per_group + j]
                             for g in range(n_groups) for j in range(per_group)])


def test_a_task_group_whose_length_its_task_sets_keeps_its_own_mean():
    tree = _groups(20, 5)
    lens = np.repeat(10.0 * np.arange(1, 21), 5)  # group g outputs 10·(g + 1), exactly
    sampled = np.array([i for i in range(100) if i % 5 < 3])  # three samples a group
    assert shrink_weight(tree, sampled, lens[sampled]) == 0.0
    est = estimate_output_lengths(tree, np.full(100, 1000), np.full(100, -1), sampled,
                                  lens[sampled])
    assert est[4] == 10.0 and est[99] == 200.0


def test_a_few_samples_of_a_noisy_group_are_pulled_towards_their_family():
    tree = _groups(60, 8)
    lens = np.random.default_rng(0).lognormal(np.log(500.0), 0.7, 480).round()  # groups say nothing
    sampled = np.array([i for i in range(480) if i % 8 < 2] + [8 * 60 - 1])
    sampled = np.array([i for i in sampled if i // 8 != 7 or i % 8 == 0])  # group 7: one sample
    k = shrink_weight(tree, sampled, lens[sampled])
    assert k >= 4.0
    est = estimate_output_lengths(tree, np.full(480, 10_000), np.full(480, -1), sampled,
                                  lens[sampled])
    family = lens[sampled].mean()
    # group 7's unsampled requests: nearer the family's mean than the group's one sample is
    assert abs(est[60] - family) < 0.5 * abs(lens[56] - family)
