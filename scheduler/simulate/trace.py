"""Trace files for the simulator: one request per JSONL line with its true output length.

`{"id": str, "prompt_token_ids": [int, …], "output_len": int}`, optionally `"max_tokens"` (the
output cap the planner may know; default DEFAULT_MAX_TOKENS) and `"ignore_eos": true` (the output
length is known in advance, as with fixed-length generation). The planner gets a PlanRequest that
carries no output length unless ignore_eos says it is known; only execution reads `output_len`.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from scheduler.errors import PlanningError
from scheduler.types import PlanRequest

DEFAULT_MAX_TOKENS = 32768  # the cap a trace line gets when it names none


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """A request to plan and the output length it will really produce."""

    request: PlanRequest  # prompt ids held as array('i'): 4 bytes a token, a real Sequence
    output_len: int  # true output length, >= 1


def parse_line(line: str, lineno: int = 0) -> TraceEntry:
    try:
        obj = json.loads(line)
        rid = str(obj["id"])
        ids = array("i", obj["prompt_token_ids"])
        out = int(obj["output_len"])
        cap = int(obj.get("max_tokens") or max(DEFAULT_MAX_TOKENS, out))
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise PlanningError(f"trace line {lineno}: {exc}") from exc
    if not ids or out < 1 or out > cap:
        raise PlanningError(f"trace line {lineno}: empty prompt or output_len outside [1, max_tokens]")
    known = out if obj.get("ignore_eos") else None
    return TraceEntry(PlanRequest(rid, ids, cap, known), out)


def iter_trace(lines: Iterable[str]) -> Iterator[TraceEntry]:
    for n, line in enumerate(lines, 1):
        if line.strip():
            yield parse_line(line, n)


def read_trace(path: str | Path) -> list[TraceEntry]:
    """All entries of a trace file; ids must be unique."""
    with open(path) as f:
        entries = list(iter_trace(f))
    if len({e.request.id for e in entries}) != len(entries):
        raise PlanningError(f"trace {path}: duplicate request ids")
    return entries
