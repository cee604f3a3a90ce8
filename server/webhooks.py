"""Batch webhooks as OpenAI sends them: the outbox row written with a batch's terminal status, and
the sender thread that POSTs it, signed per Standard Webhooks, until the receiver answers 2xx.

Delivery is at least once. A sender claims a due event with a conditional UPDATE that pushes its
due time one lease ahead, so two workers rarely send it twice and a sender killed mid-POST only
delays it by the lease; receivers deduplicate on `webhook-id`. Nothing here touches a batch: a
receiver that is down, slow or answering 500 costs retries, never a batch's status.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from server.config import Settings, WebhookTarget
from server.ids import new_id
from server.models import BatchRow, BatchStatus, WebhookEventRow

log = logging.getLogger(__name__)

EVENT_TYPES = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"  # webhook_events.status
LEASE_SECONDS = 60.0  # a claimed event is not due again for this long (> the POST timeout)
MAX_BACKOFF_SECONDS = 3600.0
CLAIMS_PER_PASS = 20


def record_event(
    s: Session, settings: Settings, batch_id: str, status: BatchStatus, *, created_at: int
) -> None:
    """Add the event of a batch that just became terminal `status` to the caller's transaction,
    so the event exists exactly when the status change committed. No-op without a webhook."""
    if not settings.webhooks:
        return
    project = s.scalar(sa.select(BatchRow.project).where(BatchRow.id == batch_id))
    if project not in settings.webhooks:
        return
    event_id, kind = new_id("evt_"), EVENT_TYPES[status]
    payload = {
        "id": event_id,
        "object": "event",
        "created_at": created_at,
        "type": kind,
        "data": {"id": batch_id},
    }
    s.add(
        WebhookEventRow(
            id=event_id,
            project=project,
            batch_id=batch_id,
            type=kind,
            payload=json.dumps(payload),
            status=PENDING,
            attempts=0,
            next_attempt_at=time.time(),
            created_at=created_at,
        )
    )


def signature(key: bytes, event_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header: `v1,` + base64(HMAC-SHA256(key, "id.timestamp.body"))."""
    mac = hmac.new(key, f"{event_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def backoff_seconds(attempts: int) -> float:
    """The wait after the `attempts`-th failed attempt: 1 s, 2 s, 4 s, … at most an hour."""
    return min(2.0 ** min(attempts - 1, 32), MAX_BACKOFF_SECONDS)


class WebhookSender:
    """A daemon thread that delivers due outbox events; one per worker process."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        poll_seconds: float = 0.5,
        timeout_seconds: float = 10.0,
        give_up_after_seconds: float = 24 * 3600.0,  # from the event's creation
        now: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.sessions, self.now = settings, sessions, now
        self.poll_seconds, self.give_up_after_seconds = poll_seconds, give_up_after_seconds
        self._join_seconds = timeout_seconds + 5.0
        self._client = httpx.Client(timeout=timeout_seconds, follow_redirects=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop after the POST in flight, if any; an unfinished event stays due for the next run."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._join_seconds)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.deliver_due()
                wait = self.poll_seconds
            except Exception as e:  # noqa: BLE001 - database down or not migrated yet: retry later
                log.warning("webhooks: cannot read the outbox (%s: %s)", type(e).__name__, e)
                wait = self.poll_seconds * 10
            self._stop.wait(wait)

    def deliver_due(self) -> int:
        """One pass: attempt each due event this process can claim; returns how many it tried."""
        with self.sessions() as s:
            due = s.scalars(
                sa.select(WebhookEventRow.id)
                .where(
                    WebhookEventRow.status == PENDING, WebhookEventRow.next_attempt_at <= self.now()
                )
                .order_by(WebhookEventRow.next_attempt_at)
                .limit(CLAIMS_PER_PASS)
            ).all()
        tried = 0
        for event_id in due:
            if self._stop.is_set():
                break
            event = self._claim(event_id)
            if event is not None:
                self._attempt(event)
                tried += 1
        return tried

    def _claim(self, event_id: str) -> WebhookEventRow | None:
        """Lease the event if it is still due (another worker may have just claimed it)."""
        now = self.now()
        with self.sessions() as s, s.begin():
            claimed = s.execute(
                sa.update(WebhookEventRow)
                .where(
                    WebhookEventRow.id == event_id,
                    WebhookEventRow.status == PENDING,
                    WebhookEventRow.next_attempt_at <= now,
                )
                .values(next_attempt_at=now + LEASE_SECONDS, attempts=WebhookEventRow.attempts + 1)
            ).rowcount  # type: ignore[attr-defined]  # a CursorResult for UPDATE
            if claimed != 1:
                return None
            event = s.get(WebhookEventRow, event_id)
            assert event is not None
            s.expunge(event)
        return event

    def _attempt(self, event: WebhookEventRow) -> None:
        target = self.settings.webhooks.get(event.project)
        error = self._post(target, event) if target else "no webhook configured for the project"
        if error is None:
            self._update(event.id, status=DELIVERED, delivered_at=int(self.now()), last_error=None)
        elif target is None or self.now() - event.created_at >= self.give_up_after_seconds:
            log.error(
                "webhook %s (%s of batch %s): giving up after %d attempts: %s",
                event.id,
                event.type,
                event.batch_id,
                event.attempts,
                error,
            )
            self._update(event.id, status=FAILED, last_error=error)
        else:
            wait = backoff_seconds(event.attempts)
            log.warning(
                "webhook %s (%s of batch %s): attempt %d failed (%s); retry in %.0f s",
                event.id,
                event.type,
                event.batch_id,
                event.attempts,
                error,
                wait,
            )
            self._update(event.id, next_attempt_at=self.now() + wait, last_error=error)

    def _post(self, target: WebhookTarget, event: WebhookEventRow) -> str | None:
        """POST the event once; None on 2xx, else what went wrong (the body is never read)."""
        timestamp = int(self.now())  # of this attempt, so a late retry still passes replay checks
        headers = {
            "content-type": "application/json",
            "user-agent": "BlendServe-Webhooks/1",
            "webhook-id": event.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(target.key, event.id, timestamp, event.payload),
        }
        try:
            with self._client.stream(
                "POST", target.url, content=event.payload.encode(), headers=headers
            ) as response:
                return None if response.is_success else f"HTTP {response.status_code}"
        except Exception as e:  # noqa: BLE001 - any failure to deliver is a retry
            return f"{type(e).__name__}: {e}"[:500]

    def _update(self, event_id: str, **values: Any) -> None:
        with self.sessions() as s, s.begin():
            s.execute(
                sa.update(WebhookEventRow).where(WebhookEventRow.id == event_id).values(**values)
            )
