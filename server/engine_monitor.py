"""A worker's live figures for `/metrics`: engine steps, KV-cache use, tokens and requests.

The engine runs in worker processes and `/metrics` is answered by the API process, so a worker
publishes what it sees as a small JSON snapshot, `DATA_DIR/metrics/workers/<worker>.json`,
rewritten (temp file + rename) every `metrics_snapshot_seconds`. The data directory is already
shared by the API and every worker (they read the same uploaded files), so this needs no extra
service, survives any worker crash (a snapshot that stops changing is dropped as stale), and keeps
each worker's series apart (label `worker`). See server/metrics.py for the reading side.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.types import StepRecord
    from server.pipeline import LineResult

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "metrics/workers"  # under DATA_DIR
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATE_WINDOW_S = 10.0  # tokens/s and requests/s are averaged over this many seconds
_COUNTERS = (
    "requests_ok",
    "requests_failed",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "sampled_tokens",  # tokens the engine generated, finished requests or not (step log)
)


def snapshot_dir(data_dir: Path) -> Path:
    return data_dir / SNAPSHOT_DIR


def snapshot_name(worker_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:200] + ".json"


class EngineMonitor:
    """Counts what one worker does and publishes it; every method is safe from any thread."""

    def __init__(
        self, data_dir: Path, worker_id: str, *, every_s: float = 1.0, clock: Any = time.time
    ) -> None:
        self.path = snapshot_dir(data_dir) / snapshot_name(worker_id)
        self.worker_id = worker_id
        self.every_s = every_s
        self.clock = clock
        self.started_at = clock()
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._bucket_counts = [0] * (len(STEP_BUCKETS) + 1)  # the last one is +Inf
        self._step_sum = 0.0
        self._batch: str | None = None
        self._history: deque[tuple[float, dict[str, int]]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_failed = False
        self._log: list[StepRecord] = []  # the engine's step log we last read, and how far
        self._log_seen = 0

    # -- what the worker feeds in -------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        """Watch this engine: its step log (step times), KV pool and counters."""
        with self._lock:
            self._engine = engine

    def observe_steps(self, steps: Iterable[StepRecord]) -> None:
        """Engine steps as they ran: the step-time histogram and the tokens they sampled."""
        with self._lock:
            for step in steps:
                self._bucket_counts[bisect.bisect_left(STEP_BUCKETS, step.seconds)] += 1
                self._step_sum += step.seconds
                self._counts["sampled_tokens"] += step.rows

    def _drain_step_log(self, engine: Engine) -> None:
        """Steps the engine logged since the last look. `generate()` starts a new list; what the
        old one got after our last look is read before moving on."""
        log = engine.step_log
        new: list[StepRecord] = []
        if log is not self._log:
            new.extend(self._log[self._log_seen :])
            self._log, self._log_seen = log, 0
        end = len(log)  # the engine appends from its own thread: read up to a fixed end
        new.extend(log[self._log_seen : end])
        self._log_seen = end
        self.observe_steps(new)

    def on_result(self, result: LineResult) -> None:
        """One request journaled (finished or refused): its outcome and usage."""
        with self._lock:
            c = self._counts
            c["requests_ok" if result.ok else "requests_failed"] += 1
            c["prompt_tokens"] += result.input_tokens
            c["cached_tokens"] += result.cached_tokens
            c["output_tokens"] += result.output_tokens

    def running(self, batch_id: str | None) -> None:
        with self._lock:
            self._batch = batch_id

    # -- publishing ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The figures as of now (also what `publish` writes)."""
        now = self.clock()
        if self._engine is not None:
            self._drain_step_log(self._engine)
        with self._lock:
            engine, batch = self._engine, self._batch
            figures = _engine_figures(engine) if engine is not None else {}
            counts = dict(self._counts)
            buckets = list(self._bucket_counts)
            step_sum = self._step_sum
            sample = dict(counts)
            for phase in ("prefill", "decode"):
                sample[f"engine_{phase}_tokens"] = figures.get("engine", {}).get(
                    f"{phase}_tokens", 0
                )
            self._history.append((now, sample))
            while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
                self._history.popleft()
            (t0, first), (t1, last) = self._history[0], self._history[-1]
        span = t1 - t0
        rates = {k: (last[k] - first[k]) / span if span > 0 else 0.0 for k in sample}
        prompt, cached = rates["prompt_tokens"], rates["cached_tokens"]
        if prompt <= 0:  # nothing finished lately: the lifetime ratio
            prompt, cached = counts["prompt_tokens"], counts["cached_tokens"]
        snap: dict[str, Any] = {
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "updated_at": now,
            "batch_id": batch,
            "counters": counts,
            "rates": {
                "requests_per_s": rates["requests_ok"] + rates["requests_failed"],
                "prompt_tokens_per_s": rates["prompt_tokens"],
                "cached_tokens_per_s": rates["cached_tokens"],
                "output_tokens_per_s": rates["output_tokens"],
                "engine_prefill_tokens_per_s": rates["engine_prefill_tokens"],
                "engine_decode_tokens_per_s": rates["engine_decode_tokens"],
                "engine_sampled_tokens_per_s": rates["sampled_tokens"],
            },
            "prefix_hit_ratio": cached / prompt if prompt > 0 else 0.0,
            "step_seconds": {"le": list(STEP_BUCKETS), "counts": buckets, "sum": step_sum},
        }
        snap.update(figures)
        return snap

    def publish(self) -> None:
        """Write the snapshot now (temp file + rename, so a reader never sees half of one)."""
        text = json.dumps(self.snapshot())
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
            self._write_failed = False
        except OSError as e:  # a full disk must not stop the worker; the next tick retries
            if not self._write_failed:
                log.warning("cannot publish worker metrics to %s: %s", self.path, e)
            self._write_failed = True
            tmp.unlink(missing_ok=True)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.publish()
            if self._stop.wait(self.every_s):
                return

    def close(self) -> None:
        """Stop publishing and remove the snapshot: a worker that left cleanly is not 'up'."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.path.unlink(missing_ok=True)


def _engine_figures(engine: Engine) -> dict[str, Any]:
    """Read from the publishing thread: int attributes and list lengths, each read atomically."""
    pool, stats = engine.pool, engine.stats
    pages, free, evictable = pool.num_pages, pool.num_free, engine.cache.evictable_pages
    return {
        "model": engine.model_name,
        "kv": {
            "capacity_tokens": pages * pool.page_size,
            "used_tokens": (pages - free) * pool.page_size,  # held, including reusable prefixes
            "cached_tokens": evictable * pool.page_size,  # prefix cache nobody holds right now
            "usage_ratio": max(pages - free - evictable, 0) / pages,  # held by running requests
        },
        "engine": {
            "steps": stats.steps,
            "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens,
            "cached_tokens": stats.cached_tokens,
            "preemptions": stats.preemptions,
            "finished_requests": stats.finished_requests,
        },
    }
