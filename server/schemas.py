"""Wire schemas: field names and Literal statuses copied from openai-python (types/batch.py,
file_object.py, batch_usage.py, …) so the official SDK parses every answer unchanged."""

from __future__ import annotations

from typing import Any, Generic, Literal, Self, TypeVar

from pydantic import BaseModel, Field

from server.models import BatchRow, FileRow

T = TypeVar("T")

FilePurpose = Literal[
    "assistants",
    "assistants_output",
    "batch",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
    "evals",
]
BatchStatusLiteral = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(BaseModel):
    """Every non-2xx response."""

    error: ErrorBody


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size of the file in bytes.")
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = Field(
        description="Deprecated; always 'processed'."
    )
    expires_at: int | None = Field(
        default=None, description="Unix seconds; null = kept until deleted."
    )
    status_details: str | None = Field(default=None, description="Deprecated; always null.")

    @classmethod
    def from_row(cls, row: FileRow) -> FileObject:
        return cls.model_validate(
            {
                "id": row.id,
                "bytes": row.bytes,
                "created_at": row.created_at,
                "filename": row.filename,
                "purpose": row.purpose,
                "status": row.status,
                "expires_at": row.expires_at,
            }
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ListPage(BaseModel, Generic[T]):
    """A cursor page: pass `last_id` as `after` for the next one while `has_more`."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[Any], has_more: bool) -> Self:
        """The page holding `data`, its cursor ids taken from its ends."""
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )


class FileList(ListPage[FileObject]):
    """GET /v1/files."""


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = Field(default=None, description="1-based input line, when one is at fault.")


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int = Field(description="Requests that succeeded.")
    failed: int = Field(description="Requests that ended in the error file.")


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatusLiteral
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = Field(default=None, description="created_at + completion_window.")
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts | None = None
    metadata: dict[str, str] | None = None
    usage: BatchUsage | None = None

    @classmethod
    def from_row(cls, row: BatchRow) -> Batch:
        errors = None
        if row.errors:
            errors = BatchErrors(data=[BatchError(**_error_fields(e)) for e in row.errors])
        return cls(
            id=row.id,
            endpoint=row.endpoint,
            model=row.model,
            errors=errors,
            input_file_id=row.input_file_id,
            completion_window=row.completion_window,
            status=row.status,  # type: ignore[arg-type]
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            created_at=row.created_at,
            in_progress_at=row.in_progress_at,
            expires_at=row.expires_at,
            finalizing_at=row.finalizing_at,
            completed_at=row.completed_at,
            failed_at=row.failed_at,
            expired_at=row.expired_at,
            cancelling_at=row.cancelling_at,
            cancelled_at=row.cancelled_at,
            request_counts=BatchRequestCounts(
                total=row.total or 0, completed=row.completed or 0, failed=row.failed or 0
            ),
            metadata=row.metadata_,
            usage=BatchUsage(
                input_tokens=row.input_tokens or 0,
                input_tokens_details=InputTokensDetails(cached_tokens=row.cached_tokens or 0),
                output_tokens=row.output_tokens or 0,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                total_tokens=(row.input_tokens or 0) + (row.output_tokens or 0),
            ),
        )


class BatchList(ListPage[Batch]):
    """GET /v1/batches, newest first."""


def _error_fields(e: Any) -> dict[str, Any]:
    e = e if isinstance(e, dict) else {}
    return {k: e.get(k) for k in ("code", "message", "param", "line")}


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class BatchCreateRequest(BaseModel):
    """Body of POST /v1/batches."""

    # Types are loose on purpose: the route checks values itself so that each problem gets
    # OpenAI's code and param (`invalid_value` on `endpoint`, `invalid_type` on `metadata`, …).

    input_file_id: str
    endpoint: str = Field(description="/v1/chat/completions or /v1/completions.")
    completion_window: str = Field(
        description="'24h', or '<N>m' / '<N>h' from 1 minute to 168 hours."
    )
    metadata: Any = Field(
        default=None, description="Up to 16 string pairs (key ≤ 64, value ≤ 512 chars)."
    )
    output_expires_after: Any = Field(
        default=None, description="{anchor: 'created_at', seconds: 3600..2592000}"
    )


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "blendserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class PlanReport(BaseModel):
    """BlendServe extension: how the planner ran a batch (`GET /v1/batches/{id}/report`)."""

    model_config = {"extra": "allow"}

    object: Literal["batch.report"] = "batch.report"
    batch_id: str
    policy: str = Field(description="Admission policy: fcfs, dfs or blend.")
    mode: str | None = Field(description="blend's mode on this device (blend / sharing order).")
    requests: int = Field(description="Requests this run finished (a resumed run: since resume).")
    sampled: int = Field(description="Warm-up sample size.")
    censored: int = Field(description="Samples still running when the warm-up deadline planned.")
    warmup_steps: int | None
    warmup_seconds: float = Field(description="Engine seconds until the plan was built.")
    steps: int
    engine_seconds: float = Field(description="Measured: the engine's steps, summed.")
    wall_seconds: float = Field(description="Measured: the run from first to last request.")
    step_model_seconds: float = Field(description="Predicted: the device profile over the steps as run.")
    simulated_seconds: float | None = Field(
        description="Predicted: the simulator replaying this batch with its true output lengths.")
    prompt_tokens: int
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    output_tokens: int
    output_tokens_per_s: float | None
    tokens_per_s: float | None = Field(description="(prompt + output tokens) / wall seconds.")
    preemptions: int
    max_step_tokens: int
    profile: dict[str, Any] = Field(description="The device profile the planner used.")
    plan: dict[str, Any] | None = Field(description="Leaves split, sharing kept, ρ target.")
    steps_png: str | None = Field(
        default=None, description="Compute and memory time per step: GET .../report.png.")
