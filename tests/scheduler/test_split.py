import numpy as np

from scheduler.prefix_tree import PrefixTree
from scheduler.split import DEFAULT_KEEP_SHARING, build_plan, shared_with_previous, sorted_dfs
from tests.scheduler.factories import h200_8b

# Densities on the H200 profile: A (long shared prompts, 4 tokens out) ρ ≈ 7, B ρ ≈ 5, C ρ ≈ 0.4.
# Request 7 sits in A but has ρ ≈ 2: it belongs between B and C.
PROMPTS = (
    [[1] * 200 + [1000 + i] * 50 for i in range(40)]
    + [[2] * 20 + [2000 + i] * 5 for i in range(40)]
    + [[3] * 20 + [3000 + i] * 5 for i in range(5)]
)
OUT = np.array([4.0] * 40 + [200.0] * 40 + [3000.0] * 5)
OUT[7] = 400.0
TREE = PrefixTree.build(PROMPTS)


def _rho(order):
    cm = h200_8b()
    p = TREE.prompt_lens[order]
    return cm.rho(p, OUT[order])


def test_siblings_are_sorted_compute_heavy_first_and_subtrees_stay_contiguous():
    stats = TREE.stats(OUT, h200_8b())
    order = sorted_dfs(TREE, stats.rho)
    fam = np.searchsorted([40, 80], order, side="right")
    assert (np.diff(fam) >= 0).all() and fam[0] == 0 and fam[-1] == 2
    inside_a = order[fam == 0]
    assert inside_a[-1] == 7  # the outlier sorts last among its siblings


def test_infinite_keys_sort_without_overflow_warnings():
    # ρ is inf without decodes, and the longest-first key of an empty batch's root is -inf.
    import warnings

    empty = PrefixTree.build([])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(sorted_dfs(empty, empty.subtree_max(np.zeros(0)))) == 0
        tree = PrefixTree.build([[1, 2], [1, 3], [4]])
        key = np.full(tree.num_nodes, np.inf)
        key[tree.parent == 0] = -np.inf
        assert sorted(sorted_dfs(tree, key).tolist()) == [0, 1, 2]


def test_shared_with_previous_is_the_common_prefix_length():
    order = TREE.dfs_order()
    shared = shared_with_previous(TREE, order)
    for i in range(1, len(order)):
        a, b = PROMPTS[order[i - 1]], PROMPTS[order[i]]
        lcp = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared[i] == lcp


def test_without_splitting_the_plan_keeps_all_dfs_sharing():
    plan = build_plan(TREE, OUT, h200_8b(), split=False)
    assert plan.leaves_moved == 0 and plan.sharing_kept == 1.0
    assert abs(plan.sharing_ratio - TREE.max_sharing_ratio()) < 1e-12


def test_split_moves_the_outlier_past_the_denser_family():
    plan = build_plan(TREE, OUT, h200_8b(), keep_sharing=0.9)
    order = list(plan.order)
    assert plan.leaves_moved == 1 and plan.sharing_kept >= 0.9
    assert (
        max(order.index(i) for i in range(40, 80))
        < order.index(7)
        < min(order.index(i) for i in range(80, 85))
    )


def test_split_keeps_the_default_share_of_sharing():
    rng = np.random.default_rng(1)
    out = rng.choice([2.0, 5000.0], size=len(PROMPTS))
    plan = build_plan(TREE, out, h200_8b())
    assert plan.sharing_kept >= DEFAULT_KEEP_SHARING


def test_no_split_is_affordable_when_all_sharing_must_stay():
    plan = build_plan(TREE, OUT, h200_8b(), keep_sharing=1.0)
    assert plan.leaves_moved == 0


def test_plan_excludes_requests_already_run():
    exclude = np.zeros(len(PROMPTS), bool)
    exclude[[0, 50]] = True
    plan = build_plan(TREE, OUT, h200_8b(), exclude=exclude)
    assert sorted(plan.order.tolist()) == [i for i in range(len(PROMPTS)) if i not in (0, 50)]
    assert np.isclose(plan.rho_target, plan.comp.sum() / plan.mem.sum())
