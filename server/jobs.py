"""One batch's life on a worker: validate the input, run the lines not yet journaled, journal each
result as it finishes, then write the output and error files and stamp the terminal status.

Everything a run produces is in SQL the moment it exists (one transaction per finished request:
its `batch_results` row, the live counts, the usage and the heartbeat), so a worker killed at any
point loses only the requests it had in flight, and the next worker resumes with the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from server import journal
from server.config import Settings
from server.models import BatchRow, BatchStatus, FileRow
from server.outage import is_outage
from server.storage import FileStorage

if TYPE_CHECKING:
    from runtime.engine import Engine
    from server.pipeline import LineResult

log = logging.getLogger(__name__)


INTERNAL_ERROR = "The server hit an internal error while running this batch."


class StopReason(StrEnum):
    """Why a run stopped admitting requests before the input ran out."""

    CANCELLED = "cancelled"  # the batch is `cancelling`
    EXPIRED = "expired"  # now > expires_at
    INTERRUPTED = "interrupted"  # worker shutting down or claim lost: the batch stays resumable


@dataclass(frozen=True, slots=True)
class JobContext:
    """What a job needs from its worker; tests build one with their own clock or engine."""

    settings: Settings
    sessions: sessionmaker[Session]
    storage: FileStorage
    engine: Callable[[], Engine]  # the worker's engine, loaded once on first use
    policy: str  # admission policy name for the pipeline
    worker_id: str  # the claim this job writes under; journaling stops if it is lost
    interrupted: Callable[[], bool] = lambda: False  # shutdown asked or claim lost
    now: Callable[[], float] = time.time  # wall clock (unix seconds), injectable for expiry tests
    cancel_poll_seconds: float = 0.5  # how often the run re-reads the status for a cancel
    on_result: Callable[[LineResult], None] = lambda _: None  # each journaled result (metrics)


def run_batch(batch_id: str, ctx: JobContext) -> bool:
    """Drive one claimed batch alone as far as it goes; True when it reached a terminal status.
    (The worker runs batches together: server/shared_run.py; this is that run with one batch.)"""
    from server.shared_run import SharedRun

    return SharedRun(ctx).run(batch_id).get(batch_id, False)


def fail_batch(ctx: JobContext, batch_id: str, message: str) -> None:
    """Mark a batch `failed` after a server-side error; journaled results still reach the files."""
    batch = load_batch(ctx, batch_id)
    if batch is None or BatchStatus(batch.status).is_terminal:
        return
    files: tuple[FileRow | None, FileRow | None] = (None, None)
    if batch.in_progress_at is not None:
        try:
            files = journal.write_files(
                ctx.sessions, ctx.storage, batch, never_ran_code=None, now=ctx.now
            )
        except Exception:
            log.exception("could not write files for failed batch %s", batch_id)
    error = {"code": "server_error", "message": message, "param": None, "line": None}
    active = {s for s in BatchStatus if not s.is_terminal}
    _transition(ctx, batch_id, active, BatchStatus.FAILED, files=files, errors=[error])


# --- validating -------------------------------------------------------------------------------


def validate(ctx: JobContext, batch: BatchRow) -> None:
    from server.batch_input import validate_batch_file

    path = ctx.storage.path(batch.input_file_id)
    with ctx.sessions() as s:
        input_row = s.get(FileRow, batch.input_file_id)
    if input_row is None or not path.exists():
        error = {
            "code": "invalid_request",
            "message": f"Input file {batch.input_file_id} was not found.",
            "param": "file_id",
            "line": None,
        }
        _transition(ctx, batch.id, {BatchStatus.VALIDATING}, BatchStatus.FAILED, errors=[error])
        return
    engine = ctx.engine()
    served = {engine.model_name, ctx.settings.model}
    result = validate_batch_file(
        path, endpoint=batch.endpoint, served_models=served, max_lines=ctx.settings.max_batch_lines
    )
    if not result.ok:
        errors = [
            {"code": e.code, "message": e.message, "param": e.param, "line": e.line}
            for e in result.errors
        ]
        _transition(ctx, batch.id, {BatchStatus.VALIDATING}, BatchStatus.FAILED, errors=errors)
        return
    _transition(
        ctx,
        batch.id,
        {BatchStatus.VALIDATING},
        BatchStatus.IN_PROGRESS,
        total=result.total,
        model=batch.model or result.model,
    )


# --- in_progress ------------------------------------------------------------------------------


class StopCheck:
    """The pipeline's `should_stop`: cheap clock checks every call, a status read every ~0.5 s."""

    def __init__(self, ctx: JobContext, batch_id: str, expires_at: int | None,
                 shard: int | None = None) -> None:
        self.ctx, self.batch_id, self.expires_at, self.shard = ctx, batch_id, expires_at, shard
        self.reason: StopReason | None = None
        self._next_poll = 0.0

    def __call__(self) -> bool:
        if self.reason is None:
            self.reason = self._check()
        return self.reason is not None

    def _check(self) -> StopReason | None:
        if self.ctx.interrupted():
            return StopReason.INTERRUPTED
        if self.expires_at is not None and self.ctx.now() > self.expires_at:
            return StopReason.EXPIRED
        if time.monotonic() < self._next_poll:
            return None
        self._next_poll = time.monotonic() + self.ctx.cancel_poll_seconds
        try:
            batch = load_batch(self.ctx, self.batch_id)
        except Exception as e:
            if not is_outage(e):
                raise
            return None  # the database is down: no news is no cancel; journaling waits for it
        if batch is None or batch.status == BatchStatus.CANCELLING:
            return StopReason.CANCELLED
        if self.shard is None:
            holder = batch.worker_id
        else:
            from server.shards import owner

            holder = owner(self.ctx.sessions, self.batch_id, self.shard)
        if batch.status != BatchStatus.IN_PROGRESS or holder != self.ctx.worker_id:
            return StopReason.INTERRUPTED  # someone else moved or took the batch (or shard)
        return None


def write_report(ctx: JobContext, batch_id: str, engine: Engine, finished: list[Any],
                  seconds: float) -> None:
    """The plan report of this run (of what ran in it, after a resume); never fails the batch."""
    from server.plan_report import build_report, report_path, write_report

    try:
        report = build_report(engine, ctx.policy, finished, wall_seconds=seconds)
        write_report({"batch_id": batch_id, **report}, report_path(ctx.settings.data_dir, batch_id),
                     engine)
    except Exception:
        log.exception("batch %s: could not write the plan report", batch_id)


# --- finalizing -------------------------------------------------------------------------------


def finish(ctx: JobContext, batch: BatchRow) -> bool:
    """Pick the terminal status for a batch whose run is over, write its files, stamp it."""
    if batch.status == BatchStatus.CANCELLING:
        return _finalize(ctx, batch, BatchStatus.CANCELLED, {BatchStatus.CANCELLING})
    if batch.status == BatchStatus.IN_PROGRESS:
        if journal.done_count(ctx.sessions, batch.id) < batch.total:
            if batch.expires_at is not None and ctx.now() > batch.expires_at:
                return _finalize(ctx, batch, BatchStatus.EXPIRED, {BatchStatus.IN_PROGRESS})
            missing = batch.total - journal.done_count(ctx.sessions, batch.id)
            raise RuntimeError(f"pipeline returned without {missing} requests and no stop reason")
        if not _transition(ctx, batch.id, {BatchStatus.IN_PROGRESS}, BatchStatus.FINALIZING):
            fresh = load_batch(ctx, batch.id)  # a cancel raced with the last request
            assert fresh is not None
            return BatchStatus(fresh.status).is_terminal or finish(ctx, fresh)
        batch = load_batch(ctx, batch.id)  # type: ignore[assignment]
    if batch.status == BatchStatus.FINALIZING:
        return _finalize(ctx, batch, BatchStatus.COMPLETED, {BatchStatus.FINALIZING})
    return BatchStatus(batch.status).is_terminal


def _finalize(
    ctx: JobContext, batch: BatchRow, final: BatchStatus, from_statuses: set[BatchStatus]
) -> bool:
    never_ran = {BatchStatus.CANCELLED: "batch_cancelled", BatchStatus.EXPIRED: "batch_expired"}
    files = journal.write_files(
        ctx.sessions, ctx.storage, batch, never_ran_code=never_ran.get(final), now=ctx.now
    )
    if _transition(ctx, batch.id, from_statuses, final, files=files):
        log.info("batch %s %s", batch.id, final.value)
        return True
    fresh = load_batch(ctx, batch.id)
    return fresh is None or BatchStatus(fresh.status).is_terminal


# --- SQL helpers ------------------------------------------------------------------------------


def load_batch(ctx: JobContext, batch_id: str) -> BatchRow | None:
    with ctx.sessions() as s:
        batch = s.get(BatchRow, batch_id)
        if batch is not None:
            s.expunge(batch)
        return batch


_STAMPS = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


def _transition(
    ctx: JobContext,
    batch_id: str,
    from_statuses: set[BatchStatus],
    to: BatchStatus,
    *,
    files: tuple[FileRow | None, FileRow | None] = (None, None),
    **values: Any,
) -> bool:
    """Move the batch to `to` (stamping its `*_at`) only if it is still in `from_statuses`.

    The files' rows land in the same transaction, so a batch never points at a missing row.
    """
    values = {"status": to.value, _STAMPS[to]: int(ctx.now()), **values}
    output, error = files
    if output is not None:
        values["output_file_id"] = output.id
    if error is not None:
        values["error_file_id"] = error.id
    with ctx.sessions() as s, s.begin():
        moved = s.execute(
            sa.update(BatchRow)
            .where(BatchRow.id == batch_id, BatchRow.status.in_([f.value for f in from_statuses]))
            .values(**values)
        ).rowcount  # type: ignore[attr-defined]  # a CursorResult for UPDATE
        if moved != 1:
            return False
        for row in files:
            if row is not None:
                s.merge(row)
        if to.is_terminal:  # its webhook event commits with the status, or not at all
            from server.webhooks import record_event

            record_event(s, ctx.settings, batch_id, to, created_at=values[_STAMPS[to]])
    return True
