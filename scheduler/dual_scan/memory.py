"""The memory-side arithmetic of the dual scan: how a step's KV splits between the cursors,
the steady-state prefill of a side, and the KV peak of a set of running requests (at their
estimates, or forecast from the lengths the run has shown)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scheduler.dual_scan.run_lengths import Survival

PAGE_TOKENS = 16  # the engine's KV page (runtime.engine.EngineConfig.page_size)

if TYPE_CHECKING:
    from scheduler.split import Plan


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """One step's view of the two cursors: densities, memory shares and steady-state prefill."""

    rho_left: float
    rho_right: float
    rho_target: float
    mem_left: float  # KV tokens of the left (compute-heavy) side
    mem_right: float
    prefill_left: float  # DESIGN.md steady state C = N·p̄/d̄ of each side, tokens per step
    prefill_right: float


def split_memory(
    rho_left: float, rho_right: float, rho_target: float, capacity: float
) -> tuple[float, float]:
    """M_L = M·(ρ_t − ρ_R)/(ρ_L − ρ_R) clamped to [0, M]; all to the left when densities tie."""
    if not rho_left > rho_right:
        return float(capacity), 0.0
    share = (rho_target - rho_right) / (rho_left - rho_right)
    m_left = float(capacity) * min(1.0, max(0.0, share))
    return m_left, float(capacity) - m_left


def steady_prefill(mem_tokens: float, mean_computed: float, mean_output: float) -> float:
    """C = N·p̄/d̄ with N = M/(p̄ + d̄/2): prefill that replaces a side's finishers each step."""
    if mem_tokens <= 0 or mean_output <= 0:
        return 0.0
    n = mem_tokens / max(mean_computed + mean_output / 2.0, 1.0)
    return n * mean_computed / mean_output


class PlanSums:
    """Prefix sums over a plan's positions: any window [lo, hi) of it in O(1)."""

    def __init__(self, plan: Plan) -> None:
        def cum(x: np.ndarray) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(x)))

        self.need = cum(plan.computed + plan.output / 2.0)  # average occupancy p + d̂/2
        self.comp = cum(plan.comp)
        self.mem = cum(plan.mem)
        self.computed = cum(plan.computed)
        self.prompt = cum(plan.prompt)
        self.out = cum(plan.output)
        self.held = cum(plan.computed + page_slack(plan.prompt, plan.computed))  # KV each adds

    def window(self, lo: int, hi: int) -> tuple[float, float, float]:
        """(ρ, p̄ computed, d̄) over plan positions [lo, hi)."""
        comp = self.comp[hi] - self.comp[lo]
        mem = self.mem[hi] - self.mem[lo]
        n = max(hi - lo, 1)
        rho = comp / mem if mem > 0 else float("inf")
        return (rho, (self.computed[hi] - self.computed[lo]) / n, (self.out[hi] - self.out[lo]) / n)

    def prefill_token_s(self, lo: int, hi: int, s_token: float, s_row: float) -> float:
        """Compute seconds of one prefill token over plan positions [lo, hi): the linear layers
        (`s_token` a token) plus its share of the prompts' attention (which a long prompt makes
        a few percent more); `s_row`: a decode row's cost beyond its token."""
        computed = self.computed[hi] - self.computed[lo]
        if computed <= 0:
            return s_token
        out = self.out[hi] - self.out[lo]
        linear = computed * s_token + out * (s_token + s_row)
        attention = self.comp[hi] - self.comp[lo] - linear
        return s_token + max(attention, 0.0) / computed

    def memory_split(self, lo: int, hi: int, capacity: float, leaves: int) -> MemorySplit:
        """Densities at the cursors `lo` and `hi` (over the requests that would fill the
        capacity, at most `leaves` of them), the M_L / M_R split and each side's steady-state
        prefill."""
        j = int(np.searchsorted(self.need, self.need[lo] + capacity, side="right"))
        j = min(max(j - 1, lo + 1), hi, lo + leaves)
        k = int(np.searchsorted(self.need, self.need[hi] - capacity, side="left"))
        k = max(min(k, hi - 1), lo, hi - leaves)
        rho_l, p_l, d_l = self.window(lo, j)
        rho_r, p_r, d_r = self.window(k, hi)
        rho_t = self.window(lo, hi)[0]
        m_l, m_r = split_memory(rho_l, rho_r, rho_t, capacity)
        return MemorySplit(rho_l, rho_r, rho_t, m_l, m_r, steady_prefill(m_l, p_l, d_l),
                           steady_prefill(m_r, p_r, d_r))


def page_slack(prompt: np.ndarray | float, computed: np.ndarray | float) -> np.ndarray | float:
    """KV slots a request of `prompt` tokens, `computed` of them its own (the rest a cached
    prefix), holds in the engine's pages beyond its tokens, at most: its last page's empty slots
    and, where the cached prefix ends inside a page, the slots of it copied into a page of its
    own (runtime.radix_cache). Sharing-order admission counts them."""
    return (prompt - computed) % PAGE_TOKENS + PAGE_TOKENS


# A small tail starts whatever its forecast (small_tail): its prompts take at most this share
# of the free KV. At 0.4-0.6 the same on bench/cpu_scale_sweep.py's bimodal runs; at 0.75 and
# 1 the tail's growth preempted more (bimodal mean 0.9998x and 0.9996x, was 1.0009x).
TAIL_SHARE = 0.5
# ... where recomputing one of its requests (a preemption) costs at most this share of the
# steps the tail would decode alone: 0.1 on a 2-core Zen 5 (SmolLM2: 9 ms a step, 0.32 ms a
# token), 0.24-0.3 on a 2-core Emerald Rapids Xeon (18 ms, 1.4-1.7 ms), where 0.25 held
# low_sharing 6x's tail (bimodal seed 3: 512 steps, 0.987x; started, 311 and 0.999x). On the
# tests' toy the tail wins up to ~0.6 and loses at 1.25 (steps costing about a token: fewer
# steps, longer in seconds).
TAIL_RECOMPUTE = 0.5


def small_tail(held: float, free: float, prompt: np.ndarray, order: np.ndarray, limit: np.ndarray,
               token_s: float, step_s: float) -> bool:
    """Whether the requests not started (plan positions with `prompt` tokens and request ids
    `order`; `limit`: each request's most tokens, by id), adding `held` KV with their pages'
    slack (PlanSums.held), take at most TAIL_SHARE of the `free` KV, and recomputing one costs
    at most TAIL_RECOMPUTE of the steps they would decode alone (read only where they are few:
    a step's admission asks). Where the run's lengths are uncertain, the forecast's deviations
    may hold such a tail until the running requests end (bimodal outputs, low_sharing 6x: the
    last 10 of 288 started after 256 steps, and decoded alone for 256 more, 512 steps where
    fcfs took 290); started at once, a request that outgrows the KV is preempted, recomputes
    and keeps what it generated (311 steps)."""
    if held > TAIL_SHARE * free:
        return False
    lim = limit[order]
    recompute = float(np.max(prompt + lim, initial=0.0)) * token_s  # one preempted at its limit
    alone = float(np.max(lim, initial=0.0)) * step_s  # the steps of a tail held to the end
    return recompute <= TAIL_RECOMPUTE * alone


class KvPeak:
    """The most KV a set of running requests will hold: request i holds c_i + t tokens until
    it finishes r_i steps from now, so with r sorted descending the peak is
    max_k (c_1 + … + c_k + k·r_k), just before the k-th longest finishes."""

    def __init__(self, held: np.ndarray, left: np.ndarray, used: float | None = None) -> None:
        """`used`: the KV in use now, when more than the requests' own `held` (a shared prefix
        whose first holder has finished): the difference stays held throughout."""
        order = np.argsort(-left, kind="stable")
        self._held = held[order]  # c: KV held now, by remaining steps, descending
        self._left = left[order]  # r
        self._base = 0.0 if used is None else max(used - float(np.sum(held)), 0.0)

    def _insert(self, held: float, left: float) -> tuple[np.ndarray, np.ndarray]:
        k = int(np.searchsorted(-self._left, -left, side="right"))
        return np.insert(self._held, k, held), np.insert(self._left, k, left)

    def _peak(self, held: np.ndarray, left: np.ndarray) -> float:
        if len(left) == 0:
            return self._base
        return self._base + float(np.max(np.cumsum(held) + np.arange(1, len(left) + 1) * left))

    def with_request(self, held: float, left: float) -> float:
        """The peak if a request holding `held` tokens now and decoding `left` more joins."""
        return self._peak(*self._insert(held, left))

    def with_requests(self, held: np.ndarray, left: np.ndarray) -> float:
        """The peak if requests holding `held` tokens now and decoding `left` more join."""
        h, r = np.concatenate((self._held, held)), np.concatenate((self._left, left))
        order = np.argsort(-r, kind="stable")
        return self._peak(h[order], r[order])

    def value(self) -> float:
        """The peak of the requests as they are (the base for none)."""
        return self._peak(self._held, self._left)

    def rows(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(KV held, steps left) of each request, longest first, and the KV held throughout."""
        return self._held, self._left, self._base

    def add(self, held: float, left: float) -> None:
        self._held, self._left = self._insert(held, left)


class KvForecast:
    """The KV a set of running requests is expected to hold over the coming steps where some
    lengths are uncertain. Request i holds h_i + t + 1 tokens in the step t steps from now if it
    runs then, which it does with probability a_i(t): 1 up to a known length, else
    S((g_i + t)/e_i) / S(g_i/e_i) before its max_tokens (S: run_lengths.Survival of lengths in
    units of the estimate e_i it started with; g_i: tokens generated). The bound is the peak
    over t of `held` (KV in use that the requests do not account for) plus their expected KV
    plus `z` standard deviations (lengths independent). It is taken over intervals of steps
    [t_k, t_k+1): every step to LINEAR_STEPS, then GRID steps further apart up to `horizon`;
    over an interval a request counts the KV it holds at its end with the chance it runs at its
    start, an upper bound (KV grows, the chance falls). Plus a token a request: the executor
    keeps the next step's decode tokens free.

    Past the longest length seen, S stays flat: a request running that long is expected to run
    to its max_tokens. Letting S fall linearly to 0 there instead (right for lengths uniform up
    to max_tokens) preempted 18-91 requests where half the outputs run to max_tokens
    (bench/cpu_scale_sweep.py --lengths bimodal: 0.97-0.98 of the best baseline, was 1.03-1.05).
    """

    LINEAR_STEPS = 32
    GRID = 96

    def __init__(self, survival: Survival, horizon: float, z: float, held: float = 0.0) -> None:
        far = np.geomspace(self.LINEAR_STEPS, max(horizon, self.LINEAR_STEPS) + 1, self.GRID)
        t = np.unique(np.concatenate((np.arange(self.LINEAR_STEPS), np.round(far))))
        self._t, self._end = t[:-1], t[1:]  # intervals [t_k, t_k+1)
        self._s = survival
        self._z = z
        self._mean = np.full(len(self._t), held)
        self._var = np.zeros(len(self._t))
        self._n = 0  # requests added

    def _curves(self, held: np.ndarray, generated: np.ndarray, estimate: np.ndarray,
                limit: np.ndarray, known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected KV and its variance over the intervals of requests with these columns
        (`limit`: the length a request cannot pass, its known length or max_tokens)."""
        t = self._t[None, :]
        g = generated[:, None]
        e = estimate[:, None]
        now = self._s(g / e)
        alive = np.where(now > 0, self._s((g + t) / e) / np.where(now > 0, now, 1.0), 1.0)
        alive = np.where(known[:, None], 1.0, alive) * (g + t < limit[:, None])
        size = held[:, None] + np.minimum(self._end[None, :], limit[:, None] - g)  # at the end
        kv = size * alive
        return kv.sum(axis=0), (kv * size * (1.0 - alive)).sum(axis=0)

    def add(self, held: np.ndarray, generated: np.ndarray, estimate: np.ndarray,
            limit: np.ndarray, known: np.ndarray) -> None:
        mean, var = self._curves(held, generated, estimate, limit, known)
        self._mean += mean
        self._var += var
        self._n += len(held)

    @staticmethod
    def _request(held: float, estimate: float, limit: float,
                 known: bool) -> tuple[np.ndarray, ...]:
        """The columns of one request that is not decoding yet."""
        return (np.array([held]), np.zeros(1), np.array([estimate]), np.array([limit]),
                np.array([known]))

    def with_request(self, held: float, estimate: float, limit: float, known: bool) -> float:
        """The bound if a request holding `held` tokens, not yet decoding, joins."""
        mean, var = self._curves(*self._request(held, estimate, limit, known))
        peak = float(np.max(self._mean + mean + self._z * np.sqrt(self._var + var)))
        return peak + self._n + 1  # the executor keeps a step's decode tokens free ahead

    def add_request(self, held: float, estimate: float, limit: float, known: bool) -> None:
        self.add(*self._request(held, estimate, limit, known))


def generated_by_now(generated: np.ndarray, lag: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Tokens running requests have generated by now: progress is reported now and then (at 1,
    2, 4, … tokens), so a decoding request (`generated` > 0) counts a token for each of the
    `lag` steps since its report, up to `cap`. Taken as reported, each KV curve runs late by
    its lag, and curves lagging by different amounts miss the peak they make together. (A
    preempted request recomputing counts as decoding on: the policy is not told.)"""
    return np.where(generated > 0,
                    np.minimum(generated + np.maximum(lag, 0.0), np.maximum(cap, generated)), 0.0)
