"""The batch queue: which worker runs which batch, and how a dead worker's batch is taken over.

SQL is the source of truth. A worker owns a batch while `batches.worker_id` names it and its
`heartbeat_at` is fresher than `settings.worker_stall_seconds`; every claim is one conditional
UPDATE (`... WHERE id = ? AND (worker_id IS NULL OR heartbeat_at < cutoff)`), so two workers can
never both win a batch, on SQLite or PostgreSQL alike.

- `SqlQueue` (no REDIS_URL): workers poll SQL for the oldest batch needing work.
- `RedisQueue` (REDIS_URL set): a stream + consumer group spreads batches over several
  `blendserve worker` processes; XAUTOCLAIM hands a stalled consumer's messages to another. The
  SQL claim still guards every run, and an idle worker falls back to the SQL poll, so a message
  lost in Redis (or a batch left `in_progress` by a crash) is still picked up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import sqlalchemy as sa

from server.config import Settings
from server.models import ACTIVE_STATUSES

log = logging.getLogger(__name__)

# Statuses a worker still has to act on (validating: check the file; in_progress: run lines;
# cancelling: stop and write files; finalizing: write files).
ACTIVE = sorted(s.value for s in ACTIVE_STATUSES)

STREAM = "blendserve:batches"
GROUP = "workers"


class BatchQueue(Protocol):
    """What the API (enqueue) and the worker (claim, heartbeat, release) need from a queue."""

    def enqueue(self, batch_id: str) -> None: ...

    def claim(self, worker_id: str) -> str | None: ...

    def heartbeat(self, batch_id: str, worker_id: str) -> bool: ...

    def release(self, batch_id: str, worker_id: str, *, terminal: bool) -> None: ...

    def recover(self, worker_id: str) -> list[str]: ...

    def close(self) -> None: ...


def make_queue(settings: Settings, *, engine: sa.Engine | None = None) -> BatchQueue:
    """The queue the settings ask for; `engine` reuses a SQLAlchemy engine the caller already has."""
    if engine is None:
        from server.db import make_engine

        engine = make_engine(settings)
    if settings.redis_url:
        return RedisQueue(engine, settings.redis_url, stall_seconds=settings.worker_stall_seconds)
    return SqlQueue(engine, stall_seconds=settings.worker_stall_seconds)


class SqlQueue:
    """Row claims in SQL only: `enqueue` is a no-op, workers poll `claim`."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        stall_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.stall_seconds = stall_seconds
        self.clock = clock

    def enqueue(self, batch_id: str) -> None:
        """Nothing to do: a new batch is already visible to `claim` through its row."""

    def claim(self, worker_id: str) -> str | None:
        """Claim the oldest batch that needs work and has no live owner; None when there is none."""
        now = self.clock()
        cutoff = now - self.stall_seconds
        with self.engine.connect() as conn:
            candidates = (
                conn.execute(
                    sa.text(
                        "SELECT id FROM batches WHERE status IN :active"
                        " AND (worker_id IS NULL OR heartbeat_at IS NULL OR heartbeat_at < :cutoff)"
                        " ORDER BY created_at, id LIMIT 16"
                    ).bindparams(sa.bindparam("active", expanding=True)),
                    {"active": ACTIVE, "cutoff": cutoff},
                )
                .scalars()
                .all()
            )
        for batch_id in candidates:
            if self.try_claim(batch_id, worker_id):
                return batch_id
        return None

    def try_claim(self, batch_id: str, worker_id: str) -> bool:
        """One conditional UPDATE: True when this worker now owns the batch."""
        now = self.clock()
        with self.engine.begin() as conn:
            prior = conn.execute(
                sa.text("SELECT worker_id FROM batches WHERE id = :id"), {"id": batch_id}
            ).scalar()
            claimed = conn.execute(
                sa.text(
                    "UPDATE batches SET worker_id = :w, heartbeat_at = :now"
                    " WHERE id = :id AND status IN :active AND (worker_id IS NULL"
                    " OR heartbeat_at IS NULL OR heartbeat_at < :cutoff)"
                ).bindparams(sa.bindparam("active", expanding=True)),
                {
                    "w": worker_id,
                    "now": now,
                    "id": batch_id,
                    "active": ACTIVE,
                    "cutoff": now - self.stall_seconds,
                },
            ).rowcount
        if claimed == 1 and prior and prior != worker_id:
            log.warning("worker %s took over stalled batch %s from %s", worker_id, batch_id, prior)
        return claimed == 1

    def heartbeat(self, batch_id: str, worker_id: str) -> bool:
        """Refresh the claim; False when another worker has taken the batch over."""
        with self.engine.begin() as conn:
            return (
                conn.execute(
                    sa.text(
                        "UPDATE batches SET heartbeat_at = :now WHERE id = :id AND worker_id = :w"
                    ),
                    {"now": self.clock(), "id": batch_id, "w": worker_id},
                ).rowcount
                == 1
            )

    def release(self, batch_id: str, worker_id: str, *, terminal: bool) -> None:
        """Drop the claim (if still ours) so another worker, or this one later, can continue."""
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE batches SET worker_id = NULL, heartbeat_at = NULL"
                    " WHERE id = :id AND worker_id = :w"
                ),
                {"id": batch_id, "w": worker_id},
            )

    def recover(self, worker_id: str) -> list[str]:
        """At worker start: drop claims of dead workers on this host, so a restart resumes at once.

        Worker ids are `host:pid:nonce`. A claim from this host whose pid is gone (or is our own
        pid under another nonce: a restarted container's pid 1) cannot be alive; claims of other
        hosts still wait for `stall_seconds`.
        """
        host, _, _ = worker_id.partition(":")
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT id, worker_id FROM batches WHERE status IN :active"
                    " AND worker_id LIKE :prefix"
                ).bindparams(sa.bindparam("active", expanding=True)),
                {"active": ACTIVE, "prefix": f"{host}:%"},
            ).all()
        freed = []
        for batch_id, holder in rows:
            if holder != worker_id and not _local_worker_alive(holder):
                with self.engine.begin() as conn:
                    conn.execute(
                        sa.text(
                            "UPDATE batches SET worker_id = NULL, heartbeat_at = NULL"
                            " WHERE id = :id AND worker_id = :w"
                        ),
                        {"id": batch_id, "w": holder},
                    )
                log.warning("released batch %s held by dead worker %s", batch_id, holder)
                freed.append(batch_id)
        return freed

    def status(self, batch_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                sa.text("SELECT status FROM batches WHERE id = :id"), {"id": batch_id}
            ).scalar()

    def close(self) -> None:
        """The engine belongs to the caller; nothing to close here."""


class RedisQueue:
    """A Redis stream + consumer group in front of the SQL claim (several workers, one queue)."""

    def __init__(
        self,
        engine: sa.Engine,
        redis_url: str,
        *,
        stall_seconds: float,
        stream: str = STREAM,
        group: str = GROUP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import redis

        self.sql = SqlQueue(engine, stall_seconds=stall_seconds, clock=clock)
        # Any: redis-py's stream reply types are unions mypy cannot narrow usefully.
        self.redis: Any = redis.Redis.from_url(redis_url, socket_timeout=10)
        self.stream = stream
        self.group = group
        self.stall_ms = int(stall_seconds * 1000)
        self._messages: dict[str, bytes] = {}  # batch id -> stream message id this worker holds
        try:
            self._create_group()
        except (redis.ConnectionError, redis.TimeoutError) as e:  # claim() creates it later
            log.warning("Redis unavailable at start (%s); claiming from SQL until it is back", e)

    def _create_group(self) -> None:
        import redis

        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def enqueue(self, batch_id: str) -> None:
        self.redis.xadd(self.stream, {"batch_id": batch_id})

    def claim(self, worker_id: str) -> str | None:
        """Stalled messages first, then new ones, then the SQL poll (lost messages, restarts).
        Redis down or restarted empty (no consumer group) only delays the stream: SQL answers."""
        import redis

        try:
            batch_id = self._claim_from_stream(worker_id)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("the Redis consumer group is gone (Redis restarted empty?); recreating it")
            self._create_group()
            batch_id = None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("Redis unavailable (%s); claiming from SQL", e)
            batch_id = None
        # 3. anything SQL says needs work and nobody owns
        return batch_id if batch_id is not None else self.sql.claim(worker_id)

    def _claim_from_stream(self, worker_id: str) -> str | None:
        # 1. take over messages whose consumer has not touched them for stall_seconds
        start: bytes | str = "0-0"
        for _ in range(1000):  # one message at a time: what we take, we act on
            reply = self.redis.xautoclaim(
                self.stream, self.group, worker_id, self.stall_ms, start_id=start, count=1
            )
            for msg_id, fields in reply[1]:
                if (batch_id := self._take(msg_id, fields, worker_id)) is not None:
                    return batch_id
            start = reply[0]
            if start in (b"0-0", "0-0"):
                break
        # 2. new messages
        while fresh := self.redis.xreadgroup(self.group, worker_id, {self.stream: ">"}, count=1):
            for msg_id, fields in fresh[0][1]:
                if (batch_id := self._take(msg_id, fields, worker_id)) is not None:
                    return batch_id
        return None

    def _take(self, msg_id: bytes, fields: dict[bytes, bytes] | None, worker_id: str) -> str | None:
        """Claim the message's batch in SQL; a message for a finished or owned batch is dropped.

        Dropping a message for a batch another worker owns is safe: if that worker dies, its claim
        goes stale and the SQL poll (or its own message, via XAUTOCLAIM) hands the batch on.
        """
        raw = fields.get(b"batch_id") if fields else None
        batch_id = raw.decode() if raw else None
        if batch_id is not None and self.sql.try_claim(batch_id, worker_id):
            self._messages[batch_id] = msg_id
            return batch_id
        self._drop(msg_id)
        return None

    def _drop(self, msg_id: bytes) -> None:
        self.redis.xack(self.stream, self.group, msg_id)
        self.redis.xdel(self.stream, msg_id)

    def heartbeat(self, batch_id: str, worker_id: str) -> bool:
        """Refresh the SQL claim and reset the message's idle time so XAUTOCLAIM leaves it alone."""
        alive = self.sql.heartbeat(batch_id, worker_id)
        msg_id = self._messages.get(batch_id)
        if alive and msg_id is not None:
            self.redis.xclaim(self.stream, self.group, worker_id, 0, [msg_id], justid=True)
        return alive

    def release(self, batch_id: str, worker_id: str, *, terminal: bool) -> None:
        """Ack the message; a batch left unfinished (shutdown) goes back on the stream at once."""
        self.sql.release(batch_id, worker_id, terminal=terminal)
        msg_id = self._messages.pop(batch_id, None)
        if msg_id is not None:
            self._drop(msg_id)
        if not terminal and self.sql.status(batch_id) in ACTIVE:
            self.enqueue(batch_id)

    def recover(self, worker_id: str) -> list[str]:
        """Free dead local claims; the batches come back through the SQL poll in `claim`."""
        return self.sql.recover(worker_id)

    def close(self) -> None:
        self.redis.close()


def _local_worker_alive(holder: str) -> bool:
    """Whether the worker `host:pid:nonce` (known to be on this host) may still be running."""
    try:
        pid = int(holder.split(":")[1])
    except (IndexError, ValueError):
        return True  # not our id format: let the stall timeout decide
    if pid == os.getpid():
        return False  # our pid, another nonce: an earlier incarnation of this process slot
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
