"""Several claimed batches on one engine at once: cross-batch blending.

A worker's engine runs the requests of every batch it holds together (`Engine.serve`): one plan
per priority level over all of them (scheduler/mix.py), so two teams sharing a system prompt
share its KV, and a batch claimed while others run joins at the next step. Per batch everything
stays as a single-batch run had it (jobs.py): each result is journaled with the batch's live
counts as it finishes, and the batch is finalised the moment its own last line is journaled.

`SharedRun` is the engine's `RequestFeed`. Before every step it
1. checks each held batch for cancel, expiry or a lost claim (a clock check per step, a status
   read every `cancel_poll_seconds`): a cancelled or expired batch leaves the engine at once
   (its requests are aborted, what finished stays) and is finalised with `batch_cancelled` /
   `batch_expired` lines for the rest; a lost claim drops the batch without writing anything;
2. every `worker_poll_seconds`, asks its `Claims` for another batch (the worker decides what may
   join: budget, priority, deadlines) and feeds that batch's unjournaled lines to the engine;
3. on shutdown, drains: nothing new is admitted, what runs finishes and is journaled, and the
   batches stay resumable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Protocol

from server import journal, shards
from server.engine_setup import recheck_profile
from server.jobs import (
    INTERNAL_ERROR,
    JobContext,
    StopCheck,
    StopReason,
    _transition,
    fail_batch,
    finish,
    load_batch,
    validate,
    write_report,
)
from server.models import BatchRow, BatchStatus
from server.outage import is_outage, retry_outages
from server.shards import parse_unit

if TYPE_CHECKING:
    from runtime.engine import Engine, FeedUpdate
    from runtime.types import EngineRequest, RequestOutput
    from server.pipeline import LineResult

log = logging.getLogger(__name__)

MAX_CLAIMS_PER_POLL = 16  # batches that may join between two steps


class Claims(Protocol):
    """How a shared run gets more batches and gives them back (the worker's queue and budget).
    A claim unit is a batch id or a shard's "batch id#k" (server/shards.py)."""

    def claim_next(self, run: SharedRun) -> str | None: ...

    def shards_for(self, total_lines: int) -> int: ...

    def enqueue(self, units: list[str]) -> None: ...

    def lost(self, batch_id: str) -> bool: ...

    def release(self, batch_id: str, *, terminal: bool) -> None: ...


class NoMoreClaims:
    """One batch alone (tests, `run_batch`): no other batch joins, the claim is never lost."""

    def claim_next(self, run: SharedRun) -> str | None:
        return None

    def shards_for(self, total_lines: int) -> int:
        return 1

    def enqueue(self, units: list[str]) -> None:
        return None

    def lost(self, batch_id: str) -> bool:
        return False

    def release(self, batch_id: str, *, terminal: bool) -> None:
        return None


@dataclass(eq=False)
class Held:
    """A batch, or one shard of a batch, in the shared run."""

    id: str  # the claim unit
    batch_id: str
    shard: int | None
    project: str
    level: int  # priority level in the engine's plan
    endpoint: str
    stop: StopCheck
    started: float = field(default_factory=time.monotonic)
    # engine request id -> (custom_id, input line, the request) of every request not yet ended
    in_flight: dict[str, tuple[str, int, EngineRequest]] = field(default_factory=dict)
    tokens_in_flight: int = 0  # Σ prompt + max_tokens over in_flight: what the claim budget counts
    finished: list[tuple[EngineRequest, RequestOutput]] = field(default_factory=list)  # report

    def add(self, custom_id: str, line: int, request: EngineRequest) -> None:
        self.in_flight[request.id] = (custom_id, line, request)
        self.tokens_in_flight += len(request.prompt_token_ids) + request.params.max_tokens

    def pop(self, request_id: str) -> tuple[str, int, EngineRequest]:
        custom_id, line, request = self.in_flight.pop(request_id)
        self.tokens_in_flight -= len(request.prompt_token_ids) + request.params.max_tokens
        return custom_id, line, request

    def drop_all(self) -> set[str]:
        """Forget every request in flight; returns their ids (to abort in the engine)."""
        ids = set(self.in_flight)
        self.in_flight.clear()
        self.tokens_in_flight = 0
        return ids


class SharedRun:
    """The batches one engine runs together; see the module docstring."""

    def __init__(self, ctx: JobContext, claims: Claims | None = None,
                 levels: dict[str, int] | None = None) -> None:
        self.ctx = ctx
        self.claims = claims or NoMoreClaims()
        self.levels = levels or {}  # project -> priority level (default 0)
        self.held: dict[str, Held] = {}
        self.ended: dict[str, bool] = {}  # batch id -> terminal, for every batch this run let go
        self._arrivals: list[tuple[EngineRequest, int]] = []
        self._aborts: set[str] = set()
        self._next_claim = 0.0
        self._engine: Engine | None = None

    # ---- the run ---------------------------------------------------------------------------
    def run(self, batch_id: str) -> dict[str, bool]:
        """Run `batch_id` and every batch that joins it; returns batch id -> terminal."""
        self.join(batch_id)
        if self.held:
            engine = self.ctx.engine()
            recheck_profile(engine, self.ctx.settings)
            self._engine = engine
            self._next_claim = time.monotonic() + self.ctx.settings.worker_poll_seconds
            for output in engine.serve(self, policy=self.ctx.policy):
                self._on_output(output)
        for held in list(self.held.values()):  # drained: shutdown, or the engine ended early
            self._settle(held, drained=True)
        return self.ended

    def poll(self, idle: bool) -> FeedUpdate:
        """The engine's question before each step (runtime.engine.RequestFeed)."""
        from runtime.engine import FeedUpdate

        draining = self.ctx.interrupted()
        for held in list(self.held.values()):
            if held.stop():
                self._stopped(held, draining)
            elif not held.in_flight:
                self._settle(held)
        if not draining and time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self.ctx.settings.worker_poll_seconds
            for _ in range(MAX_CLAIMS_PER_POLL):
                batch_id = self.claims.claim_next(self)
                if batch_id is None:
                    break
                self.join(batch_id)
        update = FeedUpdate(self._arrivals, self._aborts, closed=draining or not self.held,
                            drain=draining)
        self._arrivals, self._aborts = [], set()
        return update

    # ---- joining ---------------------------------------------------------------------------
    def join(self, batch_id: str) -> None:
        """`take` the batch; a server-side error there fails this batch only (an outage pauses
        the whole run: the worker releases every batch it holds)."""
        try:
            self.take(batch_id)
        except Exception as e:
            if is_outage(e):
                raise
            log.exception("batch %s failed on a server error", batch_id)
            held = self.held.pop(batch_id, None)
            if held is not None:
                dropped = held.drop_all()
                self._aborts |= dropped
                self._arrivals = [(r, lvl) for r, lvl in self._arrivals if r.id not in dropped]
            fail_batch(self.ctx, batch_id, INTERNAL_ERROR)
            self._end(batch_id, terminal=True)

    def take(self, unit: str) -> None:
        """Bring a claimed batch (or shard) as far as it goes without the engine, then feed the
        lines it still needs to the engine."""
        ctx = self.ctx
        batch_id, shard = parse_unit(unit)
        batch = load_batch(ctx, batch_id)
        if batch is not None and batch.status == BatchStatus.VALIDATING:
            validate(ctx, batch)
            batch = load_batch(ctx, batch_id)
        if batch is None or BatchStatus(batch.status).is_terminal:
            return self._end(unit, terminal=True)
        if batch.status == BatchStatus.CANCELLING and batch.in_progress_at is None:
            _transition(ctx, batch_id, {BatchStatus.CANCELLING}, BatchStatus.CANCELLED)
            return self._end(unit, terminal=True)
        if shard is None and batch.status == BatchStatus.IN_PROGRESS and self._shard(batch):
            return self._end(unit, terminal=True)  # its shards carry on, claimed one by one
        batch_ctx = replace(ctx, interrupted=partial(self._interrupted, unit))
        held = Held(unit, batch_id, shard, batch.project, self.levels.get(batch.project, 0),
                    batch.endpoint, StopCheck(batch_ctx, batch_id, batch.expires_at, shard))
        self.held[unit] = held
        if batch.status != BatchStatus.IN_PROGRESS:  # finalizing, or cancelling after a run
            return self._settle(held)
        if held.stop():
            return self._stopped(held, self.ctx.interrupted())
        only = None if shard is None else shards.lines_of(ctx.sessions, batch_id, shard)
        self._feed(held, batch.input_file_id, batch.total, only)

    def _shard(self, batch: BatchRow) -> bool:
        """Cut a large batch for the live workers (server/shards.py); True if it was cut."""
        from server.batch_input import iter_batch_lines
        from server.pipeline import LineResult, engine_request

        k = self.claims.shards_for(batch.total)
        if k < 2 or journal.done_count(self.ctx.sessions, batch.id):
            return False  # one worker, or a run already under way: it stays whole
        engine = self.ctx.engine()
        requests = []
        for item in iter_batch_lines(self.ctx.storage.path(batch.input_file_id)):
            request = engine_request(item, engine, batch.endpoint, str(item.line))
            if not isinstance(request, LineResult):
                requests.append((item.line, engine.plan_request(request)))
        parts = shards.plan(requests, k, engine.cost_model)
        planned = {line for part in parts for line in part}
        refused = set(range(1, batch.total + 1)) - planned  # error lines: the first shard's
        if refused and parts:
            parts[0] = sorted(refused) + parts[0]
        units = shards.create(self.ctx.sessions, batch.id, parts)
        log.info("batch %s: %d lines cut into %d shards of %s lines", batch.id, batch.total,
                 len(parts), [len(p) for p in parts])
        self.claims.enqueue(units)
        return True

    def _feed(self, held: Held, input_file_id: str, total: int, only: set[int] | None) -> None:
        from server.batch_input import iter_batch_lines
        from server.pipeline import LineResult, engine_request

        engine = self.ctx.engine()
        done = journal.done_ids(self.ctx.sessions, held.batch_id)
        if done:
            log.info("batch %s: resuming, %d of %d requests already journaled",
                     held.id, len(done), total)
        for item in iter_batch_lines(self.ctx.storage.path(input_file_id)):
            if item.custom_id in done or (only is not None and item.line not in only):
                continue
            request = engine_request(item, engine, held.endpoint, f"{held.id}/{item.line}")
            if isinstance(request, LineResult):  # refused: its error line now
                if not self._journal(held, request):
                    return
                continue
            held.add(item.custom_id, item.line, request)
            self._arrivals.append((request, held.level))
        log.info("batch %s joined the engine: %d requests, level %d, %d batches running",
                 held.id, len(held.in_flight), held.level, len(self.held))

    # ---- results ---------------------------------------------------------------------------
    def _on_output(self, output: RequestOutput) -> None:
        from server.pipeline import line_result

        unit = output.id.rpartition("/")[0]
        held = self.held.get(unit)
        if held is None or output.id not in held.in_flight:
            return  # a batch that left the run while this request was finishing
        custom_id, line, request = held.pop(output.id)
        held.finished.append((request, output))
        model = self._engine.model_name if self._engine is not None else ""
        if self._journal(held, line_result(custom_id, line, output, held.endpoint, model)) \
                and not held.in_flight:
            self._settle(held)

    def _journal(self, held: Held, result: LineResult) -> bool:
        """Record one result; on a lost claim the batch leaves the run, unwritten."""
        ctx = self.ctx
        recorded = retry_outages(  # a database restart costs a pause, not the work in flight
            partial(journal.record, ctx.sessions, held.batch_id, ctx.worker_id, result,
                    now=ctx.now(), shard=held.shard),
            what=f"batch {held.id}: journaling {result.custom_id}",
            give_up_after_s=ctx.settings.outage_retry_seconds,
            stop=partial(self._interrupted, held.id),
        )
        if not recorded:
            self._leave(held, terminal=False, release=False)
            return False
        ctx.on_result(result)
        return True

    # ---- leaving ---------------------------------------------------------------------------
    def _settle(self, held: Held, drained: bool = False) -> None:
        """Every fed line is journaled (or the engine drained): finish the batch if it is done."""
        batch = load_batch(self.ctx, held.batch_id)
        if batch is None:
            return self._leave(held, terminal=True)
        self._report(held)
        stopped = held.stop.reason in (StopReason.CANCELLED, StopReason.EXPIRED) or \
            batch.status != BatchStatus.IN_PROGRESS
        if held.shard is not None:
            if held.in_flight and not stopped:
                return self._leave(held, terminal=False)  # shutdown: resumable
            if shards.mark_done(self.ctx.sessions, held.batch_id, held.shard,
                                self.ctx.worker_id):
                finish(self.ctx, batch)  # the last shard: the batch ends here
            return self._leave(held, terminal=True)  # the shard is done either way
        missing = batch.total - journal.done_count(self.ctx.sessions, held.batch_id)
        if missing > 0 and not stopped:
            if not drained:
                log.warning("batch %s: %d lines unjournaled, leaving it resumable", held.id,
                            missing)
            return self._leave(held, terminal=False)  # shutdown: resumable
        self._leave(held, terminal=finish(self.ctx, batch))

    def _stopped(self, held: Held, draining: bool) -> None:
        """Cancel, expiry or a lost claim: out of the engine now; keep what finished."""
        reason = held.stop.reason
        if reason is StopReason.INTERRUPTED and draining:
            return  # shutdown: in-flight requests finish first (see `run`)
        self._aborts |= held.drop_all()
        if reason is StopReason.INTERRUPTED:  # the claim went to another worker
            log.warning("batch %s: claim lost, leaving the run", held.id)
            return self._leave(held, terminal=False, release=False)
        log.info("batch %s %s: stopped in the engine", held.id, reason)
        self._settle(held)

    def _leave(self, held: Held, *, terminal: bool, release: bool = True) -> None:
        self.held.pop(held.id, None)
        self._end(held.id, terminal=terminal, release=release)

    def _end(self, batch_id: str, *, terminal: bool, release: bool = True) -> None:
        self.ended[batch_id] = terminal
        if release:
            self.claims.release(batch_id, terminal=terminal)

    def _report(self, held: Held) -> None:
        if self._engine is not None and held.finished and held.shard is None:
            write_report(self.ctx, held.id, self._engine, held.finished,
                         time.monotonic() - held.started)

    def _interrupted(self, batch_id: str) -> bool:
        return self.ctx.interrupted() or self.claims.lost(batch_id)
