"""The batch worker process: claim a batch, run it on this process's engine, release it, repeat.

The engine never runs in the API's process: `blendserve serve` starts one worker as a spawned
child (`spawn_embedded_worker`), `blendserve worker` runs one alone (one per GPU). A worker talks
to the API only through SQL (and Redis when configured), so either side can crash alone.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy.orm import sessionmaker

from server.config import Settings
from server.db import upgrade
from server.engine_monitor import EngineMonitor
from server.jobs import INTERNAL_ERROR, JobContext, fail_batch
from server.outage import is_outage, retry_outages
from server.queue import BatchQueue, Candidate, make_queue
from server.shared_run import SharedRun
from server.storage import FileStorage

if TYPE_CHECKING:
    from runtime.engine import Engine

log = logging.getLogger("blendserve.worker")


class Worker:
    """One worker: one engine (loaded on first use), one claim at a time."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        queue: BatchQueue | None = None,
        worker_id: str | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        from server.db import make_engine
        from server.webhooks import WebhookSender

        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.db = make_engine(settings)
        self.sessions = sessionmaker(bind=self.db, expire_on_commit=False)
        self.queue = queue or make_queue(settings, engine=self.db)
        self.storage = FileStorage(settings.data_dir / "files")
        self.now = now
        self.stopping = threading.Event()  # set: stop admitting, finish in-flight, release, exit
        self.monitor = EngineMonitor(
            settings.data_dir, self.worker_id, every_s=settings.metrics_snapshot_seconds
        )
        self._engine = engine
        if engine is not None:
            self.monitor.attach(engine)
        self._policy: str | None = None
        self.webhooks = WebhookSender(settings, self.sessions) if settings.webhooks else None

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = load_engine(self.settings)
            self.monitor.attach(self._engine)
        return self._engine

    def policy(self) -> str:
        if self._policy is None:
            self._policy = choose_policy(self.settings.policy, self.engine())
        return self._policy

    def run(self, *, until_idle: bool = False) -> int:
        """The loop; `until_idle` returns once no batch needs work (tests, one-shot runs)."""
        log.info("worker %s started (queue: %s)", self.worker_id, type(self.queue).__name__)
        # Load the engine (and measure the device profile, the first time) before holding any
        # claim: nothing heartbeats a claim while the model loads, so a long load would let
        # another worker take the batch over. A worker that cannot load exits here, loudly.
        self.policy()
        self.monitor.start()
        if self.webhooks is not None:
            self.webhooks.start()
        self._recover()
        while not self.stopping.is_set():
            # 1. Claim the oldest batch that needs work, or one whose owner stopped heartbeating.
            self._register()
            batch_id = self._claim()
            if batch_id is None:
                if until_idle:
                    break
                # 2. Nothing to do: wait a poll interval (a signal wakes us at once).
                self.stopping.wait(self.settings.worker_poll_seconds)
                continue
            # 3. Run it, and the batches that join it, on the engine (server/shared_run.py);
            #    each is released as it ends; shutdown or a lost claim leaves one resumable.
            self.run_one(batch_id)
        log.info("worker %s stopped", self.worker_id)
        return 0

    def _recover(self) -> None:
        """Free batches that dead workers of this host still claim (a restart after kill -9)."""
        try:
            self.queue.recover(self.worker_id)
        except Exception as e:  # noqa: BLE001 - schema not there yet: stalled claims still expire
            log.warning("could not check for dead workers' claims (%s)", e)

    def _register(self) -> None:
        """Tell the queue this worker is alive (with Redis: how many workers shards are cut for)."""
        try:
            self.queue.register(self.worker_id)
        except Exception as e:  # noqa: BLE001 - Redis down: fewer shards, nothing worse
            log.debug("cannot register as a live worker (%s)", e)

    def _claim(self) -> str | None:
        try:
            return self.queue.claim(self.worker_id)  # then the run claims by the worker's rules
        except Exception as e:  # noqa: BLE001 - database not migrated yet, Redis restarting, ...: keep polling
            log.warning("cannot claim a batch yet (%s: %s)", type(e).__name__, e)
            self.stopping.wait(self.settings.worker_poll_seconds * 4)
            return None

    def run_one(self, batch_id: str) -> bool:
        """Run a claimed batch, and every batch that joins it on the engine, releasing each as it
        ends; True when `batch_id` ended terminal."""
        try:
            policy = self.policy()  # loads the engine on first use
        except BaseException:
            self.queue.release(batch_id, self.worker_id, terminal=False)
            raise  # a worker without an engine is useless: exit loudly, the batch waits
        with _Heartbeat(self.queue, self.worker_id, self._heartbeat_seconds()) as beat:
            claims = _WorkerClaims(self, beat)
            ctx = JobContext(
                settings=self.settings,
                sessions=self.sessions,
                storage=self.storage,
                engine=self.engine,
                policy=policy,
                worker_id=self.worker_id,
                interrupted=self.stopping.is_set,
                now=self.now,
                on_result=self.monitor.on_result,
            )
            run = SharedRun(ctx, claims, levels=self.settings.priorities)
            claims.held(batch_id)
            self.monitor.running(batch_id)
            try:
                ended = run.run(batch_id)
            except Exception as e:  # noqa: BLE001 - every held batch is paused or failed
                ended = dict(run.ended)
                for held in list(run.held):
                    ended[held] = self._after_error(ctx, held, e)
            self.monitor.running(None)
        for held_id, terminal in ended.items():
            log.info("batch %s %s", held_id, "done" if terminal else "left resumable")
        return ended.get(batch_id, False)

    def _after_error(self, ctx: JobContext, batch_id: str, e: Exception) -> bool:
        """A shared run broke: pause its batches for an outage, else fail them (server error)."""
        if is_outage(e):  # the database, Redis or the disk, not the batch: pause it
            log.warning("batch %s paused, a dependency is down (%s: %s); it resumes when it is "
                        "back", batch_id, type(e).__name__, e)
            self._release_after_outage(batch_id)
            return False
        log.error("batch %s failed on a server error", batch_id, exc_info=e)
        terminal = False
        try:
            fail_batch(ctx, batch_id, INTERNAL_ERROR)
            terminal = True
        except Exception:
            log.exception("could not mark batch %s failed", batch_id)
        try:
            self.queue.release(batch_id, self.worker_id, terminal=terminal)
        except Exception:  # the claim then goes stale and is taken over
            log.exception("could not release batch %s", batch_id)
        return terminal

    def _release_after_outage(self, batch_id: str) -> None:
        """Hand the batch back once the database answers again (so it resumes at once, not after
        the stall timeout); while it stays down past the stall timeout, the claim just lapses."""
        try:
            retry_outages(
                lambda: self.queue.release(batch_id, self.worker_id, terminal=False),
                what=f"releasing batch {batch_id}",
                give_up_after_s=self.settings.worker_stall_seconds,
                stop=self.stopping.is_set,
                max_wait_s=self.settings.worker_poll_seconds * 4,
            )
        except Exception as e:  # noqa: BLE001 - still down: the claim goes stale and is taken over
            log.warning("could not release batch %s yet (%s)", batch_id, e)

    def _heartbeat_seconds(self) -> float:
        return max(self.settings.worker_stall_seconds / 4, 0.05)

    def close(self) -> None:
        if self.webhooks is not None:
            self.webhooks.close()
        self.monitor.close()
        self.queue.close()
        self.db.dispose()


class _WorkerClaims:
    """What may join a worker's shared run, in which order (server/shared_run.Claims).

    Order: the higher project priority, then the earlier `expires_at`, then the project with
    fewer batches in the run (fair share), then the older batch. A candidate joins while the run
    holds fewer than `worker_max_inflight_tokens` (and its project fewer than
    `project_max_inflight_tokens`); one of a higher priority than everything running, or one
    already past its `expires_at` (it only needs finalising), joins regardless.
    """

    def __init__(self, worker: Worker, beat: _Heartbeat) -> None:
        self.worker, self.beat = worker, beat

    def claim_next(self, run: SharedRun | None) -> str | None:
        w = self.worker
        try:
            batch_id = w.queue.claim(w.worker_id, partial(self.choose, run))
        except Exception as e:  # noqa: BLE001 - the run goes on; the next poll tries again
            log.warning("cannot claim another batch now (%s: %s)", type(e).__name__, e)
            return None
        if batch_id is not None:
            self.held(batch_id)
        return batch_id

    def choose(self, run: SharedRun | None, candidates: list[Candidate]) -> list[str]:
        settings, now = self.worker.settings, self.worker.now()
        prio = settings.priorities
        held = run.held if run is not None else {}
        in_run = Counter(h.project for h in held.values())
        tokens: Counter[str] = Counter()
        for h in held.values():
            tokens[h.project] += h.tokens_in_flight
        total = sum(tokens.values())
        lowest = min((h.level for h in held.values()), default=None)
        shards_held = {h.batch_id for h in held.values() if h.shard is not None}

        def may_join(c: Candidate) -> bool:
            if c.id != c.batch_id and c.batch_id in shards_held and not c.stalled \
                    and now - c.created_at < settings.worker_stall_seconds:
                return False  # a fresh shard of a batch we run: left for another worker
            if not held or (c.expires_at is not None and c.expires_at <= now):
                return True
            if lowest is not None and prio.get(c.project, 0) > lowest:
                return True
            cap = settings.project_max_inflight_tokens
            if cap is not None and tokens[c.project] >= cap:
                return False
            return total < settings.worker_max_inflight_tokens

        ranked = sorted(
            (c for c in candidates if c.id not in held),
            key=lambda c: (-prio.get(c.project, 0), c.expires_at or math.inf, in_run[c.project],
                           c.created_at, c.id),
        )
        return [c.id for c in ranked if may_join(c)]

    def shards_for(self, total_lines: int) -> int:
        """Shards to cut a batch of `total_lines` into: the live workers, on Redis, for a batch
        of at least `shard_min_lines`; else 1 (it stays whole)."""
        w = self.worker
        if not w.settings.redis_url or total_lines < w.settings.shard_min_lines:
            return 1
        w._register()  # loading the model may have outlasted our presence key
        try:
            return max(w.queue.live_workers(), 1)
        except Exception as e:  # noqa: BLE001 - Redis down: run it whole
            log.warning("cannot count live workers (%s); the batch stays whole", e)
            return 1

    def enqueue(self, units: list[str]) -> None:
        for unit in units:
            try:
                self.worker.queue.enqueue(unit)
            except Exception as e:  # noqa: BLE001 - the SQL poll finds the shard anyway
                log.warning("could not announce %s on the queue (%s)", unit, e)

    def held(self, batch_id: str) -> None:
        self.beat.add(batch_id)
        self.worker.monitor.running(batch_id)

    def lost(self, batch_id: str) -> bool:
        return batch_id in self.beat.lost

    def release(self, batch_id: str, *, terminal: bool) -> None:
        self.beat.discard(batch_id)
        try:
            self.worker.queue.release(batch_id, self.worker.worker_id, terminal=terminal)
        except Exception:  # the claim then goes stale and is taken over
            log.exception("could not release batch %s", batch_id)


class _Heartbeat:
    """A thread that refreshes the claims of a shared run's batches (engine steps can be long)."""

    def __init__(self, queue: BatchQueue, worker_id: str, every: float) -> None:
        self.queue, self.worker_id, self.every = queue, worker_id, every
        self.lost: set[str] = set()  # batches another worker took over
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def add(self, batch_id: str) -> None:
        with self._lock:
            self._ids.add(batch_id)
            self.lost.discard(batch_id)

    def discard(self, batch_id: str) -> None:
        with self._lock:
            self._ids.discard(batch_id)

    def _run(self) -> None:
        while not self._done.wait(self.every):
            try:
                self.queue.register(self.worker_id)
            except Exception as e:  # noqa: BLE001 - Redis down: fewer shards, nothing worse
                log.debug("cannot register as a live worker (%s)", e)
            with self._lock:
                ids = sorted(self._ids)
            for batch_id in ids:
                try:
                    if not self.queue.heartbeat(batch_id, self.worker_id):
                        log.warning("lost the claim on batch %s", batch_id)
                        with self._lock:
                            self.lost.add(batch_id)
                            self._ids.discard(batch_id)
                except Exception as e:  # noqa: BLE001 - a blip; the next beat retries
                    log.warning("heartbeat for %s failed: %s", batch_id, e)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def load_engine(settings: Settings) -> Engine:
    """The served model on the best device here with its device profile, once per process."""
    from server.engine_setup import build_engine

    return build_engine(settings)


def choose_policy(name: str, engine: Engine) -> str:
    """`name` if the scheduler can build it for this engine, else fcfs (always available)."""
    try:
        from scheduler.policies import POLICY_NAMES, make_policy
        from scheduler.types import PlanRequest

        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; known: {POLICY_NAMES}")
        probe = [PlanRequest("probe", (1, 2, 3), 4)]
        make_policy(name, probe, kv_capacity_tokens=engine.kv_capacity_tokens,
                    cost_model=engine.cost_model)
        return name
    except Exception as e:  # noqa: BLE001 - any failure means "not this policy"
        log.warning("policy %r unavailable (%s); using fcfs", name, e)
        return "fcfs"


# --- entry points -----------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """`blendserve worker`: run one worker until SIGTERM/SIGINT (a second signal exits at once)."""
    _configure_logging()
    settings = Settings()
    upgrade(settings)  # idempotent; a standalone worker may start before any API has migrated
    return _serve_forever(Worker(settings))


def spawn_embedded_worker(settings: Settings) -> BaseProcess:
    """Start the API's worker as a spawned child process (never a thread of the API)."""
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(
        target=_embedded_main,
        args=(settings.model_dump(), os.getpid()),
        name="blendserve-worker",
        daemon=True,
    )
    process.start()
    return process


def _embedded_main(fields: dict[str, Any], parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    _configure_logging()
    raise SystemExit(_serve_forever(Worker(Settings(**fields))))


def _serve_forever(worker: Worker) -> int:
    def on_signal(signum: int, _frame: object) -> None:
        if worker.stopping.is_set():
            os._exit(128 + signum)  # second signal: journaled work is safe, in-flight is dropped
        log.info("signal %d: finishing in-flight requests, then exiting", signum)
        worker.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return worker.run()
    finally:
        worker.close()


def _die_with_parent(parent_pid: int) -> None:
    """An embedded worker must not outlive its API process (kill -9 of `serve` included)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
