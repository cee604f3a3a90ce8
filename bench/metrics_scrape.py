"""How long a Prometheus scrape of GET /metrics takes as the batches table and the number of
workers grow (run by hand; numbers go into reports, not tests).

    .venv/bin/python bench/metrics_scrape.py [--batches 20000] [--projects 50] [--workers 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient

from runtime.types import StepRecord
from server.app import create_app
from server.config import Settings
from server.db import make_engine, upgrade
from server.engine_monitor import EngineMonitor
from server.models import BatchRow, BatchStatus
from server.pipeline import LineResult


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--projects", type=int, default=50)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=None, redis_url=None, api_keys=None)
        upgrade(settings)
        db = make_engine(settings)
        statuses = [s.value for s in BatchStatus]
        now = int(time.time())
        rows = [
            {
                "id": f"batch_{i:024x}",
                "project": f"p{i % args.projects}",
                "endpoint": "/v1/chat/completions",
                "input_file_id": f"file-{i:024x}",
                "completion_window": "24h",
                "status": statuses[i % len(statuses)],
                "created_at": now,
                "total": 100,
                "completed": i % 100,
                "failed": 0,
                "input_tokens": 1000,
                "cached_tokens": 300,
                "output_tokens": 500,
            }
            for i in range(args.batches)
        ]
        with db.begin() as conn:
            conn.execute(sa.insert(BatchRow), rows)
        db.dispose()
        for w in range(args.workers):
            monitor = EngineMonitor(settings.data_dir, f"host:{w}:bench")
            monitor.observe_steps(StepRecord(64, 32, 0, 0, 32, 0.02) for _ in range(1000))
            monitor.on_result(LineResult("c", 1, True, {}, 100, 30, 50))
            monitor.publish()
        with TestClient(create_app(settings)) as client:
            client.get("/metrics")  # warm
            times = []
            for _ in range(args.scrapes):
                started = time.perf_counter()
                r = client.get("/metrics")
                times.append(time.perf_counter() - started)
                r.raise_for_status()
        times.sort()
        print(
            f"/metrics: {args.batches} batches, {args.projects} projects, {args.workers} workers, "
            f"{len(r.content)} bytes: p50 {1000 * statistics.median(times):.1f} ms, "
            f"p95 {1000 * times[int(0.95 * (len(times) - 1))]:.1f} ms"
        )


if __name__ == "__main__":
    main()
