"""The official openai SDK (and the real curl, when installed) against a live server: upload,
create, poll, list with pagination, retrieve, cancel, content, delete, and typed errors. No worker
runs here, so batches stay `validating`; the worker's tests cover execution."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from sqlalchemy import update

from server.config import Settings
from server.db import session_factory, session_scope
from server.models import BatchRow
from tests.server.conftest import batch_line

CHAT = "/v1/chat/completions"


@pytest.fixture
def client(live_server: str) -> OpenAI:
    return OpenAI(base_url=f"{live_server}/v1", api_key="unused-without-keys", max_retries=2)


@pytest.fixture
def input_path(tmp_path: Path) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(batch_line(f"req-{i}", f"Count to {i}.") + "\n" for i in range(4)))
    return path


def test_sdk_full_round_trip(client: OpenAI, input_path: Path) -> None:
    with input_path.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == input_path.stat().st_size
    assert uploaded.filename == "requests.jsonl" and uploaded.purpose == "batch"
    assert uploaded.expires_at == uploaded.created_at + 30 * 24 * 3600

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"suite": "sdk"}
    )
    assert batch.status == "validating" and batch.metadata == {"suite": "sdk"}
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.usage is not None and batch.usage.input_tokens_details.cached_tokens == 0

    for _ in range(3):  # poll
        polled = client.batches.retrieve(batch.id)
        assert polled.id == batch.id and polled.status == "validating"

    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).read() == input_path.read_bytes()

    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert client.batches.cancel(batch.id).status == "cancelling"

    with pytest.raises(openai.ConflictError):  # the input of a live batch
        client.files.delete(uploaded.id)
    other = client.files.create(file=("notes.txt", b"hello"), purpose="user_data")
    deleted = client.files.delete(other.id)
    assert deleted.deleted is True and deleted.id == other.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(other.id)


def test_sdk_lists_page_through_everything(client: OpenAI, input_path: Path) -> None:
    fid = client.files.create(file=input_path.open("rb"), purpose="batch").id
    ids = [
        client.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="1h").id
        for _ in range(5)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:-3:-1] and first.has_more is True
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-pagination via after
    files = [client.files.create(file=("f.jsonl", b"{}\n"), purpose="batch").id for _ in range(3)]
    listed = [f.id for f in client.files.list(purpose="batch", limit=2, order="asc")]
    assert listed == [fid, *files]


def test_sdk_raises_typed_errors(client: OpenAI, settings: Settings, input_path: Path) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.batches.retrieve("batch_missing")
    assert exc.value.body["message"] == "No such Batch object: batch_missing"
    fid = client.files.create(file=input_path.open("rb"), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    assert bad.value.code == "invalid_value" and bad.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="2w")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("input.txt", b"{}\n"), purpose="batch")

    done = client.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="24h")
    with session_scope(session_factory(settings)) as s:
        s.execute(update(BatchRow).where(BatchRow.id == done.id).values(status="completed"))
    raw = client.batches.with_raw_response
    with pytest.raises(openai.ConflictError) as conflict:
        raw.cancel(done.id)
    assert conflict.value.response.headers["x-should-retry"] == "false"
    assert conflict.value.message.endswith("Cannot cancel a batch with status 'completed'.")


def test_sdk_with_api_keys(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(make_settings(api_keys="sk-one:p1,sk-two:p2"))
    one = OpenAI(base_url=f"{base}/v1", api_key="sk-one")
    two = OpenAI(base_url=f"{base}/v1", api_key="sk-two")
    f = one.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert [x.id for x in one.files.list()] == [f.id]
    assert list(two.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        two.files.retrieve(f.id)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{base}/v1", api_key="sk-wrong").files.list()


def test_sdk_models(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models] == ["smollm2-135m-instruct"]
    assert client.models.retrieve("smollm2-135m-instruct").owned_by == "blendserve"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_real_curl_upload_and_create(live_server: str, input_path: Path) -> None:
    def curl(*args: str) -> dict:
        out = subprocess.run(["curl", "-sS", *args], check=True, capture_output=True, timeout=60)
        return json.loads(out.stdout)

    f = curl(f"{live_server}/v1/files", "-F", "purpose=batch", "-F", f"file=@{input_path}")
    assert f["bytes"] == input_path.stat().st_size and f["filename"] == "requests.jsonl"
    b = curl(
        f"{live_server}/v1/batches",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps({"input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"}),
    )
    assert b["status"] == "validating"
    out = subprocess.run(
        ["curl", "-sS", f"{live_server}/v1/files/{f['id']}/content"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    assert out == input_path.read_bytes()
    err = curl(
        f"{live_server}/v1/files", "-F", "purpose=batch", "-F", "file=@/dev/null;filename=x.csv"
    )
    assert err["error"]["message"] == "Invalid file format for Batch API. Must be .jsonl"


@pytest.mark.parametrize(
    "spec,name",
    [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("dummy:llama-3-8b", "dummy:llama-3-8b"),
        ("/models/Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct"),
        ("/models/Qwen2.5-7B-Instruct/", "Qwen2.5-7B-Instruct"),
        ("./weights/smollm2.Q8_0.gguf", "smollm2.Q8_0"),
    ],
)
def test_served_model_name(make_settings: Callable[..., Settings], spec: str, name: str) -> None:
    from server.routes.models import served_model_name

    assert served_model_name(make_settings(model=spec)) == name
