"""The per-request journal (`batch_results`): each finished request is recorded with the batch's
live counts and usage in one transaction, read back on resume, and turned into the output and
error files at the end. Finished work lives here, so a crash can only lose what was in flight."""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from server.models import BatchResultRow, BatchRow, BatchShardRow, FileRow
from server.storage import FileStorage

if TYPE_CHECKING:
    from server.pipeline import LineResult

log = logging.getLogger(__name__)

NEVER_RAN_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}

Sessions = sessionmaker[Session]


def record(sessions: Sessions, batch_id: str, worker_id: str, r: LineResult, *, now: float,
           shard: int | None = None) -> bool:
    """Journal one finished request with counts, usage and heartbeat; False if the claim is gone.

    The UPDATE only matches while `worker_id` still owns the batch (or, for a shard, the shard
    while its batch still runs), so a worker whose claim was taken over cannot write; the
    primary key refuses a custom_id that is already journaled (the counts then stay as they
    were).
    """
    with sessions() as s:
        try:
            s.add(
                BatchResultRow(
                    batch_id=batch_id,
                    custom_id=r.custom_id,
                    line=r.line,
                    ok=r.ok,
                    record=json_text(r.record),
                    input_tokens=r.input_tokens,
                    cached_tokens=r.cached_tokens,
                    output_tokens=r.output_tokens,
                    created_at=int(now),
                )
            )
            s.flush()
            if shard is None:
                claim = sa.and_(BatchRow.id == batch_id, BatchRow.worker_id == worker_id)
            else:
                claim = sa.and_(BatchRow.id == batch_id,
                                BatchRow.status.in_(["in_progress", "cancelling"]))
                held = s.execute(
                    sa.update(BatchShardRow)
                    .where(BatchShardRow.batch_id == batch_id, BatchShardRow.shard == shard,
                           BatchShardRow.worker_id == worker_id)
                    .values(heartbeat_at=time.time())
                ).rowcount  # type: ignore[attr-defined]  # a CursorResult for UPDATE
                if held != 1:
                    claim = sa.false()
            owned = s.execute(
                sa.update(BatchRow)
                .where(claim)
                .values(
                    completed=BatchRow.completed + int(r.ok),
                    failed=BatchRow.failed + int(not r.ok),
                    input_tokens=BatchRow.input_tokens + r.input_tokens,
                    cached_tokens=BatchRow.cached_tokens + r.cached_tokens,
                    output_tokens=BatchRow.output_tokens + r.output_tokens,
                    **({"heartbeat_at": time.time()} if shard is None else {}),
                )
            ).rowcount  # type: ignore[attr-defined]  # a CursorResult for UPDATE
            if owned != 1:
                s.rollback()
                log.warning("batch %s: claim lost, dropping result %s", batch_id, r.custom_id)
                return False
            s.commit()
        except IntegrityError:
            s.rollback()
            log.warning("batch %s: %s was already journaled", batch_id, r.custom_id)
    return True


def done_ids(sessions: Sessions, batch_id: str) -> set[str]:
    """custom_ids already journaled: a resumed run skips them."""
    with sessions() as s:
        return set(
            s.scalars(
                sa.select(BatchResultRow.custom_id).where(BatchResultRow.batch_id == batch_id)
            )
        )


def done_count(sessions: Sessions, batch_id: str) -> int:
    with sessions() as s:
        return s.scalar(sa.select(sa.func.count()).where(BatchResultRow.batch_id == batch_id)) or 0


def write_files(
    sessions: Sessions,
    storage: FileStorage,
    batch: BatchRow,
    *,
    never_ran_code: str | None,
    now: Callable[[], float],
) -> tuple[FileRow | None, FileRow | None]:
    """Write the output file (successes) and error file (failures, then never-ran lines merged in
    input order); None for a file that would be empty. The caller inserts the returned rows.

    File ids derive from the batch id, so a finalize interrupted by a crash rewrites the same files
    instead of leaving orphans.
    """
    with sessions() as s:
        rows = s.execute(
            sa.select(BatchResultRow.ok, sa.func.count())
            .where(BatchResultRow.batch_id == batch.id)
            .group_by(BatchResultRow.ok)
        ).all()
    counts: dict[bool, int] = {bool(ok): int(n) for ok, n in rows}
    n_ok, n_failed = counts.get(True, 0), counts.get(False, 0)
    n_never_ran = max(batch.total - n_ok - n_failed, 0) if never_ran_code else 0
    output = error = None
    if n_ok:
        output = _store(storage, batch, "output", _journal_lines(sessions, batch.id, ok=True), now)
    if n_failed or n_never_ran:
        lines: Iterable[tuple[int, str]] = _journal_lines(sessions, batch.id, ok=False)
        if n_never_ran and never_ran_code:
            never_ran = _never_ran_lines(
                sessions, storage.path(batch.input_file_id), batch.id, never_ran_code
            )
            lines = heapq.merge(lines, never_ran)
        error = _store(storage, batch, "error", lines, now)
    return output, error


def json_text(record: dict[str, Any]) -> str:
    """One JSONL object as text (batch_output's encoding, without the newline)."""
    from server.batch_output import encode_line

    return encode_line(record)[:-1].decode("utf-8")


def _journal_lines(sessions: Sessions, batch_id: str, *, ok: bool) -> Iterator[tuple[int, str]]:
    with sessions() as s:
        rows = s.execute(
            sa.select(BatchResultRow.line, BatchResultRow.record)
            .where(BatchResultRow.batch_id == batch_id, BatchResultRow.ok == ok)
            .order_by(BatchResultRow.line),
            execution_options={"yield_per": 1000},
        )
        yield from ((line, text) for line, text in rows)  # plain tuples for heapq.merge


def _never_ran_lines(
    sessions: Sessions, input_path: Path, batch_id: str, code: str
) -> Iterator[tuple[int, str]]:
    from server.batch_input import iter_batch_lines
    from server.batch_output import never_ran_line

    done = done_ids(sessions, batch_id)
    for line in iter_batch_lines(input_path):
        if line.custom_id not in done:
            yield (
                line.line,
                json_text(never_ran_line(line.custom_id, code, NEVER_RAN_MESSAGES[code])),
            )


def _store(
    storage: FileStorage,
    batch: BatchRow,
    kind: str,
    lines: Iterable[tuple[int, str]],
    now: Callable[[], float],
) -> FileRow:
    file_id = "file-" + hashlib.sha256(f"{batch.id}/{kind}".encode()).hexdigest()[:24]
    size = storage.write(file_id, _chunks(text for _, text in lines))
    created = int(now())
    expires = batch.output_expires_after or {}
    return FileRow(
        id=file_id,
        project=batch.project,
        filename=f"{batch.id}_{kind}.jsonl",
        purpose="batch_output",
        bytes=size,
        created_at=created,
        expires_at=created + int(expires["seconds"]) if expires.get("seconds") else None,
        status="processed",
    )


def _chunks(texts: Iterable[str], size: int = 1 << 16) -> Iterator[bytes]:
    """JSONL lines gathered into ~64 KiB writes."""
    buf: list[bytes] = []
    held = 0
    for text in texts:
        data = text.encode() + b"\n"
        buf.append(data)
        held += len(data)
        if held >= size:
            yield b"".join(buf)
            buf, held = [], 0
    if buf:
        yield b"".join(buf)
