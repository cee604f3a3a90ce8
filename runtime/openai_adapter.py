"""OpenAI endpoint bodies in, engine requests out; engine outputs in, OpenAI response bodies out.

Covers `/v1/chat/completions` and `/v1/completions`. Every problem with a body becomes a
`RequestError` (400 with the offending `param`), never an exception: one bad request lands in the
error file and the batch goes on.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from runtime.config import Tokenizer
from runtime.response_format import FormatError, parse_response_format
from runtime.types import Choice, EngineRequest, RequestError, RequestOutput, SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

MAX_N = 128
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; also used for /v1/completions (OpenAI: 5)
MAX_STOP_TOKEN_IDS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Accepted and ignored: they change nothing about the generated text.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logprobs", "stream", "stream_options", "logit_bias",
    "top_k", "ignore_eos", "stop_token_ids",  # extensions (vLLM spells them the same)
} | _IGNORED
_CHAT = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "functions", "function_call", "reasoning_effort", "modalities", "audio",
    "prediction", "web_search_options",
}
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix", "best_of",
                          "response_format"}  # an extension: structured output for completions
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class _Invalid(Exception):
    """Internal short-cut out of nested validation; always turned into a RequestError."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value",
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.error = RequestError(message=message, param=param, code=code,
                                  status_code=status_code)


# ---------------------------------------------------------------------------------------------
# Body → EngineRequest


def to_engine_request(
    request_id: str,
    endpoint: str,
    body: dict,
    tokenizer: Tokenizer,
    *,
    served_model: str,
    max_model_len: int,
) -> EngineRequest | RequestError:
    """Validate one endpoint body and turn it into an engine request (or a 400 RequestError)."""
    try:
        if endpoint not in ENDPOINTS:
            raise _Invalid(f"Unsupported endpoint {endpoint!r}; use one of {ENDPOINTS}.", None)
        if not isinstance(body, Mapping):
            raise _Invalid("The request body must be a JSON object.", None, "invalid_type")
        chat = endpoint == CHAT
        _check_keys(body, _CHAT if chat else _COMPLETIONS)
        _check_model(body, served_model)
        _check_unsupported(body, chat)
        params = _sampling_params(body, chat, tokenizer.vocab_size)
        if chat:
            ids = _chat_prompt(body, tokenizer)
        else:
            ids = _completion_prompt(body, tokenizer)
        if body.get("response_format") is not None:
            text = _user_text(body, chat, tokenizer, ids)
            params = replace(params, response_format=parse_response_format(
                body["response_format"], text))
        return EngineRequest(request_id, ids, _fit_context(params, body, chat, len(ids),
                                                           max_model_len))
    except _Invalid as exc:
        return exc.error
    except FormatError as exc:
        return exc.error


def _check_keys(body: Mapping[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise _Invalid(f"Unrecognized request argument supplied: {key}", key,
                           "unsupported_parameter")


def _check_model(body: Mapping[str, Any], served_model: str) -> None:
    """A body may omit `model` (or send null); if it names one, it must be the served model."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _Invalid("Invalid type for 'model': expected a string.", "model", "invalid_type")
    if model != served_model:
        raise _Invalid(
            f"The model `{model}` does not exist; this server serves `{served_model}`.",
            "model", "model_not_found", 404,
        )


# Features this server does not have: a param is refused unless its value means "off".
_OFF: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "stream_options": (None,), "logit_bias": (None, {}),
}
_CHAT_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}
_COMPLETIONS_OFF: dict[str, tuple[Any, ...]] = {"echo": (None, False), "suffix": (None, "")}


def _check_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    for key, off in (_OFF | (_CHAT_OFF if chat else _COMPLETIONS_OFF)).items():
        if body.get(key) not in off:
            shown = json.dumps(body[key], default=str)[:80]
            raise _Invalid(f"'{key}' = {shown} is not supported by this server.", key,
                           "unsupported_parameter")
    best_of = body.get("best_of")
    if not chat and best_of is not None and best_of != (body.get("n") or 1):
        raise _Invalid("'best_of' different from 'n' is not supported by this server.",
                       "best_of", "unsupported_parameter")


def _sampling_params(body: Mapping[str, Any], chat: bool, vocab_size: int) -> SamplingParams:
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    top_k = _integer(body, "top_k", -1, None, 0)
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "off"
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token survives
        top_p, top_k = 1.0, 1
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _Invalid("Invalid type for 'stop': expected a string or a list of strings.",
                       "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise _Invalid(f"Invalid 'stop': at most {MAX_STOP} stop sequences.", "stop")
    if any(s == "" for s in stops):
        raise _Invalid("Invalid 'stop': stop sequences must not be empty.", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _Invalid("Invalid type for 'stop_token_ids': expected a list of integers.",
                       "stop_token_ids", "invalid_type")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab_size for t in stop_ids):
        raise _Invalid(f"Invalid 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} ids, each in "
                       f"[0, {vocab_size}).", "stop_token_ids")
    if chat:
        logprobs = _boolean(body, "logprobs", False)
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
        if top is not None and top > 0 and not logprobs:
            raise _Invalid("Invalid 'top_logprobs': only allowed when 'logprobs' is true.",
                           "top_logprobs")
        top_logprobs = top or 0
    else:  # /v1/completions: logprobs is the number of alternatives (0 = sampled token only)
        k = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
        logprobs, top_logprobs = k is not None, k or 0
    seed = _integer(body, "seed", -(2**63), 2**64 - 1, None)
    return SamplingParams(
        max_tokens=1,  # placeholder; _fit_context sets the real cap once the prompt is known
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stops,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_boolean(body, "ignore_eos", False),
        n=_integer(body, "n", 1, MAX_N, 1),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
    )


def _fit_context(
    params: SamplingParams, body: Mapping[str, Any], chat: bool, prompt_len: int,
    max_model_len: int,
) -> SamplingParams:
    """Set max_tokens: the body's value, else what OpenAI would use; refuse what cannot fit."""
    requested = _integer(body, "max_tokens", 1, None, None)
    if chat:
        newer = _integer(body, "max_completion_tokens", 1, None, None)
        if newer is not None and requested is not None and newer != requested:
            raise _Invalid("Set either 'max_tokens' or 'max_completion_tokens', not both with "
                           "different values.", "max_completion_tokens")
        requested = newer if newer is not None else requested
    where = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise _Invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{where} resulted in {prompt_len} tokens. Please reduce the length of the {where}.",
            where, "context_length_exceeded",
        )
    if requested is None:  # chat: up to the context; completions: OpenAI's default of 16
        room = max_model_len - prompt_len
        max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    elif prompt_len + requested > max_model_len:
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        raise _Invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {where}, "
            f"{requested} in the completion). Please reduce the length of the {where} or "
            "completion.",
            key, "context_length_exceeded",
        )
    else:
        max_tokens = requested
    return replace(params, max_tokens=max_tokens)


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise _Invalid("Missing required parameter: 'messages'.", "messages",
                       "missing_required_parameter")
    if not isinstance(messages, list):
        raise _Invalid("Invalid type for 'messages': expected an array.", "messages",
                       "invalid_type")
    if not messages:
        raise _Invalid("Invalid 'messages': empty array. Expected at least one message.",
                       "messages")
    plain = [_message(i, m) for i, m in enumerate(messages)]
    try:
        ids = tokenizer.apply_chat_template(plain)
    except Exception as exc:  # the template is user-facing logic (e.g. "roles must alternate")
        raise _Invalid(f"Invalid 'messages': the chat template refused them: {exc}",
                       "messages") from exc
    return list(ids)


def _message(i: int, message: Any) -> dict[str, str]:
    """One OpenAI message → {"role", "content"} with plain-text content for the chat template."""
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise _Invalid(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    role = message.get("role")
    if role is None:
        raise _Invalid(f"Missing required parameter: '{where}.role'.", f"{where}.role",
                       "missing_required_parameter")
    if role not in _ROLES:
        raise _Invalid(f"Invalid value: '{role}'. Supported values are: 'system', 'developer', "
                       "'user' and 'assistant'.", f"{where}.role")
    if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
        raise _Invalid(f"Tool calling is not supported by this server ('{where}').", where,
                       "unsupported_parameter")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise _Invalid(f"Invalid type for '{where}.name': expected a string.", f"{where}.name",
                       "invalid_type")
    content = message.get("content")
    if content is None:
        raise _Invalid(f"Missing required parameter: '{where}.content'.", f"{where}.content",
                       "missing_required_parameter")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            ok_kinds = ("text", "refusal") if role == "assistant" else ("text",)
            if kind not in ok_kinds:
                raise _Invalid(f"Invalid '{pwhere}.type': only text content parts are "
                               "supported by this server.", f"{pwhere}.type")
            text = part.get(kind)
            if not isinstance(text, str):
                raise _Invalid(f"Invalid type for '{pwhere}.{kind}': expected a string.",
                               f"{pwhere}.{kind}", "invalid_type")
            texts.append(text)
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _Invalid(f"Invalid type for '{where}.content': expected a string or an array of "
                       "content parts.", f"{where}.content", "invalid_type")
    # Most chat templates know only "system"; OpenAI's "developer" role means the same here.
    return {"role": "system" if role == "developer" else role, "content": content}


def _user_text(body: Mapping[str, Any], chat: bool, tokenizer: Tokenizer, ids: list[int]) -> str:
    """What the client wrote (message contents, or the prompt), without any chat template."""
    if chat:
        return "\n".join(_message(i, m)["content"] for i, m in enumerate(body["messages"]))
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def _completion_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """`prompt` as a string or token ids; a list of several prompts is refused (one per line)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _Invalid("Missing required parameter: 'prompt'.", "prompt",
                       "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # ["text"] or [[ids]]: one prompt in a list
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _Invalid("Invalid 'prompt': this server takes one prompt per request; send each "
                       "prompt as its own batch line.", "prompt", "unsupported_parameter")
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        except Exception as exc:  # e.g. a lone surrogate ("\ud800") the tokenizer cannot take
            raise _Invalid(f"Invalid 'prompt': it cannot be tokenized ({exc}).", "prompt") from exc
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise _Invalid(f"Invalid 'prompt': token ids must be in [0, {vocab}).", "prompt")
    else:
        raise _Invalid("Invalid type for 'prompt': expected a string or an array of token ids.",
                       "prompt", "invalid_type")
    if not ids:
        raise _Invalid("Invalid 'prompt': the prompt must not be empty.", "prompt")
    return ids


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _integer(body: Mapping[str, Any], key: str, lo: int | None, hi: int | None, default: Any) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise _Invalid(f"Invalid type for '{key}': expected an integer, but got "
                       f"{type(v).__name__}.", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise _Invalid(f"Invalid '{key}': {v}. Expected a value {span}.", key)
    return v


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Invalid(f"Invalid type for '{key}': expected a number.", key, "invalid_type")
    if not lo <= v <= hi:
        raise _Invalid(f"Invalid '{key}': {v}. Expected a value between {lo:g} and {hi:g}.", key)
    return float(v)


def _boolean(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _Invalid(f"Invalid type for '{key}': expected a boolean.", key, "invalid_type")
    return v


# ---------------------------------------------------------------------------------------------
# RequestOutput → response body


def to_response_body(endpoint: str, output: RequestOutput, *, model: str, created: int) -> dict:
    """The `chat.completion` / `text_completion` object OpenAI would return for this output."""
    if output.error is not None:
        raise ValueError(f"request {output.id} failed; it has no response body")
    usage = {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    if endpoint == CHAT:
        choices: list[dict[str, Any]] = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None,
                            "annotations": []},
                "logprobs": _chat_logprobs(c),
                "finish_reason": c.finish_reason,
            }
            for c in output.choices
        ]
        obj, prefix = "chat.completion", "chatcmpl-"
    elif endpoint == COMPLETIONS:
        choices = [
            {"text": c.text, "index": c.index, "logprobs": _completion_logprobs(c),
             "finish_reason": c.finish_reason}
            for c in output.choices
        ]
        obj, prefix = "text_completion", "cmpl-"
    else:
        raise ValueError(f"unsupported endpoint {endpoint!r}")
    return {
        "id": prefix + uuid.uuid4().hex,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _chat_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    content = [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": _utf8(t.token),
            "top_logprobs": [
                {"token": text, "logprob": lp, "bytes": _utf8(text)} for _, text, lp in t.top
            ],
        }
        for t in choice.logprobs
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(choice: Choice) -> dict[str, Any] | None:
    """Legacy shape: parallel lists; `top_logprobs` maps text → logprob and, as OpenAI's does,
    always includes the sampled token; `text_offset` counts characters from the completion start."""
    if choice.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for t in choice.logprobs:
        tokens.append(t.token)
        token_logprobs.append(t.logprob)
        top = {text: lp for _, text, lp in t.top}
        top.setdefault(t.token, t.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}
