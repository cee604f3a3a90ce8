"""The one path from batch lines to output/error records, shared by `blendserve run` and the worker.

Lines are converted lazily while the engine pulls them, so with the fcfs policy only the requests
in flight are held in memory; a line the endpoint rejects becomes an error record at once and
never reaches the engine. Results come out as requests finish, not in input order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.openai_adapter import to_engine_request, to_response_body
from runtime.types import EngineRequest, RequestError, RequestOutput
from server.batch_input import BatchLine
from server.batch_output import request_error_line, success_line

if TYPE_CHECKING:
    from runtime.engine import Engine


@dataclass(frozen=True, slots=True)
class LineResult:
    custom_id: str
    line: int  # 1-based line of the input file
    ok: bool  # True: `record` is an output-file line; False: an error-file line
    record: dict[str, Any]  # the full output or error JSONL object
    input_tokens: int = 0  # prompt tokens (0 for a request that did not run)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0  # generated tokens over all choices


@dataclass(frozen=True, slots=True)
class _InFlight:
    custom_id: str
    line: int


def run_lines(
    lines: Iterable[BatchLine],
    engine: Engine,
    *,
    endpoint: str,
    policy: str,
    should_stop: Callable[[], bool] | None = None,
    finished: list[tuple[EngineRequest, RequestOutput]] | None = None,
) -> Iterator[LineResult]:
    """Run every line through the engine and yield one LineResult per line as it finishes.

    With `should_stop` True the engine stops admitting: lines it never yielded were never run
    and get no LineResult (the caller writes batch_cancelled / batch_expired lines for them).
    `finished`, when given, collects (request, output) of every request the engine ran (for
    the plan report).
    """
    model = engine.model_name
    in_flight: dict[str, _InFlight] = {}  # engine request id (the line number) -> where it came from
    sent: dict[str, EngineRequest] = {}  # the requests themselves, when `finished` wants them
    rejected: deque[LineResult] = deque()  # refused before reaching the engine, not yet yielded

    def requests() -> Iterator[EngineRequest]:
        for item in lines:
            request = engine_request(item, engine, endpoint, str(item.line))
            if isinstance(request, LineResult):
                rejected.append(request)
                continue
            in_flight[request.id] = _InFlight(item.custom_id, item.line)
            if finished is not None:
                sent[request.id] = request
            yield request

    for output in engine.generate(requests(), policy=policy, should_stop=should_stop):
        while rejected:
            yield rejected.popleft()
        origin = in_flight.pop(output.id)
        if finished is not None:
            finished.append((sent.pop(output.id), output))
        yield line_result(origin.custom_id, origin.line, output, endpoint, model)
    while rejected:
        yield rejected.popleft()


def engine_request(
    item: BatchLine, engine: Engine, endpoint: str, request_id: str
) -> EngineRequest | LineResult:
    """The line as an engine request, or the error record of a line the engine cannot run."""
    model = engine.model_name
    request = to_engine_request(
        request_id, endpoint, _served(item.body, model), engine.tokenizer,
        served_model=model, max_model_len=engine.max_model_len,
    )
    if not isinstance(request, RequestError):
        problem = engine.check(request)
        if problem is None:
            return request
        request = problem
    return _error(item.custom_id, item.line, request)


def _served(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The body with `model` resolved to the engine's name: batch_input already checked the
    file's model against every name the server answers to (e.g. BLENDSERVE_MODEL's spec
    besides the engine's name), so an accepted alias must not be refused here."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != model:
        return {**body, "model": model}
    return body


def line_result(
    custom_id: str, line: int, output: RequestOutput, endpoint: str, model: str
) -> LineResult:
    """The output or error record of a request the engine finished."""
    if output.error is not None:
        return _error(custom_id, line, output.error)
    body = to_response_body(endpoint, output, model=model, created=int(time.time()))
    return LineResult(
        custom_id=custom_id,
        line=line,
        ok=True,
        record=success_line(custom_id, body),
        input_tokens=output.prompt_tokens,
        cached_tokens=output.cached_tokens,
        output_tokens=output.completion_tokens,
    )


def _error(custom_id: str, line: int, error: RequestError) -> LineResult:
    """A failed request counts no tokens, as OpenAI bills none for it."""
    return LineResult(custom_id, line, False, request_error_line(custom_id, error))
