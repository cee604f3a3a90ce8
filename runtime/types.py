"""What crosses the server ↔ runtime boundary: sampling parameters, engine requests, finished outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A structured-output constraint (OpenAI `response_format`), already validated
    (runtime/response_format.py); `text` is no constraint and never becomes one of these."""

    type: Literal["json_object", "json_schema"]
    schema: str | None = None  # json_schema: the schema as compact JSON text, property order kept
    name: str = ""  # json_schema.name
    strict: bool = False  # json_schema.strict: every keyword is enforced (checked up front)

    @property
    def key(self) -> str:
        """What compiles to one grammar: requests with equal keys share it."""
        return self.schema if self.schema is not None else self.type


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding settings, already validated (see runtime/openai_adapter.py)."""

    max_tokens: int = 16  # output cap per choice, >= 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed + same prompt = same output
    stop: tuple[str, ...] = ()  # stop strings, not included in the text
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides the model's EOS
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    n: int = 1  # choices per request
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20, needs logprobs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: ResponseFormat | None = None  # None: free text


@dataclass(frozen=True, slots=True)
class EngineRequest:
    id: str  # unique among requests given to one engine run
    prompt_token_ids: Sequence[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob), best first


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    token_ids: tuple[int, ...]  # generated ids, stop string/EOS excluded
    text: str
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None = None  # set when params.logprobs


@dataclass(frozen=True, slots=True)
class RequestError:
    """A problem with one request: it fails alone, never the engine (a 400 in the error file)."""

    message: str
    param: str | None = None
    code: str | None = None
    status_code: int = 400


@dataclass(frozen=True, slots=True)
class RequestOutput:
    id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    choices: tuple[Choice, ...] = field(default=())
    error: RequestError | None = None  # set instead of choices when the request failed

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as it ran: what it held and how long it took (plan reports, profiling)."""

    tokens: int  # tokens through the model (decodes + prefill chunks)
    rows: int  # rows sampled (decodes + prefills that finished their prompt)
    pairs: int  # prefill attention (query, key) pairs
    kv_read: int  # KV tokens the decodes attended to
    decodes: int  # decoding sequences
    seconds: float  # wall time of the step (schedule + model + sampling + bookkeeping)
    grammar_seconds: float = 0.0  # of which: building, applying and advancing grammar masks
    fresh_kv: int = 0  # KV slots on pages never used before that the step took (first writes)
    kv_shared: int = 0  # of kv_read: tokens of pages another decode of the step read too
    sampled: int = 0  # of rows: drawn at a temperature > 0 (on the host)
