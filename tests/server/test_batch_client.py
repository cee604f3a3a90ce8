"""`blendserve batches list|watch|get`: the terminal client against a live server, found through
flags or the OpenAI SDK's environment variables."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from rich.console import Console

from server.batch_client import _BarWatch, bar
from server.cli import main
from server.config import Settings
from server.db import make_engine
from server.models import BatchRow
from tests.server.conftest import batch_line, upload
from tests.server.live_process import free_port

KEYS = "sk-alice-0123456789:alpha,sk-bob-9876543210:beta"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


@pytest.fixture
def keyed(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings(api_keys=KEYS)


@pytest.fixture
def base(keyed: Settings, live_server_factory: Callable[[Settings], str]) -> str:
    return live_server_factory(keyed)


def _batch(base: str, key: str, **metadata: str) -> str:
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as c:
        fid = upload(c, (batch_line("x") + "\n").encode()).json()["id"]
        body: dict[str, Any] = {
            "input_file_id": fid,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        if metadata:
            body["metadata"] = metadata
        return str(c.post("/v1/batches", json=body).json()["id"])


def _set(settings: Settings, batch_id: str, **values: Any) -> None:
    db = make_engine(settings)
    with db.begin() as conn:
        conn.execute(sa.update(BatchRow).where(BatchRow.id == batch_id).values(**values))
    db.dispose()


def test_list_shows_this_projects_batches_with_progress(
    base: str, keyed: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    mine, theirs = _batch(base, ALICE), _batch(base, BOB)
    _set(keyed, mine, status="in_progress", total=8, completed=3, failed=1)
    code = main(["batches", "--base-url", f"{base}/v1", "--api-key", ALICE, "list"])
    out = capsys.readouterr().out
    assert code == 0
    assert mine in out and theirs not in out
    assert "in_progress" in out and " 50.0%" in out and bar(4, 8) in out


def test_the_sdk_environment_variables_find_the_server(
    base: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    batch_id = _batch(base, BOB, team="search")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{base}/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", BOB)
    assert main(["batches", "get", batch_id]) == 0
    out = capsys.readouterr().out
    assert f"id          {batch_id}" in out and "status      validating" in out
    assert "metadata    team=search" in out
    assert main(["batches", "list", "--json"]) == 0
    assert f'"id": "{batch_id}"' in capsys.readouterr().out


def test_errors_are_the_apis_message_and_an_exit_code(
    base: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["batches", "--base-url", f"{base}/v1", "--api-key", ALICE, "get", "batch_x"]) == 1
    assert "HTTP 404: No such Batch object: batch_x" in capsys.readouterr().err
    assert main(["batches", "--base-url", f"{base}/v1", "--api-key", "sk-nope", "list"]) == 1
    assert "HTTP 401: Incorrect API key provided" in capsys.readouterr().err
    closed = free_port()  # nobody listens there
    assert main(["batches", "--base-url", f"http://127.0.0.1:{closed}/v1", "list"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_watch_prints_each_change_until_the_batch_finishes(
    base: str, keyed: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    batch_id = _batch(base, ALICE)
    steps = [
        {"status": "in_progress", "total": 4},
        {"completed": 1},
        {"completed": 3, "failed": 1},
        {"status": "finalizing"},
        {"status": "completed"},
    ]

    def worker() -> None:  # moves the row the way a worker would, one change per 0.3 s
        for values in steps:
            time.sleep(0.3)
            _set(keyed, batch_id, **values)

    mover = threading.Thread(target=worker)
    mover.start()
    args = [
        "batches",
        "--base-url",
        f"{base}/v1",
        "--api-key",
        ALICE,
        "watch",
        "--interval",
        "0.05",
    ]
    code = main(args)
    mover.join()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(batch_id)]
    assert code == 0
    assert lines[0].split()[1] == "validating" and lines[-1].split()[1] == "completed"
    assert [line.split()[-1] for line in lines] == ["0/0", "0/4", "1/4", "4/4", "4/4", "4/4"]


def test_watch_without_unfinished_batches_says_so(
    base: str, keyed: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    _set(keyed, _batch(base, ALICE), status="completed")
    assert main(["batches", "--base-url", f"{base}/v1", "--api-key", ALICE, "watch"]) == 0
    assert "no unfinished batches" in capsys.readouterr().out


def test_on_a_terminal_watch_draws_progress_bars() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with _BarWatch(console) as watch:
        batch = {"id": "batch_t", "status": "in_progress", "request_counts": {"total": 10}}
        watch.show({**batch, "request_counts": {"total": 10, "completed": 2, "failed": 1}})
        task = watch.progress.tasks[0]
        assert (task.completed, task.total, task.fields["status"]) == (3, 10, "in_progress")
        watch.show(
            {**batch, "status": "completed", "request_counts": {"total": 10, "completed": 10}}
        )
        assert watch.progress.tasks[0].finished
    assert "batch_t" in out.getvalue() and "completed" in out.getvalue()
