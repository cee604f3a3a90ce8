"""Property tests (hypothesis) for what a client can put in a request body: whatever the values
of the sampling parameters, the adapter answers an EngineRequest whose parameters are in range
or a RequestError naming the parameter, never an exception; and an accepted request never makes
the sampler or the stop checker raise. A crash here would fail a whole batch on one bad line."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.config import LoadedModel
from runtime.openai_adapter import CHAT, COMPLETIONS, MAX_N, MAX_STOP, to_engine_request
from runtime.sampler import Sampler, SamplingState, StopChecker
from runtime.types import EngineRequest, RequestError

CONTEXT = 2048
EXAMPLES = 250

# Values a JSON body can carry, weighted toward the edges of each parameter's range.
edge_numbers = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        3,
        20,
        21,
        128,
        129,
        0.0,
        1e-320,
        5e-324,
        1e-45,
        1e-30,
        1e-8,
        1e-6,
        0.5,
        1.0,
        1.5,
        2.0,
        2.0000001,
        -2.0,
        -0.0,
        1e308,
        -1e308,
        2**63 - 1,
        2**64 - 1,
        2**64,
        -(2**63),
        -(2**63) - 1,
        10**30,
        4096,
        2047,
        2048,
    ]
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    edge_numbers,
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
SAMPLING_KEYS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "stop_token_ids",
    "logit_bias",
    "best_of",
)
params = st.dictionaries(
    st.sampled_from(SAMPLING_KEYS), st.one_of(edge_numbers, json_values), max_size=8
)
texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from("\ud800 <|>"),
    max_size=40,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "x"]),
            "content": st.one_of(
                texts,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2
                ),
                json_values,
            ),
        },
        optional={"name": st.one_of(texts, st.integers())},
    ),
    max_size=4,
)
prompts = st.one_of(texts, st.lists(st.integers(-5, 60_000), max_size=12), json_values)


BOUNDED = settings(  # fixed examples, no shrink database: the same cases on every run
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def tokenizer(default_model: LoadedModel) -> Any:
    return default_model.tokenizer


def _names_a_key(param: str | None, body: dict[str, Any]) -> bool:
    """A 400's `param` is a key of the body, or a path inside one (`messages[0].content`)."""
    return param is None or param in body or param.split(".")[0].split("[")[0] in body


def _check_request(req: EngineRequest, vocab: int) -> None:
    p = req.params
    assert 1 <= len(req.prompt_token_ids) and all(0 <= t < vocab for t in req.prompt_token_ids)
    assert 1 <= p.max_tokens and len(req.prompt_token_ids) + p.max_tokens <= CONTEXT
    assert 0.0 <= p.temperature <= 2.0 and math.isfinite(p.temperature)
    assert 0.0 < p.top_p <= 1.0 and p.top_k >= 0
    assert 1 <= p.n <= MAX_N and 0 <= p.top_logprobs <= 20
    assert -2.0 <= p.presence_penalty <= 2.0 and -2.0 <= p.frequency_penalty <= 2.0
    assert len(p.stop) <= MAX_STOP and all(p.stop)
    assert all(0 <= t < vocab for t in p.stop_token_ids)


def _run_sampler(req: EngineRequest, tokenizer: Any, data: Any) -> None:
    """Sample a few tokens for each choice the way the engine does; nothing may raise."""
    vocab = tokenizer.vocab_size
    states = [SamplingState.create(req.params, i, 1234) for i in range(min(req.params.n, 3))]
    stops = [StopChecker(req.params, tokenizer, tokenizer.eos_token_ids) for _ in states]
    scale = data.draw(st.sampled_from([1.0, 30.0, 1e4]))
    for _ in range(3):
        logits = torch.randn(len(states), vocab) * scale
        for state, stop, tok in zip(states, stops, Sampler().sample(logits, states)):
            assert 0 <= tok.token_id < vocab
            if tok.logprob is not None:
                assert tok.logprob <= 0.0 and not math.isnan(tok.logprob)
            stop.append(tok.token_id)
    for stop in stops:
        if stop.finish is not None:
            stop.result()


def _holds(endpoint: str, body: dict[str, Any], tokenizer: Any, data: Any) -> None:
    """The property: a named 400/404, or a request in range that samples without raising."""
    out = to_engine_request("r", endpoint, body, tokenizer, served_model="m", max_model_len=CONTEXT)
    if isinstance(out, RequestError):
        assert out.status_code in (400, 404) and out.message
        assert _names_a_key(out.param, body), (out, body)
    else:
        _check_request(out, tokenizer.vocab_size)
        _run_sampler(out, tokenizer, data)


@BOUNDED
@given(
    msgs=messages,
    sampling=params,
    extra=st.dictionaries(st.text(max_size=8), json_values, max_size=2),
    data=st.data(),
)
def test_chat_bodies_become_valid_requests_or_named_400s(
    tokenizer: Any, msgs: list[Any], sampling: dict[str, Any], extra: dict[str, Any], data: Any
) -> None:
    _holds(CHAT, {**extra, "messages": msgs, **sampling}, tokenizer, data)


@BOUNDED
@given(prompt=prompts, sampling=params, data=st.data())
def test_completion_bodies_become_valid_requests_or_named_400s(
    tokenizer: Any, prompt: Any, sampling: dict[str, Any], data: Any
) -> None:
    _holds(COMPLETIONS, {"prompt": prompt, **sampling}, tokenizer, data)


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-38])
def test_a_tiny_positive_temperature_samples_instead_of_crashing(
    tokenizer: Any, temperature: float
) -> None:
    """Found by the property above: float32 turned these into 0 and the sampler raised."""
    body = {"prompt": "Hello", "temperature": temperature, "seed": 7}
    req = to_engine_request(
        "r", COMPLETIONS, body, tokenizer, served_model="m", max_model_len=CONTEXT
    )
    assert isinstance(req, EngineRequest)
    logits = torch.randn(1, tokenizer.vocab_size) * 30
    state = SamplingState.create(req.params, 0, 1)
    assert Sampler().sample(logits, [state])[0].token_id == int(logits.argmax())
