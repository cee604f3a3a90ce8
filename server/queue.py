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
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa

from server.config import Settings
from server.models import ACTIVE_STATUSES
from server.shards import parse_unit, shard_unit

log = logging.getLogger(__name__)

# Statuses a worker still has to act on (validating: check the file; in_progress: run lines;
# cancelling: stop and write files; finalizing: write files).
ACTIVE = sorted(s.value for s in ACTIVE_STATUSES)

STREAM = "blendserve:batches"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A batch a worker could claim, with what its claim rules look at."""

    id: str  # a batch id, or a shard's unit id "batch_…#k" (server/shards.py)
    project: str
    expires_at: int | None
    created_at: float
    batch_id: str = ""  # the batch (== id unless a shard)
    stalled: bool = False  # held by a worker that stopped heartbeating: a takeover


Chooser = Callable[[list[Candidate]], list[str]]  # candidates -> ids to try, in order

GROUP = "workers"
WORKERS = "blendserve:worker:"  # + worker id: presence keys of live workers


class BatchQueue(Protocol):
    """What the API (enqueue) and the worker (claim, heartbeat, release) need from a queue."""

    def enqueue(self, batch_id: str) -> None: ...

    def claim(self, worker_id: str, choose: Chooser | None = None) -> str | None: ...

    def heartbeat(self, batch_id: str, worker_id: str) -> bool: ...

    def release(self, batch_id: str, worker_id: str, *, terminal: bool) -> None: ...

    def recover(self, worker_id: str) -> list[str]: ...

    def live_workers(self) -> int: ...

    def register(self, worker_id: str) -> None: ...

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

    def claim(self, worker_id: str, choose: Chooser | None = None) -> str | None:
        """Claim a batch (or a shard of one) that needs work and has no live owner; None when
        there is none.

        Without `choose`, the oldest; with it, the first of `choose(candidates)` that this worker
        wins (the worker's order and admission rules: priority, deadline, fair share, budget)."""
        now = self.clock()
        cutoff = now - self.stall_seconds
        limit = 16 if choose is None else 256
        with self.engine.connect() as conn:
            batches = conn.execute(
                sa.text(
                    "SELECT id, project, expires_at, created_at, id, heartbeat_at IS NOT NULL"
                    " FROM batches WHERE status IN :active AND " + _UNOWNED + " AND " + _UNSHARDED +
                    " ORDER BY created_at, id LIMIT :limit"
                ).bindparams(sa.bindparam("active", expanding=True)),
                {"active": ACTIVE, "cutoff": cutoff, "limit": limit},
            ).all()
            shards = conn.execute(
                sa.text(
                    "SELECT s.batch_id, s.shard, b.project, b.expires_at, s.created_at,"
                    " s.heartbeat_at IS NOT NULL FROM batch_shards s JOIN batches b"
                    " ON b.id = s.batch_id WHERE b.status IN :running AND NOT s.done AND"
                    " (s.worker_id IS NULL OR s.heartbeat_at IS NULL OR s.heartbeat_at < :cutoff)"
                    " ORDER BY s.created_at, s.batch_id, s.shard LIMIT :limit"
                ).bindparams(sa.bindparam("running", expanding=True)),
                {"running": SHARD_RUNNING, "cutoff": cutoff, "limit": limit},
            ).all()
        candidates = [Candidate(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in batches] + [
            Candidate(shard_unit(r[0], r[1]), r[2], r[3], r[4], r[0], bool(r[5])) for r in shards
        ]
        candidates.sort(key=lambda c: (c.created_at, c.id))
        ids = [c.id for c in candidates[:limit]] if choose is None else choose(candidates)
        for unit in ids:
            if self.try_claim(unit, worker_id):
                return unit
        return None

    def try_claim(self, batch_id: str, worker_id: str) -> bool:
        """One conditional UPDATE: True when this worker now owns the batch (or shard)."""
        now = self.clock()
        table, key, extra = _claim_target(batch_id)
        with self.engine.begin() as conn:
            prior = conn.execute(
                sa.text(f"SELECT worker_id FROM {table} WHERE {key}"), extra
            ).scalar()
            claimable, statuses = _CLAIMABLE[table]
            claimed = conn.execute(
                sa.text(
                    f"UPDATE {table} SET worker_id = :w, heartbeat_at = :now"
                    f" WHERE {key} AND {claimable} AND {_UNOWNED}"
                ).bindparams(sa.bindparam("statuses", expanding=True)),
                {"w": worker_id, "now": now, "statuses": statuses,
                 "cutoff": now - self.stall_seconds, **extra},
            ).rowcount
        if claimed == 1 and prior and prior != worker_id:
            log.warning("worker %s took over stalled %s from %s", worker_id, batch_id, prior)
        return claimed == 1

    def heartbeat(self, batch_id: str, worker_id: str) -> bool:
        """Refresh the claim; False when another worker has taken the batch (or shard) over."""
        table, key, extra = _claim_target(batch_id)
        with self.engine.begin() as conn:
            return (
                conn.execute(
                    sa.text(f"UPDATE {table} SET heartbeat_at = :now WHERE {key} AND worker_id = :w"),
                    {"now": self.clock(), "w": worker_id, **extra},
                ).rowcount
                == 1
            )

    def release(self, batch_id: str, worker_id: str, *, terminal: bool) -> None:
        """Drop the claim (if still ours) so another worker, or this one later, can continue."""
        table, key, extra = _claim_target(batch_id)
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {table} SET worker_id = NULL, heartbeat_at = NULL"
                    f" WHERE {key} AND worker_id = :w"
                ),
                {"w": worker_id, **extra},
            )

    def live_workers(self) -> int:
        """Workers known to be alive (for sharding); SQL alone does not know: 1."""
        return 1

    def register(self, worker_id: str) -> None:
        """Say this worker is alive (Redis only)."""

    def recover(self, worker_id: str) -> list[str]:
        """At worker start: drop claims of dead workers on this host, so a restart resumes at once.

        Worker ids are `host:pid:nonce`. A claim from this host whose pid is gone (or is our own
        pid under another nonce: a restarted container's pid 1) cannot be alive; claims of other
        hosts still wait for `stall_seconds`.
        """
        host, _, _ = worker_id.partition(":")
        with self.engine.connect() as conn:
            rows = list(conn.execute(
                sa.text(
                    "SELECT id, worker_id FROM batches WHERE status IN :active"
                    " AND worker_id LIKE :prefix"
                ).bindparams(sa.bindparam("active", expanding=True)),
                {"active": ACTIVE, "prefix": f"{host}:%"},
            ).all())
            rows += conn.execute(
                sa.text(
                    "SELECT s.batch_id || '#' || s.shard, s.worker_id FROM batch_shards s"
                    " WHERE NOT s.done AND s.worker_id LIKE :prefix"
                ),
                {"prefix": f"{host}:%"},
            ).all()
        freed = []
        for batch_id, holder in rows:
            if holder != worker_id and not _local_worker_alive(holder):
                self.release(batch_id, holder, terminal=False)
                log.warning("released batch %s held by dead worker %s", batch_id, holder)
                freed.append(batch_id)
        return freed

    def status(self, batch_id: str) -> str | None:
        """The batch's status; for a shard, its batch's while the shard is not done."""
        batch, shard = parse_unit(batch_id)
        with self.engine.connect() as conn:
            if shard is not None:
                return conn.execute(
                    sa.text("SELECT b.status FROM batches b JOIN batch_shards s ON s.batch_id = b.id"
                            " WHERE b.id = :id AND s.shard = :k AND NOT s.done"),
                    {"id": batch, "k": shard},
                ).scalar()
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

    def claim(self, worker_id: str, choose: Chooser | None = None) -> str | None:
        """Stalled messages first, then new ones, then the SQL poll (lost messages, restarts).
        Redis down or restarted empty (no consumer group) only delays the stream: SQL answers.

        With `choose` (a worker that already runs batches and picks what may join them), SQL
        alone: the stream hands out batches in arrival order, which would skip the worker's
        rules; its messages stay for idle workers."""
        import redis

        if choose is not None:
            return self.sql.claim(worker_id, choose)

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

    def register(self, worker_id: str) -> None:
        """A presence key that lapses `stall_seconds` after this worker's last word."""
        self.redis.set(f"{WORKERS}{worker_id}", b"1", px=self.stall_ms)

    def live_workers(self) -> int:
        """Workers whose presence key has not lapsed."""
        return sum(1 for _ in self.redis.scan_iter(match=f"{WORKERS}*", count=1000))

    def close(self) -> None:
        self.redis.close()


_UNOWNED = "(worker_id IS NULL OR heartbeat_at IS NULL OR heartbeat_at < :cutoff)"
# A batch cut into shards is claimed shard by shard until every shard is done; then the batch
# itself again (to finalise it, should its last shard's worker have died before doing so).
_UNSHARDED = "NOT EXISTS (SELECT 1 FROM batch_shards s WHERE s.batch_id = batches.id AND NOT s.done)"
SHARD_RUNNING = ["in_progress", "cancelling"]  # statuses in which a batch's shards are worked
# What makes a row of each claim table claimable (besides having no live owner), and the
# statuses bound to its `:statuses`.
_CLAIMABLE = {
    "batches": (f"status IN :statuses AND {_UNSHARDED}", ACTIVE),
    "batch_shards": (("NOT done AND EXISTS (SELECT 1 FROM batches b"
                      " WHERE b.id = batch_shards.batch_id AND b.status IN :statuses)"),
                     SHARD_RUNNING),
}


def _claim_target(unit: str) -> tuple[str, str, dict[str, Any]]:
    """(table, WHERE key, its parameters) of a claim unit: a batch or one shard of it."""
    batch_id, shard = parse_unit(unit)
    if shard is None:
        return "batches", "id = :id", {"id": batch_id}
    return "batch_shards", "batch_id = :id AND shard = :k", {"id": batch_id, "k": shard}


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
