"""Batch output and error file lines, shaped exactly as OpenAI's Batch API writes them.

A success line carries the endpoint's response body with status 200; a request the endpoint
rejected carries a 4xx/5xx response whose body is the OpenAI error envelope; a request that never
ran has `response: null` and a top-level `error` (batch_expired, batch_cancelled, request_timeout).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from runtime.types import RequestError

NEVER_RAN_CODES = ("batch_expired", "batch_cancelled", "request_timeout")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return _line(custom_id, 200, body)


def request_error_line(custom_id: str | None, error: RequestError) -> dict[str, Any]:
    """The endpoint's answer to a request it refused (status 4xx/5xx, OpenAI error envelope).

    custom_id is None only for an input line that had no usable custom_id (`blendserve run`).
    """
    kind = _ERROR_TYPES.get(error.status_code,
                            "server_error" if error.status_code >= 500 else "invalid_request_error")
    envelope = {"error": {"message": error.message, "type": kind, "param": error.param,
                          "code": error.code}}
    return _line(custom_id, error.status_code, envelope)


def never_ran_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    if code not in NEVER_RAN_CODES:
        raise ValueError(f"{code!r} is not one of {NEVER_RAN_CODES}")
    return {"id": _new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def encode_line(record: dict[str, Any]) -> bytes:
    """One JSONL line (UTF-8, newline-terminated) for an output or error file."""
    try:
        return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
    except UnicodeEncodeError:  # a lone surrogate (JSON "\\ud800" in the input): escape it
        return json.dumps(record).encode("ascii") + b"\n"


def _line(custom_id: str | None, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": _new_id("req_"), "body": body},
        "error": None,
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
