"""`GET /metrics` in Prometheus text format: the service as SQL sees it, each worker's engine as
it last published itself, and this API process's HTTP traffic.

Multiprocess-safe by construction: nothing here counts inside another process. Batch and
per-project figures are read from SQL at scrape time (the source of truth every process shares);
engine figures come from the snapshots workers write under DATA_DIR/metrics/workers/
(server/engine_monitor.py), one labelled series per worker, dropped when a snapshot goes stale
(the worker died); HTTP figures are this process's own. Nothing needs PROMETHEUS_MULTIPROC_DIR.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine_monitor import snapshot_dir
from server.models import ACTIVE_STATUSES, BatchRow, BatchStatus
from server.outage import is_outage

log = logging.getLogger(__name__)

STALE_AFTER_MIN_S = 15.0  # a snapshot older than max(this, 5 publish intervals) is a dead worker
FORGET_AFTER_S = 24 * 3600  # a dead worker's snapshot file is deleted after this
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_KINDS = ("prompt", "cached", "output")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def build_registry(
    sessions: sessionmaker[Session],
    data_dir: Path,
    *,
    stall_seconds: float,
    snapshot_seconds: float,
) -> tuple[CollectorRegistry, HttpMetrics]:
    """A registry of its own per app (tests run several apps in one process)."""
    registry = CollectorRegistry()
    registry.register(SqlCollector(sessions, stall_seconds=stall_seconds))
    registry.register(
        WorkerCollector(
            snapshot_dir(data_dir), stale_after_s=max(STALE_AFTER_MIN_S, 5 * snapshot_seconds)
        )
    )
    ProcessCollector(registry=registry)
    return registry, HttpMetrics(registry)


# --- SQL: batches, queue, projects ------------------------------------------------------------


class SqlCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], *, stall_seconds: float) -> None:
        self.sessions = sessions
        self.stall_seconds = stall_seconds

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "blendserve_database_up", "1 when the database answered this scrape."
        )
        try:
            groups, waiting, running = self._read()
        except Exception as e:
            if not is_outage(e):
                raise
            log.warning("metrics: database unavailable (%s)", type(e).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        batches = GaugeMetricFamily(
            "blendserve_batches", "Batches by status and project.", labels=["project", "status"]
        )
        requests = GaugeMetricFamily(
            "blendserve_project_requests",
            "Requests finished over all of a project's batches, by result.",
            labels=["project", "result"],
        )
        tokens = GaugeMetricFamily(
            "blendserve_project_tokens",
            "Tokens over all of a project's batches (prompt, cached prompt, output).",
            labels=["project", "kind"],
        )
        pending = GaugeMetricFamily(
            "blendserve_requests_pending",
            "Requests of in-progress batches not finished yet.",
            labels=["project"],
        )
        per_project: dict[str, list[int]] = {}
        for project, status, n, total, done, failed, prompt, cached, output in groups:
            batches.add_metric([project, status], n)
            acc = per_project.setdefault(project, [0] * 6)
            for i, v in enumerate((done, failed, prompt, cached, output)):
                acc[i] += int(v or 0)
            if status == BatchStatus.IN_PROGRESS:
                acc[5] += int(total or 0) - int(done or 0) - int(failed or 0)
        for project, (done, failed, prompt, cached, output, left) in sorted(per_project.items()):
            requests.add_metric([project, "completed"], done)
            requests.add_metric([project, "failed"], failed)
            for kind, value in zip(TOKEN_KINDS, (prompt, cached, output)):
                tokens.add_metric([project, kind], value)
            pending.add_metric([project], left)
        yield from (batches, requests, tokens, pending)
        queue = GaugeMetricFamily(
            "blendserve_queue_depth",
            "Batches that need a worker and have none (validating, in_progress, finalizing or "
            "cancelling, unclaimed or whose worker stopped heartbeating).",
        )
        queue.add_metric([], waiting)
        yield queue
        busy = GaugeMetricFamily(
            "blendserve_batches_running", "Batches a live worker is running right now."
        )
        busy.add_metric([], running)
        yield busy

    def _read(self) -> tuple[list[Any], int, int]:
        active = [s.value for s in ACTIVE_STATUSES]
        cutoff = time.time() - self.stall_seconds
        live = sa.and_(BatchRow.worker_id.is_not(None), BatchRow.heartbeat_at >= cutoff)
        with self.sessions() as s:
            groups = s.execute(
                sa.select(
                    BatchRow.project,
                    BatchRow.status,
                    sa.func.count(),
                    sa.func.sum(BatchRow.total),
                    sa.func.sum(BatchRow.completed),
                    sa.func.sum(BatchRow.failed),
                    sa.func.sum(BatchRow.input_tokens),
                    sa.func.sum(BatchRow.cached_tokens),
                    sa.func.sum(BatchRow.output_tokens),
                ).group_by(BatchRow.project, BatchRow.status)
            ).all()
            claims = s.execute(
                sa.select(sa.case((live, 1), else_=0), sa.func.count())
                .where(BatchRow.status.in_(active))
                .group_by(sa.case((live, 1), else_=0))
            ).all()
        by_live = {int(k): int(n) for k, n in claims}
        return list(groups), by_live.get(0, 0), by_live.get(1, 0)


# --- workers: engine snapshots ----------------------------------------------------------------


class WorkerCollector(Collector):
    def __init__(self, folder: Path, *, stale_after_s: float) -> None:
        self.folder = folder
        self.stale_after_s = stale_after_s

    def snapshots(self) -> list[dict[str, Any]]:
        """Fresh snapshots, one per live worker; stale ones are skipped, ancient ones deleted."""
        now = time.time()
        out = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                snap = json.loads(path.read_text())
                age = now - float(snap["updated_at"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # vanished or half-written by an old writer: next scrape
            if age > FORGET_AFTER_S:
                path.unlink(missing_ok=True)
            elif age <= self.stale_after_s:
                out.append(snap)
        return out

    def collect(self) -> Iterator[Metric]:
        snaps = self.snapshots()
        w = ["worker"]
        up = GaugeMetricFamily(
            "blendserve_worker_up", "Workers publishing figures.", labels=[*w, "model"]
        )
        busy = GaugeMetricFamily(
            "blendserve_worker_batch",
            "The batch a worker is running (value 1).",
            labels=[*w, "batch"],
        )
        reqs = CounterMetricFamily(
            "blendserve_worker_requests",
            "Requests a worker journaled, by result.",
            labels=[*w, "result"],
        )
        toks = CounterMetricFamily(
            "blendserve_worker_tokens", "Tokens of requests a worker finished.", labels=[*w, "kind"]
        )
        rps = GaugeMetricFamily(
            "blendserve_requests_per_second",
            "Requests finished per second (10 s window).",
            labels=w,
        )
        tps = GaugeMetricFamily(
            "blendserve_tokens_per_second",
            "Tokens per second of finished requests (10 s window): prompt, cached prompt, output.",
            labels=[*w, "kind"],
        )
        eng_tps = GaugeMetricFamily(
            "blendserve_engine_tokens_per_second",
            "Engine tokens per second (10 s window): prefill and decode tokens run, tokens sampled.",
            labels=[*w, "phase"],
        )
        hit = GaugeMetricFamily(
            "blendserve_prefix_hit_ratio",
            "Cached prompt tokens / prompt tokens (10 s window; lifetime when idle).",
            labels=w,
        )
        kv_cap = GaugeMetricFamily(
            "blendserve_kv_cache_capacity_tokens", "KV cache size.", labels=w
        )
        kv_used = GaugeMetricFamily(
            "blendserve_kv_cache_used_tokens",
            "KV tokens allocated (prefix cache included).",
            labels=w,
        )
        kv_cached = GaugeMetricFamily(
            "blendserve_kv_cache_cached_tokens",
            "KV tokens of reusable prefixes nobody holds.",
            labels=w,
        )
        kv_use = GaugeMetricFamily(
            "blendserve_kv_cache_usage_ratio",
            "Share of the KV cache running requests hold.",
            labels=w,
        )
        steps = HistogramMetricFamily(
            "blendserve_engine_step_seconds", "Wall time of one engine step.", labels=w
        )
        eng_toks = CounterMetricFamily(
            "blendserve_engine_tokens",
            "Engine tokens: prefill and decode run, sampled.",
            labels=[*w, "phase"],
        )
        preempt = CounterMetricFamily(
            "blendserve_engine_preemptions", "Sequences preempted for KV room.", labels=w
        )
        for snap in snaps:
            wid = str(snap.get("worker_id", "?"))
            up.add_metric([wid, str(snap.get("model", ""))], 1)
            if snap.get("batch_id"):
                busy.add_metric([wid, str(snap["batch_id"])], 1)
            c = snap.get("counters", {})
            reqs.add_metric([wid, "completed"], c.get("requests_ok", 0))
            reqs.add_metric([wid, "failed"], c.get("requests_failed", 0))
            r = snap.get("rates", {})
            rps.add_metric([wid], r.get("requests_per_s", 0.0))
            for kind in TOKEN_KINDS:
                toks.add_metric([wid, kind], c.get(f"{kind}_tokens", 0))
                tps.add_metric([wid, kind], r.get(f"{kind}_tokens_per_s", 0.0))
            for phase in ("prefill", "decode", "sampled"):
                eng_tps.add_metric([wid, phase], r.get(f"engine_{phase}_tokens_per_s", 0.0))
            hit.add_metric([wid], snap.get("prefix_hit_ratio", 0.0))
            kv = snap.get("kv")
            if kv:
                kv_cap.add_metric([wid], kv["capacity_tokens"])
                kv_used.add_metric([wid], kv["used_tokens"])
                kv_cached.add_metric([wid], kv["cached_tokens"])
                kv_use.add_metric([wid], kv["usage_ratio"])
            eng = snap.get("engine")
            if eng:
                eng_toks.add_metric([wid, "prefill"], eng["prefill_tokens"])
                eng_toks.add_metric([wid, "decode"], eng["decode_tokens"])
                eng_toks.add_metric([wid, "sampled"], c.get("sampled_tokens", 0))
                preempt.add_metric([wid], eng["preemptions"])
            hist = snap.get("step_seconds")
            if hist:
                steps.add_metric([wid], _buckets(hist), hist["sum"])
        yield from (up, busy, reqs, toks, rps, tps, eng_tps, hit)
        yield from (kv_cap, kv_used, kv_cached, kv_use, steps, eng_toks, preempt)


def _buckets(hist: dict[str, Any]) -> list[tuple[str, float]]:
    """Per-bucket counts → Prometheus' cumulative `le` buckets."""
    out, running = [], 0
    for le, n in zip([*hist["le"], float("inf")], hist["counts"]):
        running += n
        out.append(("+Inf" if le == float("inf") else repr(float(le)), running))
    return out


# --- this process: HTTP -----------------------------------------------------------------------


class HttpMetrics:
    """Counts and times this API process's requests by route template (not raw path)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "blendserve_http_requests",
            "HTTP requests answered by this API process.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.seconds = Histogram(
            "blendserve_http_request_seconds",
            "Time to answer an HTTP request (until the response starts).",
            ["method", "route"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "other"  # clients choose methods freely
        self.seconds.labels(method, route).observe(seconds)
        self.requests.labels(method, route, str(status)).inc()


class HttpMetricsMiddleware:
    """ASGI middleware feeding HttpMetrics; the route is known once routing has run."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                seconds = time.perf_counter() - started
                self.metrics.observe(scope["method"], route, int(message["status"]), seconds)
            await send(message)

        await self.app(scope, receive, send_status)
