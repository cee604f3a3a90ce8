"""Data-parallel shards (server/shards.py): the claim rules in SQL, and two live workers on Redis
sharing one large batch, one of them killed with kill -9 — every custom_id exactly once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from server import shards
from server.config import Settings
from server.queue import SqlQueue
from tests.server import test_worker
from tests.server.test_worker import chat_line, seed_batch


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return test_worker.worker_settings(make_settings)


@pytest.fixture
def db(settings: Settings) -> Iterator[sa.Engine]:
    yield from test_worker.database(settings)


def _in_progress(db: sa.Engine, batch_id: str) -> None:
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE batches SET status = 'in_progress', total = 6 WHERE id = :id"),
                     {"id": batch_id})


def test_a_sharded_batch_is_claimed_shard_by_shard_then_whole_to_finalise(settings, db) -> None:
    batch_id = seed_batch(settings, db, [chat_line(i) for i in range(6)])
    _in_progress(db, batch_id)
    sessions = sessionmaker(bind=db, expire_on_commit=False)
    units = shards.create(sessions, batch_id, [[1, 2, 3], [4, 5, 6]])
    assert units == [f"{batch_id}#0", f"{batch_id}#1"]
    q = SqlQueue(db, stall_seconds=60)
    assert not q.try_claim(batch_id, "w0")  # the batch itself waits for its shards
    assert q.claim("w0") == units[0] and q.claim("w1") == units[1]
    assert q.claim("w2") is None
    assert q.heartbeat(units[0], "w0") and not q.heartbeat(units[0], "w1")
    assert shards.owner(sessions, batch_id, 0) == "w0"
    assert shards.lines_of(sessions, batch_id, 1) == {4, 5, 6}
    assert not shards.mark_done(sessions, batch_id, 0, "w1")  # not its holder: nothing changes
    assert shards.owner(sessions, batch_id, 0) == "w0"
    assert not shards.mark_done(sessions, batch_id, 0, "w0")  # shard 1 still runs
    q.release(units[1], "w1", terminal=False)
    assert q.claim("w2") == units[1]  # released: anyone may take it
    assert shards.mark_done(sessions, batch_id, 1, "w2")  # the last one
    assert q.claim("w3") == batch_id  # all shards done: the batch, to finalise


def test_a_stalled_shard_is_taken_over(settings, db) -> None:
    batch_id = seed_batch(settings, db, [chat_line(i) for i in range(6)])
    _in_progress(db, batch_id)
    sessions = sessionmaker(bind=db, expire_on_commit=False)
    units = shards.create(sessions, batch_id, [[1, 2, 3], [4, 5, 6]])
    now = [time.time()]
    q = SqlQueue(db, stall_seconds=10, clock=lambda: now[0])
    assert q.try_claim(units[0], "dead") and q.try_claim(units[1], "alive")
    now[0] += 11
    assert q.heartbeat(units[1], "alive")
    assert q.claim("rescuer") == units[0]
    assert not q.heartbeat(units[0], "dead")


@pytest.mark.slow
def test_two_workers_on_redis_share_a_batch_and_survive_a_kill(tmp_path: Path) -> None:
    from bench.shards import run_phase

    res = run_phase(2, 0.25, lines=400, max_tokens=4, tmp=tmp_path,
                    BLENDSERVE_SHARD_MIN_LINES="100",
                    BLENDSERVE_PROFILE="none")  # no device measurement: sharding is tested
    assert res["status"] == "completed" and res["exactly_once"], res
    assert res["completed"] == 400 and res["killed"] is not None
    assert len(res["shards"]) == 2 and all(s["done"] for s in res["shards"])
    assert sum(s["lines"] for s in res["shards"]) == 400
