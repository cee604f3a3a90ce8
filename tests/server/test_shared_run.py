"""Several batches on one worker's engine at once (server/shared_run.py): they run together, share
a system prompt's KV, stop alone (cancel, expiry) without touching the others, and a
high-priority project's batch goes first."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from runtime.engine import Engine, EngineConfig
from runtime.loader import DEFAULT_MODEL, load_model
from scheduler.mix import MixPolicy
from server.config import Settings
from server.worker import Worker
from tests.server import test_worker
from tests.server.conftest import create_batch
from tests.server.test_worker import REPO, batch_row, chat_line, seed_batch, set_status


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return test_worker.worker_settings(make_settings)


@pytest.fixture
def db(settings: Settings) -> Iterator[sa.Engine]:
    yield from test_worker.database(settings)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The default model with room for a few long requests at once."""
    import torch

    torch.set_num_threads(2)
    return Engine(load_model(DEFAULT_MODEL, data_dir=REPO / "data"),
                  EngineConfig(max_batch_tokens=512, kv_memory_bytes=64 << 20))


def _project(db: sa.Engine, batch_id: str, project: str) -> None:
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE batches SET project = :p WHERE id = :id"),
                     {"p": project, "id": batch_id})


def _lines(tag: str, n: int, system: str | None = None, **body: Any) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        line = chat_line(i, **body)
        line["custom_id"] = f"{tag}-{i}"
        if system is not None:
            line["body"]["messages"].insert(0, {"role": "system", "content": system})
        out.append(line)
    return out


def _lines_of(settings: Settings, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = (settings.data_dir / "files" / file_id).read_bytes()
    return [json.loads(line) for line in data.splitlines()]


def _ids(settings: Settings, db: sa.Engine, batch_id: str) -> list[str]:
    b = batch_row(db, batch_id)
    return sorted(r["custom_id"] for r in _lines_of(settings, b.output_file_id)
                  + _lines_of(settings, b.error_file_id))


def test_batches_queued_together_run_on_the_engine_together(settings, db, engine) -> None:
    # each runs 48 steps, far past the claim interval (0.05 s), so whichever the worker claims
    # first, the others join its run (with 3-token requests a fast CPU could end each batch
    # before the worker next looked for work, and every batch ran alone)
    batches = [seed_batch(settings, db, _lines(f"b{k}", 4, max_tokens=48, ignore_eos=True))
               for k in range(6)]
    for k, b in enumerate(batches):
        _project(db, b, "alpha" if k % 2 else "beta")
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    for k, b in enumerate(batches):
        row = batch_row(db, b)
        assert row.status == "completed" and (row.completed, row.failed) == (4, 0)
        assert _ids(settings, db, b) == sorted(f"b{k}-{i}" for i in range(4))
    mix = engine.last_policy
    assert isinstance(mix, MixPolicy) and mix.replans >= 1  # later batches joined the plan


def test_two_batches_sharing_a_system_prompt_both_read_it_from_the_cache(
    settings, db, engine
) -> None:
    system = "You are the archive of a shipping company. " * 12 + f"Run {time.time_ns()}."
    a = seed_batch(settings, db, _lines("a", 2, system))
    b = seed_batch(settings, db, _lines("b", 2, system))
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    ra, rb = batch_row(db, a), batch_row(db, b)
    assert ra.status == rb.status == "completed"
    prompt_each = ra.input_tokens // 2
    assert ra.cached_tokens > 0 and rb.cached_tokens > 0
    # the system prompt was computed once for the four requests: three read it from the cache
    assert ra.cached_tokens + rb.cached_tokens >= 3 * (prompt_each - 64)


def test_cancelling_one_batch_of_a_shared_run_leaves_the_others_intact(
    settings, db, engine
) -> None:
    victim = seed_batch(settings, db, _lines("v", 10, max_tokens=1200, ignore_eos=True))
    others = [seed_batch(settings, db, _lines(f"o{k}", 3, max_tokens=8, ignore_eos=True))
              for k in range(2)]
    cancelled_at: list[float] = []

    def cancel_when_running() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = batch_row(db, victim).status  # read once: it may change between two reads
            if status != "in_progress":
                if status != "validating":
                    return  # ended before anything joined: the assertions say so
            elif batch_row(db, others[0]).status != "validating":  # it joined the run
                time.sleep(0.3)
                set_status(db, victim, "cancelling")
                cancelled_at.append(time.time())
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=cancel_when_running)
    watcher.start()
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    watcher.join()
    v = batch_row(db, victim)
    assert v.status == "cancelled" and cancelled_at
    assert v.cancelled_at is not None and v.cancelled_at - cancelled_at[0] < 15
    err = _lines_of(settings, v.error_file_id)
    assert err and {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert _ids(settings, db, victim) == sorted(f"v-{i}" for i in range(10))
    for k, o in enumerate(others):
        row = batch_row(db, o)
        assert row.status == "completed" and (row.completed, row.failed) == (3, 0)
        assert _ids(settings, db, o) == sorted(f"o{k}-{i}" for i in range(3))


def test_a_window_far_too_short_ends_expired_on_time(settings, db, engine) -> None:
    big = seed_batch(settings, db, _lines("x", 40, max_tokens=1000, ignore_eos=True))
    small = seed_batch(settings, db, _lines("s", 2, max_tokens=4))
    expires_at = int(time.time()) + 3
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE batches SET expires_at = :e WHERE id = :id"),
                     {"e": expires_at, "id": big})
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    b = batch_row(db, big)
    assert b.status == "expired" and b.expired_at is not None
    assert b.expired_at - expires_at <= 15
    out = _lines_of(settings, b.output_file_id)
    err = _lines_of(settings, b.error_file_id)
    assert len(out) == b.completed and {r["error"]["code"] for r in err} <= {"batch_expired"}
    assert _ids(settings, db, big) == sorted(f"x-{i}" for i in range(40))
    assert batch_row(db, small).status == "completed"


def test_a_high_priority_project_goes_before_large_batches_queued_earlier(
    make_settings, engine
) -> None:
    from server.db import make_engine, upgrade

    settings = make_settings(worker_poll_seconds=0.05, policy="fcfs",
                             project_priorities="vip:10")
    upgrade(settings)
    db = make_engine(settings)
    bulk = [seed_batch(settings, db, _lines(f"bulk{k}", 12, max_tokens=60, ignore_eos=True))
            for k in range(3)]
    vip = seed_batch(settings, db, _lines("vip", 2, max_tokens=4, ignore_eos=True))
    _project(db, vip, "vip")
    worker = Worker(settings, engine=engine)
    assert worker.run(until_idle=True) == 0
    worker.close()
    v = batch_row(db, vip)
    assert v.status == "completed"
    for b in bulk:
        row = batch_row(db, b)
        assert row.status == "completed"
        assert v.completed_at is not None and row.completed_at is not None
        assert v.completed_at <= row.completed_at
    with db.connect() as conn:  # the vip lines were journaled before most of the bulk lines
        order = conn.execute(sa.text(
            "SELECT custom_id FROM batch_results ORDER BY rowid")).scalars().all()
    assert max(order.index(f"vip-{i}") for i in range(2)) < len(order) // 2
    db.dispose()


@pytest.mark.slow
def test_through_the_api_a_one_minute_window_expires_and_a_cancel_lands_on_time(
    tmp_path: Path,
) -> None:
    """`completion_window: "1m"` on a batch far too big for it, and a cancel of another batch
    mid-run, on `blendserve serve` with its defaults: both end within 15 s, nothing lost."""
    import httpx

    from tests.server import live_process

    server = live_process.Server(live_process.model_data_dir(tmp_path),
                                 live_process.free_port(), tmp_path / "serve.log")
    big = "".join(json.dumps(x) + "\n" for x in _lines("big", 300, max_tokens=2000,
                                                         ignore_eos=True)).encode()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            server.wait_healthy(c)
            # The window is about a running worker, not the first start's profile measurement
            # (up to a minute on a slow CPU), which would eat the whole minute.
            server.wait_worker_up(c)

            expiring, cancelled = create_batch(c, big, window="1m"), create_batch(c, big)
            deadline = time.monotonic() + 300  # hang guard
            cancel_sent = None
            while True:
                assert time.monotonic() < deadline and server.alive(), server.tail()
                e = c.get(f"/v1/batches/{expiring['id']}").json()
                k = c.get(f"/v1/batches/{cancelled['id']}").json()
                if cancel_sent is None and k["status"] == "in_progress":
                    assert c.post(f"/v1/batches/{cancelled['id']}/cancel").status_code == 200
                    cancel_sent = time.time()
                if e["status"] == "expired" and k["status"] == "cancelled":
                    break
                time.sleep(0.5)
            for b, code in ((e, "batch_expired"), (k, "batch_cancelled")):
                rows = {key: [json.loads(x) for x in c.get(f"/v1/files/{b[key]}/content")
                              .text.splitlines()] if b[key] else []
                        for key in ("output_file_id", "error_file_id")}
                ids = [r["custom_id"] for r in rows["output_file_id"] + rows["error_file_id"]]
                assert sorted(ids) == sorted(f"big-{i}" for i in range(300))  # each once
                assert b["request_counts"]["completed"] == len(rows["output_file_id"])
                assert {r["error"]["code"] for r in rows["error_file_id"]} == {code}
    finally:
        server.stop()
    assert e["expired_at"] - e["expires_at"] <= 15
    assert cancel_sent is not None and k["cancelled_at"] - cancel_sent <= 15
