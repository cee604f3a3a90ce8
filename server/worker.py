"""The batch worker process: claim a batch, run it on this process's engine, release it, repeat.

The engine never runs in the API's process: `blendserve serve` starts one worker as a spawned
child (`spawn_embedded_worker`), `blendserve worker` runs one alone (one per GPU). A worker talks
to the API only through SQL (and Redis when configured), so either side can crash alone.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Self

from sqlalchemy.orm import sessionmaker

from server.config import Settings
from server.db import upgrade
from server.engine_monitor import EngineMonitor
from server.jobs import JobContext, fail_batch, run_batch
from server.outage import is_outage, retry_outages
from server.queue import BatchQueue, make_queue
from server.storage import FileStorage

if TYPE_CHECKING:
    from runtime.engine import Engine

log = logging.getLogger("blendserve.worker")

INTERNAL_ERROR = "The server hit an internal error while running this batch."


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
        self.monitor.start()
        if self.webhooks is not None:
            self.webhooks.start()
        self._recover()
        while not self.stopping.is_set():
            # 1. Claim the oldest batch that needs work, or one whose owner stopped heartbeating.
            batch_id = self._claim()
            if batch_id is None:
                if until_idle:
                    break
                # 2. Nothing to do: wait a poll interval (a signal wakes us at once).
                self.stopping.wait(self.settings.worker_poll_seconds)
                continue
            # 3. Run it under a heartbeat; any error fails this batch only.
            terminal = self.run_one(batch_id)
            # 4. Log where it ended; an unfinished batch (shutdown, lost claim) stays resumable.
            log.info("batch %s %s", batch_id, "done" if terminal else "left resumable")
        log.info("worker %s stopped", self.worker_id)
        return 0

    def _recover(self) -> None:
        """Free batches that dead workers of this host still claim (a restart after kill -9)."""
        try:
            self.queue.recover(self.worker_id)
        except Exception as e:  # noqa: BLE001 - schema not there yet: stalled claims still expire
            log.warning("could not check for dead workers' claims (%s)", e)

    def _claim(self) -> str | None:
        try:
            return self.queue.claim(self.worker_id)
        except Exception as e:  # noqa: BLE001 - database not migrated yet, Redis restarting, ...: keep polling
            log.warning("cannot claim a batch yet (%s: %s)", type(e).__name__, e)
            self.stopping.wait(self.settings.worker_poll_seconds * 4)
            return None

    def run_one(self, batch_id: str) -> bool:
        """Run one claimed batch and release the claim; True when the batch is terminal."""
        try:
            policy = self.policy()  # loads the engine on first use
        except BaseException:
            self.queue.release(batch_id, self.worker_id, terminal=False)
            raise  # a worker without an engine is useless: exit loudly, the batch waits
        terminal = False
        with _Heartbeat(self.queue, batch_id, self.worker_id, self._heartbeat_seconds()) as beat:
            ctx = JobContext(
                settings=self.settings,
                sessions=self.sessions,
                storage=self.storage,
                engine=self.engine,
                policy=policy,
                worker_id=self.worker_id,
                interrupted=lambda: self.stopping.is_set() or beat.lost.is_set(),
                now=self.now,
                on_result=self.monitor.on_result,
            )
            self.monitor.running(batch_id)
            try:
                terminal = run_batch(batch_id, ctx)
            except Exception as e:
                if is_outage(e):  # the database, Redis or the disk, not the batch: pause it
                    log.warning("batch %s paused, a dependency is down (%s: %s); it resumes "
                                "when it is back", batch_id, type(e).__name__, e)
                    self._release_after_outage(batch_id)
                    self.monitor.running(None)
                    return False
                log.exception("batch %s failed on a server error", batch_id)
                try:
                    fail_batch(ctx, batch_id, INTERNAL_ERROR)
                    terminal = True
                except Exception:
                    log.exception("could not mark batch %s failed", batch_id)
        self.monitor.running(None)
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


class _Heartbeat:
    """A thread that refreshes the claim while the job runs (engine steps can be long)."""

    def __init__(self, queue: BatchQueue, batch_id: str, worker_id: str, every: float) -> None:
        self.queue, self.batch_id, self.worker_id, self.every = queue, batch_id, worker_id, every
        self.lost = threading.Event()  # another worker took the batch over
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self.every):
            try:
                if not self.queue.heartbeat(self.batch_id, self.worker_id):
                    log.warning("lost the claim on batch %s", self.batch_id)
                    self.lost.set()
                    return
            except Exception as e:  # noqa: BLE001 - a blip; the next beat retries
                log.warning("heartbeat for %s failed: %s", self.batch_id, e)

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
