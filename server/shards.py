"""Data-parallel shards: one large batch run by several workers at once.

With Redis and k ≥ 2 live workers, the worker that validates a batch of at least
`shard_min_lines` lines cuts it into k shards of equal predicted work with
`scheduler/partition.py` (whole prefix subtrees, each shard's ρ near the batch's) and stores
them in `batch_shards`. Each shard is then a claim unit of its own, `"<batch id>#<k>"`, taken
like a batch: a conditional UPDATE, a heartbeat, a takeover once the holder stops heartbeating,
and on Redis a stream message whose pending entry another worker reclaims (XAUTOCLAIM).

Results go to the batch's one journal (`batch_results`, keyed by custom_id), so every custom_id
is recorded once whoever runs it and however often its shard changes hands. A worker done with
its shard marks it done; the one that finds every shard done finalises the batch (the
conditional status transitions make a second finaliser a no-op).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from server.models import BatchShardRow

if TYPE_CHECKING:
    from scheduler.cost_model import CostModel
    from scheduler.types import PlanRequest

Sessions = sessionmaker[Session]


def shard_unit(batch_id: str, shard: int) -> str:
    return f"{batch_id}#{shard}"


def parse_unit(unit: str) -> tuple[str, int | None]:
    """(batch id, shard number or None) of a claim unit."""
    batch_id, sep, shard = unit.partition("#")
    return batch_id, (int(shard) if sep else None)


def create(sessions: Sessions, batch_id: str, parts: list[list[int]]) -> list[str]:
    """Store the shards (lists of 1-based input lines); returns their claim units."""
    now = time.time()
    with sessions() as s, s.begin():
        for k, lines in enumerate(parts):
            s.add(BatchShardRow(batch_id=batch_id, shard=k, lines=lines, created_at=now))
    return [shard_unit(batch_id, k) for k in range(len(parts))]


def lines_of(sessions: Sessions, batch_id: str, shard: int) -> set[int]:
    with sessions() as s:
        row = s.get(BatchShardRow, (batch_id, shard))
        return set(row.lines) if row is not None else set()


def owner(sessions: Sessions, batch_id: str, shard: int) -> str | None:
    with sessions() as s:
        row = s.get(BatchShardRow, (batch_id, shard))
        return None if row is None or row.done else row.worker_id


def mark_done(sessions: Sessions, batch_id: str, shard: int, worker_id: str) -> bool:
    """Done, if this worker still holds it; True when every shard of the batch is done."""
    with sessions() as s, s.begin():
        s.execute(
            sa.update(BatchShardRow)
            .where(BatchShardRow.batch_id == batch_id, BatchShardRow.shard == shard,
                   BatchShardRow.worker_id == worker_id)
            .values(done=True)
        )
        left = s.scalar(
            sa.select(sa.func.count()).where(BatchShardRow.batch_id == batch_id,
                                             BatchShardRow.done.is_(False))
        )
    return not left


def plan(requests: list[tuple[int, PlanRequest]], k: int,
         cost_model: CostModel) -> list[list[int]]:
    """k shards of equal predicted work over (line, PlanRequest) pairs; lines in planned order."""
    from scheduler.partition import partition_requests

    lines = [line for line, _ in requests]
    part = partition_requests([r for _, r in requests], k, cost_model=cost_model)
    return [[lines[int(i)] for i in shard] for shard in part if len(shard)]
