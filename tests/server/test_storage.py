"""FileStorage on disk, and the SQL tables on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from server.config import Settings
from server.db import make_engine, session_factory, session_scope, upgrade
from server.models import BatchResultRow, BatchRow, BatchStatus, FileRow
from server.storage import FileStorage


# -- FileStorage ----------------------------------------------------------------------------------
def test_write_streams_chunks_and_reports_bytes(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "files")
    n = store.write("file-abc", (b"x" * 1000 for _ in range(50)))
    assert n == 50_000
    assert store.size("file-abc") == 50_000
    with store.open("file-abc") as fh:
        assert fh.read() == b"x" * 50_000


def test_an_unfinished_write_leaves_no_file(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "files")

    def chunks():
        yield b"half"
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        store.write("file-partial", chunks())
    assert not store.exists("file-partial")
    assert list((tmp_path / "files").iterdir()) == []


def test_pending_file_is_invisible_until_commit(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "files")
    with store.writer("file-p") as pending:
        pending.write(b"abc")
        assert not store.exists("file-p")
        pending.commit()
    assert store.exists("file-p") and store.path("file-p").read_bytes() == b"abc"


def test_delete_reports_whether_content_existed(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "files")
    store.write("file-d", [b"1"])
    assert store.delete("file-d") is True
    assert store.delete("file-d") is False


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", "", ".hidden", "x" * 200, "file-é"])
def test_ids_that_could_escape_the_root_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        FileStorage(tmp_path).path(bad)


# -- SQL on SQLite and PostgreSQL -----------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, make_settings: Callable[..., Settings]) -> Settings:
    s = request.getfixturevalue("pg_settings") if request.param == "postgresql" else make_settings()
    upgrade(s)
    return s


def _batch(**kw) -> BatchRow:
    fields = {
        "id": "batch_1",
        "project": "p",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "created_at": 100,
        "expires_at": 100 + 86400,
    }
    fields.update(kw)
    return BatchRow(**fields)


def test_batch_row_round_trips_json_and_defaults(db_settings: Settings) -> None:
    factory = session_factory(db_settings)
    with session_scope(factory) as s:
        s.add(
            FileRow(
                id="file-1",
                project="p",
                filename="in.jsonl",
                purpose="batch",
                bytes=3_000_000_000,
                created_at=100,
                expires_at=None,
            )
        )
        s.add(
            _batch(
                metadata_={"k": "v", "ü": "ß"},
                errors=[{"code": "empty_file", "message": "m", "param": None, "line": None}],
                output_expires_after={"anchor": "created_at", "seconds": 3600},
            )
        )
    with factory() as s:
        b = s.get(BatchRow, "batch_1")
        assert b.status == BatchStatus.VALIDATING == "validating"
        assert (b.total, b.completed, b.failed, b.input_tokens, b.cached_tokens) == (0, 0, 0, 0, 0)
        assert b.metadata_ == {"k": "v", "ü": "ß"}
        assert b.errors[0]["code"] == "empty_file"
        assert b.output_expires_after["seconds"] == 3600
        assert b.worker_id is None and b.heartbeat_at is None
        assert s.get(FileRow, "file-1").bytes == 3_000_000_000  # > 2**31: BigInteger
        assert s.get(FileRow, "file-1").status == "processed"


def test_a_custom_id_can_be_journaled_only_once(db_settings: Settings) -> None:
    factory = session_factory(db_settings)
    with session_scope(factory) as s:
        s.add(_batch())
    row = {
        "batch_id": "batch_1",
        "custom_id": "req-1",
        "line": 1,
        "ok": True,
        "record": json.dumps({"custom_id": "req-1"}),
        "created_at": 1,
    }
    with session_scope(factory) as s:
        s.add(BatchResultRow(**row))
    with pytest.raises(IntegrityError), session_scope(factory) as s:
        s.add(BatchResultRow(**{**row, "line": 2}))
    with factory() as s:
        rows = s.scalars(select(BatchResultRow)).all()
        assert [(r.custom_id, r.line, r.input_tokens) for r in rows] == [("req-1", 1, 0)]


def test_results_need_an_existing_batch(db_settings: Settings) -> None:
    with pytest.raises(IntegrityError), session_scope(session_factory(db_settings)) as s:
        s.add(
            BatchResultRow(
                batch_id="batch_missing", custom_id="c", line=1, ok=False, record="{}", created_at=1
            )
        )


def test_concurrent_writers_do_not_fail_with_locked_database(db_settings: Settings) -> None:
    """The API and a worker write the same database; WAL + busy timeout make them wait, not fail."""
    engine = make_engine(db_settings)
    factory = session_factory(db_settings, engine)
    with session_scope(factory) as s:
        s.add(_batch())
    errors: list[BaseException] = []

    def bump(n: int) -> None:
        try:
            for _ in range(n):
                with session_scope(factory) as s:  # atomic increments, as the worker journals
                    s.execute(
                        update(BatchRow)
                        .where(BatchRow.id == "batch_1")
                        .values(completed=BatchRow.completed + 1)
                    )
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=bump, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with factory() as s:
        assert s.get(BatchRow, "batch_1").completed == 100
    engine.dispose()
