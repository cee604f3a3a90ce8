"""Batch input files: line-by-line validation with OpenAI's error codes, and reading valid lines.

Streams the file (one line in memory at a time), so a 200 MB file costs no more memory than a
small one; the only state that grows is a 16-byte fingerprint per custom_id (duplicate check).

Model rule (issue 2: "a body may omit `model`"): a line without `body.model`, or with
`"model": null`, runs on the served model. A line whose `body.model` is present but empty or not
a string gets `invalid_request` "Model parameter is required." (param `body.model`); a named
model that is not served gets `model_not_found`; a second, different named model gets
`mixed_models`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_REPORTED_ERRORS = 1000  # errors kept in Validation.errors; the rest are only counted


@dataclass(frozen=True, slots=True)
class LineError:
    code: str  # one of API.md's validation codes
    message: str
    param: str | None = None
    line: int | None = None  # 1-based physical line of the input file; None for file-level errors


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int  # 1-based physical line of the input file
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Validation:
    total: int  # non-blank lines (requests), valid or not
    model: str | None  # the one model the file names; None when every line omits it
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED_ERRORS
    error_count: int = 0  # all errors, reported or not

    @property
    def ok(self) -> bool:
        return self.error_count == 0


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that failed validation, with the custom_id when the line had a usable one."""

    error: LineError
    custom_id: str | None


def validate_batch_file(
    path: str | Path,
    *,
    endpoint: str,
    served_models: Collection[str],
    max_lines: int,
) -> Validation:
    """Check every line; collect up to MAX_REPORTED_ERRORS errors but count them all."""
    errors: list[LineError] = []
    count = 0
    scan = BatchScan(endpoint=endpoint, served_models=served_models)
    for item in scan.scan(path):
        if isinstance(item, BadLine):
            count += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(item.error)
    file_errors = []
    if scan.total == 0:
        file_errors.append(LineError("empty_file", "The batch input file is empty."))
    elif scan.total > max_lines:
        file_errors.append(LineError(
            "too_many_tasks",
            f"The batch input file has {scan.total} requests; the limit is {max_lines}.",
        ))
    errors = file_errors + errors[: MAX_REPORTED_ERRORS - len(file_errors)]
    return Validation(scan.total, scan.model, errors, count + len(file_errors))


def iter_batch_lines(path: str | Path) -> Iterator[BatchLine]:
    """The requests of a file that `validate_batch_file` accepted, in file order, streamed."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                obj = _parse(raw)
                yield BatchLine(number, obj["custom_id"], obj["body"])


def first_endpoint(path: str | Path, endpoints: Collection[str]) -> str | None:
    """The url of the first line naming one of `endpoints` (how `blendserve run` picks the
    endpoint of a file); None when no line does. Stops reading at that line."""
    with open(path, "rb") as f:
        for raw in f:
            obj = _parse(raw)
            if isinstance(obj, dict) and obj.get("url") in endpoints:
                return str(obj["url"])
    return None


def count_nonblank_lines(path: str | Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


class BatchScan:
    """One pass over a file: yields each non-blank line as a BatchLine or a BadLine, in order.

    Both the worker (through `validate_batch_file`) and `blendserve run` (which turns BadLines
    into error lines and runs the rest) use this, so they agree on every code and line number.
    """

    def __init__(self, *, endpoint: str, served_models: Collection[str]) -> None:
        self.endpoint = endpoint
        self.served_models = served_models
        self.total = 0
        self.model: str | None = None
        self._seen: set[bytes] = set()

    def scan(self, path: str | Path) -> Iterator[BatchLine | BadLine]:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                self.total += 1
                yield self._check(number, raw)

    def _check(self, number: int, raw: bytes) -> BatchLine | BadLine:
        obj = _parse(raw)
        if not isinstance(obj, dict):
            return _bad(number, None, "invalid_json_line",
                        "This line is not parseable as valid JSON (or is not a JSON object).")
        if _SURROGATE_ESCAPE.search(raw) and not _is_unicode(obj):
            # JSON allows "\ud800", but such a string cannot be stored or written as UTF-8.
            return _bad(number, None, "invalid_json_line",
                        "This line contains an unpaired surrogate escape (such as \\ud800); "
                        "strings must be valid Unicode.")
        custom_id = obj.get("custom_id")
        if custom_id is None:
            return _bad(number, None, "missing_required_parameter",
                        "Missing required parameter: 'custom_id'.", "custom_id")
        if not isinstance(custom_id, str):
            return _bad(number, None, "invalid_request", "'custom_id' must be a string.",
                        "custom_id")
        # Registered before the other checks: a later line reusing the id of a bad line is
        # still a duplicate, so each custom_id gets exactly one output or error line.
        fingerprint = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"),
                                      digest_size=16).digest()
        if fingerprint in self._seen:
            return _bad(number, custom_id, "duplicate_custom_id",
                        f"The custom_id {custom_id!r} is used by an earlier line; custom_ids "
                        "must be unique within a batch.", "custom_id")
        self._seen.add(fingerprint)
        cid = custom_id
        for key in ("method", "url", "body"):
            if obj.get(key) is None:
                return _bad(number, cid, "missing_required_parameter",
                            f"Missing required parameter: '{key}'.", key)
        if obj["method"] != "POST":
            return _bad(number, cid, "invalid_request",
                        f"Invalid method {obj['method']!r}; batch requests use 'POST'.", "method")
        if obj["url"] != self.endpoint:
            return _bad(number, cid, "invalid_url",
                        f"The URL {obj['url']!r} does not match the batch endpoint "
                        f"{self.endpoint!r}.", "url")
        body = obj["body"]
        if not isinstance(body, dict):
            return _bad(number, cid, "invalid_request", "'body' must be a JSON object.", "body")
        if body.get("stream") not in (None, False):
            return _bad(number, cid, "streaming_unsupported",
                        "Streaming is not supported in batch requests.", "body.stream")
        return self._check_model(number, cid, body) or BatchLine(number, custom_id, body)

    def _check_model(self, number: int, cid: str, body: dict[str, Any]) -> BadLine | None:
        if "model" not in body or body["model"] is None:
            return None
        model = body["model"]
        if not isinstance(model, str) or not model:
            return _bad(number, cid, "invalid_request", "Model parameter is required.",
                        "body.model")
        if model not in self.served_models:
            served = ", ".join(sorted(self.served_models))
            return _bad(number, cid, "model_not_found",
                        f"The model '{model}' does not exist or is not served here "
                        f"(served: {served}).", "body.model")
        if self.model is None:
            self.model = model
        elif model != self.model:
            return _bad(number, cid, "mixed_models",
                        f"The model '{model}' differs from '{self.model}' named by an earlier "
                        "line; a batch file must use one model.", "body.model")
        return None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the cheap test before the exact one


def _is_unicode(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse(raw: bytes) -> Any:
    """The line's JSON value, or None for bytes that are not UTF-8 JSON."""
    try:
        return json.loads(raw.decode("utf-8").lstrip("\ufeff"))  # tolerate a UTF-8 BOM
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _bad(number: int, cid: str | None, code: str, message: str,
         param: str | None = None) -> BadLine:
    return BadLine(LineError(code, message, param, number), cid)
