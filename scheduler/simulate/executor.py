"""The step loop: continuous batching of a trace on the cost model, driven by an admission policy.

It steps the way the engine (runtime/engine.py) does. A request's prompt is prefilled in chunks
(minus what the prefix cache serves), and the step that completes it samples the first output
token; each later step decodes one more token, reading the request's whole context
(p + tokens generated so far) from the KV cache. A step costs W + combine(compute, memory)
(CostModel.step_time): compute counts the step's tokens, its sampled rows (the share drawn at
a temperature, `SimConfig.sampled_share`, at a measured profile's extra price), its prefill
attention pairs and, on a measured CPU profile, the first write of the KV it puts on pages the
process never used (every token written until the pool is full, as the engine caches finished
requests' KV; `SimConfig.fresh_kv_tokens`); memory counts the KV the decodes read (reads of
pages another decode reads too at the shared price, cascade.py) and one read of the weights.
A step holds at most `max_step_tokens` tokens, decodes first (they always run), as the
engine's `max_batch_tokens`.

KV memory holds the cached prompt segments (shared ones once, see PrefixCache), each running
request's generated tokens, and the partial chunk of the request being prefilled. Decode growth
is reserved first each step (evicting unpinned cache, then preempting the request started last,
which recomputes its prompt and output later, as the engine does); prefill then takes what is
left. Requests are prefilled one after another within a step, in the order admitted (a policy
may put the first of an admission ahead of the queue: `ahead_of_queue`), and a segment
prefilled earlier in the step is already cached for the next one (the engine shares it in-step
too). All per-request work happens at events (start, finish, progress report); a plain decode
step is O(1), and once the policy has admitted everything, decode-only stretches are advanced
to the next finish.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.cost_model import CostModel
from scheduler.errors import SchedulerError
from scheduler.prefix_tree import PrefixTree
from scheduler.simulate.cascade import CascadeReads, SharedReads
from scheduler.simulate.prefix_cache import PrefixCache
from scheduler.simulate.trace import TraceEntry
from scheduler.types import AdmissionPolicy, StepBudget, ahead_of_queue

DEFAULT_MAX_STEP_TOKENS = 2048  # tokens a step holds at most (the engine's max_batch_tokens)


class SimulationError(SchedulerError, RuntimeError):
    """The run cannot go on: a policy stalls or misbehaves, or a request exceeds the KV cache."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    kv_capacity_tokens: int  # KV slots of the simulated device
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS  # decode + prefill tokens per step, at most
    # KV slots the process has never written (their first write costs more on a CPU); None: all
    # of them, as in a fresh `blendserve run`
    fresh_kv_tokens: int | None = None
    # of the rows sampled, the share drawn at a temperature > 0 (each pays the profile's
    # s_per_sampled_row): the batch's share of such requests
    sampled_share: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured (seconds, tokens)."""

    makespan_s: float
    steps: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from cache at each request's first prefill
    request_cached_tokens: np.ndarray  # [requests] the same per request, in trace order
    request_first_step: np.ndarray  # [requests] the step each request's first prefill began
    prefill_tokens: int  # tokens prefilled, recomputation after preemption included
    preemptions: int  # decoding requests preempted (they recompute later)
    prefill_aborts: int  # partial prefills dropped to make room for decode tokens
    peak_kv_tokens: int  # most KV slots in use at any step end (≤ kv capacity)
    step_time_s: np.ndarray  # [steps] overhead + combine(compute, memory) of each step
    step_compute_s: np.ndarray  # [steps] compute time of each step
    step_memory_s: np.ndarray  # [steps] memory time of each step: KV reads + the weights read
    step_prefill_tokens: np.ndarray  # [steps] prompt (and recomputed) tokens prefilled
    step_decoding: np.ndarray  # [steps] requests that decoded a token
    step_queued: np.ndarray  # [steps] admitted requests waiting for or in prefill
    step_kv_used: np.ndarray  # [steps] KV slots in use after the step's prefill (cache included)

    @property
    def prefix_sharing_ratio(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _next_report(g: int) -> int:
    """Generated counts at which on_progress fires: 1, 2, 4, …, 256, then every 256 tokens."""
    return 1 if g == 0 else 2 * g if g < 256 else (g // 256 + 1) * 256


class _Run:
    """One simulation's mutable state; `simulate` is its only user."""

    def __init__(self, entries: Sequence[TraceEntry], policy: AdmissionPolicy,
                 cost: CostModel, config: SimConfig, tree: PrefixTree | None) -> None:
        self.policy, self.cost, self.cfg = policy, cost, config
        self.cap = config.kv_capacity_tokens
        self.ids = [e.request.id for e in entries]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.p = [e.request.prompt_len for e in entries]
        self.d = [e.output_len for e in entries]
        self.n = len(entries)
        tree = tree or PrefixTree.build([e.request.prompt_token_ids for e in entries])
        self.cache = PrefixCache(tree)
        # decodes sharing a prefix read it once a step, where the device's attention cascades;
        # elsewhere the reads of pages another decode reads too may cost less (a CPU's caches)
        self.shared_kv: CascadeReads | SharedReads | None = None
        if cost.hardware.cascade:
            self.shared_kv = CascadeReads(tree)
        elif cost.seconds_per_shared_kv_token != cost.seconds_per_kv_token:
            self.shared_kv = SharedReads(tree)
        self.g0 = [0] * self.n  # tokens generated when the current decode stint began
        self.base = [0] * self.n  # step of the current stint's first decode
        self.epoch = [0] * self.n  # bumps on preemption: stale heap entries are skipped
        self.path: list[list[int] | None] = [None] * self.n
        self.admitted = [False] * self.n
        self.first_step = [-1] * self.n  # step of the first prefill (hits are counted once)
        self.hits = [0] * self.n  # prompt tokens found cached at the first prefill
        self.redo = [0] * self.n  # output tokens to recompute after a preemption
        self.queue: deque[int] = deque()  # admitted, waiting for / in prefill, in order
        self.running: dict[int, None] = {}  # holds KV; insertion order = start order
        self.head_active = False  # queue[0] has acquired its path and is prefilling
        self.head_pos = 0  # tokens of queue[0] covered (hit + prefilled)
        self.head_fill = 0  # index into its path of the next node to fill
        self.partial = 0  # KV of queue[0]'s prefill not yet in cached nodes
        self.waiting = 0  # admitted tokens still to prefill (StepBudget.waiting_prefill_tokens)
        self.n_dec = 0  # decoding requests
        self.ctx = 0  # Σ (p + generated) over decoding requests: KV the next decode step reads
        self.gen = 0  # Σ (generated − 1) over decoding requests: their outputs' KV (private)
        self.finish_heap: list[tuple[int, int, int]] = []  # (last step, request, epoch)
        self.report_heap: list[tuple[int, int, int]] = []
        self.t = 0
        self.finished = 0
        self.prefilled = 0
        self.preemptions = 0  # decoding requests evicted (recomputed later)
        self.prefill_aborts = 0  # partial prefills torn down to make room for decode
        self.peak = 0
        self.written = 0  # KV tokens written so far (recomputed ones again)
        self.fresh = self.cap if config.fresh_kv_tokens is None else config.fresh_kv_tokens
        self.comp: list[float] = []
        self.mem: list[float] = []
        self.trace_rows: list[tuple[int, int, int, int]] = []  # prefill, decoding, queued, used

    # ------------------------------------------------------------------ memory
    def used(self) -> int:
        return self.cache.cached_tokens + self.gen + self.partial

    def pinned(self) -> int:
        return self.cache.pinned_tokens + self.gen + self.partial

    def budget(self) -> StepBudget:
        return StepBudget(self.cap, self.cap - self.pinned(), len(self.queue) + self.n_dec,
                          self.waiting)

    def generated(self, i: int) -> int:
        """Tokens request i (decoding) has generated before the current step."""
        return self.g0[i] + self.t - self.base[i]

    def reserve_decode(self) -> None:
        """Make room for this step's decode tokens: evict, then preempt the newest request."""
        while True:
            over = self.used() + self.n_dec - self.cap
            if over > 0:
                self.cache.evict(over)
            if self.pinned() + self.n_dec <= self.cap:
                return
            victim = next(reversed(self.running))
            if len(self.running) == 1:  # alone and still too big: it would restart forever
                raise SimulationError(f"request {self.ids[victim]!r} outgrows {self.cap} KV tokens")
            self.preempt(victim)

    def preempt(self, i: int) -> None:
        del self.running[i]
        self.preemptions += 1
        path = self.path[i]
        assert path is not None
        self.cache.release(path, self.t, again=True)
        if self.queue and self.queue[0] == i and self.head_active:
            self.prefill_aborts += 1
            self.preemptions -= 1
            self.waiting += self.head_pos
            self.head_active = False
            self.partial = 0
            return
        g = self.generated(i)
        self.n_dec -= 1
        self.ctx -= self.p[i] + g
        self.gen -= g - 1
        if self.shared_kv is not None:
            self.shared_kv.remove(path)
        self.redo[i] = g  # the engine refeeds prompt + output, then samples the next token
        self.epoch[i] += 1
        self.waiting += self.p[i] + g
        self.queue.appendleft(i)

    # ------------------------------------------------------------------ policy
    def admit(self) -> int:
        if not self.policy.has_pending():
            return 0
        got = self.policy.admit(self.budget())
        ahead = ahead_of_queue(self.policy)
        at = int(self.head_active and bool(self.queue))  # a prompt part-way in stays first
        for k, req in enumerate(got):
            i = self.index.get(req.id)
            if i is None or self.admitted[i]:
                raise SimulationError(f"policy admitted {req.id!r} twice or from outside the trace")
            self.admitted[i] = True
            if k < ahead:
                self.queue.insert(at + k, i)
            else:
                self.queue.append(i)
            self.waiting += self.p[i]
        return len(got)

    # ------------------------------------------------------------------ prefill
    def activate_head(self) -> None:
        i = self.queue[0]
        path = self.path[i] = self.cache.path(i)
        hit = self.cache.acquire(path, self.t)
        if self.first_step[i] < 0:
            self.first_step[i] = self.t
            self.hits[i] = hit
        self.head_active = True
        self.head_pos = hit
        self.head_fill = 0
        while self.head_fill < len(path) and self.cache.is_cached(path[self.head_fill]):
            self.head_fill += 1
        self.partial = 0
        self.waiting -= hit
        self.running[i] = None

    def prefill(self, tokens: int, starting: list[int]) -> tuple[int, int]:
        """Prefill up to `tokens` from the queue head(s); returns (tokens computed, attention
        pairs); requests whose prompt completes are appended to `starting`."""
        left, done, pairs = tokens, 0, 0
        while left > 0 and self.queue:
            if not self.head_active:
                if self.running and not self.prompt_fits(self.queue[0]):
                    break  # it starts once its whole prompt fits (as the engine's)
                self.activate_head()
            i = self.queue[0]
            target = self.p[i] + self.redo[i]
            want = min(left, target - self.head_pos)
            free = self.cap - self.used() - self.headroom()
            if want > free:
                self.cache.evict(want - free)
                free = self.cap - self.used() - self.headroom()
            take = min(want, free)
            if take > 0:
                pairs += take * self.head_pos + take * (take + 1) // 2
                self.head_pos += take
                self.partial += take
                left -= take
                done += take
                self.waiting -= take
                self.fill_nodes(i)
            if self.head_pos == target:
                self.gen += self.redo[i]  # recomputed output tokens stay private KV
                self.partial = 0
                self.queue.popleft()
                self.head_active = False
                starting.append(i)
            elif take <= 0:
                break  # out of memory this step
        return done, pairs

    def prompt_fits(self, i: int) -> bool:
        """The engine's rule (runtime/engine.py `_prompt_fits`): a request starts its prefill
        only once its uncached prompt fits in what is not pinned, beside the tokens the running
        requests add as they decode while it prefills. Its cached prefix is pinned once it
        starts, so the unpinned part of it is no room for the rest."""
        hit, unpinned = self.cache.hit(self.cache.path(i))
        todo = self.p[i] + self.redo[i] - hit
        steps = -(-todo // self.cfg.max_step_tokens) + 1
        return todo + len(self.running) * steps <= self.cap - self.pinned() - unpinned

    def headroom(self) -> int:
        """KV prefill must leave free: this step's decode tokens and the next step's.

        Without the second step's share a chunk that fills memory is torn down by the very next
        decode step (its request is the newest), over and over.
        """
        return 2 * self.n_dec

    def fill_nodes(self, i: int) -> None:
        path = self.path[i]
        assert path is not None
        depth = self.cache.depth
        filled = depth[path[self.head_fill - 1]] if self.head_fill else 0
        while self.head_fill < len(path) and depth[path[self.head_fill]] <= self.head_pos:
            node = path[self.head_fill]
            self.cache.fill(node)
            self.partial -= depth[node] - filled
            filled = depth[node]
            self.head_fill += 1

    # ------------------------------------------------------------------ steps
    def record(self, tokens: int, rows: int, pairs: int, kv_read: float, prefill: int,
               decoding: int, used: int, shared: int) -> None:
        # The engine keeps a finished request's KV in its cache: until the pool is full every
        # token written lands on a page it never used (the first write costs more on a CPU)
        fresh = min(self.written + tokens, self.fresh) - min(self.written, self.fresh)
        self.written += tokens
        self.comp.append(self.cost.step_compute_time(tokens, rows, pairs, fresh,
                                                     rows * self.cfg.sampled_share))
        self.mem.append(self.cost.step_memory_time(kv_read, shared))
        self.trace_rows.append((prefill, decoding, len(self.queue), used))

    def shared_reads(self) -> int:
        """KV reads of this step's decodes that another decode makes too (a shared prefix:
        read once per group where the attention cascades, from cache on a CPU)."""
        return 0 if self.shared_kv is None else self.shared_kv.shared_tokens()

    def start_decoding(self, starting: list[int]) -> None:
        """Requests whose (re)prefill completed this step sampled a token: decode or finish."""
        for i in starting:
            g = self.redo[i] + 1  # the completing step sampled one more token
            self.redo[i] = 0
            self.n_dec += 1
            self.ctx += self.p[i] + g  # its outputs' KV joined `gen` with the prefill
            self.g0[i], self.base[i] = g, self.t
            if self.shared_kv is not None:
                self.shared_kv.add(self.path[i] or [])
            # decode steps t .. t + d − g − 1; a request done at its prefill "ends" at t − 1
            heapq.heappush(self.finish_heap, (self.t + self.d[i] - g - 1, i, self.epoch[i]))
            self.push_report(i, _next_report(g - 1) if g > 1 else 1)

    def push_report(self, i: int, at: int) -> None:
        """Schedule on_progress for when request i has generated `at` tokens."""
        if at < self.d[i]:
            step = self.base[i] + at - self.g0[i] - 1  # the step after which it holds `at`
            heapq.heappush(self.report_heap, (step, i, self.epoch[i]))

    def retire(self) -> None:
        """Deliver progress and finishes of every step before self.t."""
        last = self.t - 1
        while self.report_heap and self.report_heap[0][0] <= last:
            step, i, ep = heapq.heappop(self.report_heap)
            if ep == self.epoch[i] and i in self.running:
                g = self.g0[i] + step + 1 - self.base[i]  # generated when that step ended
                self.policy.on_progress(self.ids[i], g)
                self.push_report(i, _next_report(g))
        while self.finish_heap and self.finish_heap[0][0] <= last:
            _, i, ep = heapq.heappop(self.finish_heap)
            if ep != self.epoch[i]:
                continue
            assert i in self.running
            d = self.d[i]
            self.n_dec -= 1
            self.ctx -= self.p[i] + d
            self.gen -= d - 1
            del self.running[i]
            path = self.path[i]
            assert path is not None
            if self.shared_kv is not None:
                self.shared_kv.remove(path)
            self.cache.release(path, self.t)
            self.finished += 1
            self.policy.on_finish(self.ids[i], d)

    def next_finish(self) -> int:
        heap = self.finish_heap
        while heap and heap[0][2] != self.epoch[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else self.t

    def fast_forward(self) -> bool:
        """Advance decode-only steps up to the next finish once the policy has nothing left to admit.

        Nothing can change before that finish: no prefill, no admission; progress reports due in
        the stretch are delivered right after it, with the lengths they had when due.
        """
        n = self.n_dec
        k = min(self.next_finish() - self.t + 1, (self.cap - self.pinned()) // n)
        if k < 2:
            return False
        over = self.used() + k * n - self.cap
        if over > 0:
            self.cache.evict(over)  # k·n fits in what is not pinned
        used = self.used()
        for j in range(k):
            self.record(n, n, 0, self.ctx + n * j, 0, n, used + n * (j + 1), self.shared_reads())
        self.ctx += k * n
        self.gen += k * n
        self.t += k
        return True

    def step(self) -> None:
        """One scheduling step: reserve decode KV, admit, prefill, cost the step, retire."""
        self.reserve_decode()  # 1. room for every decoding request's next token
        admitted = self.admit()  # 2. the policy picks who starts
        if (not admitted and not self.queue and self.n_dec and not self.policy.has_pending()
                and self.fast_forward()):
            self.after_step()
            return
        room = max(self.cfg.max_step_tokens - self.n_dec, 0)
        budget = self.policy.prefill_budget(self.budget())  # 3. pacing, within the step cap
        chunk = room if budget is None else max(0, min(budget, room))
        if chunk == 0 and self.n_dec == 0:
            chunk = self.cfg.max_step_tokens  # an idle step must make progress
        starting: list[int] = []
        done, pairs = self.prefill(chunk, starting)
        tokens = done + self.n_dec
        if tokens == 0 and not starting:
            self.stalled()
        self.prefilled += done
        self.gen += self.n_dec
        # 4. cost: the decodes read their contexts; prompts that completed sample a token
        self.record(tokens, self.n_dec + len(starting), pairs, self.ctx, done, self.n_dec,
                    self.used(), self.shared_reads())
        self.ctx += self.n_dec
        self.t += 1
        self.start_decoding(starting)
        self.after_step()

    def after_step(self) -> None:
        self.retire()  # 5. finished requests free KV and tell the policy
        used = self.used()
        if used > self.cap:
            raise SimulationError(f"KV use {used} exceeds the capacity {self.cap}")
        self.peak = max(self.peak, used)

    def stalled(self) -> None:
        if self.queue:
            raise SimulationError(
                f"request {self.ids[self.queue[0]]!r} does not fit in {self.cap} KV tokens")
        raise SimulationError("policy admits nothing while nothing runs; "
                              f"{self.n - self.finished} requests never finished")

    def run(self) -> SimResult:
        while self.finished < self.n:
            self.step()
        if self.policy.has_pending():
            raise SimulationError("policy still has requests after every trace request finished")
        comp, mem = np.asarray(self.comp), np.asarray(self.mem)
        dt = self.cost.step_overhead_s + np.asarray(self.cost.combine(comp, mem), dtype=np.float64)
        return SimResult(
            makespan_s=float(dt.sum()), steps=len(comp), requests=self.n,
            prompt_tokens=sum(self.p), output_tokens=sum(self.d),
            cached_prompt_tokens=sum(self.hits), prefill_tokens=self.prefilled,
            request_cached_tokens=np.asarray(self.hits, dtype=np.int64),
            request_first_step=np.asarray(self.first_step, dtype=np.int64),
            preemptions=self.preemptions, prefill_aborts=self.prefill_aborts,
            peak_kv_tokens=self.peak, step_time_s=dt,
            step_compute_s=comp, step_memory_s=mem,
            **dict(zip(("step_prefill_tokens", "step_decoding", "step_queued", "step_kv_used"),
                       np.asarray(self.trace_rows, dtype=np.int64).reshape(-1, 4).T)))


def simulate(entries: Sequence[TraceEntry], policy: AdmissionPolicy, cost: CostModel,
             config: SimConfig, tree: PrefixTree | None = None) -> SimResult:
    """Run every entry through `policy` on `cost`; `tree` (the trace's radix tree) is reused if given."""
    return _Run(entries, policy, cost, config, tree).run()
