"""Restart safety: kill -9 `blendserve serve` mid-batch, start it again on the same data dir, and
the batch completes with every custom_id exactly once and counts that never went backwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from runtime.loader import DEFAULT_MODEL
from tests.server import live_process
from tests.server.live_process import REPO, TERMINAL, free_port

LINES = 30
ENV = {
    "BLENDSERVE_POLICY": "fcfs",
    "BLENDSERVE_PROFILE": "none",  # no device measurement in a test's fresh data dir
    "BLENDSERVE_KV_MEMORY_BYTES": str(8 << 20),  # ~7 requests at a time: several waves
    "BLENDSERVE_WORKER_POLL_SECONDS": "0.1",
}


def serve(data_dir: Path, port: int, log: Path) -> live_process.Server:
    return live_process.Server(data_dir, port, log, **ENV)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A fresh data dir that reuses the default model's cached conversion (no 10 s re-convert)."""
    return live_process.model_data_dir(tmp_path)


def _batch_input() -> bytes:
    lines = []
    for i in range(LINES):
        body = {
            "model": DEFAULT_MODEL,
            "max_tokens": 2,
            "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Crash test request {i}."}],
        }
        lines.append(
            json.dumps(
                {
                    "custom_id": f"c-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.slow
def test_kill_9_mid_batch_then_restart_finishes_each_request_exactly_once(
    data_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    counts: list[int] = []  # request_counts.completed at every poll, across both servers
    servers: list[live_process.Server] = []
    try:
        with httpx.Client(timeout=30) as client:
            first = serve(data_dir, port, log)
            servers.append(first)
            first.wait_healthy(client)
            upload = client.post(
                f"{first.url}/v1/files",
                data={"purpose": "batch"},
                files={"file": ("crash.jsonl", _batch_input())},
            )
            assert upload.status_code == 200, upload.text
            created = client.post(
                f"{first.url}/v1/batches",
                json={
                    "input_file_id": upload.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]

            # 1. Let some requests be journaled, then kill -9 the server (not its worker: the
            #    worker must die with it on its own).
            running = _poll_until(
                client, first, batch_id, counts, lambda b: b["request_counts"]["completed"] >= 3
            )
            assert running["status"] == "in_progress", "the batch finished before the kill"
            children = psutil.Process(first.proc.pid).children(recursive=True)
            assert children, "serve started no worker process"
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
            _, alive = psutil.wait_procs(children, timeout=30)
            assert not alive, "the embedded worker outlived its server"
            killed_at = counts[-1]
            assert 3 <= killed_at < LINES

            # 2. Restart on the same data dir; the batch resumes and completes.
            second = serve(data_dir, port, log)
            servers.append(second)
            second.wait_healthy(client)
            final = _poll_until(client, second, batch_id, counts, lambda b: b["status"] in TERMINAL)
            assert final["status"] == "completed", final
            assert final["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
            assert counts == sorted(counts)  # never backwards, across the crash too

            out = client.get(f"{second.url}/v1/files/{final['output_file_id']}/content")
            ids = [json.loads(line)["custom_id"] for line in out.text.splitlines()]
            assert final["error_file_id"] is None
            assert sorted(ids) == sorted(f"c-{i}" for i in range(LINES))  # each exactly once
            assert f"resuming, {_journaled_before_restart(log)} of {LINES}" in log.read_text()
            # The new worker freed the dead one's claim at start (no 60 s stall wait).
            assert f"released batch {batch_id} held by dead worker" in log.read_text()
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                try:
                    server.proc.wait(30)
                except subprocess.TimeoutExpired:
                    server.proc.kill()


def _poll_until(
    client: httpx.Client, server: live_process.Server, batch_id: str, counts: list[int], done: Any
) -> dict[str, Any]:
    deadline = time.monotonic() + 600  # hang guard
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.tail()
        batch = client.get(f"{server.url}/v1/batches/{batch_id}").json()
        counts.append(batch["request_counts"]["completed"])
        if done(batch) or batch["status"] in TERMINAL:
            return batch
        time.sleep(0.02)
    pytest.fail(f"batch {batch_id} did not get there\n{server.tail()}")


def _journaled_before_restart(log: Path) -> int:
    """The count the restarted worker reports resuming from (it logs it once)."""
    for line in log.read_text(errors="replace").splitlines():
        if "resuming," in line:
            return int(line.split("resuming, ", 1)[1].split(" ", 1)[0])
    pytest.fail("the restarted worker did not resume the batch")


@pytest.mark.slow
def test_sigterm_stops_a_standalone_worker_between_requests(data_dir: Path, tmp_path: Path) -> None:
    """`blendserve worker` on SIGTERM stops admitting, journals what was in flight, releases its
    claim and exits 0, leaving the batch `in_progress` for the next worker to resume."""
    import sqlalchemy as sa

    from server.db import make_engine, upgrade
    from tests.server.conftest import make_test_settings
    from tests.server.test_worker import chat_line, journaled, seed_batch

    settings = make_test_settings(data_dir)
    upgrade(settings)
    db = make_engine(settings)
    batch_id = seed_batch(settings, db, [chat_line(i, ignore_eos=True) for i in range(LINES)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
    env.update(
        BLENDSERVE_DATA_DIR=str(data_dir),
        BLENDSERVE_POLICY="fcfs",
        BLENDSERVE_KV_MEMORY_BYTES=str(8 << 20),
        BLENDSERVE_WORKER_POLL_SECONDS="0.1",
        OMP_NUM_THREADS="2",
    )
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "worker"],
        cwd=REPO,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600  # hang guard
        while journaled(db, batch_id) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    with db.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, worker_id, completed, failed FROM batches WHERE id = :id"),
            {"id": batch_id},
        ).one()
    done = journaled(db, batch_id)
    db.dispose()
    assert row.status == "in_progress" and row.worker_id is None
    assert 1 <= row.completed + row.failed == done < LINES
    assert "finishing in-flight requests" in log.read_text()
