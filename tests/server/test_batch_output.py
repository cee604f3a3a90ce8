"""Output and error file lines have OpenAI's batch shape and unique ids."""

from __future__ import annotations

import json
import re

import pytest

from runtime.types import RequestError
from server.batch_output import encode_line, never_ran_line, request_error_line, success_line

HEX = re.compile(r"^[0-9a-f]{32}$")


def test_success_line_shape() -> None:
    body = {"object": "chat.completion", "choices": []}
    rec = success_line("task-1", body)
    assert set(rec) == {"id", "custom_id", "response", "error"}
    assert rec["id"].startswith("batch_req_") and HEX.match(rec["id"][len("batch_req_") :])
    assert rec["custom_id"] == "task-1"
    assert rec["error"] is None
    assert rec["response"]["status_code"] == 200
    assert rec["response"]["request_id"].startswith("req_")
    assert HEX.match(rec["response"]["request_id"][len("req_") :])
    assert rec["response"]["body"] == body


def test_request_error_line_has_the_error_envelope() -> None:
    rec = request_error_line(
        "t", RequestError("max_tokens must be at least 1", "max_tokens", "invalid_value")
    )
    assert rec["error"] is None
    assert rec["response"]["status_code"] == 400
    assert rec["response"]["body"] == {
        "error": {
            "message": "max_tokens must be at least 1",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_value",
        }
    }


def test_server_errors_are_typed_server_error() -> None:
    rec = request_error_line("t", RequestError("engine failed", status_code=500))
    assert rec["response"]["status_code"] == 500
    assert rec["response"]["body"]["error"]["type"] == "server_error"


@pytest.mark.parametrize("code", ["batch_expired", "batch_cancelled", "request_timeout"])
def test_never_ran_line(code: str) -> None:
    rec = never_ran_line("t", code, "This request could not be executed before the batch ended.")
    assert rec["response"] is None
    assert rec["error"] == {
        "code": code,
        "message": "This request could not be executed before the batch ended.",
    }
    assert rec["id"].startswith("batch_req_")


def test_never_ran_line_refuses_unknown_codes() -> None:
    with pytest.raises(ValueError):
        never_ran_line("t", "oops", "x")


def test_ids_are_unique() -> None:
    recs = [success_line("t", {}) for _ in range(100)]
    assert len({r["id"] for r in recs}) == 100
    assert len({r["response"]["request_id"] for r in recs}) == 100


def test_encode_line_is_one_utf8_json_line() -> None:
    raw = encode_line(success_line("日本", {"text": "é\nx"}))
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert json.loads(raw)["custom_id"] == "日本"
    lone = encode_line(success_line("\ud800", {}))  # a lone surrogate from JSON input
    assert json.loads(lone)["custom_id"] == "\ud800"
