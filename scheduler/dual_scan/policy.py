"""`BlendPolicy`: the `blend` admission policy (see the package docstring)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from scheduler.cost_model import CostModel
from scheduler.dual_scan.memory import (
    KvForecast,
    KvPeak,
    MemorySplit,
    PlanSums,
    generated_by_now,
    page_slack,
    small_tail,
)
from scheduler.dual_scan.run_lengths import RUN_LEARN_GROWTH, RunLengths
from scheduler.dual_scan.stagger import Stagger
from scheduler.errors import PlanningError
from scheduler.estimate import (
    corrected_estimate,
    estimate_grouped,
    length_dispersion,
    length_groups,
    overrun_factor,
)
from scheduler.prefix_tree import PrefixTree
from scheduler.split import DEFAULT_KEEP_SHARING, Plan, build_plan
from scheduler.types import PlanRequest, StepBudget
from scheduler.warmup import plan_warmup, prior_lengths

LEFT, RIGHT = 0, 1
EST, CRIT = 3, 5  # running-row columns: the length estimate, and the one allowing overruns
WINDOW_LEAVES = 256  # ρ at a cursor: over the leaves that would fill M, at most this many
RIGHT_MAX_SHARE = 0.9  # unless KV limits the steps, the memory side reserves at most this share
KV_SHORT_FREE_SHARE = 0.05  # where KV limits the steps, free KV the memory side leaves prompts
# Where KV limits the steps, the memory side admits until the running requests' peak at their
# estimates (means: about as many finish early as late) is this far past the capacity; one
# preempted recomputes on compute the memory-bound steps leave idle. Simulator, 48 runs (20k
# requests): Σ makespan 33,577 -> 33,485 s, runs under 0.85 of the bound 20 -> 14.
KV_SHORT_OVERCOMMIT = 0.1
KV_FORECAST_Z = 2.0  # no overlap: admit while the forecast KV plus this many deviations fits
MEMORY_HEAVY_RHO = 0.5  # past this density (Comp/Mem) the left cursor's request is memory work
PACE_LEAN_PAST = 0.10  # while compute leads, fill compute 10% past a step's memory time
PACE_LEAN_SHORT = 0.05  # while memory leads, fill it 5% short of the memory time
ROUND_ABOVE_MULTIPLES = 4  # steps of at least this many batch multiples are rounded to them
MIN_BLEND_OVERLAP = 0.5  # below this share of overlap, keep the sharing order and full steps
DEFAULT_STEP_TOKENS = 2048  # the executor's step cap when the caller does not say
FILLER_KV_SHARE = 0.5  # warm-up filler (unplanned, lengths unknown) fills at most this share of KV
FILLER_GROWTH = 2.0  # filler of unknown length decodes this many times the warm-up's steps


class BlendPolicy:
    """BlendServe's planner as an AdmissionPolicy; see the package docstring."""

    name = "blend"

    def __init__(
        self,
        requests: Sequence[PlanRequest],
        *,
        tree: PrefixTree,
        cost_model: CostModel,
        kv_capacity_tokens: int,
        sample_rate: float = 0.01,
        seed: int = 0,
        keep_sharing: float = DEFAULT_KEEP_SHARING,
        step_tokens: int = DEFAULT_STEP_TOKENS,
    ) -> None:
        self._reqs = list(requests)
        self._index = {r.id: i for i, r in enumerate(self._reqs)}
        if len(self._index) != len(self._reqs):
            raise PlanningError("request ids must be unique within a batch")
        self._tree = tree
        self._cost = cost_model
        self._spt = cost_model.seconds_per_token
        self._skv = cost_model.seconds_per_kv_token
        self._weights = cost_model.weights_read_s  # memory time every step spends on weights
        self._capacity = int(kv_capacity_tokens)
        self._keep = keep_sharing
        self._step_tokens = max(int(step_tokens), 1)
        self.blending = cost_model.overlap >= MIN_BLEND_OVERLAP
        self._max_tokens = np.array([r.max_tokens for r in self._reqs], dtype=np.int64)
        self._known = np.array(
            [-1 if r.known_output_len is None else r.known_output_len for r in self._reqs],
            dtype=np.int64,
        )
        # the most tokens each may generate: its known length, else its max_tokens
        self._limit = np.where(self._known >= 0, self._known, self._max_tokens).astype(np.float64)
        self._priors, self._groups = length_groups(self._reqs)  # structured outputs apart
        self._est = prior_lengths(self._max_tokens, self._known, self._priors)
        warm = plan_warmup(tree, self._max_tokens, self._known, rate=sample_rate, seed=seed,
                           step_tokens=self._step_tokens, priors=self._priors, groups=self._groups)
        self._samples = [int(i) for i in warm.samples]
        self._filler = [int(i) for i in warm.filler]
        self.deadline_steps = warm.deadline_steps  # plan by then, samples finished or not
        self.predicted_steps = warm.predicted_steps
        self._warm_next = 0  # next sample to admit
        self._fill_next = 0  # next filler request to consider
        self._warm_left = set(self._samples)  # samples not finished yet
        self._sample_in = False  # every sample admitted and past its prefill (_warmup_prefill)
        self._sample_lens: dict[int, int] = {}
        self._started = np.zeros(len(self._reqs), dtype=bool)  # admitted (the plan skips them)
        self._lengths = RunLengths(self._known, self._max_tokens)  # what the run shows
        self._observed = 0  # lengths the last plan was estimated from (samples, then the run's)
        self._learned = 0  # sample lengths learned since the last plan
        self.replans = 0  # plans rebuilt: censored samples finished, or the run showed lengths
        self._steps = 0  # steps seen (prefill_budget calls)
        self._reported: dict[int, int] = {}  # running request -> the step of its last progress
        self._paced = [0.0, 0.0]  # compute, memory seconds of the steps paced after the plan
        self.warmup_steps: int | None = None  # steps the warm-up took, once planned
        self.censored = 0  # samples still running when the deadline made the plan
        self._plan: Plan | None = None
        self._phi = 1.0  # E[d²]/d̂² (estimate.length_dispersion)
        self._overrun = 1.0  # critical-path allowance for overruns (estimate.overrun_factor)
        # Running requests: request -> [side, reserved KV, p, d̂, generated, d̂ allowing overrun].
        self._run: dict[int, list[float]] = {}
        self._unshared: dict[int, float] = {}  # prompt KV a running request added (sharing order)
        self._used = [0.0, 0.0]  # reserved KV per side
        self._avg_read = 0.0  # Σ (p + d̂/2): steady-state KV read per step
        self._read = 0.0  # Σ (p + g): KV read by the next step
        self._rem_comp = 0.0  # Σ (d̂ − g)·2P/F: decode compute still to do
        self._rem_mem = 0.0  # Σ (d̂ − g)·(p + (d̂ + g)/2)·kv/B: decode memory still to do
        # Lazy maxima of the decode steps running requests still need, as estimated (column
        # EST: d̂ − g) and allowing overruns (CRIT): {column: [(−steps, request, g)]}.
        self._heaps: dict[int, list[tuple[float, int, float]]] = {EST: [], CRIT: []}
        self._split: MemorySplit | None = None
        self._decoding = 0  # running requests that have reported progress (past their prefill)
        self._ahead = 0  # critical-path starts at the front of the last admit (ahead_of_queue)
        self._credit = 0.0  # prefill tokens owed to past steps by batch-multiple rounding
        self._withdrawn = False  # withdraw() took every request not yet admitted
        if not self._samples:
            self._make_plan()

    # ---------------------------------------------------------------- planning
    def _make_plan(self, run_lengths: dict[int, int] | None = None) -> None:
        """Estimate every request from the sample (censoring the ones still running) and the run's
        lengths (`RunLengths.samples`), then order and cost what has not started."""
        lens_of = dict(self._sample_lens)
        for i in self._warm_left:  # past the deadline: at least twice what it has so far
            row = self._run.get(i)
            g = int(row[4]) if row is not None else 0
            lens_of[i] = int(corrected_estimate(0.0, max(g, 1), int(self._max_tokens[i])))
        lens_of.update(run_lengths or {})
        self._observed = len(lens_of)
        if self._plan is None:
            self.censored = len(self._warm_left)
            self.warmup_steps = self._steps
        else:
            self.replans += 1
        self._learned = 0
        idx = np.array(sorted(lens_of), dtype=np.int64)
        lens = np.array([lens_of[i] for i in idx], dtype=np.float64)
        self._est = estimate_grouped(self._tree, self._max_tokens, self._known, idx, lens,
                                     priors=self._priors, groups=self._groups)
        for i, row in self._run.items():  # running requests keep their own (larger) figure
            self._est[i] = max(self._est[i], row[3])
        exclude = self._started.copy()
        self._phi = length_dispersion(self._tree, idx, lens)
        if self.blending:
            plan = build_plan(self._tree, self._est, self._cost, exclude=exclude,
                              keep_sharing=self._keep, dispersion=self._phi)
        else:  # sharing order, the subtrees with the longest decodes first
            plan = build_plan(self._tree, self._est, self._cost, exclude=exclude, split=False,
                              dispersion=self._phi, sibling_key=self._tree.subtree_max(self._est))
        self._plan = plan
        self._sums = PlanSums(plan)
        self._overrun = overrun_factor(self._tree, idx, lens)
        if run_lengths is None:  # they count running requests at their own estimates: raising
            self._raise_running_estimates()  # these to the subtree's would feed back
        allowance = np.where(self._known[plan.order] >= 0, 1.0, self._overrun)
        crit = np.minimum(plan.output * allowance, self._max_tokens[plan.order])
        self._crit = crit  # [positions] decode steps each request may need
        self._by_crit = np.argsort(-crit, kind="stable")  # positions, longest first
        self._crit_next = 0  # first entry of _by_crit that may not have started
        self._jumped = [0.0, 0.0]  # comp, mem of requests started ahead of the cursors
        self._left, self._right = 0, len(plan)
        self._stagger = Stagger()  # _admit_in_order's latest starts

    def _raise_running_estimates(self) -> None:
        """Running requests started on a guess (warm-up filler on the prior) take the plan's
        estimate of their subtree where it is larger, so their KV peak and the critical path
        count what the sample has learned about them."""
        for i, row in self._run.items():
            new = float(self._est[i])
            if self._known[i] >= 0 or new <= row[3]:
                continue
            self._account(row, -1.0)
            self._raise_estimate(i, row, new)
            self._account(row, 1.0)
            self._push(i, row)

    def _raise_estimate(self, req: int, row: list[float], new: float) -> None:
        """A running request's new (larger) length estimate: its reservation grows by the
        difference, its critical path allows overruns of it. The caller `_account`s around it."""
        row[1] += new - row[3]
        row[3] = new
        row[5] = max(row[5], min(new * self._overrun, float(self._max_tokens[req])))
        self._est[req] = new

    @property
    def overrun(self) -> float:
        return self._overrun  # how far a request may run past its estimate (≥ 1)

    def compute_leads(self, r_comp: float, r_mem: float, steps: float, *,
                      censored: bool = False) -> bool:
        """Whether the remaining compute outweighs the remaining memory work (KV reads plus a
        weights read per step). `censored`: samples cut off at the deadline still run, so compute
        leads only past what memory may overrun to (r_mem times the overrun factor)."""
        return r_comp >= r_mem * (self._overrun if censored else 1.0) + self._weights * steps

    @property
    def plan(self) -> Plan | None:
        """The planned order once warm-up has finished (None before)."""
        return self._plan

    @property
    def planned(self) -> bool:
        return self._plan is not None

    @property
    def leaves_moved(self) -> int | None:
        return None if self._plan is None else self._plan.leaves_moved

    @property
    def reserved_kv(self) -> tuple[float, float]:
        """KV tokens reserved by running requests of the (left, right) side."""
        return self._used[LEFT], self._used[RIGHT]

    @property
    def kv_read_tokens(self) -> float:
        """Σ (p + generated) over running requests: KV the next step reads."""
        return self._read

    def side_of(self, request_id: str) -> int | None:
        """0 (left, compute-heavy) or 1 (right, memory-heavy) for a running request."""
        row = self._run.get(self._index.get(request_id, -1))
        return None if row is None else int(row[0])

    @property
    def warmup_request_ids(self) -> list[str]:
        return [self._reqs[i].id for i in self._samples]

    def memory_split(self, capacity: float) -> MemorySplit:
        """Densities at both cursors, the M_L / M_R split and each side's steady-state prefill."""
        return self._sums.memory_split(self._left, self._right, capacity, WINDOW_LEAVES)

    def remaining(self, waiting_prefill_tokens: int, capacity: float,
                  cautious: bool = True) -> tuple[float, float, float]:
        """(compute s, KV-read s, steps) left in the plan and in flight. Steps: the longest
        request's decode steps (a running one's overruns allowed for when `cautious`), or the
        steps the KV reads need reading at most `capacity` tokens a step, whichever is more."""
        lo, hi = self._left, self._right
        comp = (self._sums.comp[hi] - self._sums.comp[lo] - self._jumped[0] + self._rem_comp
                + waiting_prefill_tokens * self._spt)
        mem = self._sums.mem[hi] - self._sums.mem[lo] - self._jumped[1] + self._rem_mem
        kv_steps = mem / (max(capacity, 1.0) * self._skv)
        longest = self._longest_running(CRIT if cautious else EST)
        return comp, mem, max(self._longest_unstarted()[1], kv_steps, longest, 1.0)

    def _longest_unstarted(self) -> tuple[int, float]:
        """(plan position, decode steps) of the longest request not started yet; (-1, 0) if none."""
        assert self._plan is not None
        order, by_crit = self._plan.order, self._by_crit
        while self._crit_next < len(by_crit) and self._started[order[by_crit[self._crit_next]]]:
            self._crit_next += 1
        if self._crit_next >= len(by_crit):
            return -1, 0.0
        pos = int(by_crit[self._crit_next])
        return pos, float(self._crit[pos])

    def _trim(self) -> None:
        """Move the cursors past requests the critical path started ahead of them."""
        plan = self._plan
        assert plan is not None
        started = self._started
        while self._left < self._right and started[plan.order[self._left]]:
            self._unjump(self._left)
            self._left += 1
        while self._left < self._right and started[plan.order[self._right - 1]]:
            self._right -= 1
            self._unjump(self._right)

    def _unjump(self, pos: int) -> None:
        assert self._plan is not None
        self._jumped[0] -= float(self._plan.comp[pos])
        self._jumped[1] -= float(self._plan.mem[pos])

    # ---------------------------------------------------------------- running bookkeeping
    def _contribution(self, p: float, d: float, g: float) -> tuple[float, float, float, float]:
        left = max(d - g, 0.0)
        # Expected memory still to read: Σ_{k=g}^{d} (p + k) with the d² part widened by φ.
        mem = (p * left + self._phi * (d * d - g * g) / 2.0) * self._skv if left > 0 else 0.0
        return p + d / 2.0, p + g, left * self._spt, max(mem, 0.0)

    def _account(self, row: list[float], sign: float) -> None:
        side, need, p, d, g, _ = row
        avg, read, comp, mem = self._contribution(p, d, g)
        self._used[int(side)] += sign * need
        self._avg_read += sign * avg
        self._read += sign * read
        self._rem_comp += sign * comp
        self._rem_mem += sign * mem

    def _start(self, req: int, side: int, need: float) -> PlanRequest:
        self._started[req] = True
        self._lengths.started(req, self._steps, float(self._est[req]))
        d = float(self._est[req])
        known = self._known[req] >= 0
        crit = d if known else min(d * self._overrun, float(self._max_tokens[req]))
        row = [float(side), need, float(self._reqs[req].prompt_len), d, 0.0, crit]
        self._run[req] = row
        self._account(row, 1.0)
        self._push(req, row)
        return self._reqs[req]

    def _push(self, req: int, row: list[float]) -> None:
        for col, heap in self._heaps.items():
            heapq.heappush(heap, (-(row[col] - row[4]), req, row[4]))

    def _longest_running(self, col: int = CRIT) -> float:
        heap = self._heaps[col]
        while heap:
            neg, req, g = heap[0]
            row = self._run.get(req)
            if row is not None and row[4] == g and -neg == row[col] - g:
                return -neg
            heapq.heappop(heap)
        return 0.0

    # ---------------------------------------------------------------- AdmissionPolicy
    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        if self._withdrawn:
            return []
        if self._plan is None and self._warm_next >= len(self._samples) and (
                not self._warm_left or self._steps >= self.deadline_steps):
            self._make_plan()  # every sample is in, or the deadline has come
        if self._plan is None:
            return self._admit_warmup(budget)
        if not self.blending:
            return self._admit_in_order(budget)
        return self._admit_dual(budget)

    def _admit_dual(self, budget: StepBudget) -> list[PlanRequest]:
        plan = self._plan
        assert plan is not None
        self._trim()
        capacity = float(budget.kv_capacity_tokens or self._capacity)
        split = self._split = (self.memory_split(capacity) if self._left < self._right
                               else self._split)
        r_comp, r_mem, steps = self.remaining(budget.waiting_prefill_tokens, capacity)
        # The memory side may read up to τ − W per step, τ = the larger remainder (weights read
        # once a step included) over the critical-path steps: ahead of compute is free while
        # compute is the larger remainder, and no faster than the longest decode allows.
        compute_leads = self.compute_leads(r_comp, r_mem, steps, censored=bool(self._warm_left))
        tau = max(r_comp, r_mem + self._weights * steps) / steps
        read_budget = max(tau - self._weights, 0.0) / self._skv
        # KV is what the steps are short of when the KV reads, at full capacity, need more
        # steps than the compute does in full steps (a small step cap makes compute the limit).
        kv_short = not compute_leads and (r_mem / (capacity * self._skv)
                                          > r_comp / (self._step_tokens * self._spt))
        queued = float(budget.waiting_prefill_tokens)
        free = float(budget.free_kv_tokens) - queued
        out: list[PlanRequest] = []
        # 1. Memory side. A request joins it while it fits the read budget (a memory-heavy one
        # skips it where KV is short), its prompt fits the executor's free KV, and the KV the
        # running requests will hold at its peak, as they grow and finish at their estimates,
        # fits. Unless KV is short, it must also fit M_R (at most RIGHT_MAX_SHARE of the KV, at
        # average occupancy: memory-side requests overrun, and a compute side shut out of KV
        # leaves steps memory-bound) and the capacity, the peak leaving the compute side its
        # share; while compute leads, at most a step of prefill is queued. Where KV is short, a
        # long decode holds far less than its average occupancy most of its life: only the peak
        # (KV_SHORT_OVERCOMMIT past capacity on estimates) and a little free KV bound it.
        m_right = min(split.mem_right, RIGHT_MAX_SHARE * capacity) if split is not None else 0.0
        keep_free = (1.0 - RIGHT_MAX_SHARE) * capacity
        free_margin = KV_SHORT_FREE_SHARE * capacity if kv_short else keep_free
        peak_margin = 0.0 if kv_short else keep_free
        peak = self._kv_peak(overruns=False)

        peak_limit = capacity * (1.0 + KV_SHORT_OVERCOMMIT) if kv_short else capacity

        def fits_kv(pos: int, computed: float, d: float) -> bool:
            known = self._known[int(plan.order[pos])] >= 0
            return (computed + free_margin <= free
                    and peak.with_request(float(plan.prompt[pos]), d) + peak_margin
                    <= (capacity if known else peak_limit))

        def fits(pos: int) -> bool:
            computed = float(plan.computed[pos])
            p, d = float(plan.prompt[pos]), float(plan.output[pos])
            need = computed + d / 2.0  # what it holds on average over its decode
            memory_heavy = plan.comp[pos] < plan.mem[pos]
            return (
                fits_kv(pos, computed, d)
                and ((kv_short and memory_heavy) or self._avg_read + p + d / 2.0 <= read_budget)
                and (kv_short or (self._used[RIGHT] + need <= m_right
                                  and self._used[LEFT] + self._used[RIGHT] + need <= capacity))
                and not (compute_leads and queued >= self._step_tokens)  # one step queued will do
            )

        def start(pos: int, computed: float) -> None:
            nonlocal queued, free
            d = float(plan.output[pos])
            peak.add(float(plan.prompt[pos]), d)
            out.append(self._take(pos, RIGHT, computed + d / 2.0))
            queued += computed
            free -= computed

        # 1a. The critical path: a request that would decode for longer than the rest of the
        # work needs (the longest running decode, the KV reads at full capacity, the compute in
        # full steps) starts now, wherever the plan put it (its prefix is recomputed), its prompt
        # prefilled ahead of the queue, or it would make the tail alone. A memory-side request,
        # it also fits M_R unless KV is short: many may cross the line at once (package doc).
        rest = max(self._longest_running(EST), r_mem / (capacity * self._skv),
                   r_comp / (self._step_tokens * self._spt))
        while True:
            pos, crit = self._longest_unstarted()
            if pos < 0 or crit <= rest:
                break
            p, d = float(plan.prompt[pos]), float(plan.output[pos])
            if (self._run or out) and not (fits_kv(pos, p, crit) and (
                    kv_short or self._used[RIGHT] + p + d / 2.0 <= m_right)):
                break
            self._jumped[0] += float(plan.comp[pos])
            self._jumped[1] += float(plan.mem[pos])
            start(pos, p)
            rest = max(rest, d)
        self._ahead = len(out)
        # 1b. The right cursor: the least dense requests, longest decodes first.
        self._trim()
        while self._left < self._right:
            pos = self._right - 1
            alone = not self._run and not out
            if not alone and not fits(pos):
                break
            self._right -= 1
            start(pos, float(plan.computed[pos]))
            self._trim()
        # 2. Compute side: keep about one step of prefill queued, in the executor's free KV and
        # in what the memory side leaves; estimate overruns inflate the memory side's
        # reservations, so they count only up to its maximum share. Once memory leads and the
        # left cursor has reached clearly memory-heavy requests, the compute side takes them
        # from the right end instead, longest first: in plan order the longest would start
        # last and decode alone at the end.
        left_room = capacity - min(self._used[RIGHT], RIGHT_MAX_SHARE * capacity) - self._used[LEFT]
        # Reservations (estimates, raised at once) may claim more KV than is held. Past them, a
        # request may take the executor's free KV less the memory side's margin where it keeps
        # the KV peak within max(capacity less that margin, the peak as it is): a short prompt
        # finishes long before the long decodes have grown.
        peak_bound = max(capacity - keep_free, peak.value())

        def fits_free(pos: int, need: float) -> bool:
            return (need + keep_free <= free and peak.with_request(
                float(plan.prompt[pos]), float(plan.output[pos])) <= peak_bound)
        # The executor's queue counts whole prompts, cached prefixes included: scale the pace.
        lo = self._left
        hi = min(self._right, lo + WINDOW_LEAVES)
        prompt_per_computed = (self._sums.prompt[hi] - self._sums.prompt[lo]) / max(
            self._sums.computed[hi] - self._sums.computed[lo], 1.0
        )
        # The queue also keeps up with the critical-path pace (remaining compute / steps), so
        # prompts are in when a step's budget wants them.
        pace = (max(self._prefill_tokens(self._decoding, compute_leads, r_comp / steps), 1.0)
                * prompt_per_computed)
        while self._left < self._right:
            pos = self._left
            from_right = not compute_leads and plan.comp[pos] < MEMORY_HEAVY_RHO * plan.mem[pos]
            if from_right:
                pos = self._right - 1
            computed, d = float(plan.computed[pos]), float(plan.output[pos])
            need = computed + d / 2.0
            alone = not self._run and not out
            if not alone and (queued >= pace or need > free
                              or (need > left_room and not fits_free(pos, need))):
                break
            if from_right:
                self._right -= 1
            else:
                self._left += 1
            peak.add(float(plan.prompt[pos]), d)
            out.append(self._take(pos, LEFT, need))
            left_room -= need
            queued += computed
            free -= computed
            self._trim()
        return out

    def _admit_in_order(self, budget: StepBudget) -> list[PlanRequest]:
        """No overlap: the plan's (sharing) order while the running requests' KV peak fits, at
        their estimates (KvPeak) or as the run's lengths forecast it (KvForecast), and no sooner
        than `_due`; a small tail (memory.small_tail) whatever the forecast. A request counts its
        unshared prompt and its pages' slack; KV beyond the running requests' own stays. On the
        average occupancy the newest would be preempted."""
        plan = self._plan
        assert plan is not None
        capacity = float(budget.kv_capacity_tokens or self._capacity)
        free = float(budget.free_kv_tokens - budget.waiting_prefill_tokens)
        if self._left >= self._right or (self._run and plan.computed[self._left] > free):
            return []
        # Censored samples running: every length at its overrun allowance (a preempted request
        # recomputes a shared prompt). Progress caught up to this step: 16x chat, exact lengths,
        # preempted 49-55 requests on lagging reports, none so (bench/cpu_scale_sweep.py).
        kv = (None if self._warm_left else self._kv_forecast(capacity - free)
              ) or self._kv_peak(overruns=bool(self._warm_left), caught_up=True,
                                 used=capacity - free, paged=True)
        lo, hi = self._left, self._right  # not started
        tail = isinstance(kv, KvForecast) and small_tail(
            self._sums.held[hi] - self._sums.held[lo], free, plan.prompt[lo:hi],
            plan.order[lo:hi], self._limit, self._spt, self._cost.step_fixed_s)
        out: list[PlanRequest] = []
        while self._left < self._right:
            pos = self._left
            req = int(plan.order[pos])
            computed = float(plan.computed[pos] if out or self._run else plan.prompt[pos])
            d = float(plan.output[pos]) * (self._overrun if self._warm_left else 1.0)
            known = bool(self._known[req] >= 0)
            limit = float(self._limit[req])
            held = computed + float(page_slack(plan.prompt[pos], computed))
            bound = (kv.with_request(held, d, limit, known) if isinstance(kv, KvForecast)
                     else kv.with_request(held, d))
            if (self._run or out) and (computed > free or (bound > capacity and not tail)
                                       or pos >= self._due(capacity, capacity - free)):
                break
            self._left += 1
            if isinstance(kv, KvForecast):
                kv.add_request(held, d, limit, known)
            else:
                kv.add(held, d)
            out.append(self._take(pos, LEFT, computed + float(plan.output[pos]) / 2.0))
            self._unshared[req] = computed
            free -= computed
        return out

    def _due(self, capacity: float, used: float) -> int:
        """Plan position before which requests may start now (stagger.Stagger on the lengths
        known, else max_tokens; where all are known or RunLengths.may_all_run_to_max)."""
        plan = self._plan
        assert plan is not None
        lo, hi = self._left, self._right
        if self._stagger.stale(self._steps, lo):
            reqs = plan.order[lo:hi]
            running = (self._kv_peak(overruns=False, caught_up=True, used=used, paged=True)
                       if (self._known[reqs] >= 0).all() or self._lengths.may_all_run_to_max
                       else None)
            self._stagger.pack(self._steps, lo, running, plan.prompt[lo:hi], plan.computed[lo:hi],
                               self._limit[reqs], capacity)
        return self._stagger.due(self._steps)

    def _running(self, paged: bool = False) -> tuple[np.ndarray, ...]:
        """Running requests: their ids, the prompt KV each added (in sharing order only the
        part it does not share; `paged`: with its page_slack), the tokens generated as last
        reported, and the steps since."""
        rows = list(self._run.items())
        n = len(rows)
        prompt = np.fromiter((self._unshared.get(i, row[2]) for i, row in rows), np.float64, n)
        if paged:
            prompt += page_slack(np.fromiter((row[2] for _, row in rows), np.float64, n), prompt)
        return (np.fromiter((i for i, _ in rows), np.int64, n), prompt,
                np.fromiter((row[4] for _, row in rows), np.float64, n),
                np.fromiter((self._steps - self._reported.get(i, self._steps) for i, _ in rows),
                            np.float64, n))

    def _kv_forecast(self, used: float) -> KvForecast | None:
        """The KV in use over the coming steps, `used` now (queued prompts included), as the
        run's lengths forecast the running requests' growth and finishes (KvForecast), their
        pages' slack counted (page_slack); None until RunLengths.survival_known. KV beyond the
        running requests' own tokens stays."""
        if not self._lengths.survival_known:
            return None
        reqs, prompt, generated, lag = self._running(paged=True)
        known = self._known[reqs] >= 0
        limit = self._limit[reqs]
        now = generated_by_now(generated, lag, limit - 1.0)
        survival = self._lengths.survival(reqs, now)
        if survival is None:
            return None
        held = prompt + now
        forecast = KvForecast(survival, float(self._max_tokens.max()), KV_FORECAST_Z,
                              max(used - float(held.sum()), 0.0))
        forecast.add(held, now, self._lengths.basis(reqs), limit, known)
        return forecast

    def _kv_peak(self, *, overruns: bool, caught_up: bool = False,
                 used: float | None = None, paged: bool = False) -> KvPeak:
        """The running requests' KV growth and finishes, at their estimates or allowing for
        overruns; one started in sharing order counts its unshared prompt (and KvPeak's `used`
        what outlives it). `caught_up`: progress counted to this step (generated_by_now);
        `paged`: their pages' slack counted (page_slack)."""
        _, prompt, now, lag = self._running(paged)
        col = CRIT if overruns else EST
        length = np.fromiter((row[col] for row in self._run.values()), np.float64, len(now))
        if caught_up:
            now = generated_by_now(now, lag, length - 1.0)
        return KvPeak(prompt + now, np.maximum(length - now, 0.0), used)

    def _take(self, pos: int, side: int, need: float) -> PlanRequest:
        assert self._plan is not None
        return self._start(int(self._plan.order[pos]), side, need)

    def _prefill_tokens(self, decoding: int, compute_leads: bool,
                        at_least_s: float = 0.0) -> float:
        """Prefill tokens that fill the step's compute up to its memory time (KV reads and the
        weights read: compute under it is nearly free), or to `at_least_s` seconds when that is
        larger. The fill leans PACE_LEAN_PAST past the memory time while compute is the larger
        remainder (its steps should be compute-bound, hiding all memory) and PACE_LEAN_SHORT
        short of it while memory is."""
        lean = 1.0 + PACE_LEAN_PAST if compute_leads else 1.0 - PACE_LEAN_SHORT
        memory = (self._read * self._skv + self._weights) * lean
        seconds = max(memory, at_least_s)
        return max((seconds - decoding * self._spt) / self._prefill_token_s(), 0.0)

    def _prefill_token_s(self) -> float:
        """Compute seconds of one prefill token at the left cursor (PlanSums.prefill_token_s)."""
        if self._plan is None:
            return self._spt
        hi = min(self._right, self._left + WINDOW_LEAVES)
        return self._sums.prefill_token_s(self._left, hi, self._spt, self._cost.seconds_per_row)

    def _admit_warmup(self, budget: StepBudget) -> list[PlanRequest]:
        """The sample first, then filler (known lengths, then sharing order) while the KV
        estimate fits and less than a step of prefill is queued. Filler of unknown length counts
        as decoding for twice the deadline's steps, like a censored sample: counted only to the
        deadline, ~400 filler generations of a compute-heavy batch outgrew the KV after it and
        shut the compute side out for thousands of memory-bound steps."""
        out: list[PlanRequest] = []
        growth = FILLER_GROWTH * float(self.deadline_steps)
        free = float(budget.free_kv_tokens - budget.waiting_prefill_tokens)
        queued = float(budget.waiting_prefill_tokens)
        used = self._used[LEFT] + self._used[RIGHT]
        for side, queue in ((RIGHT, self._samples), (LEFT, self._filler)):
            while True:
                nxt = self._warm_next if side == RIGHT else self._fill_next
                if nxt >= len(queue):
                    break
                req = queue[nxt]
                p = float(self._reqs[req].prompt_len)
                need = p + float(self._est[req]) / 2.0
                if side == LEFT and self._known[req] < 0:  # may still decode past the plan
                    need = max(need, p + min(float(self._max_tokens[req]), growth))
                alone = not self._run and not out
                cap = budget.kv_capacity_tokens * (1.0 if side == RIGHT else FILLER_KV_SHARE)
                if not alone and (used + need > cap or p > free
                                  or (side == LEFT and queued >= self._step_tokens)):
                    break
                if side == RIGHT:
                    self._warm_next += 1
                else:
                    self._fill_next += 1
                out.append(self._start(req, side, need))
                used += need
                free -= p
                queued += p
        return out

    def prefill_budget(self, budget: StepBudget) -> int | None:
        """This step's prefill tokens (None: as many as the executor's step holds). Paced only
        when blending. A step big enough to be compute-bound carries a total token count
        (decode + prefill) in batch multiples; a small one is exact (on a GPU it is
        weight-bound, so padding buys nothing). Rounding remainders carry over as credit, so
        the average rate is exact. Before the plan: `_warmup_prefill`."""
        self._steps += 1
        if not self.blending or self._read <= 0:
            return None  # full steps: no overlap to pace for, or nothing decodes
        if self._plan is None:
            return self._warmup_prefill()
        multiple = max(1, self._cost.hardware.batch_multiple)
        decoding = self._decoding
        capacity = float(budget.kv_capacity_tokens or self._capacity)
        r_comp, r_mem, steps = self.remaining(budget.waiting_prefill_tokens, capacity,
                                              cautious=False)
        compute_leads = self.compute_leads(r_comp, r_mem, steps)
        if compute_leads and self._warm_left and not self.compute_leads(
                r_comp, r_mem, steps, censored=True):  # censored samples run (package docstring)
            to_cap = max((float(self._max_tokens[i]) - self._run[i][4] for i in self._warm_left
                          if i in self._run), default=0.0)  # the steps they may still take
            compute_leads = self.compute_leads(r_comp, r_mem, max(steps, to_cap))
        at_least_s = 0.0
        if compute_leads:
            crit_steps = max(steps, self._longest_running(CRIT))
            if not self.compute_leads(r_comp, r_mem, crit_steps):
                # The estimates disagree (the longest running decode at its estimate leaves
                # compute ahead, at its overrun allowance memory): lean as the steps paced so
                # far were bound.
                compute_leads = self._paced[0] >= self._paced[1]
            elif not self._warm_left:
                # Compute leads even at every overrun allowance and every sample's length is
                # in: keep up with the critical path at those allowances (package docstring).
                at_least_s = r_comp / crit_steps
        want = self._prefill_tokens(decoding, compute_leads, at_least_s)
        self._paced[1] += self._read * self._skv + self._weights
        if budget.waiting_prefill_tokens <= 0:
            self._credit = 0.0
            self._paced[0] += decoding * self._spt
            return int(want)
        self._credit = min(self._credit + want, want + 2 * multiple)
        total = decoding + self._credit
        grain = multiple if total >= ROUND_ABOVE_MULTIPLES * multiple else 1
        prefill = max(int(total // grain) * grain - decoding, 0)
        self._credit -= prefill
        self._paced[0] += (decoding * self._spt + min(prefill, budget.waiting_prefill_tokens)
                           * self._prefill_token_s())
        return prefill

    def _warmup_prefill(self) -> int | None:
        """Warm-up: the sample prefills in full steps (its lengths are what the warm-up is
        for); the filler's prefill fills compute to the step's memory time, leaning past it as
        if compute led (full filler steps cost memory_low ~20 s of its first 600 steps)."""
        if not self._sample_in:  # once every sample has its first token, it stays so
            self._sample_in = self._warm_next >= len(self._samples) and all(
                self._run[i][4] > 0 for i in self._samples if i in self._run)
            if not self._sample_in:
                return None
        return int(self._prefill_tokens(self._decoding, compute_leads=True))

    def on_finish(self, request_id: str, output_len: int) -> None:
        req = self._index.get(request_id)
        if req is None:
            return
        row = self._run.pop(req, None)
        self._reported.pop(req, None)
        self._unshared.pop(req, None)
        if row is not None:
            self._account(row, -1.0)
            self._decoding -= row[4] > 0
        if not self._run:  # drop float drift
            self._used = [0.0, 0.0]
            self._avg_read = self._read = self._rem_comp = self._rem_mem = 0.0
            self._decoding = 0
        self._lengths.finished(req, int(output_len))
        if req in self._warm_left:
            self._warm_left.discard(req)
            self._sample_lens[req] = int(output_len)
            self._learn()
        elif self.blending and self._lengths.due():
            self._learn_from_run()

    def _learn_from_run(self) -> None:
        """Re-plan what has not started from the lengths the run has shown once they are twice
        as many as the last plan's."""
        if self._plan is None or self._withdrawn or self._warm_left or self._left >= self._right:
            return
        lengths = self._lengths.samples(self._steps, {i: row[EST] for i, row in self._run.items()})
        if len(lengths) >= RUN_LEARN_GROWTH * max(self._observed, 1):
            self._make_plan(lengths)

    def _learn(self) -> None:
        """Planned at the deadline with samples censored: re-plan what has not started once a
        quarter of the censored samples (or the last of them) have finished or, when blending,
        outgrown their censored estimate: the long ones set the memory work (it grows with d²)
        and the critical path, which the memory side's admission follows."""
        self._learned += 1
        if self._plan is not None and not self._withdrawn and self._left < self._right and (
                not self._warm_left or self._learned >= max(1, self.censored // 4)):
            self._make_plan()

    def on_progress(self, request_id: str, generated: int) -> None:
        """Track progress; a request past its estimate is re-estimated and charged to the memory
        side (a censored sample's overrun also counts towards a re-plan)."""
        req = self._index.get(request_id)
        if req is None or (row := self._run.get(req)) is None:
            return
        self._account(row, -1.0)
        self._decoding += row[4] == 0 and generated > 0
        row[4] = float(generated)
        self._reported[req] = self._steps
        outgrown = generated >= row[3]
        if outgrown:
            row[0] = float(RIGHT)
            self._raise_estimate(req, row,
                                 corrected_estimate(row[3], generated, int(self._max_tokens[req])))
        self._account(row, 1.0)
        self._push(req, row)
        if outgrown and self.blending and req in self._warm_left and self._plan is not None:
            self._learn()

    def ahead_of_queue(self) -> int:
        """The last admit's critical-path starts (its front): prefilled before the queue."""
        return self._ahead

    def has_pending(self) -> bool:
        if self._withdrawn:
            return False
        if self._plan is None:
            return True  # the warm-up runs: the plan is still to come
        self._trim()
        return self._left < self._right

    def withdraw(self) -> list[PlanRequest]:
        if self._withdrawn:
            return []
        self._withdrawn = True
        if self._plan is None:
            return [r for i, r in enumerate(self._reqs) if not self._started[i]]
        order = self._plan.order[self._left : self._right]
        self._left = self._right
        return [self._reqs[int(i)] for i in order if not self._started[i]]
