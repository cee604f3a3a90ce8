"""The bad-input suite: whatever a client sends, the answer is the four-key OpenAI envelope with
a 4xx status (never a 5xx, never a traceback), and the server keeps serving."""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import Settings
from server.db import downgrade, upgrade
from tests.server.conftest import assert_error, batch_line, upload

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def batch_file(shared_api: httpx.Client) -> str:
    return upload(shared_api, (batch_line("a") + "\n").encode()).json()["id"]


# -- POST /v1/batches: every synchronous validation code ------------------------------------------
@pytest.mark.parametrize(
    "body,code,param",
    [
        (
            {"endpoint": CHAT, "completion_window": "24h"},
            "missing_required_parameter",
            "input_file_id",
        ),
        (
            {"input_file_id": "F", "completion_window": "24h"},
            "missing_required_parameter",
            "endpoint",
        ),
        (
            {"input_file_id": "F", "endpoint": CHAT},
            "missing_required_parameter",
            "completion_window",
        ),
        (
            {"input_file_id": "F", "endpoint": "/v1/embeddings", "completion_window": "24h"},
            "invalid_value",
            "endpoint",
        ),
        (
            {"input_file_id": "F", "endpoint": CHAT, "completion_window": "7d"},
            "invalid_value",
            "completion_window",
        ),
        (
            {"input_file_id": "F", "endpoint": CHAT, "completion_window": "24h", "metadata": "x"},
            "invalid_type",
            "metadata",
        ),
        (
            {
                "input_file_id": "F",
                "endpoint": CHAT,
                "completion_window": "24h",
                "metadata": {"a": 1},
            },
            "invalid_type",
            "metadata.a",
        ),
        (
            {"input_file_id": 5, "endpoint": CHAT, "completion_window": "24h"},
            "invalid_type",
            "input_file_id",
        ),
        (
            {"input_file_id": "F", "endpoint": ["x"], "completion_window": "24h"},
            "invalid_type",
            "endpoint",
        ),
        (
            {"input_file_id": "F", "endpoint": CHAT, "completion_window": 24},
            "invalid_type",
            "completion_window",
        ),
        (
            {
                "input_file_id": "F",
                "endpoint": CHAT,
                "completion_window": "24h",
                "output_expires_after": 5,
            },
            "invalid_type",
            "output_expires_after",
        ),
    ],
)
def test_create_batch_validation_codes(
    shared_api: httpx.Client, batch_file: str, body: dict, code: str, param: str
) -> None:
    if body.get("input_file_id") == "F":
        body = {**body, "input_file_id": batch_file}
    assert_error(shared_api.post("/v1/batches", json=body), 400, code=code, param=param)


@pytest.mark.parametrize(
    "content,content_type",
    [
        (b"not json", "application/json"),
        (b'{"input_file_id": ', "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"[]", "application/json"),
        (b"null", "application/json"),
        (b"42", "application/json"),
        (b'"a string"', "application/json"),
        (b"", "application/json"),
        (b"input_file_id=file-1&endpoint=x", "application/x-www-form-urlencoded"),
        (b'{"input_file_id": "f"}', "text/plain"),
        (b'{"input_file_id": "f"}', ""),
        (os.urandom(4096), "application/octet-stream"),
    ],
)
def test_junk_batch_bodies_are_400(
    shared_api: httpx.Client, content: bytes, content_type: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    assert_error(shared_api.post("/v1/batches", content=content, headers=headers), 400)


def test_oversized_json_body_is_413(shared_api: httpx.Client) -> None:
    big = b'{"metadata": {"k": "' + b"x" * (2 * 1024 * 1024) + b'"}}'
    assert_error(
        shared_api.post("/v1/batches", content=big, headers={"Content-Type": "application/json"}),
        413,
    )

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"metadata": {"k": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}}'

    assert_error(
        shared_api.post(
            "/v1/batches", content=chunked(), headers={"Content-Type": "application/json"}
        ),
        413,
    )


# -- POST /v1/files -------------------------------------------------------------------------------
def test_upload_field_problems(shared_api: httpx.Client) -> None:
    api = shared_api
    assert_error(
        api.post("/v1/files", data={"purpose": "batch"}, files={"other": ("x.jsonl", b"{}")}),
        400,
        code="missing_required_parameter",
        param="file",
    )
    assert_error(
        api.post("/v1/files", files={"file": ("x.jsonl", b"{}")}),
        400,
        code="missing_required_parameter",
        param="purpose",
    )
    assert_error(
        upload(api, b"{}\n", purpose="batch_output"), 400, code="invalid_value", param="purpose"
    )
    assert_error(
        upload(api, b"{}\n", purpose="nonsense"), 400, code="invalid_value", param="purpose"
    )
    assert_error(
        upload(
            api,
            b"{}\n",
            **{"expires_after[anchor]": "last_access", "expires_after[seconds]": "3600"},
        ),
        400,
        param="expires_after[anchor]",
    )
    two = api.post(
        "/v1/files",
        data={"purpose": "batch"},
        files=[("file", ("a.jsonl", b"{}")), ("file", ("b.jsonl", b"{}"))],
    )
    assert_error(two, 400, param="file")


@pytest.mark.parametrize(
    "content,content_type",
    [
        (b'{"purpose": "batch"}', "application/json"),
        (b"purpose=batch", "application/x-www-form-urlencoded"),
        (
            b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--x--\r\n',
            "multipart/form-data",
        ),  # no boundary parameter
        (b"this is not multipart at all", "multipart/form-data; boundary=abc"),
        (
            b'--abc\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}',
            "multipart/form-data; boundary=abc",
        ),  # truncated: no closing boundary
        (
            b"--abc\r\nContent-Disposition: form-data\r\n\r\nbatch\r\n--abc--\r\n",
            "multipart/form-data; boundary=abc",
        ),  # a part without a name
        (
            b'--abc\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n\xff\xfe\r\n--abc--\r\n',
            "multipart/form-data; boundary=abc",
        ),  # a field that is not UTF-8
        (os.urandom(8192), "multipart/form-data; boundary=abc"),
        (b"", "multipart/form-data; boundary=abc"),
        (b"", ""),
    ],
)
def test_junk_upload_bodies_are_400(
    shared_api: httpx.Client, content: bytes, content_type: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    assert_error(shared_api.post("/v1/files", content=content, headers=headers), 400)


def test_empty_and_non_utf8_batch_files_are_stored_for_validation(shared_api: httpx.Client) -> None:
    """The worker's validation reports them line by line (empty_file, invalid_json_line); the
    upload itself stores them as sent, and a batch can be created on them."""
    for content in (b"", b"\xff\xfe\xfa not utf-8\n", b"\x00\x01\x02"):
        f = upload(shared_api, content).json()
        assert f["bytes"] == len(content)
        assert shared_api.get(f"/v1/files/{f['id']}/content").content == content
        r = shared_api.post(
            "/v1/batches",
            json={"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"},
        )
        assert r.status_code == 200 and r.json()["status"] == "validating"


def test_odd_filenames_survive(shared_api: httpx.Client) -> None:
    for name in ("ünïcødé ✓.jsonl", 'quo"te.jsonl', "../../etc/passwd.jsonl", "a\\b.jsonl"):
        f = upload(shared_api, b"{}\n", filename=name).json()
        assert "/" not in f["filename"]
        r = shared_api.get(f"/v1/files/{f['id']}/content")
        assert r.status_code == 200 and r.content == b"{}\n"


# -- unknown ids, routes, methods, pagination -----------------------------------------------------
@pytest.mark.parametrize(
    "method,path,message",
    [
        ("GET", "/v1/files/file-abc", "No such File object: file-abc"),
        ("GET", "/v1/files/file-abc/content", "No such File object: file-abc"),
        ("DELETE", "/v1/files/file-abc", "No such File object: file-abc"),
        ("GET", "/v1/files/..%2F..%2Fetc%2Fpasswd/content", None),
        ("GET", "/v1/batches/batch_abc", "No such Batch object: batch_abc"),
        ("POST", "/v1/batches/batch_abc/cancel", "No such Batch object: batch_abc"),
        ("GET", "/v1/models/gpt-4", "No such Model object: gpt-4"),
        ("GET", "/v1/nothing-here", "Invalid URL (GET /v1/nothing-here)"),
        ("GET", "/", None),
    ],
)
def test_unknown_ids_and_routes_are_404(
    shared_api: httpx.Client, method: str, path: str, message: str | None
) -> None:
    err = assert_error(shared_api.request(method, path), 404)
    if message is not None:
        assert err["message"] == message


@pytest.mark.parametrize(
    "method,path",
    [
        ("PUT", "/v1/files"),
        ("DELETE", "/v1/batches"),
        ("PATCH", "/v1/batches/batch_x"),
        ("POST", "/health"),
        ("GET", "/v1/batches/batch_x/cancel"),
    ],
)
def test_wrong_method_is_405(shared_api: httpx.Client, method: str, path: str) -> None:
    assert_error(shared_api.request(method, path), 405)


@pytest.mark.parametrize(
    "path,params,param",
    [
        ("/v1/batches", {"limit": "0"}, "limit"),
        ("/v1/batches", {"limit": "101"}, "limit"),
        ("/v1/batches", {"limit": "ten"}, "limit"),
        ("/v1/batches", {"limit": "-5"}, "limit"),
        ("/v1/batches", {"after": "batch_unknown"}, "after"),
        ("/v1/files", {"limit": "10001"}, "limit"),
        ("/v1/files", {"limit": "1e3"}, "limit"),
        ("/v1/files", {"order": "sideways"}, "order"),
        ("/v1/files", {"after": "file-unknown"}, "after"),
    ],
)
def test_bad_pagination_params_are_400(
    shared_api: httpx.Client, path: str, params: dict, param: str
) -> None:
    assert_error(shared_api.get(path, params=params), 400, param=param)


def test_junk_everywhere_never_5xx(shared_api: httpx.Client) -> None:
    """A small fuzz over every route with junk bodies, headers and query strings."""
    junk = [b"", b"[]", os.urandom(256), b'{"a":' * 500]
    routes = [
        ("POST", "/v1/files"),
        ("GET", "/v1/files"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches"),
        ("POST", "/v1/batches/batch_x/cancel"),
        ("GET", "/v1/files/%00/content"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("DELETE", "/v1/files/" + "x" * 5000),
    ]
    ctypes = [
        "application/json; charset=utf-16",
        "multipart/form-data; boundary=zz",
        "multipart/form-data; boundary=" + "b" * 300,
    ]
    for method, path in routes:
        for body in junk:
            for ctype in ctypes:
                r = shared_api.request(
                    method,
                    path,
                    content=body,
                    headers={"Content-Type": ctype},
                    params={"limit": "x\x7f", "after": "\u2603"},
                )
                assert r.status_code < 500, (method, path, body[:20], ctype, r.text)
                if r.status_code >= 400:
                    assert_error(r, r.status_code)
    assert shared_api.get("/health").status_code == 200


# -- server-side failures: envelope, no traceback -------------------------------------------------
def test_unhandled_errors_are_a_500_envelope_without_traceback(settings: Settings) -> None:
    upgrade(settings)
    app = create_app(settings)

    def boom() -> None:
        raise RuntimeError("secret internal detail")

    app.add_api_route("/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    err = assert_error(r, 500)
    assert err["type"] == "server_error" and "secret" not in r.text


def test_a_broken_database_is_503_not_500(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    settings = make_settings()
    with httpx.Client(base_url=live_server_factory(settings)) as api:
        downgrade(settings, "base")  # tables gone under the running server
        r = api.get("/v1/batches")
        err = assert_error(r, 503)
        assert r.headers["retry-after"]
        assert "Traceback" not in err["message"] and "sqlite" not in r.text.lower()
        assert_error(api.get("/health"), 503)
