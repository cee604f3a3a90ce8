"""Server test fixtures: Settings on a tmp data dir, real PostgreSQL / Redis (skipped when they do
not answer), and a live uvicorn server on a free port (API only, `--no-worker` semantics)."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from server.config import Settings

PG_HOST, PG_PORT = "127.0.0.1", 5432
REDIS_URL = "redis://127.0.0.1:6379/0"


def make_test_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Settings that ignore the caller's BLENDSERVE_* environment for the fields tests depend on."""
    fields: dict[str, Any] = {
        "data_dir": data_dir,
        "database_url": None,
        "redis_url": None,
        "api_keys": None,
        "host": "127.0.0.1",
        "model": "smollm2-135m-instruct",
        "profile": "none",  # a worker that loads its own engine does not measure the device
    }
    fields.update(overrides)
    return Settings(**fields)


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Settings]:
    """Factory: make_settings(max_file_bytes=1000, api_keys="k:p", ...) on this test's tmp dir."""
    return lambda **overrides: make_test_settings(tmp_path / "data", **overrides)


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings()


def _pg_admin_connect() -> Any:
    import psycopg

    last: Exception | None = None
    for user in ("postgres", "root"):
        for dbname in ("test", "postgres"):
            try:
                return psycopg.connect(
                    host=PG_HOST,
                    port=PG_PORT,
                    user=user,
                    dbname=dbname,
                    autocommit=True,
                    connect_timeout=3,
                ), user
            except Exception as exc:  # noqa: BLE001 - try the next user/database
                last = exc
    raise ConnectionError(f"PostgreSQL at {PG_HOST}:{PG_PORT} does not answer: {last}")


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """Create a randomly named PostgreSQL database; drop it (closing its connections) on exit.
    Skips the test when PostgreSQL does not answer."""
    try:
        conn, user = _pg_admin_connect()
    except ConnectionError as exc:
        pytest.skip(str(exc))
    name = f"blendserve_test_{secrets.token_hex(6)}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}"
        finally:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh, randomly named PostgreSQL database for this test session, dropped afterwards."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def pg_settings(make_settings: Callable[..., Settings], pg_url: str) -> Iterator[Settings]:
    """Settings on the session's PostgreSQL database, emptied (downgraded) after the test."""
    s = make_settings(database_url=pg_url)
    yield s
    from server.db import downgrade

    downgrade(s, "base")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The local Redis; skips when it does not answer."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means skip
        pytest.skip(f"Redis at {REDIS_URL} does not answer: {exc}")
    return REDIS_URL


class LiveServer:
    """uvicorn serving create_app(settings) in a background thread on a pre-bound free port."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from server.app import create_app
        from server.db import upgrade

        upgrade(settings)
        self.settings = settings
        self.app = create_app(settings)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()


@pytest.fixture
def live_server_factory() -> Iterator[Callable[[Settings], str]]:
    """Factory: live_server_factory(settings) -> base URL ("http://127.0.0.1:PORT"), no worker."""
    servers: list[LiveServer] = []

    def start(settings: Settings) -> str:
        servers.append(LiveServer(settings))
        return servers[-1].url

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def live_server(live_server_factory: Callable[[Settings], str], settings: Settings) -> str:
    """Base URL of the API on `settings` (SQLite in a tmp data dir, no auth, no worker)."""
    return live_server_factory(settings)


@pytest.fixture
def api(live_server: str) -> Iterator[Any]:
    """An httpx client on the live server (no auth)."""
    import httpx

    with httpx.Client(base_url=live_server, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def shared_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One live server per test module, for tests that only need answers, not a clean slate."""
    import httpx

    server = LiveServer(make_test_settings(tmp_path_factory.mktemp("shared") / "data"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        server.stop()


def batch_line(custom_id: str, content: str = "Say hi.", **body: Any) -> str:
    """One JSONL line of a chat-completions batch input file."""
    import json

    payload = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
        **body,
    }
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": payload}
    )


def upload(
    client: Any,
    content: bytes,
    *,
    filename: str = "input.jsonl",
    purpose: str = "batch",
    **fields: str,
) -> Any:
    """POST /v1/files as a multipart form; returns the httpx response."""
    return client.post(
        "/v1/files",
        data={"purpose": purpose, **fields},
        files={"file": (filename, content, "application/jsonl")},
    )


def create_batch(client: Any, content: bytes, *, window: str = "24h", **body: Any) -> dict[str, Any]:
    """Upload `content` and create a chat-completions batch over it; returns the batch object."""
    up = upload(client, content)
    assert up.status_code == 200, up.text
    created = client.post("/v1/batches", json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": window, **body})
    assert created.status_code == 200, created.text
    return dict(created.json())


def assert_error(
    response: Any, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The response is the four-key OpenAI error envelope with this status (and code/param)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err
