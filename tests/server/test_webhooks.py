"""Batch webhooks: settings refuse bad config; one OpenAI-shaped, Standard-Webhooks-signed event per
terminal batch, checked against an HMAC computed here and against the openai SDK's verifier;
retries with backoff, a give-up, one send between two workers, and delivery across a restart."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from server.config import Settings
from server.db import make_engine, upgrade
from server.jobs import JobContext, run_batch
from server.models import BatchStatus, WebhookEventRow
from server.storage import FileStorage
from server.webhooks import WebhookSender, record_event
from tests.server import test_worker
from tests.server.conftest import batch_line, create_batch, make_test_settings
from tests.server.live_process import TERMINAL, free_port
from tests.server.test_worker import batch_row, chat_line, seed_batch, set_status

SECRET = "whsec_" + base64.b64encode(b"blendserve-webhook-test-key-0001").decode()


class Receiver:
    """A webhook endpoint on a local port: records each POST, answers `statuses` in turn, then 200."""

    def __init__(self, port: int = 0, statuses: tuple[int, ...] = (), delay_s: float = 0.0) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []  # (lower-cased headers, body)
        self.statuses, self.delay_s = list(statuses), delay_s
        lock, receiver = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                time.sleep(receiver.delay_s)
                with lock:
                    receiver.requests.append(
                        ({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def hooks_json(url: str, project: str = "proj") -> str:
    return json.dumps({project: {"url": url, "secret": SECRET}})


@pytest.fixture
def settings(make_settings: Callable[..., Settings], receiver: Receiver) -> Settings:
    """Project "proj" (test_worker's seed_batch) with a webhook to `receiver`; migrated SQLite."""
    s = make_settings(
        api_keys="k:proj",
        webhooks=hooks_json(receiver.url),
        worker_poll_seconds=0.05,
        policy="fcfs",
    )
    upgrade(s)
    return s


@pytest.fixture
def db(settings: Settings) -> Iterator[sa.Engine]:
    yield from test_worker.database(settings)


def events(db: sa.Engine) -> list[WebhookEventRow]:
    with sessionmaker(bind=db, expire_on_commit=False)() as s:
        return list(s.scalars(sa.select(WebhookEventRow).order_by(WebhookEventRow.id)))


def verified(headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The event, after checking its Standard Webhooks signature with an HMAC computed here."""
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert headers["webhook-signature"] == f"v1,{expected}"
    assert headers["content-type"] == "application/json"
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 300
    event: dict[str, Any] = json.loads(body)
    assert headers["webhook-id"] == event["id"]
    return event


class Clock:
    """A settable wall clock for the sender's retry schedule."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def run_job(settings: Settings, db: sa.Engine, batch_id: str) -> bool:
    """run_batch on a batch that needs no engine (it fails, is cancelled or expires unrun)."""

    def no_engine() -> Any:
        raise AssertionError("this batch should not need the engine")

    ctx = JobContext(
        settings=settings,
        sessions=sessionmaker(bind=db, expire_on_commit=False),
        storage=FileStorage(settings.data_dir / "files"),
        engine=no_engine,
        policy="fcfs",
        worker_id="w-test",
    )
    return run_batch(batch_id, ctx)


def seed_event(settings: Settings, db: sa.Engine) -> str:
    """A batch of project "proj" and its `batch.completed` event, as `_transition` records it."""
    batch_id = seed_batch(settings, db, [chat_line(0)])
    with sessionmaker(bind=db)() as s, s.begin():
        record_event(s, settings, batch_id, BatchStatus.COMPLETED, created_at=int(time.time()))
    return batch_id


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"default": {"url": "ftp://x/h", "secret": SECRET}}), "not an http(s) URL"),
        (json.dumps({"default": {"url": "http://x/h", "secret": "abc"}}), "start with 'whsec_'"),
        (json.dumps({"default": {"url": "http://x/h", "secret": "whsec_%%"}}), "not valid base64"),
        (json.dumps({"default": {"url": "http://x/h", "secret": "whsec_"}}), "empty"),
        (hooks_json("http://x/h", project="typo"), "no API key maps to: ['typo']"),
    ],
)
def test_settings_refuse_a_bad_webhooks_value(
    make_settings: Callable[..., Settings], value: str, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        make_settings(webhooks=value)
    assert message in str(raised.value)


def test_a_refused_secret_stays_out_of_the_error(make_settings: Callable[..., Settings]) -> None:
    with pytest.raises(ValueError) as raised:
        make_settings(webhooks=hooks_json("http://x/h").replace(SECRET, "whsec_SENSITIVE!"))
    assert "not valid base64" in str(raised.value) and "SENSITIVE" not in str(raised.value)


def test_settings_read_webhooks_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BLENDSERVE_WEBHOOKS", hooks_json("http://127.0.0.1:9/h", "default"))
    target = make_test_settings(tmp_path).webhooks["default"]
    assert target.url == "http://127.0.0.1:9/h"
    assert target.key == b"blendserve-webhook-test-key-0001"
    assert SECRET not in repr(target)


# --- events recorded with the terminal status -------------------------------------------------


def _cancelled(settings: Settings, db: sa.Engine, batch_id: str) -> None:
    set_status(db, batch_id, "cancelling")


def _failed(settings: Settings, db: sa.Engine, batch_id: str) -> None:
    (settings.data_dir / "files" / batch_row(db, batch_id).input_file_id).unlink()


def _expired(settings: Settings, db: sa.Engine, batch_id: str) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE batches SET status = 'in_progress', total = 1, in_progress_at = :t, "
                "expires_at = :t WHERE id = :id"
            ),
            {"t": int(time.time()) - 5, "id": batch_id},
        )


@pytest.mark.parametrize(
    "setup,status",
    [(_cancelled, "cancelled"), (_failed, "failed"), (_expired, "expired")],
)
def test_each_terminal_status_records_exactly_one_event_of_its_type(
    settings: Settings, db: sa.Engine, setup: Callable[..., None], status: str
) -> None:
    batch_id = seed_batch(settings, db, [chat_line(0)])
    setup(settings, db, batch_id)
    for _ in range(2):  # the second run finds the batch terminal: no second event
        assert run_job(settings, db, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == status
    [event] = events(db)
    assert (event.type, event.batch_id, event.status) == (f"batch.{status}", batch_id, "pending")
    assert json.loads(event.payload) == {
        "id": event.id,
        "object": "event",
        "created_at": getattr(b, f"{status}_at"),
        "type": f"batch.{status}",
        "data": {"id": batch_id},
    }
    assert event.id.startswith("evt_")


def test_a_project_without_a_webhook_records_no_event(
    make_settings: Callable[..., Settings], receiver: Receiver
) -> None:
    settings = make_settings(api_keys="k:proj,k2:other", webhooks=hooks_json(receiver.url, "other"))
    upgrade(settings)
    db = make_engine(settings)
    try:
        batch_id = seed_batch(settings, db, [chat_line(0)])
        _cancelled(settings, db, batch_id)
        assert run_job(settings, db, batch_id)
        assert batch_row(db, batch_id).status == "cancelled" and events(db) == []
    finally:
        db.dispose()


# --- delivery ---------------------------------------------------------------------------------


def test_an_event_is_signed_so_the_openai_sdk_verifies_it(
    settings: Settings, db: sa.Engine, receiver: Receiver
) -> None:
    from openai import OpenAI

    batch_id = seed_event(settings, db)
    sender = WebhookSender(settings, sessionmaker(bind=db))
    assert sender.deliver_due() == 1
    sender.close()
    [(headers, body)] = receiver.requests
    assert verified(headers, body)["data"] == {"id": batch_id}
    event = OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(body, headers)
    assert (event.type, event.data.id, event.object) == ("batch.completed", batch_id, "event")
    [row] = events(db)
    assert (row.status, row.attempts, row.last_error) == ("delivered", 1, None)
    assert row.delivered_at is not None


def test_a_500_is_retried_after_1_then_2_seconds_with_the_same_event(
    settings: Settings, db: sa.Engine, receiver: Receiver
) -> None:
    receiver.statuses = [500, 500]
    seed_event(settings, db)
    clock = Clock()
    sender = WebhookSender(settings, sessionmaker(bind=db), now=clock)
    assert sender.deliver_due() == 1  # 500: due again in 1 s
    assert events(db)[0].last_error == "HTTP 500"
    first = clock.t
    clock.t = first + 0.9
    assert sender.deliver_due() == 0
    clock.t = first + 1.0
    assert sender.deliver_due() == 1  # 500: due again in 2 s
    second = clock.t
    clock.t = second + 1.9
    assert sender.deliver_due() == 0
    clock.t = second + 2.0
    assert sender.deliver_due() == 1  # 200
    clock.t += 3600
    assert sender.deliver_due() == 0
    sender.close()
    assert len(receiver.requests) == 3
    ids = {verified(headers, body)["id"] for headers, body in receiver.requests}
    assert len(ids) == 1 and len({body for _, body in receiver.requests}) == 1
    [row] = events(db)
    assert (row.status, row.attempts, row.last_error) == ("delivered", 3, None)


def test_delivery_gives_up_after_the_retry_window(
    settings: Settings, db: sa.Engine, receiver: Receiver
) -> None:
    receiver.statuses = [503] * 10
    seed_event(settings, db)
    clock = Clock()
    sender = WebhookSender(settings, sessionmaker(bind=db), now=clock, give_up_after_seconds=60)
    assert sender.deliver_due() == 1
    clock.t += 61
    assert sender.deliver_due() == 1
    clock.t += 86400
    assert sender.deliver_due() == 0
    sender.close()
    [row] = events(db)
    assert (row.status, row.attempts, row.last_error) == ("failed", 2, "HTTP 503")


def test_two_workers_polling_at_once_send_an_event_once(
    settings: Settings, db: sa.Engine, receiver: Receiver
) -> None:
    receiver.delay_s = 0.3  # both senders see the event due before either finishes
    seed_event(settings, db)
    senders = [WebhookSender(settings, sessionmaker(bind=db)) for _ in range(2)]
    threads = [threading.Thread(target=s.deliver_due) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in senders:
        s.close()
    assert len(receiver.requests) == 1
    assert events(db)[0].status == "delivered"


# --- through the server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Any:
    """The default model once per module (its conversion is cached under <repo>/data)."""
    import torch

    from runtime.engine import Engine, EngineConfig
    from runtime.loader import DEFAULT_MODEL, load_model
    from tests.server.live_process import REPO

    torch.set_num_threads(2)
    model = load_model(DEFAULT_MODEL, data_dir=REPO / "data")
    return Engine(model, EngineConfig(max_batch_tokens=512, kv_memory_bytes=4 << 20))


def _run_batch_over_http(client: httpx.Client, lines: int) -> dict[str, Any]:
    """Upload `lines` one-token chat requests, create a batch, poll it to a terminal status."""
    data = "".join(batch_line(f"r-{i}", max_tokens=1) + "\n" for i in range(lines)).encode()
    batch = create_batch(client, data)
    deadline = time.monotonic() + 300  # hang guard
    while batch["status"] not in TERMINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return batch


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s  # hang guard
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_batch_completed_through_the_api_sends_one_signed_event(
    live_server_factory: Callable[[Settings], str],
    settings: Settings,
    db: sa.Engine,
    receiver: Receiver,
    engine: Any,
) -> None:
    from server.worker import Worker

    url = live_server_factory(settings)
    worker = Worker(settings, engine=engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=url, headers={"authorization": "Bearer k"}, timeout=30) as c:
            batch = _run_batch_over_http(c, lines=2)
        assert batch["status"] == "completed"
        _wait_for(lambda: len(receiver.requests) >= 1, "the webhook")
        time.sleep(1.0)  # two more sender polls: still one event
    finally:
        worker.stopping.set()
        thread.join()
        worker.close()
    [(headers, body)] = receiver.requests
    assert verified(headers, body) == {
        "id": headers["webhook-id"],
        "object": "event",
        "created_at": batch["completed_at"],
        "type": "batch.completed",
        "data": {"id": batch["id"]},
    }
    assert [(e.id, e.status) for e in events(db)] == [(headers["webhook-id"], "delivered")]


@pytest.mark.slow
def test_an_event_missed_while_the_receiver_is_down_arrives_after_a_restart(
    tmp_path: Path,
) -> None:
    from tests.server import live_process

    data_dir = live_process.model_data_dir(tmp_path)
    hook_port, port, log = free_port(), free_port(), tmp_path / "serve.log"
    env = {
        "BLENDSERVE_API_KEYS": "k:proj",
        "BLENDSERVE_WEBHOOKS": hooks_json(f"http://127.0.0.1:{hook_port}/hooks"),
        "BLENDSERVE_POLICY": "fcfs",
        "BLENDSERVE_PROFILE": "none",
        "BLENDSERVE_WORKER_POLL_SECONDS": "0.1",
    }
    db = make_engine(make_test_settings(data_dir))
    receiver: Receiver | None = None
    server = live_process.Server(data_dir, port, log, **env)
    try:
        with httpx.Client(
            base_url=server.url, headers={"authorization": "Bearer k"}, timeout=30
        ) as client:
            # 1. The batch completes while nothing listens on the webhook's port.
            server.wait_healthy(client)
            batch = _run_batch_over_http(client, lines=1)
            assert batch["status"] == "completed", server.tail()
            # attempts counts a claimed attempt; last_error is written once it has failed
            _wait_for(lambda: bool(events(db) and events(db)[0].last_error), "a failed attempt")
            [missed] = events(db)
            assert missed.status == "pending" and missed.last_error, missed.last_error

            # 2. Stop the server (and its worker), bring the receiver up, start the server again.
            server.stop()
            receiver = Receiver(port=hook_port)
            server = live_process.Server(data_dir, port, log, **env)
            server.wait_healthy(client)
            _wait_for(lambda: bool(receiver and receiver.requests), "the webhook", timeout_s=90)
            _wait_for(lambda: events(db)[0].status == "delivered", "delivered")
    finally:
        server.stop()
        if receiver is not None:
            receiver.close()
        db.dispose()
    [(headers, body)] = receiver.requests
    event = verified(headers, body)
    assert (event["id"], event["type"], event["data"]) == (
        missed.id,
        "batch.completed",
        {"id": batch["id"]},
    )
    assert json.loads(missed.payload) == event  # the very event recorded before the restart
