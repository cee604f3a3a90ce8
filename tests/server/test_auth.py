"""Bearer keys map to projects; a project never sees another's files or batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from server.auth import project_for
from server.config import Settings
from server.errors import APIError
from tests.server.conftest import assert_error, batch_line, upload

KEYS = "sk-alice-0123456789:alpha,sk-bob-9876543210:beta"


@pytest.fixture
def base(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> str:
    return live_server_factory(make_settings(api_keys=KEYS))


@pytest.fixture
def alice(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer sk-alice-0123456789"}) as c:
        yield c


@pytest.fixture
def bob(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer sk-bob-9876543210"}) as c:
        yield c


def _batch(client: httpx.Client) -> tuple[str, str]:
    fid = upload(client, (batch_line("x") + "\n").encode()).json()["id"]
    bid = client.post(
        "/v1/batches",
        json={"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()["id"]
    return fid, bid


@pytest.mark.parametrize(
    "headers,code",
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer"}, "missing_api_key"),
        ({"Authorization": "Basic c2stYWxpY2U6"}, "missing_api_key"),
        ({"Authorization": "Bearer sk-mallory-000000"}, "invalid_api_key"),
        ({"Authorization": "Bearer sk-alice-0123456789x"}, "invalid_api_key"),
    ],
)
def test_missing_or_unknown_key_is_401(base: str, headers: dict[str, str], code: str) -> None:
    with httpx.Client(base_url=base, headers=headers) as c:
        for r in (
            c.get("/v1/files"),
            c.get("/v1/batches"),
            c.get("/v1/models"),
            c.post("/v1/batches", json={}),
            c.get("/v1/files/file-x"),
            upload(c, b"{}\n"),
        ):
            err = assert_error(r, 401, code=code)
            assert err["type"] == "authentication_error"


def test_the_key_is_not_echoed_in_full(base: str) -> None:
    with httpx.Client(base_url=base, headers={"Authorization": "Bearer sk-secret-abcdefgh"}) as c:
        assert "sk-secret-abcdefgh" not in c.get("/v1/files").text


def test_health_needs_no_key(base: str) -> None:
    assert httpx.get(f"{base}/health").status_code == 200


def test_another_projects_objects_are_404(alice: httpx.Client, bob: httpx.Client) -> None:
    fid, bid = _batch(alice)
    for r in (
        bob.get(f"/v1/files/{fid}"),
        bob.get(f"/v1/files/{fid}/content"),
        bob.delete(f"/v1/files/{fid}"),
    ):
        assert assert_error(r, 404)["message"] == f"No such File object: {fid}"
    for r in (bob.get(f"/v1/batches/{bid}"), bob.post(f"/v1/batches/{bid}/cancel")):
        assert assert_error(r, 404)["message"] == f"No such Batch object: {bid}"
    r = bob.post(
        "/v1/batches",
        json={"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert_error(r, 404, param="input_file_id")
    # alice's objects are untouched by bob's attempts
    assert alice.get(f"/v1/batches/{bid}").json()["status"] == "validating"
    assert alice.get(f"/v1/files/{fid}").status_code == 200


def test_lists_show_only_the_callers_project(alice: httpx.Client, bob: httpx.Client) -> None:
    a_file, a_batch = _batch(alice)
    b_file, b_batch = _batch(bob)
    assert [f["id"] for f in alice.get("/v1/files").json()["data"]] == [a_file]
    assert [f["id"] for f in bob.get("/v1/files").json()["data"]] == [b_file]
    assert [b["id"] for b in alice.get("/v1/batches").json()["data"]] == [a_batch]
    assert [b["id"] for b in bob.get("/v1/batches").json()["data"]] == [b_batch]
    # a cursor from another project is not a way in
    assert_error(bob.get("/v1/batches", params={"after": a_batch}), 400, param="after")


def test_without_keys_everything_is_project_default(api: httpx.Client) -> None:
    fid = upload(api, b"{}\n").json()["id"]
    r = api.get(f"/v1/files/{fid}", headers={"Authorization": "Bearer anything-at-all"})
    assert r.status_code == 200
    assert project_for(None, {}) == "default"


def test_project_for_maps_keys() -> None:
    keys = {"k1": "p1", "k2": "p2"}
    assert project_for("Bearer k2", keys) == "p2"
    assert project_for("bearer k1", keys) == "p1"
    with pytest.raises(APIError) as exc:
        project_for("Bearer k3", keys)
    assert exc.value.status == 401
