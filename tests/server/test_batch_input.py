"""Batch file validation: every code of API.md with its 1-based line, streamed line by line."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from server.batch_input import (
    MAX_REPORTED_ERRORS,
    BatchLine,
    LineError,
    Validation,
    first_endpoint,
    iter_batch_lines,
    validate_batch_file,
)

CHAT = "/v1/chat/completions"
MODEL = "smollm2-135m-instruct"


def line(
    custom_id: Any = "r1",
    *,
    url: Any = CHAT,
    method: Any = "POST",
    body: Any = None,
    drop: str | None = None,
) -> str:
    obj = {
        "custom_id": custom_id,
        "method": method,
        "url": url,
        "body": body if body is not None else {"messages": [{"role": "user", "content": "hi"}]},
    }
    if drop:
        del obj[drop]
    return json.dumps(obj)


def write(tmp_path: Path, *lines: str | bytes) -> Path:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def validate(path: Path, max_lines: int = 50_000) -> Validation:
    return validate_batch_file(path, endpoint=CHAT, served_models={MODEL}, max_lines=max_lines)


def only_error(v: Validation) -> LineError:
    assert len(v.errors) == 1, v.errors
    return v.errors[0]


def test_valid_file_has_no_errors_and_reads_back(tmp_path: Path) -> None:
    path = write(tmp_path, line("a"), "", "   ", line("b", body={"model": MODEL, "messages": []}))
    v = validate(path)
    assert (v.ok, v.total, v.model, v.errors) == (True, 2, MODEL, [])
    assert list(iter_batch_lines(path)) == [
        BatchLine(1, "a", {"messages": [{"role": "user", "content": "hi"}]}),
        BatchLine(4, "b", {"model": MODEL, "messages": []}),
    ]


def test_file_without_any_model_is_valid(tmp_path: Path) -> None:
    v = validate(write(tmp_path, line("a"), line("b")))
    assert v.ok and v.model is None


@pytest.mark.parametrize(
    ("bad", "code", "param"),
    [
        ("{not json", "invalid_json_line", None),
        ("[1, 2]", "invalid_json_line", None),
        (b'{"custom_id": "\xff\xfe"}', "invalid_json_line", None),  # not UTF-8
        (line(drop="custom_id"), "missing_required_parameter", "custom_id"),
        (line(drop="method"), "missing_required_parameter", "method"),
        (line(drop="url"), "missing_required_parameter", "url"),
        (line(drop="body"), "missing_required_parameter", "body"),
        (line(custom_id=None), "missing_required_parameter", "custom_id"),
        (line(custom_id=5), "invalid_request", "custom_id"),
        (line(url="/v1/completions"), "invalid_url", "url"),
        (line(method="GET"), "invalid_request", "method"),
        (line(body=[1]), "invalid_request", "body"),
        (line(body={"stream": True, "messages": []}), "streaming_unsupported", "body.stream"),
        (line(body={"model": "gpt-4o", "messages": []}), "model_not_found", "body.model"),
        (line(body={"model": "", "messages": []}), "invalid_request", "body.model"),
        (line(body={"model": 3, "messages": []}), "invalid_request", "body.model"),
    ],
)
def test_each_bad_line_gets_its_code_param_and_line(
    tmp_path: Path, bad: str | bytes, code: str, param: str | None
) -> None:
    v = validate(write(tmp_path, line("ok1"), "", bad, line("ok2")))
    err = only_error(v)
    assert (err.code, err.param, err.line) == (code, param, 3)
    assert err.message
    assert v.total == 3 and not v.ok


def test_model_parameter_is_required_message(tmp_path: Path) -> None:
    err = only_error(validate(write(tmp_path, line(body={"model": "", "messages": []}))))
    assert err.message == "Model parameter is required."


def test_duplicate_custom_id_is_reported_on_the_later_line(tmp_path: Path) -> None:
    err = only_error(validate(write(tmp_path, line("a"), line("b"), line("a"))))
    assert (err.code, err.param, err.line) == ("duplicate_custom_id", "custom_id", 3)


def test_reusing_the_id_of_a_bad_line_is_still_a_duplicate(tmp_path: Path) -> None:
    v = validate(write(tmp_path, line("a", method="GET"), line("a")))
    assert [(e.code, e.line) for e in v.errors] == [
        ("invalid_request", 1),
        ("duplicate_custom_id", 2),
    ]


def test_mixed_models(tmp_path: Path) -> None:
    v = validate_batch_file(
        write(
            tmp_path,
            line("a", body={"model": MODEL, "messages": []}),
            line("b"),
            line("c", body={"model": "alias", "messages": []}),
        ),
        endpoint=CHAT,
        served_models={MODEL, "alias"},
        max_lines=10,
    )
    err = only_error(v)
    assert (err.code, err.param, err.line) == ("mixed_models", "body.model", 3)
    assert v.model == MODEL


def test_empty_file(tmp_path: Path) -> None:
    for content in (b"", b"\n  \n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_bytes(content)
        err = only_error(validate(path))
        assert (err.code, err.line) == ("empty_file", None)


def test_too_many_tasks(tmp_path: Path) -> None:
    v = validate(write(tmp_path, *(line(f"r{i}") for i in range(4))), max_lines=3)
    err = only_error(v)
    assert (err.code, err.line) == ("too_many_tasks", None)
    assert v.total == 4


def test_errors_are_capped_but_all_counted(tmp_path: Path) -> None:
    n = MAX_REPORTED_ERRORS + 50
    v = validate(write(tmp_path, *(["{bad"] * n)))
    assert len(v.errors) == MAX_REPORTED_ERRORS
    assert v.error_count == n
    assert v.errors[-1].line == MAX_REPORTED_ERRORS


def test_utf8_bom_and_unicode_ids_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + line("naïve").encode() + b"\n" + line("日本").encode())
    assert validate(path).ok
    assert [b.custom_id for b in iter_batch_lines(path)] == ["naïve", "日本"]


def test_first_endpoint_is_the_first_supported_url(tmp_path: Path) -> None:
    path = write(
        tmp_path, "junk", line(url="/v1/embeddings"), line(url="/v1/completions"), line(url=CHAT)
    )
    assert first_endpoint(path, (CHAT, "/v1/completions")) == "/v1/completions"
    assert first_endpoint(write(tmp_path, "junk"), (CHAT,)) is None


def test_validation_streams_in_constant_memory(tmp_path: Path) -> None:
    """A file of ~20 MB is validated with far less than its size in peak Python memory."""
    path = tmp_path / "big.jsonl"
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    with open(path, "w") as f:
        f.writelines(line(f"r{i}", body=big) + "\n" for i in range(10_000))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        v = validate(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert v.ok and v.total == 10_000
    assert peak < size / 10, (peak, size)
