"""/v1/batches: create (synchronous checks, then hand-off to the worker queue), retrieve, list,
cancel. The worker owns every later transition; the API only moves a batch to `cancelling`."""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from sqlalchemy import update

from server.auth import ProjectDep
from server.config import Settings
from server.errors import APIError, bad_request, not_found
from server.ids import new_batch_id
from server.models import BatchRow, BatchStatus
from server.plan_report import report_path
from server.routes.deps import SessionDep, SettingsDep
from server.routes.files import MAX_TTL_S, MIN_TTL_S, lookup_file
from server.routes.pagination import page
from server.schemas import Batch, BatchCreateRequest, BatchList, ErrorEnvelope, PlanReport

log = logging.getLogger("blendserve.api")
router = APIRouter(prefix="/v1/batches", tags=["batches"])

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_WINDOW_MINUTES = 168 * 60
_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,5})([mh])$")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorEnvelope} for code in (400, 401, 404)
}


def window_seconds(window: str) -> int | None:
    """Seconds in a completion window ('24h', '<N>m', '<N>h'; 1 minute to 168 hours), or None."""
    match = _WINDOW_RE.match(window)
    if match is None:
        return None
    minutes = int(match.group(1)) * (60 if match.group(2) == "h" else 1)
    return minutes * 60 if 1 <= minutes <= MAX_WINDOW_MINUTES else None


def check_metadata(value: Any, settings: Settings) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f"Invalid type for 'metadata': expected an object, but got "
            f"{_json_type(value)} instead.",
            param="metadata",
            code="invalid_type",
        )
    if len(value) > settings.max_metadata_pairs:
        raise bad_request(
            f"Invalid 'metadata': too many properties. Expected an object with at "
            f"most {settings.max_metadata_pairs} properties, but got an object with "
            f"{len(value)} properties instead.",
            param="metadata",
            code="invalid_value",
        )
    for key, val in value.items():
        if len(key) > settings.max_metadata_key_chars:
            raise bad_request(
                f"Invalid 'metadata': key '{key[:20]}…' is longer than "
                f"{settings.max_metadata_key_chars} characters.",
                param="metadata",
                code="invalid_value",
            )
        if not isinstance(val, str):
            raise bad_request(
                f"Invalid type for 'metadata.{key}': expected a string, but got "
                f"{_json_type(val)} instead.",
                param=f"metadata.{key}",
                code="invalid_type",
            )
        if len(val) > settings.max_metadata_value_chars:
            raise bad_request(
                f"Invalid 'metadata.{key}': string too long. Expected a string with "
                f"maximum length {settings.max_metadata_value_chars}, but got a "
                f"string with length {len(val)} instead.",
                param=f"metadata.{key}",
                code="invalid_value",
            )
    return dict(value)


def check_output_expires_after(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            "Invalid type for 'output_expires_after': expected an object, but got "
            f"{_json_type(value)} instead.",
            param="output_expires_after",
            code="invalid_type",
        )
    if value.get("anchor") != "created_at":
        raise bad_request(
            "Invalid 'output_expires_after.anchor': the only anchor is 'created_at'.",
            param="output_expires_after.anchor",
            code="invalid_value",
        )
    seconds = value.get("seconds")
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise bad_request(
            "Invalid type for 'output_expires_after.seconds': expected an integer.",
            param="output_expires_after.seconds",
            code="invalid_type",
        )
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise bad_request(
            f"Invalid 'output_expires_after.seconds': must be between {MIN_TTL_S} and {MAX_TTL_S}.",
            param="output_expires_after.seconds",
            code="invalid_value",
        )
    return {"anchor": "created_at", "seconds": seconds}


def _json_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), "a value")


def require_unicode(value: Any, param: str) -> None:
    """400 for a string (or key) with an unpaired surrogate: JSON can spell one ("\\ud800"), but
    it cannot be stored or sent back as UTF-8, so it would poison every later read."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"Invalid '{param}': strings must be valid Unicode (no unpaired surrogates).",
                param=param,
                code="invalid_value",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{param}.{key}" if param else str(key)
            require_unicode(key, param or "body")
            require_unicode(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            require_unicode(item, f"{param}[{i}]")


def lookup_batch(session: SessionDep, project: str, batch_id: str) -> BatchRow:
    row = session.get(BatchRow, batch_id)
    if row is None or row.project != project:
        raise not_found("Batch", batch_id)
    return row


@router.post("", response_model=Batch, responses=_ERRORS)
def create_batch(
    body: BatchCreateRequest,
    request: Request,
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
) -> Batch:
    """Create a batch from an uploaded `purpose=batch` file; it starts `validating`."""
    require_unicode(body.model_dump(), "")
    if body.endpoint not in ENDPOINTS:
        raise bad_request(
            f"Invalid value: '{body.endpoint}'. Supported values are: "
            + " and ".join(f"'{e}'" for e in ENDPOINTS)
            + ".",
            param="endpoint",
            code="invalid_value",
        )
    window = window_seconds(body.completion_window)
    if window is None:
        raise bad_request(
            f"Invalid value: '{body.completion_window}'. Supported values are: "
            "'24h', or '<N>m' / '<N>h' between 1 minute and 168 hours.",
            param="completion_window",
            code="invalid_value",
        )
    metadata = check_metadata(body.metadata, settings)
    output_expires_after = check_output_expires_after(body.output_expires_after)
    input_file = lookup_file(session, project, body.input_file_id, param="input_file_id")
    if input_file.purpose != "batch":
        raise bad_request(
            f"File {input_file.id} has purpose '{input_file.purpose}'; a batch "
            "input file must be uploaded with purpose 'batch'.",
            param="input_file_id",
            code="invalid_value",
        )
    now = int(time.time())
    row = BatchRow(
        id=new_batch_id(),
        project=project,
        endpoint=body.endpoint,
        model=None,
        input_file_id=input_file.id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING.value,
        created_at=now,
        expires_at=now + window,
        total=0,
        completed=0,
        failed=0,
        metadata_=metadata,
        errors=None,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        output_expires_after=output_expires_after,
    )
    session.add(row)
    session.commit()
    _enqueue(request, row.id)
    return Batch.from_row(row)


def _enqueue(request: Request, batch_id: str) -> None:
    """Tell the workers; the SQL row is the source of truth, so a failure here only delays."""
    queue = request.app.state.queue
    if queue is None:
        return
    try:
        queue.enqueue(batch_id)
    except Exception:  # a down Redis must not fail a batch that is already stored
        log.exception("could not enqueue %s; workers will find it in SQL", batch_id)


@router.get("", response_model=BatchList, responses=_ERRORS)
def list_batches(
    session: SessionDep,
    project: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    """This project's batches, newest first."""
    rows, has_more = page(session, BatchRow, project, after=after, limit=limit, order="desc")
    return BatchList.of([Batch.from_row(r) for r in rows], has_more)


@router.get("/{batch_id}", response_model=Batch, responses=_ERRORS)
def retrieve_batch(batch_id: str, session: SessionDep, project: ProjectDep) -> Batch:
    return Batch.from_row(lookup_batch(session, project, batch_id))


@router.get("/{batch_id}/report", response_model=PlanReport, responses=_ERRORS)
def batch_report(batch_id: str, session: SessionDep, project: ProjectDep,
                 settings: SettingsDep) -> Any:
    """BlendServe extension: the batch's plan report (warm-up, steps, predicted vs measured
    time, cached tokens, tokens/s), written when the batch's run ends."""
    row = lookup_batch(session, project, batch_id)
    path = report_path(settings.data_dir, row.id)
    try:
        return PlanReport.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        raise APIError(404, f"No plan report for batch '{row.id}' yet: it is written when the "
                       "batch's run ends.", param="id", code="report_not_ready") from None


@router.get("/{batch_id}/report.png", responses={
    **_ERRORS, 200: {"content": {"image/png": {}}, "description": "PNG image"}},
    response_class=FileResponse)
def batch_report_png(batch_id: str, session: SessionDep, project: ProjectDep,
                     settings: SettingsDep) -> FileResponse:
    """BlendServe extension: compute and memory time per engine step of the batch's run."""
    row = lookup_batch(session, project, batch_id)
    path = report_path(settings.data_dir, row.id).with_suffix(".png")
    if not path.is_file():
        raise APIError(404, f"No plan plot for batch '{row.id}' yet: it is written when the "
                       "batch's run ends.", param="id", code="report_not_ready")
    return FileResponse(path, media_type="image/png")


@router.post(
    "/{batch_id}/cancel", response_model=Batch, responses={**_ERRORS, 409: {"model": ErrorEnvelope}}
)
def cancel_batch(batch_id: str, session: SessionDep, project: ProjectDep) -> Batch:
    """validating|in_progress → cancelling (the worker finishes it to cancelled);
    cancelling|cancelled → unchanged; finalizing|completed|failed|expired → 409."""
    row = lookup_batch(session, project, batch_id)
    cancellable = [BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value]
    if row.status in cancellable:
        # Conditional update: the worker may move the batch between our read and this write.
        session.execute(
            update(BatchRow)
            .where(BatchRow.id == row.id, BatchRow.status.in_(cancellable))
            .values(status=BatchStatus.CANCELLING.value, cancelling_at=int(time.time()))
        )
        session.commit()
        session.refresh(row)
    if row.status in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
        return Batch.from_row(row)
    raise APIError(
        409,
        f"Cannot cancel a batch with status '{row.status}'.",
        param="id",
        code="batch_not_cancellable",
        headers={"x-should-retry": "false"},
    )
