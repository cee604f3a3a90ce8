"""`blendserve run INPUT.jsonl -o OUTPUT.jsonl`: a batch file through the engine, no server.

Our answer to `vllm run-batch`: the same validation codes and pipeline as the Batch API, one bad
line never aborts the run (it becomes an error line), results are written and flushed as each
request finishes, and memory stays flat in the number of lines (with the fcfs policy; dfs and
blend plan over all prompts first). Exit codes: 0 ran (some lines may have failed), 2 could not
start (missing or empty input, unusable paths, a model that does not load), 130 interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from runtime.openai_adapter import CHAT, ENDPOINTS
from runtime.types import RequestError
from server.batch_input import BadLine, BatchLine, BatchScan, count_nonblank_lines, first_endpoint
from server.batch_output import encode_line, request_error_line
from server.config import Settings
from server.pipeline import run_lines

if TYPE_CHECKING:
    from runtime.engine import Engine


class _Fatal(Exception):
    """A problem that stops the run before it starts (exit code 2, message on stderr)."""


def run_main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except _Fatal as exc:
        print(f"blendserve run: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # 1. Check the paths and find the endpoint before paying for the model.
    source = Path(args.input)
    if not source.is_file():
        raise _Fatal(f"no such input file: {source}")
    output = Path(args.output)
    errors = Path(args.errors) if args.errors else output.with_name(output.stem + ".errors.jsonl")
    for path in (output, errors):
        if not path.parent.is_dir():
            raise _Fatal(f"no such directory for {path}")
    if len({source.resolve(), output.resolve(), errors.resolve()}) < 3:
        raise _Fatal("the input, output and error files must be three different paths")
    total = count_nonblank_lines(source)
    if total == 0:
        raise _Fatal(f"empty_file: {source} has no request lines")
    endpoint = first_endpoint(source, ENDPOINTS)
    if endpoint is None:
        endpoint = CHAT
        print(f"blendserve run: warning: no line names a supported url {ENDPOINTS}; every line "
              "will be an invalid_url error", file=sys.stderr)

    # 2. Load the model and build the engine.
    try:
        settings = Settings()
    except ValueError as exc:  # pydantic's ValidationError: a bad BLENDSERVE_* variable
        raise _Fatal(f"bad BLENDSERVE_* settings: {exc}") from exc
    spec = args.model or settings.model
    engine = _make_engine(spec, settings, args)
    report_path = Path(args.report) if args.report else None
    if report_path is not None and not report_path.parent.is_dir():
        raise _Fatal(f"no such directory for {report_path}")
    finished: list[Any] | None = [] if report_path is not None else None

    # 3. Stream lines through validation and the pipeline; write each result as it finishes.
    stop = _StopFlag()
    # Bodies may name the engine's model or the spec it was loaded from (like the worker).
    scan = BatchScan(endpoint=endpoint, served_models={engine.model_name, spec})
    with ExitStack() as stack:
        try:
            out_f = stack.enter_context(open(output, "wb"))
            err_f = stack.enter_context(open(errors, "wb"))
        except OSError as exc:
            raise _Fatal(f"cannot write results: {exc}") from exc
        progress = stack.enter_context(_Progress(total))
        stack.enter_context(stop)

        def good_lines() -> Iterator[BatchLine]:
            for item in scan.scan(source):
                if isinstance(item, BatchLine):
                    yield item
                else:
                    err_f.write(encode_line(_bad_line_record(item)))
                    err_f.flush()
                    progress.add(ok=False, result=None)

        for result in run_lines(good_lines(), engine, endpoint=endpoint, policy=args.policy,
                                should_stop=stop.is_set, finished=finished):
            f = out_f if result.ok else err_f
            f.write(encode_line(result.record))
            f.flush()
            progress.add(ok=result.ok, result=result)
    if progress.failed == 0:
        errors.unlink(missing_ok=True)  # as the Batch API: no error file when nothing failed

    # 4. One summary line, and the plan report when asked for.
    print(progress.summary(output, errors if progress.failed else None, stopped=stop.is_set()),
          file=sys.stderr)
    if report_path is not None and finished is not None:
        from server.plan_report import build_report, write_report

        report = build_report(engine, args.policy, finished,
                              wall_seconds=time.monotonic() - progress.started)
        write_report(report, report_path, engine)
        print(f"blendserve run: plan report: {report_path}", file=sys.stderr)
    return 130 if stop.is_set() else 0


def _make_engine(spec: str, settings: Settings, args: argparse.Namespace) -> Engine:
    from server.engine_setup import EngineSetup, build_engine  # late: `--help` stays fast

    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise _Fatal("--max-step-tokens must be at least 1")
    if args.kv_memory is not None and args.kv_memory < 1:
        raise _Fatal("--kv-memory must be a positive number of bytes")
    setup = EngineSetup(model=spec, max_batch_tokens=args.max_batch_tokens,
                        kv_memory_bytes=args.kv_memory, device=args.device)
    try:
        return build_engine(settings, setup)
    except (OSError, ValueError, KeyError) as exc:
        raise _Fatal(f"cannot load model {spec!r}: {exc}") from exc


def profile_main(args: argparse.Namespace) -> int:
    """`blendserve profile`: measure the served model's step time here and write the profile
    (`--if-missing`: only where the cache holds no current one, as `make install` does, so that
    neither the first `run` nor the first batch pays for it)."""
    import json

    from runtime.host_load import disturbance
    from runtime.profile import cached_profile_path, load_or_measure, measure, write_profile
    from server.engine_setup import EngineSetup, build_engine

    try:
        settings = Settings()
        engine = build_engine(settings, EngineSetup(model=args.model, device=args.device),
                              with_profile=False)
    except (OSError, ValueError, KeyError) as exc:
        print(f"blendserve profile: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else cached_profile_path(settings.data_dir, engine)
    dtype = str(engine.dtype).removeprefix("torch.")
    what = f"{engine.model_name} on {engine.model.device} ({dtype})"
    if args.if_missing and not args.out:
        print(f"blendserve profile: {what}: the cached profile if current, else measured now ...",
              file=sys.stderr)
        profile, out, fresh = load_or_measure(engine, settings.data_dir)
        if not fresh:
            print(f"blendserve profile: {out} is current; kept", file=sys.stderr)
            return 0
    else:
        print(f"blendserve profile: measuring {what} ...", file=sys.stderr)
        profile = measure(engine)
        write_profile(out, profile)
    fit = profile["fit"]
    if warning := disturbance(fit, "blendserve profile: warning: this profile"):
        print(warning, file=sys.stderr)
    print(json.dumps({"profile": str(out), **profile["step_model"],
                      "fit_error": round(fit["mean_abs_rel_error"], 3),
                      "calibration_error": round(fit["calibration_mean_abs_rel_error"], 3),
                      "other_load": fit["other_load"],
                      "seconds": round(profile["seconds"], 1)}))
    return 0


def _bad_line_record(bad: BadLine) -> dict[str, Any]:
    """A line that failed file validation, as the 400 the endpoint would have answered; the
    message names the line because such a line may have no usable custom_id."""
    e = bad.error
    error = RequestError(message=f"Line {e.line}: {e.message}", param=e.param, code=e.code)
    return request_error_line(bad.custom_id, error)


class _Progress:
    """Counts results; draws a tqdm bar (requests, output tokens/s, ETA) on a terminal only."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.ok = self.failed = 0
        self.input_tokens = self.cached_tokens = self.output_tokens = 0
        self.started = time.monotonic()
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", file=sys.stderr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def add(self, *, ok: bool, result: Any) -> None:
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        if result is not None:
            self.input_tokens += result.input_tokens
            self.cached_tokens += result.cached_tokens
            self.output_tokens += result.output_tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self.tokens_per_s():.1f} tok/s, {self.failed} failed",
                                      refresh=False)

    def tokens_per_s(self) -> float:
        return self.output_tokens / max(time.monotonic() - self.started, 1e-9)

    def summary(self, output: Path, errors: Path | None, *, stopped: bool) -> str:
        seconds = time.monotonic() - self.started
        not_run = self.total - self.ok - self.failed
        parts = [
            f"blendserve run: {self.ok} succeeded, {self.failed} failed"
            + (f", {not_run} not run (interrupted)" if stopped else "")
            + f" of {self.total} requests in {seconds:.1f}s",
            f"{self.input_tokens} prompt tokens ({self.cached_tokens} cached)",
            f"{self.output_tokens} output tokens ({self.tokens_per_s():.1f} tok/s)",
            f"output: {output}" + (f", errors: {errors}" if errors else ""),
        ]
        return "; ".join(parts)


class _StopFlag:
    """First Ctrl-C: stop admitting, finish what runs, write it; a second one aborts."""

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def __enter__(self) -> Self:
        self._previous = signal.getsignal(signal.SIGINT)

        def handler(signum: int, frame: Any) -> None:
            if self._set:
                raise KeyboardInterrupt
            self._set = True
            print("\nblendserve run: stopping after the running requests (Ctrl-C again to "
                  "abort)", file=sys.stderr)

        try:
            signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread (e.g. called from a test runner's thread)
            self._previous = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

