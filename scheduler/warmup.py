"""The warm-up phase of `blend`: what to sample, what runs beside the sample, when to stop.

The planner needs output lengths; a ~1% sample run first supplies them (estimate.py). The sample
never runs alone: steps are filled with work that needs no estimate — requests whose length is
known, then the first subtree in sharing (DFS) order — so no step runs nearly empty while the
sample decodes. The warm-up ends when every sample has finished or, at the latest, after
WARMUP_SHARE of the batch's predicted steps; samples still running then are censored (expected
to run twice as long as they have so far) and the plan is rebuilt as they finish. A batch that
would end about when a typical sample does is planned at once from max_tokens and the prior:
there is nothing left to plan by the time the sample is in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scheduler.estimate import DEFAULT_PRIOR, select_warmup_samples
from scheduler.prefix_tree import PrefixTree

WARMUP_SHARE = 0.05  # the warm-up may take at most this share of the batch's predicted steps


@dataclass(frozen=True, slots=True)
class Warmup:
    """The warm-up of one batch (request indices into it)."""

    samples: np.ndarray  # [k] requests to run first for their lengths (empty: plan at once)
    filler: np.ndarray  # requests that may run beside the sample, in this order
    deadline_steps: int  # plan after this many steps even if samples still run
    predicted_steps: float  # the batch's predicted steps from max_tokens and the prior


def prior_lengths(max_tokens: np.ndarray, known: np.ndarray, prior: int = DEFAULT_PRIOR) -> np.ndarray:
    """[requests] output length to expect before sampling: known, else min(max_tokens, prior)."""
    guess = np.minimum(np.asarray(max_tokens, dtype=np.float64), float(prior))
    return np.where(np.asarray(known) >= 0, np.asarray(known, dtype=np.float64), guess)


def predicted_steps(tree: PrefixTree, output: np.ndarray, step_tokens: int) -> float:
    """Steps a batch needs at least: its longest output, or all its tokens in full steps."""
    if len(output) == 0:
        return 0.0
    tokens = tree.unique_tokens + float(np.sum(output))
    return max(float(np.max(output)), tokens / max(step_tokens, 1))


def plan_warmup(
    tree: PrefixTree,
    max_tokens: np.ndarray,
    known: np.ndarray,
    *,
    rate: float,
    seed: int,
    step_tokens: int,
) -> Warmup:
    """Choose the sample (estimate.select_warmup_samples), the filler order and the deadline.

    `known[i]` >= 0 is request i's exact output length; < 0 unknown."""
    known = np.asarray(known)
    prior = prior_lengths(max_tokens, known)
    steps = predicted_steps(tree, prior, step_tokens)
    deadline = max(1, math.ceil(WARMUP_SHARE * steps))
    samples = select_warmup_samples(tree, known >= 0, rate=rate, seed=seed)
    if len(samples) and steps < 2 * float(np.median(prior[samples])):
        samples = samples[:0]  # the batch ends about when a typical sample would: no gain
    chosen = np.zeros(tree.num_requests, dtype=bool)
    chosen[samples] = True
    dfs = tree.dfs_order()
    dfs = dfs[~chosen[dfs]]
    is_known = known[dfs] >= 0
    filler = np.concatenate((dfs[is_known], dfs[~is_known])) if len(samples) else dfs[:0]
    return Warmup(samples.astype(np.int64), filler.astype(np.int64), deadline, steps)
