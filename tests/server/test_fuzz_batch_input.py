"""Property tests (hypothesis) for the JSONL validator: any bytes at all, and batch lines mutated
in every field, give exactly one verdict per non-blank line, in order, with its line number and
one of the documented codes; never an exception, never a custom_id accepted twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.batch_input import (
    BadLine,
    BatchLine,
    BatchScan,
    iter_batch_lines,
    validate_batch_file,
)

ENDPOINT = "/v1/chat/completions"
SERVED = {"smollm2-135m-instruct", "alias"}
CODES = {
    "invalid_json_line",
    "missing_required_parameter",
    "invalid_url",
    "invalid_request",
    "duplicate_custom_id",
    "streaming_unsupported",
    "model_not_found",
    "mixed_models",
}
EXAMPLES = 300

# text includes unpaired surrogates: JSON can carry them ("\ud800"), UTF-8 cannot
texts = st.text(
    alphabet=st.characters() | st.sampled_from(["\ud800", "\udfff", "\ufeff"]), max_size=8
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
custom_ids = st.one_of(
    st.sampled_from(["a", "b", "c", "a\u0301", "\ud800"]), texts, texts, json_values
)
valid_bodies = st.fixed_dictionaries(
    {"messages": st.just([{"role": "user", "content": "hi"}])},
    optional={
        "model": st.one_of(st.sampled_from([*sorted(SERVED), "gpt-4", ""]), st.none(), texts),
        "stream": st.one_of(st.booleans(), st.none(), json_values),
        "max_tokens": json_values,
        "temperature": json_values,
    },
)
bodies = st.one_of(valid_bodies, valid_bodies, json_values)
random_lines = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": custom_ids,
        "method": st.one_of(st.just("POST"), st.sampled_from(["GET", "post"]), json_values),
        "url": st.one_of(st.just(ENDPOINT), st.sampled_from(["/v1/completions", ""]), json_values),
        "body": bodies,
        "extra": json_values,
    },
)


@st.composite
def mutated_lines(draw: st.DrawFn) -> dict[str, Any]:
    """A valid line with at most one field changed or dropped: deep paths get exercised."""
    line: dict[str, Any] = {
        "custom_id": draw(custom_ids),
        "method": "POST",
        "url": ENDPOINT,
        "body": draw(bodies),
    }
    if draw(st.integers(0, 2)) == 0:
        key = draw(st.sampled_from(["custom_id", "method", "url", "body"]))
        if draw(st.booleans()):
            del line[key]
        else:
            line[key] = draw(json_values)
    return line


batch_lines = st.one_of(mutated_lines(), mutated_lines(), random_lines)


def _encode(obj: Any, style: int) -> bytes:
    text = json.dumps(obj, ensure_ascii=style % 2 == 0)
    raw = text.encode("utf-8", "surrogatepass")
    return [raw, b"\xef\xbb\xbf" + raw, raw + b"  \r", b" \t" + raw][style % 4]


lines = st.one_of(
    st.tuples(batch_lines, st.integers(0, 7)).map(lambda t: _encode(*t)),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"", b"   ", b"\r", b"{", b"null", b"[]", b'"x"', b"\xff\xfe", b"{}"]),
)
files = st.lists(lines, max_size=12).map(lambda ls: b"\n".join(ls) + b"\n")


def _write(tmp: Path, data: bytes) -> Path:
    path = tmp / "input.jsonl"
    path.write_bytes(data)
    return path


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=files)
def test_every_line_gets_exactly_one_verdict(tmp_path: Path, data: bytes) -> None:
    path = _write(tmp_path, data)
    nonblank = [n for n, raw in enumerate(data.split(b"\n")[:-1], start=1) if raw.strip()]
    scan = BatchScan(endpoint=ENDPOINT, served_models=SERVED)
    verdicts = list(scan.scan(path))
    numbers = [v.error.line if isinstance(v, BadLine) else v.line for v in verdicts]
    assert numbers == nonblank and scan.total == len(nonblank)
    accepted = [v for v in verdicts if isinstance(v, BatchLine)]
    assert len({v.custom_id for v in accepted}) == len(accepted)  # never one custom_id twice
    for v in verdicts:
        if isinstance(v, BadLine):
            assert v.error.code in CODES and v.error.message
        else:
            assert isinstance(v.custom_id, str) and isinstance(v.body, dict)
            v.custom_id.encode("utf-8")  # stored in SQL and written to files as UTF-8
            json.dumps(v.body, ensure_ascii=False).encode("utf-8")
            assert v.body.get("stream") in (None, False)
            assert v.body.get("model") in (None, *SERVED)
    models = {v.body["model"] for v in accepted if v.body.get("model") is not None}
    assert len(models) <= 1  # one model per file

    result = validate_batch_file(path, endpoint=ENDPOINT, served_models=SERVED, max_lines=8)
    bad = sum(isinstance(v, BadLine) for v in verdicts)
    file_level = int(not nonblank) + int(len(nonblank) > 8)
    assert result.total == len(nonblank) and result.error_count == bad + file_level
    assert all(e.code in CODES | {"empty_file", "too_many_tasks"} for e in result.errors)
    if result.ok:  # what the worker then reads back is exactly what was accepted
        assert [(b.line, b.custom_id) for b in iter_batch_lines(path)] == [
            (b.line, b.custom_id) for b in accepted
        ]


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ids=st.lists(st.text(max_size=4), min_size=1, max_size=10))
def test_duplicate_custom_ids_are_reported_on_every_later_line(
    tmp_path: Path, ids: list[str]
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    data = b"".join(
        json.dumps(
            {"custom_id": i, "method": "POST", "url": ENDPOINT, "body": body}, ensure_ascii=False
        ).encode("utf-8", "surrogatepass")
        + b"\n"
        for i in ids
    )
    verdicts = list(BatchScan(endpoint=ENDPOINT, served_models=SERVED).scan(_write(tmp_path, data)))
    seen: set[str] = set()
    for cid, verdict in zip(ids, verdicts):
        if cid in seen:
            assert isinstance(verdict, BadLine) and verdict.error.code == "duplicate_custom_id"
        else:
            assert isinstance(verdict, BatchLine) and verdict.custom_id == cid
        seen.add(cid)


def test_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path: Path) -> None:
    """Found by the property above: `"custom_id": "\\ud800"` passed validation, then SQL could not
    store the id and the worker failed the whole batch."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    good = {"custom_id": "ok \U0001f600", "method": "POST", "url": ENDPOINT, "body": body}
    bad = {**good, "custom_id": "x\ud800"}
    data = (json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode()
    result = validate_batch_file(
        _write(tmp_path, data), endpoint=ENDPOINT, served_models=SERVED, max_lines=10
    )
    assert [(e.code, e.line) for e in result.errors] == [("invalid_json_line", 2)]
