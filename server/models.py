"""SQL tables (SQLAlchemy 2 ORM): files, batches, batch_results, batch_shards, webhook_events. The
schema is a contract with the worker (team brief); wire shapes live in schemas.py, never here."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class BatchStatus(StrEnum):
    """Batch lifecycle; the values are the wire strings of API.md."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    @property
    def is_cancellable(self) -> bool:
        return self in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


TERMINAL_STATUSES = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
# A batch in one of these still reads its input file.
ACTIVE_STATUSES = frozenset(
    {
        BatchStatus.VALIDATING,
        BatchStatus.IN_PROGRESS,
        BatchStatus.FINALIZING,
        BatchStatus.CANCELLING,
    }
)


class FileRow(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_project_created", "project", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(), primary_key=True)  # "file-" + 24 hex
    project: Mapped[str] = mapped_column(String())
    filename: Mapped[str] = mapped_column(String())
    purpose: Mapped[str] = mapped_column(String())
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(Integer)  # unix seconds
    expires_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(), default="processed", server_default="processed")


class BatchRow(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_project_created", "project", "created_at", "id"),
        Index("ix_batches_status", "status"),  # workers poll for claimable batches
    )

    id: Mapped[str] = mapped_column(String(), primary_key=True)  # "batch_" + 24 hex
    project: Mapped[str] = mapped_column(String())
    endpoint: Mapped[str] = mapped_column(String())
    model: Mapped[str | None] = mapped_column(String(), nullable=True)  # set by validation
    input_file_id: Mapped[str] = mapped_column(String())
    completion_window: Mapped[str] = mapped_column(String())
    status: Mapped[str] = mapped_column(
        String(), default=BatchStatus.VALIDATING.value, server_default=BatchStatus.VALIDATING.value
    )
    output_file_id: Mapped[str | None] = mapped_column(String(), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(), nullable=True)
    # Unix seconds; each status transition stamps its own.
    created_at: Mapped[int] = mapped_column(Integer)
    in_progress_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    expires_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # request_counts, live while running.
    total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    completed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    metadata_: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSON, nullable=True
    )  # {code,message,param,line}
    # usage
    input_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    output_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    output_expires_after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # A worker's claim: who holds the batch and when it last proved alive (unix seconds, float).
    worker_id: Mapped[str | None] = mapped_column(String(), nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class BatchResultRow(Base):
    """One finished request, journaled as it completes; the PK forbids a custom_id twice."""

    __tablename__ = "batch_results"

    batch_id: Mapped[str] = mapped_column(
        String(), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    custom_id: Mapped[str] = mapped_column(String(), primary_key=True)
    line: Mapped[int] = mapped_column(Integer)  # 1-based input line
    ok: Mapped[bool] = mapped_column(Boolean)
    record: Mapped[str] = mapped_column(Text)  # the full output/error JSONL object, as JSON text
    input_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    output_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[int] = mapped_column(Integer)


class BatchShardRow(Base):
    """A piece of a large batch that one worker runs while others run the rest (data-parallel
    shards, server/shards.py). Claimed like a batch: `worker_id` + a fresh `heartbeat_at`."""

    __tablename__ = "batch_shards"

    batch_id: Mapped[str] = mapped_column(
        String(), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    lines: Mapped[list[int]] = mapped_column(JSON)  # 1-based input lines, in planned order
    created_at: Mapped[float] = mapped_column(Float)
    done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    worker_id: Mapped[str | None] = mapped_column(String(), nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class WebhookEventRow(Base):
    """A batch event to POST to its project's webhook: an outbox row, written in the transaction
    that made the batch terminal, so no event is lost to a crash (server/webhooks.py sends it)."""

    __tablename__ = "webhook_events"
    __table_args__ = (Index("ix_webhook_events_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(), primary_key=True)  # "evt_" + 24 hex: webhook-id
    project: Mapped[str] = mapped_column(String())  # whose webhook (resolved when sending)
    batch_id: Mapped[str] = mapped_column(String())
    type: Mapped[str] = mapped_column(String())  # "batch.completed", "batch.failed", ...
    payload: Mapped[str] = mapped_column(Text)  # the exact JSON body, the same on every attempt
    status: Mapped[str] = mapped_column(String(), default="pending", server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Unix seconds (float): when the next attempt is due; a claim pushes it one lease ahead.
    next_attempt_at: Mapped[float] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[int] = mapped_column(Integer)  # unix seconds, the batch's terminal stamp
    delivered_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
