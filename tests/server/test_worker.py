"""The worker and its jobs on the real default model: a batch's whole life in SQL and files —
completed, failed validation, cancelled mid-run, expired, resumed after an interruption, and a
server-side error that fails one batch while the worker carries on."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from runtime.engine import Engine, EngineConfig
from runtime.loader import DEFAULT_MODEL, load_model
from server.config import Settings
from server.db import make_engine, upgrade
from server.jobs import JobContext, run_batch
from server.models import BatchRow, FileRow
from server.queue import SqlQueue
from server.storage import FileStorage
from server.worker import Worker

REPO = Path(__file__).resolve().parents[2]
ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The default model once per module (its conversion is cached under <repo>/data)."""
    import torch

    torch.set_num_threads(2)
    model = load_model(DEFAULT_MODEL, data_dir=REPO / "data")
    return Engine(model, EngineConfig(max_batch_tokens=512, kv_memory_bytes=4 << 20))


def worker_settings(make_settings: Callable[..., Settings]) -> Settings:
    """A migrated SQLite database in a tmp data dir; the worker polls fast and runs fcfs."""
    settings = make_settings(worker_poll_seconds=0.05, policy="fcfs")
    upgrade(settings)
    return settings


def database(settings: Settings) -> Iterator[sa.Engine]:
    engine = make_engine(settings)
    yield engine
    engine.dispose()


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return worker_settings(make_settings)


@pytest.fixture
def db(settings: Settings) -> Iterator[sa.Engine]:
    yield from database(settings)


def chat_line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": ENDPOINT,
        "body": {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": f"Say the number {i}."}],
            "max_tokens": 2,
            "temperature": 0,
            **body,
        },
    }


def seed_batch(
    settings: Settings, db: sa.Engine, lines: list[dict[str, Any]] | bytes, **columns: Any
) -> str:
    """An uploaded input file and a `validating` batch over it, as the API would leave them."""
    raw = (
        lines
        if isinstance(lines, bytes)
        else b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    )
    file_id = f"file-{uuid.uuid4().hex[:24]}"
    batch_id = f"batch_{uuid.uuid4().hex[:24]}"
    size = FileStorage(settings.data_dir / "files").write(file_id, [raw])
    now = int(time.time())
    with sessionmaker(bind=db)() as s:
        s.add(
            FileRow(
                id=file_id,
                project="proj",
                filename="in.jsonl",
                purpose="batch",
                bytes=size,
                created_at=now,
                expires_at=None,
                status="processed",
            )
        )
        s.add(
            BatchRow(
                id=batch_id,
                project="proj",
                endpoint=ENDPOINT,
                input_file_id=file_id,
                completion_window="24h",
                status="validating",
                created_at=now,
                expires_at=now + 86400,
                **columns,
            )
        )
        s.commit()
    return batch_id


def batch_row(db: sa.Engine, batch_id: str) -> BatchRow:
    with sessionmaker(bind=db, expire_on_commit=False)() as s:
        row = s.get(BatchRow, batch_id)
        assert row is not None
        return row


def file_lines(settings: Settings, db: sa.Engine, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    with sessionmaker(bind=db)() as s:
        row = s.get(FileRow, file_id)
        assert row is not None and row.purpose == "batch_output" and row.project == "proj"
        size = row.bytes
    data = (settings.data_dir / "files" / file_id).read_bytes()
    assert len(data) == size
    return [json.loads(line) for line in data.splitlines()]


def set_status(db: sa.Engine, batch_id: str, status: str) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE batches SET status = :s WHERE id = :id"), {"s": status, "id": batch_id}
        )


def journaled(db: sa.Engine, batch_id: str) -> int:
    with db.connect() as conn:
        return conn.execute(
            sa.text("SELECT count(*) FROM batch_results WHERE batch_id = :id"), {"id": batch_id}
        ).scalar_one()


def job(
    settings: Settings,
    db: sa.Engine,
    engine: Engine,
    batch_id: str,
    *,
    interrupted: Callable[[], bool] = lambda: False,
    now: Callable[[], float] = time.time,
) -> bool:
    """Claim the batch as worker "w-test" and run one job over it, like Worker.run_one."""
    queue = SqlQueue(db, stall_seconds=60)
    assert queue.try_claim(batch_id, "w-test")
    ctx = JobContext(
        settings=settings,
        sessions=sessionmaker(bind=db, expire_on_commit=False),
        storage=FileStorage(settings.data_dir / "files"),
        engine=lambda: engine,
        policy="fcfs",
        worker_id="w-test",
        interrupted=interrupted,
        now=now,
        cancel_poll_seconds=0.0,
    )
    try:
        return run_batch(batch_id, ctx)
    finally:
        queue.release(batch_id, "w-test", terminal=True)


def test_a_batch_runs_to_completed_with_output_and_error_files(settings, db, engine) -> None:
    lines = [chat_line(i) for i in range(3)] + [chat_line(3, max_tokens=0)]
    batch_id = seed_batch(settings, db, lines)
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    b = batch_row(db, batch_id)
    assert b.status == "completed" and b.worker_id is None
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at  # type: ignore[operator]
    assert (b.total, b.completed, b.failed) == (4, 3, 1)
    assert b.model == DEFAULT_MODEL
    assert b.input_tokens > 0 and 0 < b.output_tokens <= 3 * 2
    out = file_lines(settings, db, b.output_file_id)
    err = file_lines(settings, db, b.error_file_id)
    assert sorted(r["custom_id"] for r in out) == [f"req-{i}" for i in range(3)]
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["object"] == "chat.completion"
    assert [r["custom_id"] for r in err] == ["req-3"]
    assert err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_an_invalid_file_fails_with_line_numbered_errors(settings, db, engine) -> None:
    raw = (json.dumps(chat_line(0)) + "\n{not json\n" + json.dumps(chat_line(0)) + "\n").encode()
    batch_id = seed_batch(settings, db, raw)
    assert job(settings, db, engine, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == "failed" and b.failed_at is not None and b.in_progress_at is None
    codes = {(e["code"], e["line"]) for e in b.errors or []}
    assert ("invalid_json_line", 2) in codes and ("duplicate_custom_id", 3) in codes
    assert b.output_file_id is None and b.error_file_id is None


def test_a_missing_input_file_fails_the_batch(settings, db, engine) -> None:
    batch_id = seed_batch(settings, db, [chat_line(0)])
    (settings.data_dir / "files" / batch_row(db, batch_id).input_file_id).unlink()
    assert job(settings, db, engine, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == "failed"
    assert b.errors == [
        {
            "code": "invalid_request",
            "message": b.errors[0]["message"],  # type: ignore[index]
            "param": "file_id",
            "line": None,
        }
    ]


def test_cancel_mid_run_keeps_finished_work_and_writes_batch_cancelled(
    settings, db, engine
) -> None:
    lines = [chat_line(i, ignore_eos=True) for i in range(10)]
    batch_id = seed_batch(settings, db, lines)

    def cancel_after_some_results() -> bool:
        """What a client's cancel does (the API's UPDATE), once a few requests are journaled."""
        if journaled(db, batch_id) >= 1 and batch_row(db, batch_id).status == "in_progress":
            set_status(db, batch_id, "cancelling")
        return False

    assert job(settings, db, engine, batch_id, interrupted=cancel_after_some_results)
    b = batch_row(db, batch_id)
    assert b.status == "cancelled" and b.cancelled_at is not None and b.completed_at is None
    out = file_lines(settings, db, b.output_file_id)
    err = file_lines(settings, db, b.error_file_id)
    assert 1 <= len(out) < 10 and b.completed == len(out) and b.failed == 0
    assert all(r["error"]["code"] == "batch_cancelled" and r["response"] is None for r in err)
    ids = [r["custom_id"] for r in out + err]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(10))  # each exactly once
    assert [r["custom_id"] for r in err] == sorted(
        (r["custom_id"] for r in err), key=lambda c: int(c.split("-")[1])
    )  # never-ran lines in input order


def test_the_window_expires_mid_run_with_batch_expired_lines(settings, db, engine) -> None:
    lines = [chat_line(i, ignore_eos=True) for i in range(10)]
    batch_id = seed_batch(settings, db, lines)
    expires_at = batch_row(db, batch_id).expires_at
    assert expires_at is not None

    def clock() -> float:
        """Real time until a few requests are journaled, then past the window."""
        return expires_at + 1.0 if journaled(db, batch_id) >= 1 else time.time()

    assert job(settings, db, engine, batch_id, now=clock)
    b = batch_row(db, batch_id)
    assert b.status == "expired" and b.expired_at == expires_at + 1
    out = file_lines(settings, db, b.output_file_id)
    err = file_lines(settings, db, b.error_file_id)
    assert 1 <= len(out) < 10 and b.completed == len(out)
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"req-{i}" for i in range(10))


def test_a_batch_already_past_its_window_expires_without_running(settings, db, engine) -> None:
    batch_id = seed_batch(settings, db, [chat_line(i) for i in range(3)])
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE batches SET expires_at = :t WHERE id = :id"),
            {"t": int(time.time()) - 1, "id": batch_id},
        )
    assert job(settings, db, engine, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == "expired" and b.output_file_id is None and b.completed == 0
    assert [r["error"]["code"] for r in file_lines(settings, db, b.error_file_id)] == [
        "batch_expired"
    ] * 3


def test_a_cancel_while_validating_ends_cancelled_without_files(settings, db, engine) -> None:
    batch_id = seed_batch(settings, db, [chat_line(0)])
    set_status(db, batch_id, "cancelling")
    assert job(settings, db, engine, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == "cancelled" and b.output_file_id is None and b.error_file_id is None


def test_an_interrupted_batch_resumes_with_only_unfinished_requests(settings, db, engine) -> None:
    lines = [chat_line(i, ignore_eos=True) for i in range(6)]
    batch_id = seed_batch(settings, db, lines)
    assert not job(
        settings, db, engine, batch_id, interrupted=lambda: journaled(db, batch_id) >= 1
    )  # e.g. SIGTERM
    first = batch_row(db, batch_id)
    assert first.status == "in_progress" and 1 <= first.completed < 6
    finished_before = engine.stats.finished_requests
    assert job(settings, db, engine, batch_id)
    b = batch_row(db, batch_id)
    assert b.status == "completed" and (b.completed, b.failed) == (6, 0)
    assert engine.stats.finished_requests - finished_before == 6 - first.completed
    out = file_lines(settings, db, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(6))
    assert b.output_tokens == 6 * 2


def test_a_finalize_cut_short_by_a_crash_is_redone_with_the_same_files(
    settings, db, engine
) -> None:
    batch_id = seed_batch(settings, db, [chat_line(i) for i in range(2)])
    assert job(settings, db, engine, batch_id)
    done = batch_row(db, batch_id)
    assert done.status == "completed" and done.output_file_id is not None
    with db.begin() as conn:  # as if killed after writing the file, before the status commit
        conn.execute(
            sa.text(
                "UPDATE batches SET status='finalizing', completed_at=NULL, output_file_id=NULL"
                " WHERE id=:id"
            ),
            {"id": batch_id},
        )
    finished = engine.stats.finished_requests
    assert job(settings, db, engine, batch_id)
    again = batch_row(db, batch_id)
    assert again.status == "completed" and again.output_file_id == done.output_file_id
    assert engine.stats.finished_requests == finished  # nothing re-ran
    with db.connect() as conn:
        n_files = conn.execute(sa.text("SELECT count(*) FROM files WHERE purpose='batch_output'"))
        assert n_files.scalar_one() == 1
    out = file_lines(settings, db, again.output_file_id)
    assert sorted(r["custom_id"] for r in out) == ["req-0", "req-1"]


def test_a_server_error_fails_one_batch_and_the_worker_goes_on(settings, db, engine) -> None:
    broken = seed_batch(settings, db, [chat_line(i) for i in range(3)])
    healthy = seed_batch(settings, db, [chat_line(i) for i in range(2)])
    # `broken` validated and started, then lost its input file (a disk problem, say).
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE batches SET status='in_progress', total=3 WHERE id=:id"), {"id": broken}
        )
    (settings.data_dir / "files" / batch_row(db, broken).input_file_id).unlink()
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    b = batch_row(db, broken)
    assert b.status == "failed" and b.errors and b.errors[0]["code"] == "server_error"
    assert "Traceback" not in json.dumps(b.errors)
    assert batch_row(db, healthy).status == "completed"


def test_the_openai_sdk_follows_a_batch_from_validating_to_completed(
    live_server_factory, settings, db, engine
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=live_server_factory(settings) + "/v1", api_key="unused", max_retries=0)
    worker = Worker(settings, engine=engine)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        data = b"".join(json.dumps(chat_line(i)).encode() + b"\n" for i in range(4))
        upload = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id,
            endpoint=ENDPOINT,
            completion_window="24h",
            metadata={"run": "sdk"},
        )
        history = [batch]
        deadline = time.monotonic() + 600  # a hang guard, not a timing assertion
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, history[-1]
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
            history.append(batch)
    finally:
        worker.stopping.set()
        thread.join()
        worker.close()
    statuses = [
        b.status for i, b in enumerate(history) if i == 0 or b.status != history[i - 1].status
    ]
    assert statuses[0] == "validating" and statuses[-1] == "completed"
    order = ["validating", "in_progress", "finalizing", "completed"]
    assert [order.index(s) for s in statuses] == sorted(order.index(s) for s in statuses)
    done = [b.request_counts.completed for b in history if b.request_counts is not None]
    assert done == sorted(done)  # live counts never go backwards
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (4, 4)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.metadata == {"run": "sdk"} and batch.error_file_id is None
    assert batch.output_file_id is not None
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.filename.endswith(".jsonl")
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in lines) == [f"req-{i}" for i in range(4)]
    assert output.bytes == len(client.files.content(batch.output_file_id).content)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(
    request: pytest.FixtureRequest, settings: Settings
) -> Iterator[tuple[Settings, sa.Engine]]:
    """The same job on SQLite and on the real PostgreSQL (skipped when it does not answer)."""
    chosen = settings if request.param == "sqlite" else request.getfixturevalue("pg_settings")
    upgrade(chosen)
    engine = make_engine(chosen)
    yield chosen, engine
    engine.dispose()


def test_a_result_is_journaled_and_counted_once(any_db) -> None:
    from server import journal
    from server.pipeline import LineResult

    settings, db = any_db
    sessions = sessionmaker(bind=db)
    batch_id = seed_batch(settings, db, [chat_line(0)], total=1)
    set_status(db, batch_id, "in_progress")
    assert SqlQueue(db, stall_seconds=60).try_claim(batch_id, "w-test")
    result = LineResult("req-0", 1, True, {"custom_id": "req-0"}, input_tokens=7, output_tokens=2)
    assert journal.record(sessions, batch_id, "w-test", result, now=time.time())
    assert journal.record(
        sessions, batch_id, "w-test", result, now=time.time()
    )  # a re-run: ignored
    b = batch_row(db, batch_id)
    assert (journaled(db, batch_id), b.completed, b.input_tokens, b.output_tokens) == (1, 1, 7, 2)
    assert SqlQueue(db, stall_seconds=60).try_claim(batch_id, "w-other") is False
    with db.begin() as conn:  # the claim moves to another worker: the old one may not journal
        conn.execute(
            sa.text("UPDATE batches SET worker_id='w-other' WHERE id=:id"), {"id": batch_id}
        )
    late = LineResult("req-1", 2, True, {"custom_id": "req-1"})
    assert not journal.record(sessions, batch_id, "w-test", late, now=time.time())
    assert journaled(db, batch_id) == 1


def test_a_batch_completes_on_postgresql_too(pg_settings: Settings, engine: Engine) -> None:
    settings = pg_settings
    upgrade(settings)
    db = make_engine(settings)
    batch_id = seed_batch(settings, db, [chat_line(i) for i in range(2)])
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    b = batch_row(db, batch_id)
    assert (b.status, b.completed, b.failed) == ("completed", 2, 0)
    out = file_lines(settings, db, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == ["req-0", "req-1"]
    db.dispose()


def test_a_worker_on_the_redis_queue_runs_and_acks_a_batch(settings, db, engine, redis_url) -> None:
    from server.queue import RedisQueue

    queue = RedisQueue(
        db, redis_url, stall_seconds=60, stream=f"blendserve:test:{uuid.uuid4().hex[:12]}"
    )
    try:
        batch_id = seed_batch(settings, db, [chat_line(i) for i in range(2)])
        queue.enqueue(batch_id)  # what POST /v1/batches does
        worker = Worker(settings, engine=engine, queue=queue)
        assert worker.run(until_idle=True) == 0
        assert batch_row(db, batch_id).status == "completed"
        assert queue.redis.xpending(queue.stream, queue.group)["pending"] == 0
        assert queue.redis.xlen(queue.stream) == 0
    finally:
        queue.redis.delete(queue.stream)
        queue.close()


def test_a_finished_batch_has_a_plan_report_and_plot(live_server_factory, settings, db,
                                                     engine) -> None:
    import httpx
    from openai import OpenAI

    base = live_server_factory(settings)
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    data = b"".join(json.dumps(chat_line(i)).encode() + b"\n" for i in range(3))
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    missing = httpx.get(f"{base}/v1/batches/{batch.id}/report")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "report_not_ready"
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    assert client.batches.retrieve(batch.id).status == "completed"
    report = httpx.get(f"{base}/v1/batches/{batch.id}/report").json()
    assert report["object"] == "batch.report" and report["batch_id"] == batch.id
    assert report["requests"] == 3 and report["steps"] > 0 and report["output_tokens"] > 0
    assert report["prompt_tokens"] >= report["cached_tokens"] >= 0
    assert report["engine_seconds"] > 0 and report["simulated_seconds"] > 0
    png = httpx.get(f"{base}/v1/batches/{batch.id}/report.png")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content.startswith(b"\x89PNG")
    other = httpx.get(f"{base}/v1/batches/batch_nope/report")
    assert other.status_code == 404 and other.json()["error"]["param"] == "id"
