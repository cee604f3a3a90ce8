"""The batch queue: SQL row claims (SQLite and PostgreSQL) and the Redis stream consumer group.

Real databases only: the PostgreSQL and Redis cases skip when those servers do not answer.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from server.config import Settings
from server.db import make_engine, upgrade
from server.models import BatchRow
from server.queue import RedisQueue, SqlQueue, make_queue


class Clock:
    """A hand-moved clock for stall arithmetic."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """Settings on a migrated database: SQLite in a tmp dir, or the session's PostgreSQL."""
    chosen = settings if request.param == "sqlite" else request.getfixturevalue("pg_settings")
    upgrade(chosen)
    return chosen


@pytest.fixture
def engine(db_settings: Settings) -> Iterator[sa.Engine]:
    engine = make_engine(db_settings)
    yield engine
    engine.dispose()


def make_batch(engine: sa.Engine, *, status: str = "validating", created_at: int = 100) -> str:
    batch_id = f"batch_{uuid.uuid4().hex[:24]}"
    with sessionmaker(bind=engine)() as s:
        s.add(
            BatchRow(
                id=batch_id,
                project="p",
                endpoint="/v1/chat/completions",
                input_file_id="file-" + "0" * 24,
                completion_window="24h",
                status=status,
                created_at=created_at,
                expires_at=created_at + 86400,
            )
        )
        s.commit()
    return batch_id


def owner(engine: sa.Engine, batch_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT worker_id FROM batches WHERE id = :id"), {"id": batch_id}
        ).scalar()


def test_claim_takes_the_oldest_batch_that_needs_work(engine: sa.Engine) -> None:
    newer = make_batch(engine, created_at=200)
    older = make_batch(engine, status="in_progress", created_at=100)
    make_batch(engine, status="completed", created_at=50)
    make_batch(engine, status="failed", created_at=50)
    queue = SqlQueue(engine, stall_seconds=60)
    assert queue.claim("w1") == older
    assert queue.claim("w2") == newer
    assert queue.claim("w3") is None
    assert owner(engine, older) == "w1" and owner(engine, newer) == "w2"


def test_cancelling_and_finalizing_batches_are_claimed(engine: sa.Engine) -> None:
    ids = {make_batch(engine, status="cancelling"), make_batch(engine, status="finalizing")}
    queue = SqlQueue(engine, stall_seconds=60)
    assert {queue.claim("w1"), queue.claim("w1")} == ids


def test_a_stalled_claim_is_taken_over_and_the_old_owner_learns_it(engine: sa.Engine) -> None:
    batch = make_batch(engine)
    clock = Clock()
    queue = SqlQueue(engine, stall_seconds=10, clock=clock)
    assert queue.claim("w1") == batch
    clock.t += 5
    assert queue.claim("w2") is None  # w1 is still fresh
    assert queue.heartbeat(batch, "w1")
    clock.t += 11
    assert queue.claim("w2") == batch
    assert owner(engine, batch) == "w2"
    assert not queue.heartbeat(batch, "w1")
    queue.release(batch, "w1", terminal=False)  # a stale owner cannot drop the new claim
    assert owner(engine, batch) == "w2"


def test_release_makes_the_batch_claimable_again(engine: sa.Engine) -> None:
    batch = make_batch(engine, status="in_progress")
    queue = SqlQueue(engine, stall_seconds=60)
    assert queue.claim("w1") == batch
    queue.release(batch, "w1", terminal=False)
    assert owner(engine, batch) is None
    assert queue.claim("w2") == batch


def test_concurrent_workers_never_claim_the_same_batch(engine: sa.Engine) -> None:
    batches = {make_batch(engine, created_at=i) for i in range(4)}
    queue = SqlQueue(engine, stall_seconds=60)
    won: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def grab(worker: str) -> None:
        start.wait()
        while (batch := queue.claim(worker)) is not None:
            with lock:
                won.append(batch)

    threads = [threading.Thread(target=grab, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == sorted(batches)


def test_make_queue_without_redis_is_the_sql_queue(db_settings: Settings) -> None:
    queue = make_queue(db_settings)
    assert isinstance(queue, SqlQueue)
    queue.enqueue("batch_whatever")  # a no-op, never an error


# --- Redis --------------------------------------------------------------------------------------


@pytest.fixture
def redis_queue_factory(settings: Settings, redis_url: str) -> Iterator:
    """RedisQueues on a private stream over one SQLite database."""
    upgrade(settings)
    engine = make_engine(settings)
    stream = f"blendserve:test:{uuid.uuid4().hex[:12]}"
    made: list[RedisQueue] = []

    def factory(stall_seconds: float = 60.0) -> RedisQueue:
        queue = RedisQueue(engine, redis_url, stall_seconds=stall_seconds, stream=stream)
        made.append(queue)
        return queue

    factory.engine = engine  # type: ignore[attr-defined]
    yield factory
    if made:
        made[0].redis.delete(stream)
    for queue in made:
        queue.close()
    engine.dispose()


def pending(queue: RedisQueue) -> int:
    return int(queue.redis.xpending(queue.stream, queue.group)["pending"])


def test_two_redis_workers_share_the_stream(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    w1, w2 = redis_queue_factory(), redis_queue_factory()
    batches = [make_batch(engine, created_at=i) for i in range(4)]
    for b in batches:
        w1.enqueue(b)
    got = [w1.claim("w1"), w2.claim("w2"), w1.claim("w1"), w2.claim("w2")]
    assert sorted(got) == sorted(batches)  # type: ignore[type-var]
    assert pending(w1) == 4
    for b, q, w in zip(got, [w1, w2, w1, w2], ["w1", "w2", "w1", "w2"], strict=True):
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE batches SET status='completed' WHERE id=:id"), {"id": b})
        q.release(b, w, terminal=True)  # type: ignore[arg-type]
    assert pending(w1) == 0
    assert w1.redis.xlen(w1.stream) == 0
    assert w1.claim("w1") is None


def test_a_stalled_redis_consumer_is_taken_over(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    w1, w2 = redis_queue_factory(stall_seconds=0.3), redis_queue_factory(stall_seconds=0.3)
    batch = make_batch(engine)
    w1.enqueue(batch)
    assert w1.claim("w1") == batch
    assert w2.claim("w2") is None  # fresh claim: the message stays with w1
    time.sleep(0.5)  # w1 "dies": no heartbeat
    assert w2.claim("w2") == batch
    assert w2._messages[batch] is not None  # it came through XAUTOCLAIM, not the SQL poll
    assert not w1.heartbeat(batch, "w1")
    assert owner(engine, batch) == "w2"


def test_heartbeat_keeps_a_live_consumer_message(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    w1, w2 = redis_queue_factory(stall_seconds=0.4), redis_queue_factory(stall_seconds=0.4)
    batch = make_batch(engine)
    w1.enqueue(batch)
    assert w1.claim("w1") == batch
    for _ in range(4):
        time.sleep(0.15)
        assert w1.heartbeat(batch, "w1")
    assert w2.claim("w2") is None
    assert owner(engine, batch) == "w1"


def test_a_duplicate_message_for_an_owned_batch_is_dropped(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    w1, w2 = redis_queue_factory(), redis_queue_factory()
    batch = make_batch(engine)
    w1.enqueue(batch)
    w1.enqueue(batch)
    assert w1.claim("w1") == batch
    assert w2.claim("w2") is None
    assert pending(w1) == 1  # only w1's own message is left


def test_a_batch_missing_from_the_stream_is_found_in_sql(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    batch = make_batch(engine, status="in_progress")  # e.g. left by a crash, never enqueued
    assert redis_queue_factory().claim("w1") == batch


def test_an_unfinished_release_puts_the_batch_back_on_the_stream(redis_queue_factory) -> None:
    engine = redis_queue_factory.engine
    w1, w2 = redis_queue_factory(), redis_queue_factory()
    batch = make_batch(engine, status="in_progress")
    w1.enqueue(batch)
    assert w1.claim("w1") == batch
    w1.release(batch, "w1", terminal=False)  # shutting down mid-batch
    assert w2.redis.xlen(w2.stream) == 1
    assert w2.claim("w2") == batch
    assert w2._messages[batch] is not None


def test_recover_frees_claims_of_dead_workers_on_this_host_only(engine: sa.Engine) -> None:
    import os
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is now free
    holders = {
        "dead": f"{host}:{gone.pid}:aaaaaa",
        "earlier_me": f"{host}:{os.getpid()}:bbbbbb",  # a restarted container's pid 1, say
        "alive": f"{host}:1:cccccc",
        "elsewhere": f"other-host:{gone.pid}:dddddd",
    }
    queue = SqlQueue(engine, stall_seconds=60)
    batches = {}
    for name, holder in holders.items():
        batches[name] = make_batch(engine, status="in_progress")
        assert queue.try_claim(batches[name], holder)
    freed = queue.recover(f"{host}:{os.getpid()}:eeeeee")
    assert sorted(freed) == sorted([batches["dead"], batches["earlier_me"]])
    assert owner(engine, batches["alive"]) == holders["alive"]
    assert owner(engine, batches["elsewhere"]) == holders["elsewhere"]
    assert {queue.claim("w-new"), queue.claim("w-new")} == {batches["dead"], batches["earlier_me"]}
