"""The OpenAI adapter: body validation (400s with `param`, never exceptions) and response shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from runtime.config import LoadedModel
from runtime.openai_adapter import CHAT, COMPLETIONS, to_engine_request, to_response_body
from runtime.types import (
    Choice,
    EngineRequest,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

MODEL = "smollm2-135m-instruct"
CONTEXT = 256


class ByteTokenizer:
    """A small real tokenizer for these tests: one token per UTF-8 byte (id = byte + 3) and a
    ChatML chat template, so prompt lengths are easy to reason about."""

    eos_token_ids = frozenset({2})
    vocab_size = 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if messages[0]["role"] == "assistant":
            raise ValueError("Conversation must start with a user or system message")
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + "<|im_start|>assistant\n")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


TOK = ByteTokenizer()


def chat(**body: Any) -> EngineRequest | RequestError:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return to_engine_request("7", CHAT, body, TOK, served_model=MODEL, max_model_len=CONTEXT)


def completion(**body: Any) -> EngineRequest | RequestError:
    body.setdefault("prompt", "Once upon a time")
    return to_engine_request("7", COMPLETIONS, body, TOK, served_model=MODEL,
                             max_model_len=CONTEXT)


def ok(result: EngineRequest | RequestError) -> EngineRequest:
    assert isinstance(result, EngineRequest), result
    return result


def refused(result: EngineRequest | RequestError, param: str | None) -> RequestError:
    assert isinstance(result, RequestError), result
    assert result.status_code == (404 if result.code == "model_not_found" else 400)
    assert result.param == param
    assert result.message
    return result


# --- requests ---------------------------------------------------------------------------------


def test_chat_body_becomes_templated_prompt_and_params() -> None:
    req = ok(chat(model=MODEL, max_tokens=5, temperature=0, top_p=0.9, top_k=40, n=2, seed=3,
                  stop=["\n", "END"], presence_penalty=0.5, frequency_penalty=-0.5,
                  logprobs=True, top_logprobs=3, ignore_eos=True, stop_token_ids=[5, 6]))
    assert req.id == "7"
    assert TOK.decode(req.prompt_token_ids) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert req.params == SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.9, top_k=40, seed=3, stop=("\n", "END"),
        stop_token_ids=(5, 6), ignore_eos=True, n=2, logprobs=True, top_logprobs=3,
        presence_penalty=0.5, frequency_penalty=-0.5)


def test_body_may_omit_model_or_send_null() -> None:
    ok(chat())
    ok(chat(model=None))


def test_other_model_is_refused() -> None:
    err = refused(chat(model="gpt-4o"), "model")
    assert err.code == "model_not_found"


def test_content_parts_of_type_text_are_joined() -> None:
    req = ok(chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "sam"},
    ]))
    text = TOK.decode(req.prompt_token_ids)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text  # developer is the system role
    assert "<|im_start|>user\na\nb<|im_end|>" in text


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hi", "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
         "messages[0].content[0].text"),
        ([{"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[0]"),
        ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name"),
        ([{"role": "assistant", "content": "hi"}], "messages"),  # the template refuses it
    ],
)
def test_bad_messages_are_refused_with_their_param(messages: Any, param: str) -> None:
    refused(chat(messages=messages), param)


def test_missing_messages_is_refused() -> None:
    body = {"model": MODEL}
    err = to_engine_request("1", CHAT, body, TOK, served_model=MODEL, max_model_len=CONTEXT)
    assert refused(err, "messages").code == "missing_required_parameter"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"stream": True}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"model": 5}, "model"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": CONTEXT}, "max_tokens"),  # prompt + max_tokens beyond the context
    ],
)
def test_bad_chat_params_are_refused_with_their_param(body: dict[str, Any], param: str) -> None:
    refused(chat(**body), param)


def test_context_overflow_names_the_sizes() -> None:
    err = refused(chat(max_tokens=250), "max_tokens")
    assert err.code == "context_length_exceeded"
    assert "256" in err.message


def test_prompt_alone_beyond_the_context_is_refused() -> None:
    err = refused(completion(prompt="x" * CONTEXT), "prompt")
    assert err.code == "context_length_exceeded"


def test_chat_default_max_tokens_fills_the_context() -> None:
    req = ok(chat())
    assert req.params.max_tokens == CONTEXT - len(req.prompt_token_ids)


def test_max_completion_tokens_sets_the_cap() -> None:
    assert ok(chat(max_completion_tokens=9)).params.max_tokens == 9


def test_best_of_equal_to_n_is_accepted() -> None:
    assert ok(completion(best_of=2, n=2)).params.n == 2
    assert ok(completion(best_of=1, n=None)).params.n == 1


def test_allowed_no_op_params_are_accepted() -> None:
    req = ok(chat(response_format={"type": "text"}, user="u1", tool_choice="none", tools=[],
                  logit_bias={}, stream=False, store=False, metadata={"a": "b"}))
    assert req.params.max_tokens > 0


def test_top_p_zero_means_most_likely_token_only() -> None:
    params = ok(chat(top_p=0)).params
    assert (params.top_p, params.top_k) == (1.0, 1)


def test_completion_prompt_string_and_token_ids() -> None:
    req = ok(completion(max_tokens=3))
    assert TOK.decode(req.prompt_token_ids) == "Once upon a time"
    assert req.params.max_tokens == 3
    assert ok(completion(prompt=[10, 11, 12])).prompt_token_ids == [10, 11, 12]
    assert ok(completion(prompt=["one"])).prompt_token_ids == TOK.encode("one")
    assert ok(completion(prompt=[[4, 5]])).prompt_token_ids == [4, 5]


def test_completion_default_max_tokens_is_16() -> None:
    assert ok(completion()).params.max_tokens == 16


def test_completion_logprobs_is_a_count() -> None:
    params = ok(completion(logprobs=2)).params
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    params = ok(completion(logprobs=0)).params
    assert (params.logprobs, params.top_logprobs) == (True, 0)
    assert ok(completion()).params.logprobs is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["one", "two"]}, "prompt"),  # several prompts: one per line instead
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"messages": []}, "messages"),  # a chat parameter on the completions endpoint
    ],
)
def test_bad_completion_params_are_refused(body: dict[str, Any], param: str) -> None:
    refused(completion(**body), param)


def test_non_object_body_is_refused_not_raised() -> None:
    result = to_engine_request("1", CHAT, ["x"], TOK, served_model=MODEL,  # type: ignore[arg-type]
                               max_model_len=CONTEXT)
    assert isinstance(result, RequestError) and result.status_code == 400


# --- responses --------------------------------------------------------------------------------


def _output(logprobs: bool = False) -> RequestOutput:
    lps = (
        (TokenLogprob(72, "H", -0.1, ((72, "H", -0.1), (73, "I", -2.5))),
         TokenLogprob(105, "é", -0.3, ((106, "x", -0.2), (105, "é", -0.3))))
        if logprobs else None
    )
    return RequestOutput(
        id="7",
        prompt_tokens=12,
        cached_tokens=8,
        choices=(
            Choice(0, (72, 105), "Hé", "stop", lps),
            Choice(1, (72, 105, 106), "Hex", "length", lps),
        ),
    )


def test_chat_completion_body_has_openai_shape() -> None:
    body = to_response_body(CHAT, _output(), model=MODEL, created=1700000000)
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert (body["created"], body["model"]) == (1700000000, MODEL)
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hé", "refusal": None, "annotations": []},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert body["choices"][1]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 8},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_chat_logprobs_have_token_bytes_and_top_list() -> None:
    body = to_response_body(CHAT, _output(logprobs=True), model=MODEL, created=1)
    content = body["choices"][0]["logprobs"]["content"]
    assert content[1] == {
        "token": "é", "logprob": -0.3, "bytes": [195, 169],
        "top_logprobs": [{"token": "x", "logprob": -0.2, "bytes": [120]},
                         {"token": "é", "logprob": -0.3, "bytes": [195, 169]}],
    }


def test_text_completion_body_has_openai_shape() -> None:
    body = to_response_body(COMPLETIONS, _output(), model=MODEL, created=5)
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"][1] == {"text": "Hex", "index": 1, "logprobs": None,
                                  "finish_reason": "length"}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_text_completion_logprobs_are_parallel_lists() -> None:
    body = to_response_body(COMPLETIONS, _output(logprobs=True), model=MODEL, created=5)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "é"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"H": -0.1, "I": -2.5}, {"x": -0.2, "é": -0.3}],
        "text_offset": [0, 1],
    }


def test_response_ids_are_unique() -> None:
    ids = {to_response_body(CHAT, _output(), model=MODEL, created=1)["id"] for _ in range(50)}
    assert len(ids) == 50


def test_failed_output_has_no_response_body() -> None:
    failed = RequestOutput(id="1", prompt_tokens=0, cached_tokens=0,
                           error=RequestError("too long", "messages"))
    with pytest.raises(ValueError):
        to_response_body(CHAT, failed, model=MODEL, created=1)


# --- with the default model's own tokenizer and chat template -------------------------------


def test_real_chat_template_and_context(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    context = default_model.config.max_position_embeddings
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    req = ok(to_engine_request("1", CHAT, body, tok, served_model=MODEL, max_model_len=context))
    assert list(req.prompt_token_ids) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tok.decode(req.prompt_token_ids,
                                                                   skip_special_tokens=False)
    for endpoint, bad in ((COMPLETIONS, {"prompt": "a\ud800"}),
                          (CHAT, {"messages": [{"role": "user", "content": "a\ud800"}]})):
        err = to_engine_request("3", endpoint, bad, tok, served_model=MODEL, max_model_len=context)
        refused(err, "prompt" if endpoint == COMPLETIONS else "messages")
    long_body = {"prompt": "word " * context, "max_tokens": 1}
    err = to_engine_request("2", COMPLETIONS, long_body, tok, served_model=MODEL,
                            max_model_len=context)
    assert refused(err, "prompt").code == "context_length_exceeded"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_json_schema_reaches_the_sampling_params() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    fmt = ok(chat(response_format=rf)).params.response_format
    assert fmt is not None and fmt.type == "json_schema" and fmt.strict
    assert ok(completion(response_format=rf)).params.response_format == fmt  # an extension


def test_json_object_needs_json_in_what_the_client_wrote() -> None:
    rf = {"type": "json_object"}
    said = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Hi"}]
    assert ok(chat(messages=said, response_format=rf)).params.response_format is not None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a json list"}]}]
    assert ok(chat(messages=parts, response_format=rf)).params.response_format is not None
    err = refused(chat(response_format=rf), "response_format")
    assert "json" in err.message
    assert ok(completion(prompt="Some JSON:", response_format=rf)).params.response_format
    assert ok(completion(prompt=TOK.encode("json?"), response_format=rf)).params.response_format
    refused(completion(prompt="Some YAML:", response_format=rf), "response_format")


def test_unsupported_strict_keywords_are_refused_with_response_format() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    err = refused(chat(response_format=rf), "response_format")
    assert "uniqueItems" in err.message and err.status_code == 400
