"""/v1/files on a live server: streamed upload with limits, list/order/after/limit, retrieve,
content, delete, expires_at, and multipart bodies exactly as curl writes them."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import update

from server.config import Settings
from server.db import session_factory, session_scope
from server.models import FileRow
from server.routes.files import purge_expired_files
from server.storage import FileStorage
from tests.server.conftest import assert_error, batch_line, upload

DAY = 24 * 3600


def _jsonl(n: int) -> bytes:
    return "".join(batch_line(f"r{i}") + "\n" for i in range(n)).encode()


def test_upload_returns_the_file_object(api: httpx.Client) -> None:
    content = _jsonl(3)
    before = int(time.time())
    r = upload(api, content)
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["id"].startswith("file-") and len(f["id"]) == len("file-") + 24
    assert f["object"] == "file" and f["purpose"] == "batch" and f["status"] == "processed"
    assert f["bytes"] == len(content) and f["filename"] == "input.jsonl"
    assert before <= f["created_at"] <= int(time.time())
    assert f["expires_at"] == f["created_at"] + 30 * DAY  # batch files: 30 days by default
    assert f["status_details"] is None


def test_content_streams_back_the_exact_bytes(api: httpx.Client) -> None:
    content = _jsonl(200) + "héllo ✓\n".encode()
    fid = upload(api, content).json()["id"]
    r = api.get(f"/v1/files/{fid}/content")
    assert r.status_code == 200 and r.content == content
    assert int(r.headers["content-length"]) == len(content)


def test_non_batch_files_do_not_expire_unless_asked(api: httpx.Client) -> None:
    f = upload(api, b"anything", filename="notes.txt", purpose="user_data").json()
    assert f["expires_at"] is None and f["purpose"] == "user_data"


def test_expires_after_sets_expires_at(api: httpx.Client) -> None:
    f = upload(
        api, _jsonl(1), **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
    ).json()
    assert f["expires_at"] == f["created_at"] + 7200


@pytest.mark.parametrize("seconds", ["3599", "2592001", "soon"])
def test_expires_after_out_of_range_is_400(api: httpx.Client, seconds: str) -> None:
    r = upload(
        api, _jsonl(1), **{"expires_after[anchor]": "created_at", "expires_after[seconds]": seconds}
    )
    assert_error(r, 400, param="expires_after[seconds]")


def test_batch_files_must_be_jsonl(api: httpx.Client) -> None:
    err = assert_error(upload(api, _jsonl(1), filename="input.csv"), 400, param="file")
    assert err["message"] == "Invalid file format for Batch API. Must be .jsonl"


def test_over_max_file_bytes_is_413_and_nothing_is_stored(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    settings = make_settings(max_file_bytes=10_000)
    with httpx.Client(base_url=live_server_factory(settings)) as api:
        assert upload(api, b"x" * 10_000, purpose="user_data", filename="ok.bin").status_code == 200
        assert_error(upload(api, b"x" * 10_001, purpose="user_data", filename="big.bin"), 413)
        assert_error(upload(api, b"y" * 200_000, purpose="user_data", filename="big.bin"), 413)
        assert len(api.get("/v1/files").json()["data"]) == 1
    assert len(list((settings.data_dir / "files").iterdir())) == 1  # no partial left behind


def test_over_max_batch_lines_is_400(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    with httpx.Client(base_url=live_server_factory(make_settings(max_batch_lines=5))) as api:
        assert upload(api, _jsonl(5)).status_code == 200
        assert_error(upload(api, _jsonl(6)), 400, code="too_many_tasks")
        # the line limit is for batch input only
        assert upload(api, _jsonl(6), purpose="user_data").status_code == 200


def test_list_orders_filters_and_pages(api: httpx.Client) -> None:
    ids = [upload(api, _jsonl(1)).json()["id"] for _ in range(5)]
    other = upload(api, b"x", filename="x.txt", purpose="user_data").json()["id"]
    everything = api.get("/v1/files").json()
    assert [f["id"] for f in everything["data"]] == [other, *reversed(ids)]  # newest first
    assert everything["object"] == "list" and everything["has_more"] is False

    batch_only = api.get("/v1/files", params={"purpose": "batch", "order": "asc"}).json()
    assert [f["id"] for f in batch_only["data"]] == ids

    seen, after = [], None
    while True:
        params = {"purpose": "batch", "limit": 2, **({"after": after} if after else {})}
        page = api.get("/v1/files", params=params).json()
        seen += [f["id"] for f in page["data"]]
        assert (
            page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        )
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == list(reversed(ids))


def test_retrieve_and_delete(api: httpx.Client, settings: Settings) -> None:
    fid = upload(api, _jsonl(2)).json()["id"]
    assert api.get(f"/v1/files/{fid}").json()["id"] == fid
    r = api.delete(f"/v1/files/{fid}")
    assert r.status_code == 200 and r.json() == {"id": fid, "object": "file", "deleted": True}
    assert not (settings.data_dir / "files" / fid).exists()
    for call in (
        api.get(f"/v1/files/{fid}"),
        api.get(f"/v1/files/{fid}/content"),
        api.delete(f"/v1/files/{fid}"),
    ):
        err = assert_error(call, 404, param="id")
        assert err["message"] == f"No such File object: {fid}"


def test_a_file_a_running_batch_reads_cannot_be_deleted(api: httpx.Client) -> None:
    fid = upload(api, _jsonl(2)).json()["id"]
    batch = api.post(
        "/v1/batches",
        json={"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    r = api.delete(f"/v1/files/{fid}")
    assert_error(r, 409, code="file_in_use")
    assert r.headers["x-should-retry"] == "false"
    assert batch["id"] in r.json()["error"]["message"]


def _curl_body(boundary: str, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    """A multipart body byte for byte as `curl -F name=value -F file=@path` writes it."""
    out = b""
    for name, filename, data in parts:
        out += f"--{boundary}\r\n".encode()
        if filename is None:
            out += f'Content-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        else:
            out += (
                f'Content-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
        out += data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize("file_first", [False, True])
def test_curl_style_multipart_upload(api: httpx.Client, file_first: bool) -> None:
    boundary = "------------------------d74496d66958873e"
    content = _jsonl(3)
    parts = [("purpose", None, b"batch"), ("file", "batch input.jsonl", content)]
    body = _curl_body(boundary, parts[::-1] if file_first else parts)
    r = api.post(
        "/v1/files",
        content=body,
        headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Expect": "100-continue",
            "User-Agent": "curl/8.5.0",
            "Accept": "*/*",
        },
    )
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["filename"] == "batch input.jsonl" and f["bytes"] == len(content)
    assert api.get(f"/v1/files/{f['id']}/content").content == content


def test_upload_in_small_chunks_without_content_length(api: httpx.Client) -> None:
    """Chunked transfer encoding, the body split at awkward places (inside the boundary)."""
    boundary = "XyZ123"
    content = _jsonl(50)
    body = _curl_body(boundary, [("purpose", None, b"batch"), ("file", "c.jsonl", content)])

    def pieces():
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    r = api.post(
        "/v1/files",
        content=pieces(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert r.status_code == 200, r.text
    assert api.get(f"/v1/files/{r.json()['id']}/content").content == content


def _expire(settings: Settings, file_id: str) -> None:
    with session_scope(session_factory(settings)) as s:
        s.execute(update(FileRow).where(FileRow.id == file_id).values(expires_at=1))


def test_expired_files_are_gone_from_the_api(api: httpx.Client, settings: Settings) -> None:
    keep = upload(api, _jsonl(1)).json()["id"]
    gone = upload(api, _jsonl(1)).json()["id"]
    _expire(settings, gone)
    assert [f["id"] for f in api.get("/v1/files").json()["data"]] == [keep]
    for r in (api.get(f"/v1/files/{gone}"), api.get(f"/v1/files/{gone}/content")):
        assert_error(r, 404)
    r = api.post(
        "/v1/batches",
        json={
            "input_file_id": gone,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert_error(r, 404, param="input_file_id")


def test_purge_reclaims_expired_files_but_not_a_running_batchs_input(
    api: httpx.Client, settings: Settings
) -> None:
    idle = upload(api, _jsonl(1)).json()["id"]
    busy = upload(api, _jsonl(1)).json()["id"]
    api.post(
        "/v1/batches",
        json={
            "input_file_id": busy,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    _expire(settings, idle)
    _expire(settings, busy)
    storage = FileStorage(settings.data_dir / "files")
    assert purge_expired_files(session_factory(settings), storage, int(time.time())) == 1
    assert not storage.exists(idle) and storage.exists(busy)
    with session_factory(settings)() as s:
        assert s.get(FileRow, idle) is None and s.get(FileRow, busy) is not None
