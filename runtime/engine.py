"""The engine: continuous batching with chunked prefill over the paged KV pool and radix cache.

Each step reads as schedule → run model → apply results. A sequence is a token list plus how many
of its tokens already have K/V (`computed`); prefill, decode and recompute after preemption are
the same operation (feed the uncomputed tokens, sample when none are left), so one code path
serves them all. What to admit comes from an `AdmissionPolicy` (scheduler/types.py).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime.attention import AttentionBatch, make_backend, resolve_backend
from runtime.config import LoadedModel, unmeasured_cost_model
from runtime.errors import EngineFatalError
from runtime.grammar import Grammars
from runtime.kv_cache import PagedKVPool, default_kv_memory_bytes
from runtime.model import LlamaModel
from runtime.radix_cache import PageCopies, RadixCache, RadixNode
from runtime.sampler import Sampler, SamplingState, StopChecker
from runtime.types import (
    Choice,
    EngineRequest,
    RequestError,
    RequestOutput,
    StepRecord,
    TokenLogprob,
)
from scheduler.cost_model import CostModel
from scheduler.mix import MixPolicy
from scheduler.policies import make_policy
from scheduler.types import AdmissionPolicy, PlanRequest, StepBudget, ahead_of_queue

PROGRESS_EVERY = 16  # tokens between policy.on_progress calls for one request (and its first)
MAX_STEP_LOG = 200_000  # steps a long-lived serve() keeps in step_log


@dataclass(frozen=True, slots=True)
class FeedUpdate:
    """What a `RequestFeed` has for the engine at one step."""

    arrivals: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, level)
    aborts: set[str] = field(default_factory=set)  # request ids to drop, outputs unwanted
    closed: bool = False  # nothing more will arrive: serve() returns once the rest has run
    drain: bool = False  # shutdown: admit nothing more, finish what has started


class RequestFeed(Protocol):
    """Where `Engine.serve` gets requests from; `idle` says the engine has nothing to run, so
    the feed may wait a little for work instead of answering at once."""

    def poll(self, idle: bool) -> FeedUpdate: ...


CPU_STEP_TOKENS = 8192  # the server's step cap on a CPU (default_step_tokens)
GPU_STEP_TOKENS = 2048  # and on a GPU


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # tokens (decode + prefill) per step; the server picks default_step_tokens(device)
    max_batch_tokens: int = GPU_STEP_TOKENS
    kv_memory_bytes: int | None = None  # KV pool budget; None = kv_cache.default_kv_memory_bytes
    page_size: int = 16  # tokens per KV page
    device: str = "cpu"
    dtype: str | torch.dtype | None = None  # None = bfloat16 on CPUs with AVX512-BF16/AMX, else fp32
    attention_backend: str = "auto"  # auto = flashinfer on CUDA when installed, else torch
    # CUDA + flashinfer: each step as two nano-batches on two streams (runtime/overlap.py). Off:
    # on an H200 (2026-12-04, bench/gpu_bench.py's mixed trace, Llama-3-8B shape) dfs ran the
    # same 903 steps in 35.2 s with it and 25.9 s without.
    overlap: bool = False
    seed: int = 0  # seeds unseeded sampling and dummy weights

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.page_size < 1:
            raise ValueError("max_batch_tokens and page_size must be at least 1")


@dataclass(frozen=True, slots=True)
class EngineStats:
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    decode_tokens: int = 0  # tokens run as decodes (one per generated token but the last)
    steps: int = 0
    preemptions: int = 0
    finished_requests: int = 0


def _cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 GEMMs run several times faster than float32 there."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_step_tokens(device: str) -> int:
    """The step cap the server uses when none is set: 8,192 tokens on a CPU, 2,048 on a GPU
    (`cuda`, `cuda:N`).
    On a CPU compute and memory do not overlap and every step pays a fixed cost (weights read,
    launch and Python work) on top of its tokens, so fewer, fuller prefill steps cost least by
    the step model. Measured on a 2-core bf16 host, no smaller cap is faster beyond the noise:
    bench/step_caps.py times the same prefill at 512 to 4,096-token steps at -5%..+23% of
    8,192's time over two runs, and fcfs/dfs at 2,048 and 8,192 trade places from run to run
    in bench/cpu_policies.py. A GPU step overlaps its compute with its KV reads and wants
    steps sized to hide one under the other (the dual scan paces them), at the 2,048 tokens
    NanoFlow uses."""
    return CPU_STEP_TOKENS if device == "cpu" else GPU_STEP_TOKENS


# glibc's malloc: blocks under this come from the heap, and this much freed heap is kept.
HEAP_BLOCKS_UNDER = 1 << 30
HEAP_KEPT_FREE = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def reuse_freed_memory() -> bool:
    """Have glibc keep a CPU step's large freed blocks for the next step instead of unmapping
    them. Above its mmap threshold (32 MB at most, by default) every block was mapped afresh,
    page-faulted in and unmapped again each step: a 512-row decode step's logits alone are
    100 MB of float32. Measured on a 2-core AVX512-BF16 VM, SmolLM2-135M: a decode step of 256
    rows 403 -> 346 ms, of 512 rows 1,199 -> 824 ms. The process keeps up to HEAP_KEPT_FREE of
    freed memory. False (nothing changed) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS_UNDER)
                    and libc.mallopt(_M_TRIM_THRESHOLD, HEAP_KEPT_FREE))
    except (OSError, AttributeError):
        return False


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device == "cpu":
        return torch.bfloat16 if _cpu_has_bf16() else torch.float32
    return torch.bfloat16


@dataclass(eq=False)
class _Group:
    """One request: its n choices finish separately and leave together."""

    req: EngineRequest
    cached_tokens: int = -1  # set when the first sequence starts
    choices: list[Choice | None] = field(default_factory=list)


@dataclass(eq=False)
class _Seq:
    group: _Group
    index: int  # choice index
    tokens: list[int]  # prompt + generated
    sampling: SamplingState
    stop: StopChecker
    forks_left: int = 0  # choices still to fork off after this sequence's prefill
    computed: int = 0  # tokens whose K/V sit in `pages`
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0  # leading pages owned by the radix cache (locked through `node`)
    node: RadixNode | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    order: int = 0  # start (or restart) order: the newest started is preempted first
    waiting_tokens: int = 0  # leading tokens counted in the cache's PrefixDemand (not started)
    grammar: Any = None  # xgrammar matcher of a constrained choice (response_format), else None

    @property
    def generated(self) -> int:
        return len(self.stop.tokens)


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *,
                 cost_model: CostModel | None = None) -> None:
        cfg = config or EngineConfig()
        self.config = cfg
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        mc = model.config
        self.max_model_len = mc.max_position_embeddings
        self.dtype = resolve_dtype(cfg.dtype, cfg.device)
        if cfg.device == "cpu":
            reuse_freed_memory()
        self.model = LlamaModel(mc, model.weights, dtype=self.dtype, device=cfg.device, seed=cfg.seed)
        budget = (cfg.kv_memory_bytes if cfg.kv_memory_bytes is not None
                  else default_kv_memory_bytes(cfg.device))
        per_page = PagedKVPool.bytes_per_page(num_layers=mc.num_layers, page_size=cfg.page_size,
                                              kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                              dtype=self.dtype)
        self.pool = PagedKVPool(num_layers=mc.num_layers, num_pages=max(1, budget // per_page),
                                page_size=cfg.page_size, kv_heads=mc.num_kv_heads,
                                head_dim=mc.head_dim, dtype=self.dtype, device=cfg.device)
        self.cache = RadixCache(cfg.page_size, self.pool.free)
        self.attn = make_backend(resolve_backend(cfg.attention_backend, cfg.device), self.pool,
                                 num_heads=mc.num_heads, scale=mc.head_dim**-0.5)
        self._overlap = None
        if cfg.overlap and self.attn.name == "flashinfer":
            from runtime.overlap import StepOverlap

            self._overlap = StepOverlap(self.model.device)
        # shared partial pages, copied in the forward (a step with copies is not overlapped)
        self.copies = PageCopies(self.cache) if self.attn.copies_pages else None
        self.sampler = Sampler()
        # The planner's view of this model on this device: a measured profile's (set by the
        # caller, see runtime/profile.py) or, unmeasured, the model's shape on a device that
        # runs compute and memory one after the other (which this runtime does everywhere).
        self.cost_model = cost_model or unmeasured_cost_model(mc, self.dtype)
        self.profile_path: str | None = None  # where the measured profile came from
        self.profile_checked_at = 0.0  # time.monotonic() of its load or last drift check
        self.last_policy: AdmissionPolicy | None = None  # the policy of the latest generate()
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_ids)
        self._grammar_s = 0.0  # grammar time of the step being applied
        self._stats = EngineStats()
        self.step_log: list[StepRecord] = []  # the steps of the current (or last) generate()
        self._order = itertools.count()
        self._seed = itertools.count(cfg.seed * 1_000_003 + 1)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def _count(self, **inc: int) -> None:
        s = self._stats
        self._stats = EngineStats(**{k: getattr(s, k) + inc.get(k, 0) for k in s.__dataclass_fields__})

    # ---- request validation ------------------------------------------------------------------
    def check(self, req: EngineRequest) -> RequestError | None:
        """Why this request cannot run (a 400 for it alone), or None."""
        p, n = len(req.prompt_token_ids), req.params.n
        if p == 0:
            return RequestError("The prompt must contain at least one token.", "messages")
        if req.params.max_tokens < 1:
            return RequestError("max_tokens must be at least 1.", "max_tokens", "invalid_value")
        if n < 1:
            return RequestError("n must be at least 1.", "n", "invalid_value")
        if p + req.params.max_tokens > self.max_model_len:
            return RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {p + req.params.max_tokens} tokens ({p} in the messages, "
                f"{req.params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", "messages", "context_length_exceeded")
        ps = self.pool.page_size
        need_pages = -(-p // ps) + n * -(-(req.params.max_tokens + ps) // ps)
        if need_pages > self.pool.num_pages:
            return RequestError(
                f"The request needs about {need_pages * ps} tokens of KV cache; this engine holds "
                f"{self.kv_capacity_tokens}. Reduce the prompt, max_tokens or n.", "max_tokens",
                "context_length_exceeded")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_token_ids):
            return RequestError("The prompt contains a token id outside the vocabulary.", "prompt")
        if req.params.response_format is not None:
            return self.grammars.check(req.params.response_format)
        return None

    def plan_request(self, req: EngineRequest) -> PlanRequest:
        """The request as the planner sees it: an exact length (ignore_eos, no other stop), or
        for a structured output its schema's prior and its own length group."""
        sp, fmt = req.params, req.params.response_format
        if fmt is not None:  # a finished grammar ends it early, ignore_eos or not
            return PlanRequest(req.id, req.prompt_token_ids, sp.max_tokens,
                               output_prior=self.grammars.prior(fmt), length_group=fmt.key)
        exact = sp.ignore_eos and not sp.stop and not sp.stop_token_ids
        return PlanRequest(req.id, req.prompt_token_ids, sp.max_tokens,
                           sp.max_tokens if exact else None)

    # ---- the run ----------------------------------------------------------------------------
    def generate(
        self,
        requests: Iterable[EngineRequest],
        *,
        policy: str | AdmissionPolicy = "fcfs",
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as it finishes (errors included, as outputs)."""
        known: dict[str, EngineRequest] = {}
        done: deque[RequestOutput] = deque()
        plan_requests = self._accept(requests, known, done)
        self.step_log = []
        if isinstance(policy, str):
            pol = make_policy(policy, plan_requests, kv_capacity_tokens=self.kv_capacity_tokens,
                              cost_model=self.cost_model, step_tokens=self.config.max_batch_tokens)
        else:
            pol = policy
            for _ in plan_requests:  # the caller built the policy: index the requests now
                pass
        self.last_policy = pol
        waiting: deque[_Seq] = deque()  # admitted, holding no pages
        running: list[_Seq] = []  # holding pages: prefilling or decoding
        try:
            yield from self._loop(pol, known, done, waiting, running, should_stop)
        finally:  # also when the caller abandons the generator: hand every page back
            for s in running:
                self._release(s)
            self.cache.demand.clear()

    def serve(self, feed: RequestFeed, *, policy: str = "fcfs") -> Iterator[RequestOutput]:
        """Run requests that keep arriving (a worker's batches) until the feed closes and
        everything admitted has finished; yield each output as it finishes.

        Before every step the engine polls `feed` once: arrivals are planned into their priority
        level with what that level has not started (scheduler/mix.py), and aborted requests are
        dropped wherever they are, pages freed, without an output.
        """
        def build(reqs: list[PlanRequest]) -> AdmissionPolicy:
            return make_policy(policy, reqs, kv_capacity_tokens=self.kv_capacity_tokens,
                               cost_model=self.cost_model, step_tokens=self.config.max_batch_tokens)

        mix = MixPolicy(build)
        known: dict[str, EngineRequest] = {}
        done: deque[RequestOutput] = deque()
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        self.step_log, self.last_policy = [], mix
        draining = False
        try:
            with torch.inference_mode():
                while True:
                    while done:
                        yield done.popleft()
                    idle = not running and not waiting and not mix.has_pending()
                    update = feed.poll(idle)
                    if update.drain and not draining:
                        draining = True
                        mix.withdraw()
                        self._drop_waiting(known.values(), (s for s in waiting if not _has_started(s)))
                        known.clear()
                        waiting = _started(waiting)
                    if update.aborts:
                        self._abort(update.aborts, mix, known, waiting, running)
                    for level, reqs in _by_level([] if draining else update.arrivals).items():
                        mix.add(list(self._accept(reqs, known, done)), level)
                    self._admit(mix, known, waiting, running)
                    if not running and not waiting:
                        if not done and update.closed and not mix.has_pending():
                            return
                        continue
                    done.extend(self._step(mix, waiting, running))
                    if len(self.step_log) > MAX_STEP_LOG:  # a long-lived worker: keep the recent
                        del self.step_log[: MAX_STEP_LOG // 2]
        finally:
            for s in running:
                self._release(s)
            self.cache.demand.clear()

    def _accept(self, requests: Iterable[EngineRequest], known: dict[str, EngineRequest],
                done: deque[RequestOutput]) -> Iterator[PlanRequest]:
        """Each request the engine can run, as the planner sees it (indexed in `known`); one it
        cannot run becomes an error output in `done` at once."""
        for req in requests:
            err = self.check(req)
            if err is not None:
                done.append(RequestOutput(req.id, len(req.prompt_token_ids), 0, error=err))
                continue
            known[req.id] = req
            self.cache.demand.add(req.prompt_token_ids)
            yield self.plan_request(req)

    def _abort(self, ids: set[str], pol: MixPolicy, known: dict[str, EngineRequest],
               waiting: deque[_Seq], running: list[_Seq]) -> None:
        """Drop requests wherever they are: not admitted, waiting, or holding pages."""
        for s in [s for s in running if s.group.req.id in ids]:
            self._release(s)
            running.remove(s)
        self._drop_waiting([known.pop(rid) for rid in ids if rid in known],
                           [s for s in waiting if s.group.req.id in ids])
        kept = [s for s in waiting if s.group.req.id not in ids]
        waiting.clear()
        waiting.extend(kept)
        pol.remove(ids)

    def _drop_waiting(self, requests: Iterable[EngineRequest], waiting: Iterable[_Seq]) -> None:
        """Requests leaving before they start (not admitted: `requests`; admitted: `waiting`)
        no longer count as waiting prompts in the cache's PrefixDemand."""
        for req in requests:
            self.cache.demand.add(req.prompt_token_ids, -1)
        for s in waiting:
            self._no_longer_waiting(s)
        self.cache.rekey()

    def _no_longer_waiting(self, seq: _Seq) -> None:
        if seq.waiting_tokens:
            self.cache.demand.add(seq.tokens[: seq.waiting_tokens], -1)
            seq.waiting_tokens = 0

    def _loop(self, pol: AdmissionPolicy, known: dict[str, EngineRequest],
              done: deque[RequestOutput], waiting: deque[_Seq], running: list[_Seq],
              should_stop: Callable[[], bool] | None) -> Iterator[RequestOutput]:
        stopping, idle_rounds = False, 0
        with torch.inference_mode():
            while True:
                while done:
                    yield done.popleft()
                if not stopping and should_stop is not None and should_stop():
                    stopping = True
                    self._drop_waiting(known.values(), (s for s in waiting if not _has_started(s)))
                    waiting = _started(waiting)
                if not stopping:
                    self._admit(pol, known, waiting, running)
                if not running and not waiting:
                    if done:
                        continue
                    if stopping or not pol.has_pending():
                        return
                    idle_rounds += 1
                    if idle_rounds >= 3:
                        raise EngineFatalError("the admission policy admits nothing to an idle engine")
                    continue
                idle_rounds = 0
                done.extend(self._step(pol, waiting, running))

    def _admit(self, pol: AdmissionPolicy, known: dict[str, EngineRequest],
               waiting: deque[_Seq], running: list[_Seq]) -> None:
        admitted = pol.admit(self._budget(waiting, running))
        ahead, front = ahead_of_queue(pol), deque[_Seq]()
        for k, pr in enumerate(admitted):
            req = known.pop(pr.id, None)
            if req is None:  # failed check(): its error output is already queued
                continue
            group = _Group(req, choices=[None] * req.params.n)
            seq = self._new_seq(group, 0, forks=req.params.n - 1)
            seq.waiting_tokens = len(seq.tokens)  # counted in the cache's demand by _accept
            (front if k < ahead else waiting).append(seq)
        waiting.extendleft(reversed(front))  # the policy's critical-path starts: before the queue

    def _budget(self, waiting: deque[_Seq], running: list[_Seq]) -> StepBudget:
        free = (self.pool.num_free + self.cache.evictable_pages) * self.pool.page_size
        pending = sum(len(s.tokens) - s.computed for s in itertools.chain(waiting, running)
                      if s.generated == 0)
        return StepBudget(self.kv_capacity_tokens, free, len(waiting) + len(running), pending)

    def _new_seq(self, group: _Group, index: int, forks: int = 0) -> _Seq:
        p = group.req.params
        fmt = p.response_format
        return _Seq(group, index, list(group.req.prompt_token_ids),
                    SamplingState.create(p, index, next(self._seed)),
                    StopChecker(p, self.tokenizer, self.eos_ids), forks_left=forks,
                    grammar=None if fmt is None else self.grammars.matcher(fmt))

    # ---- one step ---------------------------------------------------------------------------
    def _step(self, pol: AdmissionPolicy, waiting: deque[_Seq], running: list[_Seq]) -> list[RequestOutput]:
        started, taken = time.perf_counter(), self.pool.pages_ever_taken
        # 1. schedule: decodes first, then prefill chunks within the token and page budgets
        batch = self._schedule(pol, waiting, running)
        if not batch:
            return []
        shape = _step_shape(batch, self.pool.page_size)
        # 2. run the model on the flat batch
        logits, kv_read = self._run(batch)
        if kv_read is not None and kv_read < shape[3]:  # it read shared prefixes once (cascade)
            shape = (*shape[:3], kv_read, shape[4], 0, shape[6])
        # 3. apply: advance computed counts, cache finished prompts, sample, finish choices
        outputs = self._apply(pol, batch, logits, waiting, running)
        self.step_log.append(StepRecord(*shape[:5], seconds=time.perf_counter() - started,
                                        grammar_seconds=self._grammar_s, kv_shared=shape[5],
                                        sampled=shape[6],
                                        fresh_kv=(self.pool.pages_ever_taken - taken) * self.pool.page_size))
        return outputs

    def _schedule(self, pol: AdmissionPolicy, waiting: deque[_Seq],
                  running: list[_Seq]) -> list[tuple[_Seq, int]]:
        tokens_left, ps = self.config.max_batch_tokens, self.pool.page_size
        # decodes: every running sequence with exactly one token to feed
        decodes = [s for s in running if len(s.tokens) - s.computed == 1 and s.generated > 0]
        while decodes and not self._reserve(decodes):
            victim = max(running, key=lambda s: s.order)
            self._preempt(victim, waiting, running)
            decodes = [s for s in decodes if s is not victim]
        decodes = decodes[:tokens_left]
        batch = [(s, 1) for s in decodes]
        tokens_left -= len(batch)
        limit = pol.prefill_budget(self._budget(waiting, running))
        if limit is None or (limit <= 0 and not batch):  # an idle step helps nobody
            limit = tokens_left
        prefill_left = min(tokens_left, max(limit, 0))
        in_batch = {id(s) for s in decodes}
        candidates = [s for s in running if id(s) not in in_batch]
        starved = False
        # Sequences part-way through their prompt go first, so a waiting sequence starts only
        # once every prompt before it has all its pages in the cache (see below): no prefix
        # shared with a sequence still prefilling is ever computed twice.
        while prefill_left > 0:
            if candidates:
                seq = candidates.pop(0)
            elif waiting:
                seq = waiting[0]
                prefix = self.cache.match_prefix(seq.tokens, (len(seq.tokens) - 1) // ps)
                if running and not self._prompt_fits(seq, *prefix, len(running)):
                    break  # it starts once its whole prompt fits (see _prompt_fits)
                waiting.popleft()
                self._start(seq, *prefix)
                running.append(seq)
            else:
                break
            want = min(len(seq.tokens) - seq.computed, prefill_left)
            chunk = self._grow(seq, want)
            if chunk == 0:
                starved = True
                break
            batch.append((seq, chunk))
            # The chunk's full pages hold their K/V once this step's forward has written them
            # (every layer writes the step's new K/V before attending), so they go into the
            # prefix cache now: a sequence started later in this same step shares them.
            self._cache_prefix(seq, seq.computed + chunk)
            prefill_left -= chunk
        if not batch and starved:  # pages all held by half-prefilled sequences: make room
            self._preempt(max(running, key=lambda s: s.order), waiting, running)
        # the attention backend wants the decodes first; a prompt's one-token chunk is a prefill
        # (the decode kernel splits a long context and merges the parts, the prefill kernel does
        # not: that token would come out a rounding apart from where it is part of a longer chunk)
        batch.sort(key=lambda e: not _decodes(*e))
        return batch

    def _prompt_fits(self, seq: _Seq, cached: list[int], node: RadixNode, growing: int) -> bool:
        """Whether a waiting sequence's uncached prompt fits in the free and evictable pages,
        beside the pages `growing` running sequences take as they decode while it prefills.
        Its cached prefix (`cached`, ending at `node`) is not evictable once it starts. Started
        on less, its prefill would take what is free, and the next decode step that runs out
        would preempt it (the newest), over and over, each time recomputing it."""
        ps = self.pool.page_size
        todo = len(seq.tokens) - len(cached) * ps
        steps = -(-todo // self.config.max_batch_tokens) + 1
        need = -(-todo // ps) + growing * -(-steps // ps)
        room = self.pool.num_free + self.cache.evictable_pages - self.cache.unlocked_pages(node)
        return need <= room

    def _free_pages(self, need: int) -> bool:
        """Make `need` pages free, evicting unlocked cache leaves if needed."""
        short = need - self.pool.num_free
        if short > 0 and self.cache.evictable_pages >= short:
            self.cache.evict(max(short, 16))
        return self.pool.num_free >= need

    def _reserve(self, decodes: list[_Seq]) -> bool:
        """Give every decode a page for its next token; False when memory runs out."""
        ps = self.pool.page_size
        need = [s for s in decodes if s.computed >= len(s.pages) * ps]
        if not self._free_pages(len(need)):
            return False
        for s, page in zip(need, self.pool.alloc(len(need))):
            s.pages.append(page)
        return True

    def _grow(self, seq: _Seq, want: int) -> int:
        """Allocate pages for up to `want` more tokens of `seq`; returns how many fit."""
        ps = self.pool.page_size
        room = len(seq.pages) * ps - seq.computed  # free slots in its last page
        need = max(0, -(-(want - room) // ps))
        need = min(need, self.pool.num_free + self.cache.evictable_pages)
        self._free_pages(need)
        seq.pages.extend(self.pool.alloc(need))
        return min(want, room + need * ps)

    def _start(self, seq: _Seq, pages: list[int], node: RadixNode) -> None:
        """Give a waiting sequence its cached prefix (`cache.match_prefix`'s pages and node:
        whole pages, at least one token left to run), and the tokens after it that a cached
        page begins with, in a page of its own (PageCopies)."""
        ps = self.pool.page_size
        self.cache.lock(node)
        self._no_longer_waiting(seq)
        seq.order = next(self._order)  # the newest started is preempted first (as the simulator)
        seq.pages, seq.tree_pages, seq.node, seq.computed = pages, len(pages), node, len(pages) * ps
        if self.copies is not None:
            left = len(seq.tokens) - 1 - seq.computed
            hit = self.copies.share(node, seq.tokens, len(pages), left,
                                    lambda: self.pool.alloc(1)[0] if self._free_pages(1) else None)
            if hit is not None:
                seq.pages.append(hit[0])
                seq.computed += hit[1]
        if seq.group.cached_tokens < 0:
            seq.group.cached_tokens = seq.computed
            self._count(cached_tokens=seq.computed)

    def _preempt(self, seq: _Seq, waiting: deque[_Seq], running: list[_Seq]) -> None:
        """Recompute later: drop the sequence's K/V, keep its tokens, put it first in line."""
        self._release(seq)
        running.remove(seq)
        waiting.appendleft(seq)
        self.cache.demand.add(seq.tokens)  # its recompute wants what it had cached back
        seq.waiting_tokens = len(seq.tokens)
        self._count(preemptions=1)

    def _release(self, seq: _Seq) -> None:
        if self.copies is not None:
            self.copies.cancel(seq.pages[seq.tree_pages :])
        self.pool.free(seq.pages[seq.tree_pages :])
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.pages, seq.tree_pages, seq.node, seq.computed = [], 0, None, 0

    def _cache_prefix(self, seq: _Seq, computed: int | None = None) -> None:
        """Hand the sequence's full pages up to `computed` tokens (default: what it has computed)
        to the radix cache, dropping its own copies of pages the cache already holds."""
        ps = self.pool.page_size
        full = (seq.computed if computed is None else computed) // ps
        if full <= seq.tree_pages:
            return
        key = seq.tokens[: full * ps]
        self.cache.insert(key, seq.pages[:full])
        tree, node = self.cache.match_prefix(key, full)
        if len(tree) != full:
            raise EngineFatalError("the prefix cache lost pages it was just given")
        dup = [mine for mine, t in zip(seq.pages[seq.tree_pages : full], tree[seq.tree_pages :])
               if mine != t]
        if self.copies is not None:  # the cache's page holds it all: no copy into ours
            self.copies.cancel(dup)
        self.pool.free(dup)
        self.cache.lock(node)
        if seq.node is not None:
            self.cache.unlock(seq.node)
        seq.pages[:full], seq.tree_pages, seq.node = tree, full, node

    def _run(self, batch: list[tuple[_Seq, int]]) -> tuple[torch.Tensor, int | None]:
        """Logits of the rows to sample, and the KV tokens the decodes read (if the backend
        says; cascade attention reads a shared prefix once)."""
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for s, n in batch:
            ids.extend(s.tokens[s.computed : s.computed + n])
            pos.extend(range(s.computed, s.computed + n))
            if s.computed + n == len(s.tokens):
                rows.append(len(ids) - 1)
        num_decode = sum(1 for e in batch if _decodes(*e))
        ab = AttentionBatch(
            q_lens=[n for _, n in batch], kv_lens=[s.computed + n for s, n in batch],
            page_tables=[s.pages for s, _ in batch], num_decode=num_decode,
            page_copies=self.copies.batch() if self.copies is not None else ())
        if self._overlap is not None and not ab.page_copies:  # two nano-batches, two streams
            logits = self._run_overlapped(ab, ids, pos, rows)
            if logits is not None:
                return logits, None
        plan = self.attn.plan(ab)
        dev = self.model.device
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        # logits stay on the device: _apply brings back token ids only, where it can
        logits = self.model.forward(t(ids), t(pos), self.attn, plan, t(rows))
        if self.copies is not None:
            self.copies.done()
        return logits, getattr(plan, "kv_read", None)

    def _run_overlapped(self, ab: AttentionBatch, ids: list[int], pos: list[int],
                        rows: list[int]) -> torch.Tensor | None:
        from runtime.overlap import forward_split, split_batch

        assert self._overlap is not None
        cm = self.cost_model  # one KV token read, in units of one token's GEMMs
        cost = cm.seconds_per_kv_token / cm.seconds_per_token if cm.seconds_per_token > 0 else 0.01
        split = split_batch(ab, self.pool.page_size, kv_token_cost=cost)
        if split is None:
            return None
        attn = self.attn
        return forward_split(self.model, ab, split, ids, pos, rows,
                             lambda b, k: attn.plan(b, slot=k),
                             attn, self._overlap.lanes, self._overlap.main)

    def _apply(self, pol: AdmissionPolicy, batch: list[tuple[_Seq, int]], logits: torch.Tensor,
               waiting: deque[_Seq], running: list[_Seq]) -> list[RequestOutput]:
        sample: list[_Seq] = []
        prefill = decode = 0
        for s, n in batch:
            if _decodes(s, n):
                decode += 1
            else:
                prefill += n
            s.computed += n
            if s.computed == len(s.tokens):
                sample.append(s)
                if s.generated == 0:
                    self._cache_prefix(s)  # the prompt is in: later requests (and forks) share it
        self._count(prefill_tokens=prefill, decode_tokens=decode, steps=1)
        for s in sample:
            while s.forks_left > 0:  # n > 1: the other choices start from the cached prompt
                waiting.appendleft(self._new_seq(s.group, s.forks_left))
                s.forks_left -= 1
        outputs = []
        tok = self.tokenizer
        # constrained choices: mask what their grammar forbids (logprobs are of what is left)
        self._grammar_s, t0 = 0.0, time.perf_counter()
        rows = [i for i, s in enumerate(sample) if s.grammar is not None]
        if rows or any(_host_sampling(s.sampling) for s in sample):
            logits = logits.float().cpu()  # grammars, draws, penalties, logprobs: fp32 on the host
        if rows:
            self.grammars.constrain(logits, rows, [sample[i].grammar for i in rows])
            self._grammar_s += time.perf_counter() - t0
        for s, st in zip(sample, self.sampler.sample(logits, [s.sampling for s in sample])):
            if st.logprob is not None:
                s.logprobs.append(TokenLogprob(st.token_id, tok.token_text(st.token_id), st.logprob,
                                               tuple((i, tok.token_text(i), lp) for i, lp in st.top)))
            s.tokens.append(st.token_id)
            finished = s.stop.append(st.token_id)
            if s.grammar is not None and s.stop.finish != "stop" and self._grammar_done(s):
                finished = True  # the output is complete (also when it just reached max_tokens)
            if finished:
                out = self._finish(pol, s, running)
                if out is not None:
                    outputs.append(out)
            elif s.generated == 1 or s.generated % PROGRESS_EVERY == 0:
                pol.on_progress(s.group.req.id, s.generated)
        return outputs

    def _grammar_done(self, s: _Seq) -> bool:
        """Advance the choice's grammar by its newest token; a finished grammar ends it."""
        t0 = time.perf_counter()
        done, was_stop = self.grammars.advance(s.grammar, s.tokens[-1])
        if done:
            s.stop.end(drop_last=was_stop)
        self._grammar_s += time.perf_counter() - t0
        return done

    def _finish(self, pol: AdmissionPolicy, s: _Seq, running: list[_Seq]) -> RequestOutput | None:
        self._cache_prefix(s)
        self._release(s)
        running.remove(s)
        ids, text, reason = s.stop.result()
        lps = tuple(s.logprobs[: len(ids)]) if s.group.req.params.logprobs else None
        g = s.group
        g.choices[s.index] = Choice(s.index, tuple(ids), text, reason, lps)
        if any(c is None for c in g.choices):
            return None
        self._count(finished_requests=1)
        pol.on_finish(g.req.id, max(len(c.token_ids) for c in g.choices if c is not None))
        return RequestOutput(g.req.id, len(g.req.prompt_token_ids), max(g.cached_tokens, 0),
                             tuple(c for c in g.choices if c is not None))


def _host_sampling(st: SamplingState) -> bool:
    """Greedy rows without logprobs or penalties are sampled on the device, in the model
    dtype (one max per row); any other row has the step's logits widened to float32."""
    p = st.params
    return st.generator is not None or bool(p.logprobs or p.presence_penalty or p.frequency_penalty)


def _has_started(seq: _Seq) -> bool:
    """Generated, or a fork of a started request: a stopping run still finishes it."""
    return seq.generated > 0 or seq.index > 0


def _started(waiting: deque[_Seq]) -> deque[_Seq]:
    """The waiting sequences a stopping run still finishes."""
    return deque(s for s in waiting if _has_started(s))


def _by_level(arrivals: list[tuple[EngineRequest, int]]) -> dict[int, list[EngineRequest]]:
    levels: dict[int, list[EngineRequest]] = {}
    for req, level in arrivals:
        levels.setdefault(level, []).append(req)
    return levels


def _decodes(s: _Seq, n: int) -> bool:
    """Whether `s` runs as a decode this step: one token, past its prompt (a recompute's
    one-token chunk too, attended alike); else it prefills a chunk, however short."""
    return n == 1 and s.generated > 0


def _step_shape(batch: list[tuple[_Seq, int]],
                page_size: int) -> tuple[int, int, int, int, int, int, int]:
    """(tokens, rows, prefill attention pairs, decode KV read, decodes, of that KV the tokens
    of cached pages another decode reads too, rows drawn at random) of a scheduled batch."""
    tokens = rows = pairs = kv = decodes = sampled = 0
    cached: list[int] = []
    for s, n in batch:
        tokens += n
        if s.computed + n == len(s.tokens):
            rows += 1
            sampled += s.sampling.generator is not None
        if _decodes(s, n):
            decodes += 1
            kv += s.computed + 1
            cached += s.pages[:s.tree_pages]
        else:
            pairs += n * s.computed + n * (n + 1) // 2
    return tokens, rows, pairs, kv, decodes, (len(cached) - len(set(cached))) * page_size, sampled
