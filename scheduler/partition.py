"""Data-parallel partition: cut a batch into k shards, one per worker/GPU, of equal estimated
work, each with a density near the batch's ρ_target so every device can still blend.

With output-length estimates (a plan) the cut reuses the dual scan: each shard takes leaves from
the compute-heavy left end while its ρ is below ρ_target and from the memory-heavy right end
otherwise, until it holds its share of the remaining work; both pieces stay contiguous in DFS
order, so prefixes are shared inside a shard. Without any length information (nothing sampled
or known yet) densities cannot be told apart, so every top-level branch of the prefix tree is cut
into k contiguous pieces, one per shard: each shard gets the same mix, whatever its lengths.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.cost_model import CostModel
from scheduler.errors import PlanningError
from scheduler.estimate import DEFAULT_PRIOR, estimate_output_lengths
from scheduler.prefix_tree import PrefixTree
from scheduler.split import Plan, build_plan
from scheduler.types import PlanRequest


@dataclass(frozen=True, slots=True)
class Shard:
    """One device's requests and their estimated work."""

    requests: np.ndarray  # request indices into the batch, in planned order
    comp: float  # estimated compute seconds (prefix sharing inside the plan counted)
    mem: float  # estimated memory seconds
    rho: float  # comp / mem

    @property
    def work(self) -> float:
        """Estimated makespan on one device with perfect overlap: max(comp, mem)."""
        return max(self.comp, self.mem)


@dataclass(frozen=True, slots=True)
class Partition:
    """k shards; iterating yields each shard's request indices."""

    shards: tuple[Shard, ...]
    rho_target: float

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter([s.requests for s in self.shards])

    def __len__(self) -> int:
        return len(self.shards)

    def imbalance(self) -> float:
        """Largest shard work / mean shard work (1.0 = perfectly even)."""
        work = np.array([s.work for s in self.shards])
        return float(work.max() / work.mean()) if work.mean() > 0 else 1.0


def partition_plan(plan: Plan, k: int) -> Partition:
    """Dual-scan cut of a plan into k shards of equal estimated work with ρ near ρ_target."""
    if k < 1:
        raise PlanningError("k must be >= 1")
    comp, mem = plan.comp, plan.mem
    total = max(float(comp.sum()), float(mem.sum()))
    rho_t = plan.rho_target
    lo, hi = 0, len(plan)
    shards: list[Shard] = []
    done = 0.0
    for s in range(k):
        target = (total - done) / (k - s)
        taken: list[int] = []
        c = m = 0.0
        while lo < hi and (s == k - 1 or max(c, m) < target):
            # Too compute-heavy so far: take a memory-heavy leaf from the right, else the left.
            pos = hi - 1 if m > 0 and c / m > rho_t else lo
            after = max(c + float(comp[pos]), m + float(mem[pos]))
            if s < k - 1 and taken and after - target > target - max(c, m):
                break  # stopping short is closer to the share than overshooting
            if pos == lo:
                lo += 1
            else:
                hi -= 1
            taken.append(pos)
            c += float(comp[pos])
            m += float(mem[pos])
        done += max(c, m)
        positions = np.sort(np.asarray(taken, dtype=np.int64))
        shards.append(Shard(plan.order[positions], c, m, c / m if m > 0 else float("inf")))
    return Partition(tuple(shards), rho_t)


def partition_stratified(tree: PrefixTree, k: int) -> list[np.ndarray]:
    """Give every shard 1/k of each branch below the first branching node, as one contiguous
    DFS piece per branch: each shard gets the same mix of subtrees, with k − 1 cuts per branch."""
    if k < 1:
        raise PlanningError("k must be >= 1")
    node = 0
    while len(tree.children(node)) == 1:
        node = int(tree.children(node)[0])
    branches = tree.children(node) if len(tree.children(node)) else np.array([node])
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    start = 0  # rotate which shard gets the larger pieces, so remainders even out
    for b in branches:
        leaves = tree.leaf_requests[tree.leaf_lo[b] : tree.leaf_hi[b]]
        pieces = np.array_split(leaves, k)
        for j, piece in enumerate(pieces):
            parts[(start + j) % k].append(piece)
        start = (start + len(leaves) % k) % k
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def partition_requests(
    requests: Sequence[PlanRequest],
    k: int,
    *,
    cost_model: CostModel | None = None,
    kv_capacity_tokens: int | None = None,
    sample_rate: float = 0.01,
    seed: int = 0,
    output_lens: Mapping[str, int] | None = None,
) -> Partition:
    """Shard a batch for k workers. `output_lens` holds lengths already observed (a warm-up run);
    with none and no known lengths the cut is stratified (see the module docstring).
    `kv_capacity_tokens`, `sample_rate` and `seed` are accepted for symmetry with make_policy;
    each shard samples on its own when its worker plans it."""
    del kv_capacity_tokens, sample_rate, seed
    cost = cost_model or CostModel.default()
    tree = PrefixTree.build([r.prompt_token_ids for r in requests])
    n = len(requests)
    known = np.array(
        [-1 if r.known_output_len is None else r.known_output_len for r in requests], dtype=np.int64
    )
    lens = output_lens or {}
    observed = np.array([i for i, r in enumerate(requests) if r.id in lens], dtype=np.int64)
    max_tokens = np.array([r.max_tokens for r in requests], dtype=np.int64)
    if len(observed) == 0 and not (known >= 0).any():
        parts = partition_stratified(tree, k)
        est = np.minimum(float(DEFAULT_PRIOR), max_tokens.astype(np.float64))
        p = tree.prompt_lens.astype(np.float64)
        shards = []
        for idx in parts:
            c = float(cost.comp(p[idx], est[idx]).sum())
            m = float(cost.mem(p[idx], est[idx]).sum())
            shards.append(Shard(idx, c, m, c / m if m > 0 else float("inf")))
        c_all, m_all = sum(s.comp for s in shards), sum(s.mem for s in shards)
        return Partition(tuple(shards), c_all / m_all if m_all > 0 else float("inf"))
    sampled_lens = np.array([lens[requests[i].id] for i in observed], dtype=np.float64)
    est = estimate_output_lengths(tree, max_tokens, known, observed, sampled_lens)
    if n and len(observed) == 0:
        est[known < 0] = np.minimum(DEFAULT_PRIOR, max_tokens[known < 0])
    return partition_plan(build_plan(tree, est, cost), k)
