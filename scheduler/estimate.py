"""Output-length estimation: which requests to run first as a warm-up sample, and what to expect
of the rest.

Requests that share a prompt prefix tend to ask for similar work (same few-shot task, same
instruction), so the sampled mean of the nearest subtree is a good guess. Sampling systematically
along the DFS leaf order puts a sample in every run of `n / budget` consecutive leaves, hence in
every large subtree; subtrees the stride skips get one extra sample each, up to the cap: any of
DEFAULT_MIN_LARGE requests, and a top-level one (no prefix shared with the rest of the batch) of
DEFAULT_MIN_FAMILY, since an unsampled top-level subtree is estimated from unrelated prompts of
similar length (a 59-request family of ~4,000-token generations in a 5,000-request trace was
guessed at ~23 tokens and started late: 0.797 of the simulator's bound, 0.871 with its sample).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from scheduler.prefix_tree import PrefixTree
from scheduler.types import PlanRequest

DEFAULT_PRIOR = 256  # tokens, when nothing has been sampled
DEFAULT_CAP = 4096  # most warm-up samples
DEFAULT_MIN_LARGE = 64  # a subtree with this many unknown-length requests gets a sample
DEFAULT_MIN_FAMILY = 16  # ... and a top-level subtree with this many (module docstring)
_NEAREST_BY_LENGTH = 8  # sibling fallback: mean over the samples nearest in prompt length
# The largest overrun among ~200 samples is an outlier's: it reached the old cap of 4 on the
# synthetic traces looked at, and the critical path and the overrun-allowing KV peaks sized by
# it planned slightly worse at 4 than at 3 (simulator, 16 traces + 80 perturbed runs; 2 worse).
OVERRUN_CAP = 3.0


def select_warmup_samples(
    tree: PrefixTree,
    known: np.ndarray,
    *,
    rate: float = 0.01,
    seed: int = 0,
    cap: int = DEFAULT_CAP,
    min_large: int = DEFAULT_MIN_LARGE,
    min_family: int = DEFAULT_MIN_FAMILY,
) -> np.ndarray:
    """Request indices to run first; `known[i]` True means request i's length is known (no sample)."""
    unknown = ~np.asarray(known, dtype=bool)
    cand = tree.leaf_requests[unknown[tree.leaf_requests]]  # unknown requests, DFS order
    if len(cand) == 0 or rate <= 0:
        return np.empty(0, dtype=np.int64)
    budget = int(min(cap, max(1, math.ceil(rate * len(cand)))))
    step = len(cand) / budget
    offset = np.random.default_rng(seed).random() * step
    picked = cand[np.minimum((offset + step * np.arange(budget)).astype(np.int64), len(cand) - 1)]
    chosen = np.zeros(tree.num_requests, dtype=bool)
    chosen[picked] = True
    # Large subtrees the stride missed get one sample each, deepest first: a sample inside a
    # deep subtree also covers its ancestors. A top-level subtree needs fewer requests (module
    # docstring): below the root, an unsampled one takes its family's mean.
    n_unknown = tree.leaf_prefix_sum(unknown.astype(np.float64))
    n_chosen = tree.leaf_prefix_sum(chosen.astype(np.float64))
    need = np.where(tree.parent == 0, min(min_family, min_large), min_large)
    missing = np.flatnonzero((n_unknown >= need) & (n_chosen == 0))
    room = cap - int(chosen.sum())
    for node in missing[np.argsort(-tree.depth[missing], kind="stable")]:
        if room <= 0:
            break
        reqs = tree.leaf_requests[tree.leaf_lo[node] : tree.leaf_hi[node]]
        if chosen[reqs].any():
            continue
        reqs = reqs[unknown[reqs]]
        chosen[reqs[len(reqs) // 2]] = True
        room -= 1
    return np.flatnonzero(chosen)


def estimate_output_lengths(
    tree: PrefixTree,
    max_tokens: np.ndarray,
    known_lens: np.ndarray,
    sampled: np.ndarray,
    sampled_lens: np.ndarray,
    *,
    prior: float | np.ndarray = DEFAULT_PRIOR,
    shrink: float | None = None,
) -> np.ndarray:
    """[requests] estimated output length (float), known lengths as-is, capped by max_tokens.

    `known_lens[i]` < 0 means unknown. Fallbacks per request: the mean of the samples in the
    nearest ancestor subtree below the root that holds any, pulled towards its parent's mean as
    if the parent had `shrink` more samples there (default: `shrink_weight`'s choice; 0 keeps
    the subtree's own mean); else the samples under the root whose prompt lengths are nearest
    (siblings of similar size); else `prior`.
    """
    n = tree.num_requests
    sampled = np.asarray(sampled, dtype=np.int64)
    s_lens = np.asarray(sampled_lens, dtype=np.float64)
    est = np.broadcast_to(np.asarray(prior, dtype=np.float64), (n,)).copy()
    if len(sampled):
        cnt, tot = _sample_sums(tree, sampled, s_lens)
        means = _node_means(tree, cnt, tot, shrink_weight(tree, sampled, s_lens)
                            if shrink is None else shrink)
        node_mean = means[tree.parent[tree.leaf_node]]
        found = ~np.isnan(node_mean)
        est[found] = node_mean[found]
        rest = np.flatnonzero(~found)
        if len(rest):
            est[rest] = _nearest_by_length(tree.prompt_lens, sampled, s_lens, rest)
        est[sampled] = s_lens
    known = np.asarray(known_lens) >= 0
    est = np.minimum(est, np.asarray(max_tokens, dtype=np.float64))
    est[known] = np.asarray(known_lens, dtype=np.float64)[known]
    return np.maximum(est, 1.0)


# Shrinkage weights tried (in samples of the parent's mean): 0 is each subtree's own mean, inf
# its top-level subtree's (family's) mean. The choice looks at most SHRINK_SAMPLES samples and
# SHRINK_LEVELS ancestors of each (a chain of prompts that are prefixes of one another is as deep
# as it is long); deeper ones count as top-level.
SHRINK_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)
SHRINK_SAMPLES = DEFAULT_CAP
SHRINK_LEVELS = 32


def _sample_sums(tree: PrefixTree, sampled: np.ndarray, lens: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """([nodes] samples in each subtree, [nodes] their summed lengths)."""
    per_len = np.zeros(tree.num_requests)
    per_cnt = np.zeros(tree.num_requests)
    per_len[sampled] = lens
    per_cnt[sampled] = 1.0
    return tree.leaf_prefix_sum(per_cnt), tree.leaf_prefix_sum(per_len)


def _shrunk(tot: float, cnt: float, up: float, k: float) -> float:
    """A subtree's mean, its `cnt` samples (summing to `tot`) pulled towards its parent's mean
    `up` as if the parent had `k` more samples there; nan when neither says anything."""
    if cnt <= 0:
        return up
    if math.isnan(up) or k == 0.0:  # no parent estimate (a top-level subtree): its own mean
        return tot / cnt
    return up if math.isinf(k) else (tot + k * up) / (cnt + k)


def _node_means(tree: PrefixTree, cnt: np.ndarray, tot: np.ndarray, k: float) -> np.ndarray:
    """[nodes] each subtree's shrunk mean (nan where no ancestor below the root has a sample);
    nodes are in preorder, so a parent's mean is ready before its children's."""
    parent, c, t = tree.parent.tolist(), cnt.tolist(), tot.tolist()
    out = [math.nan] * tree.num_nodes
    for v in range(1, tree.num_nodes):
        p = parent[v]
        out[v] = _shrunk(t[v], c[v], out[p] if p > 0 else math.nan, k)
    return np.array(out)


def shrink_weight(tree: PrefixTree, sampled: np.ndarray, lens: np.ndarray,
                  grid: Sequence[float] = SHRINK_GRID) -> float:
    """How far a subtree's few samples are pulled towards their parent's mean: the weight of
    SHRINK_GRID whose leave-one-out estimates of the samples err least (squared log error).
    A few-shot group whose outputs are set by its task keeps its own mean (small weight);
    requests of one family whose lengths vary more within a group than between groups take
    the family's (a single sample says little about its neighbours)."""
    sampled = np.asarray(sampled, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.float64)
    if len(sampled) < 3:
        return 0.0
    cnt, tot = _sample_sums(tree, sampled, lens)
    if len(sampled) > SHRINK_SAMPLES:  # evenly spaced, in the order given
        pick = np.linspace(0, len(sampled) - 1, SHRINK_SAMPLES).astype(np.int64)
        sampled, lens = sampled[pick], lens[pick]
    parent = tree.parent
    chains = []
    for r, x in zip(tree.leaf_node[sampled].tolist(), lens.tolist()):
        chain: list[int] = []
        v = int(parent[r])
        while v > 0 and len(chain) < SHRINK_LEVELS:
            chain.append(v)
            v = int(parent[v])
        chains.append((chain[::-1], x))
    best, best_err = 0.0, math.inf
    for k in grid:
        err, seen = 0.0, 0
        for chain, x in chains:
            m = math.nan
            for v in chain:
                m = _shrunk(tot[v] - x, cnt[v] - 1.0, m, k)
            if m > 0:  # False for nan: no estimate
                err += (math.log(max(x, 1.0)) - math.log(m)) ** 2
                seen += 1
        if seen and err < best_err * (1.0 - 1e-9):
            best, best_err = k, err
    return best


def length_groups(requests: Sequence[PlanRequest]) -> tuple[np.ndarray, np.ndarray]:
    """([requests] prior output length, [requests] length group id, -1 = free text).

    A structured output (PlanRequest.length_group set) is bounded by its format, not by what
    free text nearby in the prefix tree produces: it keeps its own prior and is estimated from
    samples of its own group only (`estimate_grouped`)."""
    ids: dict[str, int] = {}
    groups = np.array([-1 if r.length_group is None else ids.setdefault(r.length_group, len(ids))
                       for r in requests], dtype=np.int64)
    priors = np.array([DEFAULT_PRIOR if r.output_prior is None else float(r.output_prior)
                       for r in requests], dtype=np.float64)
    return priors, groups


def add_group_samples(
    samples: np.ndarray, groups: np.ndarray, known: np.ndarray, *,
    min_large: int = DEFAULT_MIN_LARGE, cap: int = DEFAULT_CAP,
) -> np.ndarray:
    """`samples` plus one request (the middle one) of every length group with at least
    `min_large` unknown-length requests and no sample yet, within `cap` samples in all."""
    samples = np.asarray(samples, dtype=np.int64)
    groups = np.asarray(groups)
    if not (groups >= 0).any():
        return samples
    have = set(groups[samples].tolist())
    extra: list[int] = []
    unknown = np.asarray(known) < 0
    for g in range(int(groups.max()) + 1):
        members = np.flatnonzero((groups == g) & unknown)
        if g not in have and len(members) >= min_large and len(samples) + len(extra) < cap:
            extra.append(int(members[len(members) // 2]))
    return np.sort(np.concatenate((samples, np.array(extra, dtype=np.int64))))


def estimate_grouped(
    tree: PrefixTree,
    max_tokens: np.ndarray,
    known_lens: np.ndarray,
    sampled: np.ndarray,
    sampled_lens: np.ndarray,
    *,
    priors: np.ndarray,
    groups: np.ndarray,
) -> np.ndarray:
    """estimate_output_lengths with length groups (see `length_groups`): free text (group -1)
    from free-text samples through the prefix tree; a group's requests from the mean of that
    group's samples, else their own prior; every estimate capped by max_tokens."""
    sampled = np.asarray(sampled, dtype=np.int64)
    s_lens = np.asarray(sampled_lens, dtype=np.float64)
    groups = np.asarray(groups)
    free = groups[sampled] < 0
    est = estimate_output_lengths(tree, max_tokens, known_lens, sampled[free], s_lens[free],
                                  prior=priors)
    grouped = np.flatnonzero(groups >= 0)
    if len(grouped) == 0:
        return est
    g_s, g_lens = groups[sampled[~free]], s_lens[~free]
    count = np.bincount(g_s, minlength=int(groups.max()) + 1)
    total = np.bincount(g_s, weights=g_lens, minlength=len(count))
    g = groups[grouped]
    guess = np.where(count[g] > 0, total[g] / np.maximum(count[g], 1), priors[grouped])
    est[grouped] = np.maximum(np.minimum(guess, np.asarray(max_tokens, dtype=np.float64)[grouped]),
                              1.0)
    est[sampled[~free]] = g_lens
    return est


def _nearest_by_length(
    prompt_lens: np.ndarray, sampled: np.ndarray, s_lens: np.ndarray, rest: np.ndarray
) -> np.ndarray:
    """Mean output of the samples whose log prompt length is nearest each of `rest`."""
    keys = np.log1p(prompt_lens[sampled].astype(np.float64))
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], s_lens[order]
    k = max(1, min(_NEAREST_BY_LENGTH, len(keys) // 4))  # few samples: the nearest alone
    q = np.log1p(prompt_lens[rest].astype(np.float64))
    pos = np.searchsorted(keys, q)
    # The k nearest lie inside the window [pos - k, pos + k); pick them by distance.
    offs = np.arange(-k, k)
    idx = np.clip(pos[:, None] + offs[None, :], 0, len(keys) - 1)  # [rest, 2k]
    dist = np.abs(keys[idx] - q[:, None])
    dist[:, 1:][idx[:, 1:] == idx[:, :-1]] = np.inf  # clipped duplicates count once
    best = np.argsort(dist, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(vals[idx], best, axis=1).mean(axis=1)


def corrected_estimate(estimate: float, generated: int, max_tokens: int) -> float:
    """A running request has reached its estimate: assume it is halfway, within its cap."""
    if generated < estimate:
        return estimate
    return float(min(max_tokens, max(2 * generated, generated + 16)))


def _leave_one_out(tree: PrefixTree, sampled: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[samples] each sample's estimate from the other samples of its nearest shared subtree."""
    cnt, tot = _sample_sums(tree, sampled, lens)
    node = tree.parent[tree.leaf_node[sampled]]
    active = np.flatnonzero(cnt[node] < 2)
    while len(active):
        node[active] = np.maximum(tree.parent[node[active]], 0)
        active = active[(node[active] > 0) & (cnt[node[active]] < 2)]
    return (tot[node] - lens) / np.maximum(cnt[node] - 1.0, 1.0)


def overrun_factor(
    tree: PrefixTree, sampled: np.ndarray, sampled_lens: np.ndarray, *, cap: float = OVERRUN_CAP
) -> float:
    """How far a request may run past its subtree's sampled mean: the largest true length /
    leave-one-out estimate among the samples, in [1, cap]. The planner multiplies the longest
    estimate by it to size the critical path, where guessing short costs more than long."""
    sampled = np.asarray(sampled, dtype=np.int64)
    lens = np.asarray(sampled_lens, dtype=np.float64)
    if len(sampled) < 2:
        return 1.0
    ratio = lens / np.maximum(_leave_one_out(tree, sampled, lens), 1.0)
    return float(min(cap, max(1.0, ratio.max())))


def length_dispersion(
    tree: PrefixTree, sampled: np.ndarray, sampled_lens: np.ndarray, *, cap: float = 4.0
) -> float:
    """φ = E[d²] / d̂²: Mem grows with d², so a mean length under-counts memory work by this
    factor (exp(σ²) for lognormal lengths). Pooled over samples against their leave-one-out
    estimates, bias-corrected, in [1, cap]."""
    sampled = np.asarray(sampled, dtype=np.int64)
    lens = np.asarray(sampled_lens, dtype=np.float64)
    if len(sampled) < 2:
        return 1.0
    loo = np.maximum(_leave_one_out(tree, sampled, lens), 1.0)
    scale = lens.sum() / loo.sum()
    phi = float((lens**2).sum() / ((loo * scale) ** 2).sum())
    return min(cap, max(1.0, phi))
