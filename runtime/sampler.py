"""Token sampling and stop detection for a batch of sequences.

`Sampler.sample` turns one logits row per sequence into the next token: greedy rows share one
argmax, random rows (temperature / top-k / top-p) are filtered together and then drawn with each
request's own torch.Generator so a seed reproduces its output. `StopChecker` owns the per-choice
finish rules (EOS, stop ids, stop strings via incremental detokenization, max_tokens).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from runtime.attention import cpu_kernel
from runtime.config import Tokenizer
from runtime.types import FinishReason, SamplingParams

MIN_TEMPERATURE = 1e-5  # divisor floor for sampled rows (float32 logits stay finite)
# Sampled rows filter their best tokens, the first of these windows that holds their top-k or
# nucleus (one topk), instead of sorting the vocabulary (a 64-row step of SmolLM2's 49,152
# tokens: 5 ms for a topk of 256, 17 of 4,096, 96 for a sort); rows it holds in neither sort.
TOP_WINDOWS = (256, 4096)


@dataclass(slots=True)
class SamplingState:
    """What sampling needs to remember for one choice between steps."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy
    counts: dict[int, int] = field(default_factory=dict)  # output token -> times (penalties)

    @classmethod
    def create(cls, params: SamplingParams, choice_index: int, fallback_seed: int) -> SamplingState:
        gen = None
        if params.temperature > 0:
            seed = params.seed + choice_index if params.seed is not None else fallback_seed
            gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        return cls(params, gen)

    def record(self, token: int) -> None:
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # set when the choice asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """OpenAI presence/frequency penalties, in place; only rows that use them pay for it."""
    for i, st in enumerate(states):
        p = st.params
        if (p.presence_penalty or p.frequency_penalty) and st.counts:
            ids = torch.tensor(list(st.counts.keys()))  # [n]
            cnt = torch.tensor(list(st.counts.values()), dtype=logits.dtype)  # [n]
            logits[i, ids] -= p.frequency_penalty * cnt + p.presence_penalty


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tempered logits [R, V] -> probabilities [R, V] after top-k and top-p (a full sort)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    v = logits.shape[-1]
    rank = torch.arange(v)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, v)[:, None]  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of better tokens
    probs = probs.masked_fill((before >= top_p[:, None]) & (rank > 0), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def _nucleus(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [R, W] of each row's best W tokens, best first -> the weights top-k and
    top-p keep: the first top_k, then the tokens with less than top_p of the mass before them
    (the best always), of the mass renormalized over the first top_k."""
    rank = torch.arange(probs.shape[-1])[None, :]
    probs = probs.masked_fill(rank >= torch.where(top_k > 0, top_k, probs.shape[-1])[:, None], 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    return probs.masked_fill((before >= top_p[:, None]) & (rank > 0), 0.0)


def _inverse_cdf(weights: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """One index per row of non-negative weights [R, N], drawn in proportion to them with the
    row's generator (one uniform each: a row draws the same whatever shares its step). Never
    an index of weight 0 (a token top-p, top-k or a grammar ruled out)."""
    cdf = weights.cumsum(-1)  # float32, as vLLM's and FlashInfer's samplers (float64: 10x slower)
    u = torch.tensor([float(torch.rand((), generator=g)) for g in gens], dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    idx = idx.clamp_max(weights.shape[-1] - 1)
    zero = weights.gather(1, idx[:, None])[:, 0] <= 0  # u rounded up to the total: past the end
    if zero.any():
        idx[zero] = (weights[zero] > 0).cumsum(-1).argmax(-1)  # the last token it may draw
    return idx


def draw(logits: torch.Tensor, params: Sequence[SamplingParams],
         gens: Sequence[torch.Generator]) -> list[int]:
    """One token per row of float32 logits [R, V] after temperature, top-k and top-p, drawn
    with the row's generator. Rows whose top-k or nucleus ends inside their best tokens of a
    window (TOP_WINDOWS; the full softmax says so) draw from those; rows with neither filter
    draw from the whole softmax; the rest sort."""
    r, v = logits.shape
    # A positive temperature under ~1e-37 is 0 in float32 (or overflows the quotient): the
    # probabilities would be NaN. This low it is greedy anyway.
    temps = torch.tensor([p.temperature for p in params]).clamp_min(MIN_TEMPERATURE)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v else 0 for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    x = logits / temps[:, None]
    tokens = torch.zeros(r, dtype=torch.long)
    plain = (top_k == 0) & (top_p >= 1.0)
    if plain.any():
        rows = plain.nonzero()[:, 0]
        probs = (x if len(rows) == r else x[rows]).softmax(-1)
        tokens[rows] = _inverse_cdf(probs, [gens[i] for i in rows.tolist()])
    rest = (~plain).nonzero()[:, 0]
    xs = x if len(rest) == r else x[rest]  # the rows still to draw (a copy only if some are)
    lse = xs.logsumexp(-1, keepdim=True)
    for w in (w for w in TOP_WINDOWS if w < v):
        if not len(rest):
            break
        top_v, top_i = xs.topk(w, dim=-1)  # best first
        probs = (top_v - lse).exp()  # of the whole softmax
        k, p = top_k[rest], top_p[rest]
        inside = ((k > 0) & (k <= w)) | ((k == 0) & (probs.sum(-1) >= p))
        if inside.any():
            rows = inside.nonzero()[:, 0]
            idx = _inverse_cdf(_nucleus(probs[rows], k[rows], p[rows]),
                               [gens[i] for i in rest[rows].tolist()])
            tokens[rest[rows]] = top_i[rows].gather(1, idx[:, None])[:, 0]
        rest, xs, lse = rest[~inside], xs[~inside], lse[~inside]
    if len(rest):
        tokens[rest] = _inverse_cdf(_filter(xs, top_k[rest], top_p[rest]),
                                    [gens[i] for i in rest.tolist()])
    return tokens.tolist()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first highest-scoring id of each row of logits [R, V]. On a CPU with AVX-512 the
    kernel library's argmax (cpu_ops.c: 16 lanes at a time, where torch's max takes one
    element at a time), else `max(-1).indices`, not `argmax`: on a CPU the latter is 1.5x
    slower in float32 and 4x in bfloat16. Both give the first maximum (the first NaN)."""
    if logits.device.type == "cpu" and logits.dtype in cpu_kernel.DTYPES and len(logits):
        lib = cpu_kernel.load()
        tokens = cpu_kernel.argmax(lib, logits) if lib is not None else None
        if tokens is not None:
            return tokens
    return logits.max(-1).indices.tolist()


class Sampler:
    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> list[SampledToken]:
        """logits: [R, V], one row per entry of `states` -> one token per row. Greedy rows
        take the max in the logits' dtype (exact: widening changes no value); draws, penalties
        and logprobs work on a float32 copy."""
        r = logits.shape[0]
        if any(s.params.presence_penalty or s.params.frequency_penalty for s in states):
            logits = logits.to(torch.float32, copy=True)  # penalised in place: a copy
            _apply_penalties(logits, states)
        elif any(s.generator is not None or s.params.logprobs for s in states):
            logits = logits.float()
        tokens = [0] * r
        greedy = [i for i, s in enumerate(states) if s.generator is None]
        rand = [i for i, s in enumerate(states) if s.generator is not None]
        gens = [s.generator for s in states if s.generator is not None]
        if len(greedy) == r:
            tokens = greedy_tokens(logits)
        elif greedy:
            idx = torch.tensor(greedy)
            for i, t in zip(greedy, greedy_tokens(logits[idx])):
                tokens[i] = t
        if rand:
            drawn = draw(logits if len(rand) == r else logits[torch.tensor(rand)],
                         [states[i].params for i in rand], gens)
            for i, t in zip(rand, drawn):
                tokens[i] = t
        want = [i for i, s in enumerate(states) if s.params.logprobs]
        out = [SampledToken(t) for t in tokens]
        if want:
            idx = torch.tensor(want)
            lp = logits[idx].log_softmax(-1)  # [W, V]
            chosen = lp.gather(1, torch.tensor([tokens[i] for i in want])[:, None])[:, 0].tolist()
            kmax = max(states[i].params.top_logprobs for i in want)
            top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
            for j, i in enumerate(want):
                k = states[i].params.top_logprobs
                top: tuple[tuple[int, float], ...] = ()
                if k and top_v is not None and top_i is not None:  # masked tokens (-inf) are no
                    top = tuple((t, v) for t, v in zip(top_i[j, :k].tolist(),  # alternative
                                                       top_v[j, :k].tolist()) if v != -math.inf)
                out[i] = SampledToken(tokens[i], chosen[j], top)
        for st, t in zip(states, tokens):
            st.record(t)
        return out


class StopChecker:
    """Decides when one choice is finished and what its final token ids and text are.

    Stop strings are matched against text decoded incrementally (a window of the last few
    tokens per step, as vLLM's detokenizer does), so each token costs O(1), not a decode of the
    whole output; the final text is decoded once, when the choice finishes.
    """

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_ids: Collection[int]) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (incrementally; only kept when there are stop strings)
        self._prefix = 0  # tokens[_prefix:_read] decode to the tail of `text` already appended
        self._read = 0
        self.finish: FinishReason | None = None
        self.stop_at: int | None = None  # char offset of a matched stop string in `text`
        self.keep_tokens: int | None = None  # tokens to report (drops EOS / stop-string tail)

    def append(self, token: int) -> bool:
        """Record a generated token; True once the choice is finished."""
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish, self.keep_tokens = "stop", len(self.tokens) - 1
            return True
        if self.params.stop and self._match_stop():
            return True
        if len(self.tokens) >= self.params.max_tokens:
            self.finish = "length"
            return True
        return False

    def end(self, *, drop_last: bool) -> None:
        """The choice's grammar is complete: finish with "stop" (dropping the stop token that
        completed it, when one did), whatever the other rules say."""
        self.finish, self.stop_at = "stop", None
        self.keep_tokens = len(self.tokens) - 1 if drop_last else None

    def _match_stop(self) -> bool:
        before = len(self.text)
        self.text += self._new_text()
        start = max(0, before - self.max_stop + 1)
        hits = [p for p in (self.text.find(s, start) for s in self.params.stop) if p >= 0]
        if not hits:
            return False
        self.finish, self.stop_at = "stop", min(hits)
        return True

    def _new_text(self) -> str:
        """The text the newest tokens add: decode a short window, minus what it decoded before;
        nothing while the window ends inside a multi-byte character."""
        dec = self.tokenizer.decode
        window = dec(self.tokens[self._prefix :])
        if window.endswith("\ufffd"):
            return ""
        seen = dec(self.tokens[self._prefix : self._read])
        self._prefix, self._read = self._read, len(self.tokens)
        return window[len(seen) :]

    def result(self) -> tuple[list[int], str, FinishReason]:
        """(token ids, text, finish reason) of a finished choice."""
        if self.finish is None:
            raise RuntimeError("result() of a choice that has not finished")
        if self.stop_at is None:
            ids = self.tokens if self.keep_tokens is None else self.tokens[: self.keep_tokens]
            return ids, self.tokenizer.decode(ids), self.finish
        # A stop string: cut the text there, and report only tokens wholly before it.
        dec = self.tokenizer.decode
        full = dec(self.tokens)
        found = [p for p in (full.find(s) for s in self.params.stop) if p >= 0]
        cut = min(found) if found else self.stop_at
        keep = len(self.tokens)
        while keep > 0 and len(dec(self.tokens[:keep])) > cut:
            keep -= 1
        return self.tokens[:keep], full[:cut], self.finish
