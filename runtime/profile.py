"""The device profile: the served model's step time on the device it runs on, measured and fitted.

The planner and the simulator cost a step as t = W + combine(compute, memory) (scheduler/
cost_model.py). This module measures that model for one engine: it times the engine's own
forward and sampling over a spread of step shapes (decode batches at short and long contexts,
some on a prefix every row shares, prefill chunks fresh and over a cached prefix, a mixed step;
then the same kinds as large as a real batch's, sized to the device, none on one too slow to
time them within their budget) and fits, by non-negative least squares weighted by
1/sqrt(seconds) (between relative error, where a 0.1 s decode step counts as much as a 5 s
prefill step, and absolute error, which predicts a run's total but not its small steps),

    t = W + tokens·s_token + rows·s_row + pairs·s_pair + (kv − shared)·s_kv + shared·s_shared

(shared: decodes' reads of pages another decode of the step reads too, which a CPU finds in its
caches: a batch of 96 few-shot prompts on one 1,500-token prefix ran in 5.5 s where a per-row
price said 7.0, and 5.6 with s_shared, half of s_kv on a 2-core Xeon)

— overlap 0, because this runtime runs attention and GEMMs one after the other on one stream.
The steps of a representative real run through `Engine.generate` (long prompts at the step cap,
mixed steps, decode batches) join the fit, so it also covers what the forward alone misses (the
engine's sampling, scheduling and bookkeeping) and how long chunks really scale. Apart from the
fit, `fresh_kv_seconds` times what a KV token's first write on a page never used adds (the
steps above reuse their pages; a run writes new ones until its pool is full): on a 2-core
Xeon the simulator's predictions of bench/cpu_policies.py's 21 runs went from -1.8 … -10.8%
to -1.0 … +7.0%, and of a batch of 96 long prompts with short outputs from -10.1% to -0.5 …
-7.3%. The JSON it writes is what
`HardwareProfile.from_json` reads; profiles are cached under DATA_DIR/profiles/ keyed by model,
device, dtype, threads and attention path (`cached_profile_path`). A cached profile is checked
each time it is loaded: two of its step shapes timed again (`drift`, under a second on a 2-core
CPU); past 15% slower or faster a warning says to measure it again (or, opted in, its times
are scaled by the ratio).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.attention import AttentionBatch, cpu_kernel
from runtime.host_load import LoadMeter, load_fields
from runtime.sampler import Sampler, SamplingState, greedy_tokens
from runtime.types import EngineRequest, SamplingParams, StepRecord

log = logging.getLogger("blendserve.profile")

if TYPE_CHECKING:
    from runtime.engine import Engine
    from scheduler.cost_model import CostModel

PROFILE_VERSION = 13  # 2: real steps of a representative run in the fit; 3: attention kind;
# 4: what the measurement covered (a small engine's profile no longer serves a full one);
# 5: the fit weighted by 1/sqrt(seconds), the representative run sized to the device;
# 6: the device's default step cap (the simulator's, for this profile); 7: large step shapes;
# 8: CPU engines reuse freed memory (engine.reuse_freed_memory): large steps run faster;
# 9: the CPU kernel no longer cascades: decodes read (and the steps count) a shared prefix per row
# 10: s_per_fresh_kv_token, a KV token's first write on a page never used
# 11: s_per_shared_kv_token, decodes' reads of pages another decode of the step reads too;
# s_per_sampled_row, a row drawn at a temperature > 0; 12: check_seconds (drift);
# 13: step shapes timed on K/V pages written before (kv_cache.PagedKVPool.write_fresh)
FULL_STEP_TOKENS = 2048  # a profile calibrated with steps this large serves larger step caps too
FEATURES = ("step_fixed_s", "s_per_token", "s_per_row", "s_per_pair", "s_per_kv_token",
            "s_per_shared_kv_token")
LONG_STEP_S = 0.5  # a step shape whose warm-up took longer is timed once more, not `reps` times
# The representative run's size, (requests, longest output): the largest that the step shapes'
# fit says runs within CALIBRATION_BUDGET_S, so that a slow CPU (fp32 on AVX2 behind a few GB/s
# of memory: ~5x a bf16 AVX-512 core) still measures its whole profile within a minute.
CALIBRATION_BUDGET_S = 22.0
CALIBRATION_SIZES = ((24, 96), (18, 96), (12, 96), (6, 96), (6, 48), (6, 24))
# The large step shapes (large_step_shapes) at the largest of these sizes that the small shapes'
# fit says are timed within LARGE_BUDGET_S; none on a device too slow for the smallest (an
# eighth of them is no larger than step_shapes' own: on a 2-core AVX2 VM in fp32 they took 8 s
# of a 65 s profile and added no shape).
LARGE_BUDGET_S = 14.0
LARGE_SIZES = (1.0, 0.5, 0.25)
# The first write of a KV page (fresh_kv_seconds): prompts of this many tokens (fewer where one
# takes over FRESH_STEP_S), as many as take about FRESH_STEP_S, at most FRESH_PROMPTS (a 2-core
# Xeon: 8 of 512, ~1 s a step; a 2-core AVX2 VM in fp32: 1 of 304).
FRESH_PROMPT = 512
FRESH_PROMPTS = 8
FRESH_STEP_S = 1.0
FRESH_TRIES = 2
SAMPLED_ROWS = 64  # sampled_row_seconds: a decode step's rows, drawn SAMPLED_TRIES times
SAMPLED_TRIES = 5
# The drift check (check_seconds): a decode batch and a mixed step, timed first thing when the
# profile is measured and again whenever it is loaded from the cache, as many times as take
# DRIFT_SECONDS (2 to DRIFT_PASSES); a host that has slowed or sped up by more than
# DRIFT_TOLERANCE since gets a warning to measure the profile again, or, opted in, every time
# of the profile scaled by the ratio (a 2-core EPYC VM slowed by ~20% in two hours, and a
# profile measured at the start under-predicted the runs by 15-23%). Past DRIFT_MAX either way
# a check timed a burst of other load that the guest cannot see, not a drift: it changes
# nothing. On a 2-core Zen 4 VM ten checks in a row in one process read 0.94-1.05 of the
# profile's; one in each of eight processes over two minutes read 0.98, 1.01, 1.03, 1.07, 1.05,
# 1.03, 1.09 and 1.00 (then 1.73 twice: such a burst); of the 28 runs of bench/cpu_policies.py
# two read 1.24 and 1.18 at load, once in a run as fast as its peers (its prediction +16% where
# it was -5%): a check past the tolerance is taken again, and the profile rescaled only when
# both are past it on the same side, by the one nearer 1.
DRIFT_SHAPES = (([1] * 32, [256] * 32), ([1] * 16 + [256], [256] * 17))
DRIFT_SECONDS = 0.6
DRIFT_PASSES = 8
DRIFT_TOLERANCE = 0.15
DRIFT_MAX = 1.5


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed step shape: its cost-model features and the seconds it took."""

    tokens: int
    rows: int
    pairs: int
    kv_read: int
    seconds: float
    kv_shared: int = 0  # of kv_read: pages another decode of the step reads too

    @classmethod
    def of(cls, q_lens: Sequence[int], kv_lens: Sequence[int], seconds: float,
           shared: int = 0) -> Sample:
        """A step shape's features; `shared`: tokens of whole pages every decode starts with."""
        tokens = rows = pairs = kv = decodes = 0
        for q, k in zip(q_lens, kv_lens):
            tokens += q
            rows += 1
            if q == 1:
                kv += k
                decodes += 1
            else:
                pairs += q * (k - q) + q * (q + 1) // 2
        return cls(tokens, rows, pairs, kv, seconds, shared * max(decodes - 1, 0))

    @classmethod
    def from_record(cls, r: StepRecord) -> Sample:
        return cls(r.tokens, r.rows, r.pairs, r.kv_read, r.seconds, r.kv_shared)

    def features(self) -> list[float]:
        return [1.0, float(self.tokens), float(self.rows), float(self.pairs),
                float(self.kv_read - self.kv_shared), float(self.kv_shared)]


def step_shapes(capacity_tokens: int, scale: int = 1) -> list[tuple[list[int], list[int]]]:
    """(q_lens, kv_lens) of the steps to time: decodes first in each, as the engine orders them.

    Small enough for a 2-core CPU to time them all a few times within the profile's budget;
    `scale` multiplies batch sizes and lengths on devices that are far faster (GPUs)."""
    shapes: list[tuple[list[int], list[int]]] = []
    # Decode batches at short and long contexts: the long ones (~20k KV tokens) separate the
    # KV-read time from the per-row time, which short contexts alone leave to noise (a fit
    # without them over-predicted a decode-heavy run by 18%).
    for batch, ctx in ((1, 64), (1, 640), (4, 64), (16, 64), (16, 640), (64, 64), (48, 320),
                       (128, 128), (32, 640), (16, 1280), (8, 2560)):
        shapes.append(([1] * batch * scale, [ctx * scale] * batch * scale))
    for q, cached in ((64, 0), (256, 0), (768, 0), (128, 896)):
        shapes.append(([q * scale], [(q + cached) * scale]))
    shapes.append(([96 * scale] * 6, [96 * scale] * 6))  # several prompts in one step
    shapes.append(([1] * 32 * scale + [256 * scale], [320 * scale] * 32 * scale + [256 * scale]))
    return [(q, k) for q, k in shapes if sum(k) <= capacity_tokens // 2]


def shared_step_shapes(capacity_tokens: int, scale: int = 1) -> list[tuple[list[int], list[int], int]]:
    """(q_lens, kv_lens, shared) of decode batches whose rows all start with the same `shared`
    tokens of pages (a system prompt, few-shot examples): a CPU's later rows find those pages
    in its caches (on a 2-core Xeon a 1,500-token prefix read by 96 rows cost half a plain read
    a token, and a per-row price put a few-shot run 33% long), up to prefixes larger than a
    core's cache."""
    shapes = [([1] * batch * scale, [(shared + own) * scale] * batch * scale, shared * scale)
              for batch, shared, own in ((16, 640, 64), (48, 1536, 48), (8, 2560, 128),
                                         (24, 4096, 32))]
    return [(q, k, n) for q, k, n in shapes if sum(k) - n * (len(k) - 1) <= capacity_tokens // 2]


def large_step_shapes(capacity_tokens: int, size: float = 1.0) -> list[tuple[list[int], list[int]]]:
    """Steps as large as a real batch's: hundreds of decodes, and a step cap's worth of prefill
    as many short prompts and as one long one (the same tokens, 30x the attention pairs), the
    last 1,024 tokens of a 6,144-token prompt, and a mixed step. `size` scales them down on a
    slow device (large_size); none at size 0.

    Without them the fit extrapolates from decodes of at most 128 rows and prompts of at most
    768 tokens, where the per-token, per-row and per-pair times are nearly collinear: one such
    fit put a step cap of 20 prompts 23% long (no time per pair at all), and the real steps of
    a 512-request chat run 20% long; the next measurement put the same run's decodes 12% short.
    Without the long prompt's end the fit priced a pair from prompts of at most 2,048 tokens
    (2.7e-7 s on a 2-core Xeon, 1.8e-7 with it), and a batch of 3,000-6,000-word prompts came
    out 25% long (-0.5% with it)."""
    if size <= 0:
        return []

    def n(x: int) -> int:
        return max(int(x * size), 1)

    shapes = [([1] * n(256), [64] * n(256)), ([1] * n(512), [64] * n(512)),
              ([1] * n(256), [256] * n(256)),
              ([64] * n(32), [64] * n(32)), ([n(2048)], [n(2048)]),
              ([n(1024)], [n(6144)]),  # a long prompt's end: ~5x the pairs a token of 2,048's
              ([1] * n(128) + [64] * n(16), [200] * n(128) + [64] * n(16))]
    return [(q, k) for q, k in shapes if sum(k) <= capacity_tokens // 2]


def large_size(coef: dict[str, float], capacity_tokens: int) -> float:
    """The largest of LARGE_SIZES whose shapes a fit says are timed within LARGE_BUDGET_S
    (each runs twice: a warm-up and a timing); 0 where none is."""
    for size in LARGE_SIZES:
        shapes = large_step_shapes(capacity_tokens, size)
        if sum(2 * predict(coef, Sample.of(q, k, 0.0)) for q, k in shapes) <= LARGE_BUDGET_S:
            return size
    return 0.0


def time_step(engine: Engine, q_lens: list[int], kv_lens: list[int], reps: int = 2,
              long_s: float = LONG_STEP_S, shared: int = 0) -> float:
    """Seconds of the engine's forward + greedy sampling on one step shape: the mean of `reps`
    runs after a warm-up, or one run when the warm-up took over `long_s` (a long step is timed
    well enough once, and a slow CPU must not spend minutes on its profile). The mean, not the
    best: the runs the profile predicts pay the machine's noise too, and best-of-three timings
    on a noisy VM came out 10-20% under the real steps. The K/V pages are borrowed from the
    engine's pool and handed back; the decodes' first `shared` tokens are on the same pages."""
    times = _timings(engine, q_lens, kv_lens,
                     lambda t: len(t) >= 1 + (reps if t[0] <= long_s else 1), shared)
    return float(np.mean(times[1:]))


def _timings(engine: Engine, q_lens: list[int], kv_lens: list[int],
             done: Callable[[list[float]], bool], shared: int = 0) -> list[float]:
    """_forward_times on pages borrowed from the engine's pool and handed back, written first:
    a run's decodes read K/V that its prefill wrote, where pages never written are backed by the
    OS in the timed steps themselves: on a 2-core Zen 4 VM a fresh engine's decode shapes ran
    10-70% slow for their first 4-6 timings, and six profiles put one chat run's steps 4-23%
    long (fit errors 4-11%); on written pages three put them 4-10% long (fit errors 3-4%)."""
    ps = engine.pool.page_size
    since = engine.pool.pages_ever_taken
    pages = engine.pool.alloc(sum(-(-k // ps) for k in kv_lens) - shared // ps * (len(kv_lens) - 1))
    engine.pool.write_fresh(since)
    try:
        return _forward_times(engine, q_lens, kv_lens, pages, done, shared)
    finally:
        engine.pool.free(pages)


def _forward_times(engine: Engine, q_lens: list[int], kv_lens: list[int], pages: list[int],
                   done: Callable[[list[float]], bool], shared: int = 0) -> list[float]:
    """Seconds of each forward + greedy sampling of one step shape on `pages`, until `done`;
    every sequence's first `shared` tokens on the same pages."""
    ps = engine.pool.page_size
    common, it = pages[: shared // ps], iter(pages[shared // ps :])
    tables = [common + [next(it) for _ in range(-(-k // ps) - len(common))] for k in kv_lens]
    dev = engine.model.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.vocab_size, (sum(q_lens),), generator=gen).to(dev)
    pos = torch.cat([torch.arange(k - q, k) for q, k in zip(q_lens, kv_lens)]).to(dev)
    rows = (torch.cumsum(torch.tensor(q_lens), 0) - 1).to(dev)
    batch = AttentionBatch(q_lens, kv_lens, tables, sum(1 for q in q_lens if q == 1))
    times: list[float] = []
    with torch.inference_mode():
        while not times or not done(times):
            start = time.perf_counter()
            plan = engine.attn.plan(batch)
            logits = engine.model.forward(ids, pos, engine.attn, plan, rows)
            greedy_tokens(logits)  # sampling brings token ids back to the host
            times.append(time.perf_counter() - start)
    return times


def fresh_kv_seconds(engine: Engine, s_per_token: float) -> float:
    """What a KV token's first write on a page never used adds to a step (the OS backs the
    page then; kv_cache._zeros): prefill steps of prompts of FRESH_PROMPT tokens, or of the whole
    pages that take about FRESH_STEP_S where those are fewer (as many prompts as take about
    FRESH_STEP_S, at most FRESH_PROMPTS), on never-taken pages, then twice on the same pages;
    the difference per KV token, 0 at least, the smaller of FRESH_TRIES such (one took 55-70 µs
    a token on a 2-core Xeon, and whole runs paid 30-60: a one-off slow first step counts
    against it). 0 on a GPU (its pool is allocated up front) and where the pool has too few
    fresh pages left."""
    if engine.model.device.type != "cpu":
        return 0.0
    ps = engine.pool.page_size
    whole = max(int(FRESH_STEP_S / s_per_token) // ps, 1)
    prompt = min(FRESH_PROMPT, engine.max_model_len, whole * ps)
    q = [prompt] * int(min(max(FRESH_STEP_S / (prompt * s_per_token), 1), FRESH_PROMPTS))
    costs = []
    for _ in range(FRESH_TRIES):
        pages = engine.pool.alloc_fresh(sum(-(-k // ps) for k in q))
        if pages is None:
            break
        try:
            t = _forward_times(engine, q, q, pages, lambda t: len(t) >= 3)
        finally:
            engine.pool.free(pages)
        costs.append(max(t[0] - (t[1] + t[2]) / 2.0, 0.0) / sum(q))
    return min(costs, default=0.0)


def sampled_row_seconds(engine: Engine, rows: int = SAMPLED_ROWS) -> float:
    """What a row drawn at a temperature > 0 adds to a step over a greedy one, as the engine
    samples: the step's logits widened to float32 on the host, each row drawn from its softmax,
    against the greedy rows' argmax; per row, the median of SAMPLED_TRIES. Half the rows at
    temperature 1 alone (the OpenAI default: a softmax and a draw over the vocabulary), half
    with top-p 0.95 too (a topk more) over logits peaked as a language model's are (a few
    tokens far above the rest, so the nucleus ends inside the sampler's first window). On a
    2-core Xeon ~0.1 ms a row of SmolLM2's 49,152-token vocabulary, against 0.04 for the whole
    of a greedy row's own cost (s_per_row): a 64-request chat at temperature 0.8 and top-p 0.95
    ran 16.0 s where the step model without it said 14.1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, engine.vocab_size, generator=gen) * 2
    peaks = torch.randint(0, engine.vocab_size, (rows, 8), generator=gen)
    logits[torch.arange(rows)[:, None], peaks] += 16.0
    logits = logits.to(engine.model.device, engine.dtype)
    kinds = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95))
    states = [SamplingState.create(kinds[i % 2], 0, i) for i in range(rows)]
    sampler = Sampler()

    def timed(run: Callable[[], object]) -> float:
        times = []
        for _ in range(SAMPLED_TRIES):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    greedy = timed(lambda: greedy_tokens(logits))
    sampled = timed(lambda: sampler.sample(logits.float().cpu(), states))
    return max(sampled - greedy, 0.0) / rows


def check_seconds(engine: Engine) -> float | None:
    """Seconds of one pass over the drift check's shapes (those the engine's pool holds): each
    shape's fastest of the timings after a warm-up that take DRIFT_SECONDS between them (2 to
    DRIFT_PASSES). The fastest, not the mean: ten checks in a row on a 2-core VM read 0.94-1.05
    of the profile's so, where the mean of two read 0.97-1.04 and twice 1.58 (a process's first
    steps, a neighbour's burst). None when the pool holds none of them."""
    shapes = [(q, k) for q, k in DRIFT_SHAPES if sum(k) <= engine.kv_capacity_tokens // 2]
    if not shapes:
        return None
    budget = DRIFT_SECONDS / len(shapes)

    def done(t: list[float]) -> bool:
        return len(t) > DRIFT_PASSES or (len(t) > 2 and sum(t[1:]) >= budget)

    return sum(min(_timings(engine, q, k, done)[1:]) for q, k in shapes)


def drift(engine: Engine, profile: dict[str, Any]) -> float:
    """How much slower (> 1) or faster (< 1) this device runs the drift check's shapes now than
    when `profile` was measured. A reading past DRIFT_TOLERANCE is taken again and stands only
    as far as the second agrees (the one nearer 1; on the other side of 1, none). 1.0 where the
    profile or the pool has no check, where other processes shared the cores meanwhile (the
    check then times them, not the host) and past DRIFT_MAX."""
    then = profile.get("fit", {}).get("check_seconds")
    if not then:
        return 1.0
    ratio = _drift_reading(engine, then)
    if abs(ratio - 1.0) <= DRIFT_TOLERANCE:
        return ratio
    again = _drift_reading(engine, then)
    return min(ratio, max(again, 1.0)) if ratio > 1 else max(ratio, min(again, 1.0))


def _drift_reading(engine: Engine, then: float) -> float:
    with LoadMeter() as meter:
        now = check_seconds(engine)
    if now is None or (meter.load is not None and meter.load.disturbed):
        return 1.0
    ratio = now / then
    return ratio if 1.0 / DRIFT_MAX <= ratio <= DRIFT_MAX else 1.0


def rescaled(profile: dict[str, Any], ratio: float) -> dict[str, Any]:
    """`profile` with every time of its step model (and its check) multiplied by `ratio`, and
    `drift` saying by how much it now differs from its measurement and when it was checked."""
    fit_ = profile["fit"]
    total = profile.get("drift", {}).get("ratio", 1.0) * ratio
    return {**profile, "step_model": {k: v * ratio for k, v in profile["step_model"].items()},
            "flops": profile["flops"] / ratio,
            "bandwidth_bytes_per_s": profile["bandwidth_bytes_per_s"] / ratio,
            "fit": {**fit_, "check_seconds": fit_["check_seconds"] * ratio},
            "drift": {"ratio": total,
                      "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def fit(samples: Sequence[Sample]) -> tuple[dict[str, float], float]:
    """Non-negative least squares of the step model (weights 1/sqrt(seconds)), refitted once without
    the samples it misses by more than half (a timing disturbed by other load); returns the
    coefficients (FEATURES) and the mean absolute relative error over all samples."""
    coef, _ = _nnls(samples)
    kept = [s for s in samples if abs(predict(coef, s) - s.seconds) <= 0.5 * s.seconds]
    if len(kept) >= len(FEATURES) + 2 and len(kept) < len(samples):
        coef, _ = _nnls(kept)
    err = float(np.mean([abs(predict(coef, s) - s.seconds) / s.seconds for s in samples]))
    return coef, err


def _nnls(samples: Sequence[Sample]) -> tuple[dict[str, float], float]:
    x = np.array([s.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    # Relative error alone let a few small steps bend the fit away from the long ones that make
    # up most of a run (a representative run's total came out 9-14% short on a slow CPU; 4% with
    # this weighting, at the same mean relative error per step).
    w = 1.0 / np.sqrt(np.maximum(y, 1e-9))
    # Six unknowns: solve on every subset of them and keep the best non-negative solution.
    rates = [1, 4] + ([5] if x[:, 5].any() else [])  # per token, per KV token (plain, shared)
    fits: list[tuple[float, bool, np.ndarray]] = []  # (error, has the rates, coefficients)
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(x.shape[1])
            coef[list(cols)] = sol
            fits.append((float(np.mean(np.abs(x @ coef - y) * w)),
                         all(c in cols for c in rates), coef))
    # Per-token and per-KV-token times are never 0 (nor a shared KV read's, where the samples
    # hold some): a fit with those, unless the timings are too noisy to show them (a tiny model
    # on a loaded machine); then the best of any, with the plain rates floored above 0 so that
    # no rate divides by zero.
    if not fits:
        raise ValueError("no non-negative step model fits the measurements")
    err, _, coef = min([f for f in fits if f[1]] or fits, key=lambda f: f[0])
    coef[[1, 4]] = np.maximum(coef[[1, 4]], 1e-12)
    return dict(zip(FEATURES, (float(c) for c in coef))), err


def predict(coef: dict[str, float], s: Sample) -> float:
    return float(np.dot([coef[f] for f in FEATURES], s.features()))


def calibration_requests(vocab_size: int, max_len: int, n: int = 24,
                         longest: int = 96) -> list[EngineRequest]:
    """A representative run: prompts of 40 to 1,600 tokens (half sharing a 64-token prefix) and
    8 to `longest` output tokens, so its steps span long prefill chunks at the step cap, mixed
    steps and decode batches of every size, with the engine's own sampling and bookkeeping in
    each. Any n >= 6 holds every prompt length (the longest included)."""
    outputs = (8, longest, max(longest // 3, 8))
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(1, vocab_size, (64,), generator=gen).tolist()
    reqs = []
    for i in range(n):
        p = min(_CAL_PROMPTS[i % len(_CAL_PROMPTS)], max_len // 2)
        params = SamplingParams(max_tokens=outputs[i % len(outputs)], temperature=0.0,
                                ignore_eos=True)
        tail = torch.randint(1, vocab_size, (p,), generator=gen).tolist()
        reqs.append(EngineRequest(f"p{i}", (shared if i % 2 else []) + tail, params))
    return reqs  # the step log counts the KV decodes really read, shared prefixes once


_CAL_PROMPTS = (40, 1600, 120, 900, 300, 600)


def calibration_seconds(coef: dict[str, float], reqs: Sequence[EngineRequest],
                        step_tokens: int) -> float:
    """The representative run's seconds as a fit predicts them: every prompt token and its
    causal pairs once, every output token a decode row reading its context, and a fixed cost
    for each of the steps (the prefill steps at the step cap, then the longest decode)."""
    prompts = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.params.max_tokens for r in reqs]
    tokens = sum(prompts) + sum(outs)
    pairs = sum(p * (p + 1) // 2 for p in prompts)
    kv = sum(d * p + d * d // 2 for p, d in zip(prompts, outs))
    steps = -(-sum(prompts) // max(step_tokens, 1)) + max(outs)
    return predict(coef, Sample(tokens, sum(outs), pairs, kv, 0.0)) + (steps - 1) * coef["step_fixed_s"]


def calibration_size(coef: dict[str, float], vocab_size: int, max_len: int,
                     step_tokens: int) -> tuple[int, int]:
    """The largest calibration run (CALIBRATION_SIZES) the budget allows on this device."""
    for n, longest in CALIBRATION_SIZES:
        reqs = calibration_requests(vocab_size, max_len, n, longest)
        if calibration_seconds(coef, reqs, step_tokens) <= CALIBRATION_BUDGET_S:
            return n, longest
    return CALIBRATION_SIZES[-1]


def measure(engine: Engine, *, reps: int = 2) -> dict[str, Any]:
    """Profile `engine` on its device; returns the profile JSON (see module docstring)."""
    from runtime.engine import default_step_tokens

    started = time.perf_counter()
    device, ps = engine.model.device, engine.pool.page_size
    # Timings taken while other processes share the cores come out slow: say how much.
    with LoadMeter() as meter:
        check = check_seconds(engine)  # first, as a cached profile's load times it again
        shapes = [Sample.of(q, k, time_step(engine, q, k, reps)) for q, k in _shapes(engine)]
        shapes += [Sample.of(q, k, time_step(engine, q, k, reps, shared=n), n // ps * ps)
                   for q, k, n in shared_step_shapes(engine.kv_capacity_tokens, _scale(engine))]
        # Then the large shapes, as large as this device times them within their budget.
        size = large_size(fit(shapes)[0], engine.kv_capacity_tokens)
        large = large_step_shapes(engine.kv_capacity_tokens, size)
        shapes += [Sample.of(q, k, time_step(engine, q, k, reps)) for q, k in large]
        # The real steps of a representative run join the fit: what a step costs beyond the
        # forward (sampling, scheduling, stop checks, cache bookkeeping) and how long chunks
        # really scale. Its size is what the shapes alone say this device runs within the budget.
        n, longest = calibration_size(fit(shapes)[0], engine.vocab_size, engine.max_model_len,
                                      engine.config.max_batch_tokens)
        calibration = calibration_requests(engine.vocab_size, engine.max_model_len, n, longest)
        list(engine.generate(calibration, policy="fcfs"))
        steps = [Sample.from_record(r) for r in engine.step_log]
        coef, fit_error = fit(shapes + steps)
        coef["s_per_fresh_kv_token"] = fresh_kv_seconds(engine, coef["s_per_token"])
        coef["s_per_sampled_row"] = sampled_row_seconds(engine)
    run_error = float(np.mean([abs(predict(coef, s) - s.seconds) / s.seconds for s in steps]))
    run_total = sum(predict(coef, s) for s in steps) / sum(s.seconds for s in steps) - 1.0
    cfg = engine.model.config
    dtype = str(engine.dtype).removeprefix("torch.")
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
    return {
        "version": PROFILE_VERSION,
        "name": f"measured:{engine.model_name}@{device.type}",
        "model": engine.model_name,
        "device": str(device),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "overlap": 0.0,  # one stream: attention and GEMMs run one after the other
        # the gather path attends a prefix its decodes share once per step (the kernel per row)
        "cascade": engine.attn.cascades,
        "attention": attention_kind(engine),
        "kernel": _kernel_id(engine),  # a rebuilt kernel (new source or flags) is measured anew
        "linear": linear_kind(engine),  # so are GEMMs run another way (packed, row slices)
        "step_model": coef,
        # Datasheet-style equivalents, for readers and older tools.
        "flops": 2.0 * _params(cfg) / coef["s_per_token"],
        "bandwidth_bytes_per_s": kv_bytes / coef["s_per_kv_token"],
        "kv_capacity_bytes": engine.kv_capacity_tokens * kv_bytes,
        "batch_multiple": 1 if device.type == "cpu" else 128,
        "default_step_tokens": default_step_tokens(device.type),  # what `blendserve run` takes
        "model_config": cfg.to_hf(dtype),
        "fit": {"shapes": len(shapes), "large_shapes_size": size,
                "longest_prompt": _longest_prompt(engine),
                "step_tokens": engine.config.max_batch_tokens, "mean_abs_rel_error": fit_error,
                "calibration_requests": n, "calibration_longest_output": longest,
                "calibration_steps": len(steps),
                "calibration_mean_abs_rel_error": run_error,
                "calibration_total_error": run_total,
                "check_seconds": check,
                **load_fields(meter.load)},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.perf_counter() - started,
    }


def _scale(engine: Engine) -> int:
    return 1 if engine.model.device.type == "cpu" else 8


def _shapes(engine: Engine) -> list[tuple[list[int], list[int]]]:
    return step_shapes(engine.kv_capacity_tokens, _scale(engine))


def _longest_prompt(engine: Engine) -> int:
    return max(len(r.prompt_token_ids)
               for r in calibration_requests(engine.vocab_size, engine.max_model_len))


def covers(profile: dict[str, Any], engine: Engine) -> bool:
    """Whether a cached profile measured at least what `engine` would: as many step shapes, as
    long calibration prompts and as large steps, with the same CPU kernel build and GEMM path.
    An engine with a small KV pool, context or step cap (a test's) measures a few small shapes;
    its profile must not stand in for a full one."""
    fit = profile.get("fit", {})
    return (profile.get("kernel") == _kernel_id(engine)
            and profile.get("linear") == linear_kind(engine)
            and fit.get("shapes", 0) >= len(_shapes(engine)) + len(
                shared_step_shapes(engine.kv_capacity_tokens, _scale(engine))) + len(
                large_step_shapes(engine.kv_capacity_tokens, fit.get("large_shapes_size", 1.0)))
            and fit.get("longest_prompt", 0) >= _longest_prompt(engine)
            and fit.get("step_tokens", 0) >= min(engine.config.max_batch_tokens, FULL_STEP_TOKENS))


def _params(cfg: Any) -> int:
    from scheduler.cost_model import ModelShape

    return ModelShape.from_hf_config(cfg.to_hf()).params


def attention_kind(engine: Engine) -> str:
    """The attention path the steps take: `flashinfer`, `torch-paged` (the CPU kernel reads
    pages in place for decodes and prefill chunks), `torch-paged-decode` (for decodes only) or
    `torch-gather`; a profile holds for one of them."""
    attn = engine.attn
    if attn.name != "torch":
        return attn.name
    if getattr(attn, "decode_kernel", None) is None:
        return "torch-gather"
    return "torch-paged" if getattr(attn, "prefill_kernel", False) else "torch-paged-decode"


def linear_kind(engine: Engine) -> str:
    """How the model's GEMMs run (`LlamaModel.gemm`: `bf16-tiles`, the CPU kernel's own;
    `onednn-packed`, weights reordered at load; or `plain`, F.linear), `/rows<n>` when a large
    step runs n rows at a time, and `/fused` when its elementwise ops run as the CPU kernel's
    fused passes."""
    kind = engine.model.gemm
    rows = engine.model.row_chunk
    kind = kind if rows is None else f"{kind}/rows{rows}"
    return f"{kind}/fused" if engine.model.fused_ops is not None else kind


def _kernel_id(engine: Engine) -> str | None:
    """The CPU kernel's build (source, flags, compiler, CPU) when the steps run it."""
    return cpu_kernel.build_id() if attention_kind(engine).startswith("torch-paged") else None


def cached_profile_path(data_dir: Path, engine: Engine) -> Path:
    """DATA_DIR/profiles/<model>-<device>-<dtype>-t<threads>-<attention>.json."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", engine.model_name).strip("_") or "model"
    dtype = str(engine.dtype).removeprefix("torch.")
    device = engine.model.device.type
    name = f"{model}-{device}-{dtype}-t{torch.get_num_threads()}-{attention_kind(engine)}.json"
    return data_dir / "profiles" / name


def write_profile(path: Path, profile: dict[str, Any]) -> Path:
    """Write atomically, so that a worker reading the cache never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{time.monotonic_ns()}")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    tmp.replace(path)
    return path


def cost_model_from_profile(profile: dict[str, Any]) -> CostModel:
    """The cost model of the profiled model on the profiled device."""
    from scheduler.cost_model import CostModel, HardwareProfile, ModelShape

    shape = ModelShape.from_hf_config(profile["model_config"], name=str(profile.get("model")))
    return CostModel(shape, HardwareProfile.from_dict(profile))


def load_or_measure(engine: Engine, data_dir: Path, *,
                    rescale: bool = False) -> tuple[dict[str, Any], Path, bool]:
    """The cached profile of this engine's model, device, dtype and threads, or a fresh one
    (measured now and cached); returns (profile, path, measured_now). A cached one on a host
    that has drifted since (drift) is rescaled, and cached so, with `rescale`; else a warning
    says to measure it again. Off by default: on a 2-core Zen 4 VM a confirmed check still
    rescaled 4 of 17 bench runs by 0.73-1.24 where the host had not drifted (one prediction
    +24.6%), so the check cannot yet tell a drift from minutes of a neighbour's load."""
    path = cached_profile_path(data_dir, engine)
    try:
        profile = json.loads(path.read_text())
        if (profile.get("version") == PROFILE_VERSION and profile.get("model") == engine.model_name
                and covers(profile, engine)):
            cost_model_from_profile(profile)  # still readable
            ratio = drift(engine, profile)
            if abs(ratio - 1.0) > DRIFT_TOLERANCE:
                said = (f"this device runs {abs(ratio - 1.0) * 100:.1f}% "
                        f"{'slower' if ratio > 1 else 'faster'} than its profile {path} says")
                if not rescale:
                    log.warning("%s: measure it again (`blendserve profile`)", said)
                else:
                    log.info("%s: rescaled", said)
                    profile = rescaled(profile, ratio)
                    write_profile(path, profile)
            return profile, path, False
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or unreadable: measure again
    profile = measure(engine)
    write_profile(path, profile)
    return profile, path, True
