import numpy as np

from scheduler.prefix_tree import PrefixTree
from tests.scheduler.factories import h200_8b

PROMPTS = [[1, 2, 3], [1, 2, 4], [1, 2], [5], [1, 2, 3], [], [1, 2, 3, 9, 9]]


def test_every_request_is_exactly_one_leaf():
    tree = PrefixTree.build(PROMPTS)
    leaves = tree.request[tree.request >= 0]
    assert sorted(leaves.tolist()) == list(range(len(PROMPTS)))
    assert all(len(tree.children(int(v))) == 0 for v in tree.leaf_node)


def test_edges_spell_each_prompt_from_root_to_leaf():
    tree = PrefixTree.build(PROMPTS)
    for r, prompt in enumerate(PROMPTS):
        path, node = [], int(tree.leaf_node[r])
        while node >= 0:
            path = tree.edge_tokens(node, PROMPTS) + path
            node = int(tree.parent[node])
        assert path == prompt


def test_internal_nodes_branch_except_possibly_the_root():
    tree = PrefixTree.build([[7, 7, 1], [7, 7, 2], [7, 7, 2, 5]])
    internal = [v for v in range(1, tree.num_nodes) if tree.request[v] < 0]
    assert all(len(tree.children(v)) >= 2 for v in internal)


def test_nodes_are_in_preorder_so_subtrees_are_contiguous():
    tree = PrefixTree.build(PROMPTS)
    assert all(tree.parent[v] < v for v in range(1, tree.num_nodes))
    for v in range(tree.num_nodes):
        inside = np.arange(v, tree.subtree_end[v])
        assert (tree.leaf_lo[inside] >= tree.leaf_lo[v]).all() and (
            tree.leaf_hi[inside] <= tree.leaf_hi[v]
        ).all()


def test_dfs_order_is_lexicographic():
    tree = PrefixTree.build(PROMPTS)
    assert [PROMPTS[i] for i in tree.dfs_order()] == sorted(PROMPTS)


def test_max_sharing_counts_each_distinct_prefix_token_once():
    tree = PrefixTree.build(PROMPTS)  # distinct tokens: 1,2,3,4,9,9 on the 1-2 branch and 5
    assert tree.unique_tokens == 7
    assert tree.max_sharing_ratio() == 1 - 7 / sum(map(len, PROMPTS))


def test_node_stats_sum_requests_tokens_and_sharing_over_subtrees():
    prompts = [[1] * 10 + [i] for i in range(4)] + [[2] * 5]
    tree = PrefixTree.build(prompts)
    stats = tree.stats(np.full(5, 100.0), h200_8b())
    assert stats.requests[0] == 5 and stats.prompt_tokens[0] == 49
    shared = int(tree.parent[tree.leaf_node[0]])  # the node of the ten 1s
    assert stats.requests[shared] == 4
    assert stats.computed_tokens[shared] == 14 and stats.shared_tokens[shared] == 30
    assert stats.rho[shared] == stats.comp[shared] / stats.mem[shared]


def test_identical_prompts_share_everything_but_stay_separate_leaves():
    tree = PrefixTree.build([[3, 4, 5]] * 3)
    assert tree.unique_tokens == 3 and len(set(tree.leaf_node.tolist())) == 3


def test_large_random_trees_keep_their_invariants():
    rng = np.random.default_rng(0)
    heads = [rng.integers(0, 50, int(rng.integers(0, 30))).tolist() for _ in range(20)]
    prompts = [
        heads[rng.integers(0, 20)] + rng.integers(0, 3, int(rng.integers(0, 6))).tolist()
        for _ in range(500)
    ]
    tree = PrefixTree.build(prompts)
    assert tree.num_nodes <= 2 * len(prompts) + 1
    assert [prompts[i] for i in tree.dfs_order()] == sorted(prompts)
    distinct = {tuple(p[:j]) for p in prompts for j in range(1, len(p) + 1)}
    assert tree.unique_tokens == len(distinct)
