"""Hostile clients: path tricks in file names and URLs, oversize headers, bodies that trickle, key
guessing by timing, and one project flooding the API. Every answer is the OpenAI envelope."""

from __future__ import annotations

import hmac
import socket
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from server.auth import match_key
from server.config import Settings
from server.errors import APIError
from server.rate_limit import RateLimiter
from server.routes.files import stored_filename
from tests.server.conftest import assert_error, batch_line, upload

KEYS = "sk-alice-0123456789:alpha,sk-bob-9876543210:beta"
ALICE = {"Authorization": "Bearer sk-alice-0123456789"}
BOB = {"Authorization": "Bearer sk-bob-9876543210"}


# -- names and paths -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,stored",
    [
        ("../../etc/passwd.jsonl", "passwd.jsonl"),
        ("..\\..\\windows\\evil.jsonl", "evil.jsonl"),
        ("dir/sub/", "sub"),
        ("..", "upload"),
        ("a\x00b\r\nc.jsonl", "abc.jsonl"),
        ("x" * 300 + ".jsonl", "x" * 255),
    ],
)
def test_uploaded_names_are_metadata_never_paths(name: str, stored: str) -> None:
    assert stored_filename(name) == stored


def test_traversal_in_upload_names_writes_nothing_outside_storage(
    api: httpx.Client, settings: Settings
) -> None:
    before = {p for p in settings.data_dir.parent.rglob("*")}
    r = upload(api, b"{}\n", filename="../../../outside.jsonl")
    assert r.status_code == 200 and r.json()["filename"] == "outside.jsonl"
    created = {p for p in settings.data_dir.parent.rglob("*")} - before
    assert created and all((settings.data_dir / "files") in p.parents for p in created), created
    down = api.get(f"/v1/files/{r.json()['id']}/content")
    assert down.headers["content-disposition"] == 'attachment; filename="outside.jsonl"'


@pytest.mark.parametrize(
    "path",
    [
        "/ui/static/..%2F..%2Fconfig.py",
        "/ui/static/../../config.py",
        "/ui/static/%2e%2e/%2e%2e/auth.py",
        "/v1/files/..%2F..%2Fblendserve.db/content",
    ],
)
def test_path_tricks_in_urls_reach_nothing(api: httpx.Client, path: str) -> None:
    r = api.get(path)
    assert r.status_code == 404, r.text
    assert "Settings" not in r.text and "SQLite" not in r.text


# -- headers -------------------------------------------------------------------------------------
def test_oversize_headers_are_431(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(make_settings(max_header_bytes=4096))
    with httpx.Client(base_url=base) as c:
        assert c.get("/v1/batches", headers={"x-pad": "a" * 3000}).status_code == 200
        err = assert_error(c.get("/v1/batches", headers={"x-pad": "a" * 5000}), 431)
        assert err["code"] == "request_header_fields_too_large"
        many = {f"x-h{i}": "v" * 40 for i in range(100)}
        assert_error(c.get("/v1/files", headers=many), 431)


# -- slow bodies ---------------------------------------------------------------------------------
def _raw_request(port: int, head: bytes, body_parts: list[bytes], pause_s: float) -> bytes:
    """Send the head, then each body part after `pause_s`; return what the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            time.sleep(pause_s)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed: read the answer
                break
        sock.settimeout(30)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
        return data


def _multipart_head(port: int, length: int) -> bytes:
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: multipart/form-data; boundary=XyZ\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@pytest.fixture
def slow_server(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> int:
    settings = make_settings(body_idle_timeout_seconds=0.6, body_min_bytes_per_second=2000)
    return int(live_server_factory(settings).rsplit(":", 1)[1])


def test_a_body_that_stops_arriving_is_408(slow_server: int) -> None:
    started = time.monotonic()
    answer = _raw_request(slow_server, _multipart_head(slow_server, 10_000), [b"--XyZ\r\n"], 0)
    assert time.monotonic() - started < 20
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code":"request_timeout"' in body and b"Traceback" not in body


def test_a_body_that_trickles_is_408(slow_server: int) -> None:
    # one byte every 0.3 s never trips the 0.6 s idle timeout; the 2000 B/s floor does
    parts = [b"-", b"-", b"X", b"y", b"Z", b"\r", b"\n"] * 4
    answer = _raw_request(slow_server, _multipart_head(slow_server, 10_000), parts, 0.3)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"bytes/s" in body


def test_a_slow_but_steady_upload_still_succeeds(slow_server: int) -> None:
    content = b"".join((batch_line(f"r{i}") + "\n").encode() for i in range(40))
    with httpx.Client(base_url=f"http://127.0.0.1:{slow_server}") as c:

        def chunks():  # type: ignore[no-untyped-def]
            body = (
                b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"'
                b"\r\n\r\n" + content + b"\r\n--XyZ--\r\n"
            )
            for i in range(0, len(body), 2048):
                time.sleep(0.1)
                yield body[i : i + 2048]

        r = c.post(
            "/v1/files",
            content=chunks(),
            headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(content)


def test_a_finished_body_is_not_timed_while_the_answer_streams(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    """The idle timeout covers reading the request only: a slow download is not cut off."""
    base = live_server_factory(make_settings(body_idle_timeout_seconds=0.3))
    with httpx.Client(base_url=base) as c:
        fid = upload(c, b"x" * (3 << 20), filename="big.bin", purpose="user_data").json()["id"]
        got = 0
        with c.stream("GET", f"/v1/files/{fid}/content") as r:
            for chunk in r.iter_bytes(1 << 20):
                got += len(chunk)
                time.sleep(0.4)
    assert got == 3 << 20


# -- keys ----------------------------------------------------------------------------------------
def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = {"sk-first-key-000": "p1", "sk-second": "p2", "sk-a-much-longer-third-key": "p3"}
    assert match_key("sk-first-key-000", keys) == "p1"
    assert len(calls) == 3  # no early exit on the first match
    calls.clear()
    assert match_key("x", keys) is None
    assert calls == [(32, 32)] * 3  # digests: the offered key's length never shows


# -- rate limits ---------------------------------------------------------------------------------
def test_rate_limiter_refills_over_time() -> None:
    now = [0.0]
    limiter = RateLimiter(60, burst=2, clock=lambda: now[0])
    limiter.check("p")
    limiter.check("p")
    with pytest.raises(APIError) as denied:
        limiter.check("p")
    assert denied.value.status == 429 and denied.value.headers["Retry-After"] == "1"
    limiter.check("other")  # projects have their own buckets
    now[0] = 1.0  # one token back (60 per minute)
    limiter.check("p")
    with pytest.raises(APIError):
        limiter.check("p")


def test_a_flooding_project_gets_429_with_retry_after_and_others_do_not(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(make_settings(api_keys=KEYS, rate_limit_per_minute=5))
    with httpx.Client(base_url=base, headers=ALICE) as alice:
        answers = [alice.get("/v1/batches") for _ in range(7)]
        assert [r.status_code for r in answers] == [200] * 5 + [429] * 2
        err = assert_error(answers[-1], 429, code="rate_limit_exceeded")
        assert err["type"] == "rate_limit_error"
        assert 1 <= int(answers[-1].headers["retry-after"]) <= 12
        assert answers[-1].headers["x-ratelimit-limit-requests"] == "5"
        assert alice.get("/health").status_code == 200  # load balancers are never limited
    with httpx.Client(base_url=base, headers=BOB) as bob:
        assert bob.get("/v1/batches").status_code == 200
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-alice-0123456789", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        sdk.batches.list()


def test_rate_limits_are_off_by_default(api: httpx.Client) -> None:
    assert all(api.get("/v1/files").status_code == 200 for _ in range(100))


# -- text that JSON allows and UTF-8 does not ------------------------------------------------------
@pytest.mark.parametrize(
    "fields,param",
    [
        ({"metadata": {"k": "\\ud800"}}, "metadata.k"),
        ({"metadata": {"\\udc00": "v"}}, "metadata"),
        ({"endpoint": "\\ud800"}, "endpoint"),
        ({"input_file_id": "file-\\udfff"}, "input_file_id"),
    ],
)
def test_unpaired_surrogates_in_json_are_400_and_poison_nothing(
    api: httpx.Client, fields: dict[str, object], param: str
) -> None:
    """Found while fuzzing: such metadata was stored, then every list of batches answered 500."""
    import json

    fid = upload(api, (batch_line("x") + "\n").encode()).json()["id"]
    body = {
        "input_file_id": fid,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **fields,
    }
    raw = json.dumps(body).replace("\\\\u", "\\u")  # keep the escapes as JSON escapes
    r = api.post("/v1/batches", content=raw, headers={"Content-Type": "application/json"})
    assert_error(r, 400, code="invalid_value", param=param)
    assert api.get("/v1/batches").status_code == 200
