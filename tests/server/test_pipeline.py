"""The shared pipeline on the real default model: one result per line, lazily, as requests finish."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.engine import Engine, EngineConfig
from runtime.loader import DEFAULT_MODEL, load_model
from runtime.openai_adapter import CHAT, COMPLETIONS
from runtime.types import EngineRequest, SamplingParams
from server.batch_input import BatchLine
from server.pipeline import LineResult, run_lines

REPO_ROOT = Path(__file__).resolve().parents[2]


def model_data_dir() -> Path:
    """The converted-model cache the runtime tests use too ($BLENDSERVE_DATA_DIR or <repo>/data)."""
    env = os.environ.get("BLENDSERVE_DATA_DIR")
    return Path(env) if env else REPO_ROOT / "data"


pytestmark = pytest.mark.slow  # runs the real model


@pytest.fixture(scope="module")
def engine() -> Engine:
    model = load_model(DEFAULT_MODEL, data_dir=model_data_dir())
    return Engine(model, EngineConfig(kv_memory_bytes=32 << 20))


def chat_line(number: int, custom_id: str, **body: Any) -> BatchLine:
    body.setdefault("messages", [{"role": "user", "content": f"Say the number {number}."}])
    body.setdefault("max_tokens", 3)
    body.setdefault("temperature", 0)
    return BatchLine(number, custom_id, body)


def by_id(results: list[LineResult]) -> dict[str, LineResult]:
    ids = [r.custom_id for r in results]
    assert len(ids) == len(set(ids)), "a custom_id came back twice"
    return {r.custom_id: r for r in results}


def test_every_line_gets_exactly_one_result(engine: Engine) -> None:
    lines = [
        chat_line(1, "good-1"),
        chat_line(2, "zero-tokens", max_tokens=0),
        chat_line(3, "good-2", model=DEFAULT_MODEL, n=2),
        chat_line(4, "tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat_line(5, "too-long", max_tokens=engine.max_model_len),
        chat_line(6, "alias", model="an-alias-batch-input-accepted"),
    ]
    results = by_id(list(run_lines(lines, engine, endpoint=CHAT, policy="fcfs")))
    assert set(results) == {line.custom_id for line in lines}

    for cid in ("good-1", "good-2", "alias"):
        r = results[cid]
        assert r.ok and r.record["error"] is None
        assert r.record["custom_id"] == cid and r.record["id"].startswith("batch_req_")
        resp = r.record["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["model"] == DEFAULT_MODEL
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        assert all(c["message"]["role"] == "assistant" for c in body["choices"])
        usage = body["usage"]
        assert usage["completion_tokens"] == r.output_tokens >= 1
        assert usage["prompt_tokens"] == r.input_tokens
        assert usage["prompt_tokens_details"]["cached_tokens"] == r.cached_tokens
        assert usage["total_tokens"] == r.input_tokens + r.output_tokens
    messages = lines[0].body["messages"]
    assert results["good-1"].input_tokens == len(engine.tokenizer.apply_chat_template(messages))
    two = results["good-2"].record["response"]["body"]["choices"]
    assert [c["index"] for c in two] == [0, 1]
    assert two[0]["message"]["content"] == two[1]["message"]["content"]  # greedy: same choice

    for cid, param in (
        ("zero-tokens", "max_tokens"),
        ("tools", "tools"),
        ("too-long", "max_tokens"),
    ):
        r = results[cid]
        assert not r.ok and r.output_tokens == 0
        assert r.record["response"]["status_code"] == 400
        assert r.record["response"]["body"]["error"]["param"] == param
        assert r.record["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_greedy_text_matches_the_engine_alone(engine: Engine) -> None:
    line = chat_line(1, "x", max_tokens=2)
    [result] = run_lines([line], engine, endpoint=CHAT, policy="fcfs")
    ids = engine.tokenizer.apply_chat_template(line.body["messages"])
    [direct] = engine.generate(
        [EngineRequest("d", ids, SamplingParams(max_tokens=2, temperature=0))]
    )
    text = result.record["response"]["body"]["choices"][0]["message"]["content"]
    assert text == direct.choices[0].text


def test_completions_endpoint_with_logprobs(engine: Engine) -> None:
    line = BatchLine(
        1,
        "c",
        {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 2},
    )
    [result] = run_lines([line], engine, endpoint=COMPLETIONS, policy="fcfs")
    body = result.record["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"]


def test_lines_are_pulled_lazily_and_stop_ends_admission(engine: Engine) -> None:
    consumed = 0

    def lines() -> Iterator[BatchLine]:
        nonlocal consumed
        for i in range(1, 501):
            consumed += 1
            yield chat_line(i, f"r{i}", max_tokens=1)

    stop = threading.Event()
    results = []
    for r in run_lines(lines(), engine, endpoint=CHAT, policy="fcfs", should_stop=stop.is_set):
        results.append(r)
        stop.set()  # stop admitting after the first finished request
    assert 1 <= len(results) < 100
    assert consumed < 100  # fcfs pulls lines as KV room frees, not the whole file
    by_id(results)
    assert all(r.ok for r in results)
