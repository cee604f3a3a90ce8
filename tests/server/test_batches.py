"""/v1/batches on a live server: create (and its synchronous 400s), retrieve, list newest first
with after/limit, cancel through the status machine, and counts/usage/errors read from the row."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from server.config import Settings
from server.db import session_factory, session_scope
from server.models import BatchRow
from tests.server.conftest import assert_error, batch_line, upload

CHAT = "/v1/chat/completions"


@pytest.fixture
def input_file(api: httpx.Client) -> str:
    return upload(api, (batch_line("a") + "\n" + batch_line("b") + "\n").encode()).json()["id"]


@pytest.fixture(scope="module")
def shared_file(shared_api: httpx.Client) -> str:
    return upload(shared_api, (batch_line("a") + "\n").encode()).json()["id"]


def _create(api: httpx.Client, input_file: str, **over: Any) -> httpx.Response:
    body = {"input_file_id": input_file, "endpoint": CHAT, "completion_window": "24h", **over}
    return api.post("/v1/batches", json=body)


def _set(settings: Settings, batch_id: str, **values: Any) -> None:
    """Play the worker: move a batch's row directly."""
    with session_scope(session_factory(settings)) as s:
        s.execute(update(BatchRow).where(BatchRow.id == batch_id).values(**values))


def test_create_returns_a_validating_batch(api: httpx.Client, input_file: str) -> None:
    before = int(time.time())
    r = _create(api, input_file, metadata={"team": "search", "run": "7"})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["id"].startswith("batch_") and b["object"] == "batch"
    assert b["status"] == "validating" and b["endpoint"] == CHAT
    assert b["input_file_id"] == input_file and b["completion_window"] == "24h"
    assert before <= b["created_at"] <= int(time.time())
    assert b["expires_at"] == b["created_at"] + 24 * 3600
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert b["metadata"] == {"team": "search", "run": "7"}
    assert b["errors"] is None and b["output_file_id"] is None and b["error_file_id"] is None
    assert b["usage"]["total_tokens"] == 0
    for stamp in (
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        assert b[stamp] is None
    assert api.get(f"/v1/batches/{b['id']}").json() == b


@pytest.mark.parametrize(
    "window,seconds",
    [("24h", 86400), ("1m", 60), ("90m", 5400), ("1h", 3600), ("168h", 604800), ("10080m", 604800)],
)
def test_accepted_completion_windows_set_expires_at(
    shared_api: httpx.Client, shared_file: str, window: str, seconds: int
) -> None:
    b = _create(shared_api, shared_file, completion_window=window).json()
    assert b["completion_window"] == window and b["expires_at"] - b["created_at"] == seconds


@pytest.mark.parametrize(
    "window",
    ["0m", "169h", "10081m", "24", "1d", "h", "-1h", "1.5h", " 24h", "24H", "", "99999999h"],
)
def test_other_completion_windows_are_400(
    shared_api: httpx.Client, shared_file: str, window: str
) -> None:
    assert_error(
        _create(shared_api, shared_file, completion_window=window),
        400,
        code="invalid_value",
        param="completion_window",
    )


@pytest.mark.parametrize("endpoint", ["/v1/embeddings", "/v1/responses", "chat", ""])
def test_unknown_endpoint_is_400(shared_api: httpx.Client, shared_file: str, endpoint: str) -> None:
    assert_error(
        _create(shared_api, shared_file, endpoint=endpoint),
        400,
        code="invalid_value",
        param="endpoint",
    )


def test_completions_endpoint_is_accepted(shared_api: httpx.Client, shared_file: str) -> None:
    assert (
        _create(shared_api, shared_file, endpoint="/v1/completions").json()["endpoint"]
        == "/v1/completions"
    )


@pytest.mark.parametrize(
    "metadata,code,param",
    [
        ("a string", "invalid_type", "metadata"),
        ([["k", "v"]], "invalid_type", "metadata"),
        ({"k": 1}, "invalid_type", "metadata.k"),
        ({"k": None}, "invalid_type", "metadata.k"),
        ({f"k{i}": "v" for i in range(17)}, "invalid_value", "metadata"),
        ({"k" * 65: "v"}, "invalid_value", "metadata"),
        ({"k": "v" * 513}, "invalid_value", "metadata.k"),
    ],
)
def test_bad_metadata_is_400(
    shared_api: httpx.Client, shared_file: str, metadata: Any, code: str, param: str
) -> None:
    assert_error(_create(shared_api, shared_file, metadata=metadata), 400, code=code, param=param)


def test_metadata_at_the_limits_is_accepted(shared_api: httpx.Client, shared_file: str) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert _create(shared_api, shared_file, metadata=metadata).json()["metadata"] == metadata


def test_output_expires_after_is_checked(shared_api: httpx.Client, shared_file: str) -> None:
    ok = {"anchor": "created_at", "seconds": 3600}
    assert _create(shared_api, shared_file, output_expires_after=ok).status_code == 200
    assert_error(
        _create(
            shared_api, shared_file, output_expires_after={"anchor": "created_at", "seconds": 60}
        ),
        400,
        param="output_expires_after.seconds",
    )
    assert_error(
        _create(shared_api, shared_file, output_expires_after={"anchor": "now", "seconds": 3600}),
        400,
        param="output_expires_after.anchor",
    )


def test_input_file_must_exist(api: httpx.Client) -> None:
    err = assert_error(_create(api, "file-doesnotexist"), 404, param="input_file_id")
    assert err["message"] == "No such File object: file-doesnotexist"


def test_input_file_must_have_purpose_batch(api: httpx.Client) -> None:
    fid = upload(api, b"{}\n", filename="x.jsonl", purpose="user_data").json()["id"]
    assert_error(_create(api, fid), 400, code="invalid_value", param="input_file_id")


def test_list_is_newest_first_and_pages(api: httpx.Client, input_file: str) -> None:
    ids = [_create(api, input_file).json()["id"] for _ in range(7)]
    first = api.get("/v1/batches").json()
    assert [b["id"] for b in first["data"]] == ids[::-1] and first["has_more"] is False
    seen, after = [], None
    while True:
        page = api.get(
            "/v1/batches", params={"limit": 3, **({"after": after} if after else {})}
        ).json()
        assert len(page["data"]) <= 3
        seen += [b["id"] for b in page["data"]]
        assert (
            page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        )
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids[::-1]


def test_empty_list(api: httpx.Client) -> None:
    assert api.get("/v1/batches").json() == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


@pytest.mark.parametrize("status", ["validating", "in_progress"])
def test_cancel_moves_a_live_batch_to_cancelling(
    api: httpx.Client, settings: Settings, input_file: str, status: str
) -> None:
    bid = _create(api, input_file).json()["id"]
    _set(settings, bid, status=status)
    r = api.post(f"/v1/batches/{bid}/cancel")
    assert r.status_code == 200
    b = r.json()
    assert b["status"] == "cancelling" and b["cancelling_at"] is not None
    again = api.post(f"/v1/batches/{bid}/cancel").json()  # cancelling: unchanged
    assert again == b


def test_cancel_on_cancelled_returns_it_unchanged(
    api: httpx.Client, settings: Settings, input_file: str
) -> None:
    bid = _create(api, input_file).json()["id"]
    _set(settings, bid, status="cancelled", cancelling_at=1, cancelled_at=2)
    b = api.post(f"/v1/batches/{bid}/cancel").json()
    assert (b["status"], b["cancelling_at"], b["cancelled_at"]) == ("cancelled", 1, 2)


@pytest.mark.parametrize("status", ["completed", "failed", "expired", "finalizing"])
def test_cancel_on_a_finished_batch_is_409_without_retry(
    api: httpx.Client, settings: Settings, input_file: str, status: str
) -> None:
    bid = _create(api, input_file).json()["id"]
    _set(settings, bid, status=status)
    r = api.post(f"/v1/batches/{bid}/cancel")
    err = assert_error(r, 409)
    assert err["message"] == f"Cannot cancel a batch with status '{status}'."
    assert r.headers["x-should-retry"] == "false"
    assert api.get(f"/v1/batches/{bid}").json()["status"] == status


def test_counts_usage_and_errors_come_from_the_row(
    api: httpx.Client, settings: Settings, input_file: str
) -> None:
    bid = _create(api, input_file).json()["id"]
    errors = [
        {"code": "invalid_json_line", "message": "bad", "param": None, "line": 3},
        {"code": "mixed_models", "message": "two", "param": "body.model", "line": 9},
    ]
    _set(
        settings,
        bid,
        status="failed",
        failed_at=123,
        total=10,
        completed=6,
        failed=4,
        input_tokens=100,
        cached_tokens=40,
        output_tokens=25,
        errors=errors,
        model="smollm2-135m-instruct",
        output_file_id="file-out",
        error_file_id="file-err",
    )
    b = api.get(f"/v1/batches/{bid}").json()
    assert b["request_counts"] == {"total": 10, "completed": 6, "failed": 4}
    assert b["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 40},
        "output_tokens": 25,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 125,
    }
    assert b["errors"] == {"object": "list", "data": errors}
    assert (b["status"], b["failed_at"], b["model"]) == ("failed", 123, "smollm2-135m-instruct")
    assert (b["output_file_id"], b["error_file_id"]) == ("file-out", "file-err")


def test_unknown_batch_is_404(api: httpx.Client) -> None:
    for r in (api.get("/v1/batches/batch_nope"), api.post("/v1/batches/batch_nope/cancel")):
        err = assert_error(r, 404, param="id")
        assert err["message"] == "No such Batch object: batch_nope"


def test_create_notifies_the_queue(make_settings, live_server_factory, redis_url: str) -> None:
    """With REDIS_URL set, a created batch reaches the worker stream (worker helper's queue)."""
    queue_mod = pytest.importorskip("server.queue")
    import redis

    settings = make_settings(redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    stream = getattr(queue_mod, "STREAM", None)
    if stream is None:
        pytest.skip("server.queue has no STREAM name")
    with httpx.Client(base_url=live_server_factory(settings)) as api:
        fid = upload(api, (batch_line("a") + "\n").encode()).json()["id"]
        bid = _create(api, fid).json()["id"]
    mine = [
        entry_id
        for entry_id, fields in client.xrevrange(stream, count=100)
        if bid.encode() in b"".join(v for kv in fields.items() for v in kv)
    ]
    if mine:
        client.xdel(stream, *mine)  # leave the shared stream as we found it
    assert len(mine) == 1
