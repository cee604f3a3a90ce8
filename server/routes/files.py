"""/v1/files: upload (streamed), list, retrieve, content (streamed), delete.

Deleting a file that a batch still reads (validating, in_progress, finalizing, cancelling) is
refused with 409: the worker would otherwise lose its input mid-run or on resume."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session, sessionmaker

from server.auth import ProjectDep
from server.errors import APIError, bad_request, not_found
from server.ids import new_file_id
from server.models import ACTIVE_STATUSES, BatchRow, FileRow
from server.routes.deps import SessionDep, SettingsDep, StorageDep
from server.routes.pagination import page
from server.routes.upload import UploadLimits, receive_upload, too_many_lines
from server.schemas import ErrorEnvelope, FileDeleted, FileList, FileObject
from server.storage import FileStorage

router = APIRouter(prefix="/v1/files", tags=["files"])

UPLOAD_PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
BATCH_FILE_TTL_S = 30 * 24 * 3600
MIN_TTL_S, MAX_TTL_S = 3600, 2_592_000
CHUNK = 1024 * 1024

_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {
                            "type": "integer",
                            "minimum": MIN_TTL_S,
                            "maximum": MAX_TTL_S,
                        },
                    },
                }
            }
        },
    }
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorEnvelope} for code in (400, 401, 404)
}


def lookup_file(session: SessionDep, project: str, file_id: str, *, param: str = "id") -> FileRow:
    """The project's file, or 404: another project's file is indistinguishable from none."""
    row = session.get(FileRow, file_id)
    if row is None or row.project != project or _expired(row, int(time.time())):
        err = not_found("File", file_id)
        err.param = param
        raise err
    return row


def stored_filename(name: str) -> str:
    """The last path component under either separator, without control characters, at most 255
    characters: a name is metadata, never a path (Windows clients save `a\\..\\b` as a path)."""
    base = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    clean = "".join(c for c in base if c.isprintable())[:255]
    return clean if clean not in ("", ".", "..") else "upload"


def _expires_at(fields: dict[str, str], purpose: str, created_at: int) -> int | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return created_at + BATCH_FILE_TTL_S if purpose == "batch" else None
    if anchor != "created_at":
        raise bad_request(
            "Invalid 'expires_after[anchor]': the only anchor is 'created_at'.",
            param="expires_after[anchor]",
            code="invalid_value",
        )
    try:
        ttl = int(seconds or "")
    except ValueError:
        raise bad_request(
            "Invalid 'expires_after[seconds]': expected an integer.",
            param="expires_after[seconds]",
            code="invalid_type",
        ) from None
    if not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise bad_request(
            f"Invalid 'expires_after[seconds]': must be between {MIN_TTL_S} and {MAX_TTL_S}.",
            param="expires_after[seconds]",
            code="invalid_value",
        )
    return created_at + ttl


@router.post(
    "",
    response_model=FileObject,
    openapi_extra=_UPLOAD_BODY,
    responses={**_ERRORS, 413: {"model": ErrorEnvelope}},
)
async def upload_file(
    request: Request, project: ProjectDep, settings: SettingsDep, storage: StorageDep
) -> FileObject:
    """Upload a file (multipart: `file`, `purpose`, optional `expires_after[...]`)."""
    file_id = new_file_id()
    limits = UploadLimits(
        max_bytes=settings.max_file_bytes, max_batch_lines=settings.max_batch_lines
    )
    with storage.writer(file_id) as pending:
        got = await receive_upload(request, pending, limits)
        purpose = got.fields.get("purpose")
        if purpose is None:
            raise bad_request(
                "Missing required parameter: 'purpose'.",
                param="purpose",
                code="missing_required_parameter",
            )
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(
                f"Invalid value for 'purpose': '{purpose}'. Supported values are: "
                + ", ".join(f"'{p}'" for p in UPLOAD_PURPOSES)
                + ".",
                param="purpose",
                code="invalid_value",
            )
        if got.filename is None:
            raise bad_request(
                "Missing required parameter: 'file'.",
                param="file",
                code="missing_required_parameter",
            )
        filename = stored_filename(got.filename)
        if purpose == "batch":
            if not filename.lower().endswith(".jsonl"):
                raise bad_request(
                    "Invalid file format for Batch API. Must be .jsonl",
                    param="file",
                    code="invalid_file_format",
                )
            if got.lines > settings.max_batch_lines:
                raise too_many_lines(settings.max_batch_lines)
        created_at = int(time.time())
        row = FileRow(
            id=file_id,
            project=project,
            filename=filename,
            purpose=purpose,
            bytes=got.bytes,
            created_at=created_at,
            expires_at=_expires_at(got.fields, purpose, created_at),
            status="processed",
        )
        await run_in_threadpool(pending.commit)
    try:
        await run_in_threadpool(_insert, request, row)
    except BaseException:
        storage.delete(file_id)
        raise
    return FileObject.from_row(row)


def _insert(request: Request, row: FileRow) -> None:
    with request.app.state.sessions() as session, session.begin():
        session.add(row)


@router.get("", response_model=FileList, responses=_ERRORS)
def list_files(
    session: SessionDep,
    project: ProjectDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> FileList:
    """List this project's files, newest first by default."""
    now = int(time.time())
    filters = [or_(FileRow.expires_at.is_(None), FileRow.expires_at > now)]
    if purpose is not None:
        filters.append(FileRow.purpose == purpose)
    rows, has_more = page(
        session, FileRow, project, *filters, after=after, limit=limit, order=order
    )
    return FileList.of([FileObject.from_row(r) for r in rows], has_more)


@router.get("/{file_id}", response_model=FileObject, responses=_ERRORS)
def retrieve_file(file_id: str, session: SessionDep, project: ProjectDep) -> FileObject:
    return FileObject.from_row(lookup_file(session, project, file_id))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            }
        },
        **_ERRORS,
    },
)
def file_content(
    file_id: str, session: SessionDep, project: ProjectDep, storage: StorageDep
) -> StreamingResponse:
    """The file's bytes, streamed in 1 MiB chunks."""
    row = lookup_file(session, project, file_id)
    try:
        fh = storage.open(row.id)
    except (FileNotFoundError, ValueError):
        raise APIError(404, f"File {file_id} has no content.", param="id") from None
    size = os.fstat(fh.fileno()).st_size

    def chunks() -> Iterator[bytes]:
        with fh:
            while data := fh.read(CHUNK):
                yield data

    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={
            "content-length": str(size),
            "content-disposition": f'attachment; filename="{_ascii_name(row.filename)}"',
        },
    )


def _expired(row: FileRow, now: int) -> bool:
    return row.expires_at is not None and row.expires_at <= now


def purge_expired_files(sessions: sessionmaker[Session], storage: FileStorage, now: int) -> int:
    """Delete files past `expires_at` (rows, then bytes), except the input of an unfinished
    batch; returns how many went. Expired files are already invisible to the API before this."""
    with sessions() as session:
        in_use = select(BatchRow.input_file_id).where(
            BatchRow.status.in_([s.value for s in ACTIVE_STATUSES])
        )
        ids = list(
            session.scalars(
                select(FileRow.id).where(
                    FileRow.expires_at.is_not(None),
                    FileRow.expires_at <= now,
                    FileRow.id.not_in(in_use),
                )
            )
        )
        if ids:
            session.execute(delete(FileRow).where(FileRow.id.in_(ids)))
            session.commit()
    for file_id in ids:
        storage.delete(file_id)
    return len(ids)


def _ascii_name(name: str) -> str:
    """Header-safe filename (headers are latin-1; quotes and controls would break the value)."""
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)


@router.delete(
    "/{file_id}", response_model=FileDeleted, responses={**_ERRORS, 409: {"model": ErrorEnvelope}}
)
def delete_file(
    file_id: str, session: SessionDep, project: ProjectDep, storage: StorageDep
) -> FileDeleted:
    """Delete a file; refused (409) while a batch still reads it as input."""
    row = lookup_file(session, project, file_id)
    user = session.scalars(
        select(BatchRow.id).where(
            BatchRow.input_file_id == row.id,
            BatchRow.status.in_([s.value for s in ACTIVE_STATUSES]),
        )
    ).first()
    if user is not None:
        raise APIError(
            409,
            f"File {file_id} is the input of batch {user}, which is still "
            "running; cancel it or wait for it to finish.",
            param="id",
            code="file_in_use",
        )
    session.delete(row)
    session.commit()
    storage.delete(row.id)
    return FileDeleted(id=row.id, deleted=True)
