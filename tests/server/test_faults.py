"""Faults injected under a running batch, on real processes: PostgreSQL restarted, Redis restarted
(empty), the data directory full, and the worker killed with SIGKILL at ten points in a row.
Each time the batch completes with every custom_id exactly once, its counts never go backwards,
and while a dependency is down the API answers 503 with the OpenAI envelope, never a 500."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.server.conftest import assert_error, create_batch
from tests.server.live_process import (
    TERMINAL,
    Proc,
    Server,
    fixed_length_requests,
    free_port,
    model_data_dir,
)
from tests.server.scratch_services import ScratchPostgres, ScratchRedis

pytestmark = pytest.mark.slow

FAST = {  # a small engine, the fcfs order and no device profile: faults, not planning, are tested
    "BLENDSERVE_POLICY": "fcfs",
    "BLENDSERVE_PROFILE": "none",
    "BLENDSERVE_KV_MEMORY_BYTES": str(16 << 20),
    "BLENDSERVE_WORKER_POLL_SECONDS": "0.1",
    "BLENDSERVE_WORKER_STALL_SECONDS": "20",
}
HANG_GUARD_S = 600


def _input(n: int, max_tokens: int = 6) -> bytes:
    return fixed_length_requests(n, "f", max_tokens)


def _create(c: httpx.Client, n: int, max_tokens: int = 6) -> str:
    return str(create_batch(c, _input(n, max_tokens))["id"])


class Watch:
    """Polls a batch through the API, keeping every `completed` count seen and every 5xx."""

    def __init__(self, client: httpx.Client, batch_id: str, procs: list[Proc]) -> None:
        self.c, self.batch_id, self.procs = client, batch_id, procs
        self.counts: list[int] = []
        self.unavailable = 0  # 503 answers seen
        self.last: dict[str, Any] = {}

    def poll(self) -> dict[str, Any] | None:
        try:
            r = self.c.get(f"/v1/batches/{self.batch_id}")
        except httpx.TransportError:
            return None
        if r.status_code == 503:
            assert_error(r, 503)
            assert r.headers.get("retry-after")
            self.unavailable += 1
            return None
        assert r.status_code == 200, r.text
        self.last = r.json()
        self.counts.append(self.last["request_counts"]["completed"])
        return self.last

    def until(self, done: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            for p in self.procs:
                assert p.alive(), f"{what}: a process died\n{p.tail()}"
            batch = self.poll()
            if batch is not None and (done(batch) or batch["status"] in TERMINAL):
                return batch
            time.sleep(0.1)
        pytest.fail(f"{what}: hang guard\n" + "\n".join(p.tail() for p in self.procs))


def _running(c: httpx.Client, n: int, procs: list[Proc]) -> Watch:
    """A batch of `n` requests, once a few of them are journaled: the fault comes mid-run."""
    watch = Watch(c, _create(c, n), procs)
    watch.until(lambda b: b["request_counts"]["completed"] >= 3, "before the fault")
    return watch


def _exactly_once(c: httpx.Client, batch: dict[str, Any], n: int) -> None:
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert batch["error_file_id"] is None
    out = c.get(f"/v1/files/{batch['output_file_id']}/content")
    ids = [json.loads(line)["custom_id"] for line in out.text.splitlines()]
    assert sorted(ids) == sorted(f"f-{i}" for i in range(n))  # each exactly once


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


# -- PostgreSQL ----------------------------------------------------------------------------------
def test_postgresql_restarted_mid_batch(tmp_path: Path, procs: list[Proc]) -> None:
    pg = ScratchPostgres()
    pg.start()
    try:
        server = Server(
            model_data_dir(tmp_path),
            free_port(),
            tmp_path / "serve.log",
            BLENDSERVE_DATABASE_URL=pg.url,
            **FAST,
        )
        procs.append(server)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            server.wait_healthy(c)
            n = 20
            watch = _running(c, n, procs)
            pg.stop("immediate")
            down_until = time.monotonic() + 4
            while time.monotonic() < down_until:  # every answer while it is down: 503, not 500
                assert watch.poll() is None
                assert_error(c.get("/health"), 503)
                up = c.post(
                    "/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", _input(1))}
                )
                assert_error(up, 503)
                assert_error(c.get("/v1/batches"), 503)
                time.sleep(0.2)
            pg.start()
            final = watch.until(lambda b: False, "after the restart")
            _exactly_once(c, final, n)
        assert watch.counts == sorted(watch.counts) and watch.unavailable >= 5
    finally:
        for p in procs:
            p.stop()
        pg.close()


# -- Redis ---------------------------------------------------------------------------------------
def test_redis_restarted_empty_mid_batch(tmp_path: Path, procs: list[Proc]) -> None:
    redis_server = ScratchRedis()
    redis_server.start()
    try:
        data = model_data_dir(tmp_path)
        env = {**FAST, "BLENDSERVE_REDIS_URL": redis_server.url}
        api = Server(data, free_port(), tmp_path / "api.log", "--no-worker", **env)
        procs.append(api)
        with httpx.Client(base_url=api.url, timeout=30) as c:
            api.wait_healthy(c)
            worker = Proc(
                ["worker"], {"BLENDSERVE_DATA_DIR": str(data), **env}, tmp_path / "worker.log"
            )
            procs.append(worker)
            n = 16
            first = _running(c, n, procs)
            redis_server.kill()
            second = Watch(c, _create(c, 4), procs)  # accepted while Redis is down: SQL has it
            assert c.get("/v1/batches").status_code == 200
            time.sleep(2)
            redis_server.start()  # empty: no stream, no consumer group
            _exactly_once(c, first.until(lambda b: False, "first batch"), n)
            final = second.until(lambda b: False, "second batch")
            assert final["request_counts"]["completed"] == 4 and final["status"] == "completed"
            assert first.counts == sorted(first.counts)
            third = Watch(c, _create(c, 2), procs)  # and the recreated stream carries new work
            assert third.until(lambda b: False, "third batch")["status"] == "completed"
        assert "consumer group is gone" in worker.log.read_text()
    finally:
        for p in procs:
            p.stop()
        redis_server.close()


# -- a full data directory -----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs to hold the data directory (SQLite database and files)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
        check=False,
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(folder: Path) -> Path:
    """Write until the disk is full; returns the ballast file."""
    ballast = folder / "ballast"
    chunk = b"\0" * (1 << 20)
    with open(ballast, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(chunk)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    return ballast


def test_a_full_data_directory(small_disk: Path, tmp_path: Path, procs: list[Proc]) -> None:
    data = model_data_dir(small_disk)
    server = Server(data, free_port(), tmp_path / "serve.log", **FAST)
    procs.append(server)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        server.wait_healthy(c)
        n = 20
        watch = _running(c, n, procs)
        ballast = _fill(small_disk)
        refused = 0
        deadline = time.monotonic() + HANG_GUARD_S
        while refused < 3 or not _worker_hit_the_full_disk(server):  # both sides feel it
            assert time.monotonic() < deadline, server.tail()
            up = c.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", _input(20))}
            )
            if up.status_code != 200:
                err = assert_error(up, 503)
                assert "storage" in err["message"] and up.headers["retry-after"]
                refused += 1
            watch.poll()  # 200 or 503, never a 500
            time.sleep(0.2)
        assert refused >= 3
        ballast.unlink()
        final = watch.until(lambda b: False, "after space came back")
        _exactly_once(c, final, n)
    assert watch.counts == sorted(watch.counts)


def _worker_hit_the_full_disk(server: Server) -> bool:
    """The worker tried to journal (or finalize) on the full disk and is waiting, not failing."""
    log = server.log.read_text(errors="replace")
    return "retrying in" in log or "paused, a dependency is down" in log


# -- kill -9 of the worker, ten times ------------------------------------------------------------
def _journaled(db: sa.Engine, batch_id: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM batch_results WHERE batch_id = :b"), {"b": batch_id}
            ).scalar()
            or 0
        )


def _claimed_by(db: sa.Engine, batch_id: str, pid: int) -> bool:
    with db.connect() as conn:
        holder = conn.execute(
            sa.text("SELECT worker_id FROM batches WHERE id = :b"), {"b": batch_id}
        ).scalar()
    return bool(holder) and f":{pid}:" in str(holder)


KILL_POINTS: list[tuple[str, float]] = [  # (what to wait for, how much of it) before SIGKILL
    ("seconds", 0.5),  # importing
    ("seconds", 2.5),  # loading the model
    ("claimed", 0),  # holding the batch, nothing journaled by this worker yet
    ("journaled", 1),
    ("journaled", 2),
    ("claimed", 0),
    ("journaled", 3),
    ("journaled", 1),
    ("journaled", 4),
    ("journaled", 2),
]


def test_worker_killed_at_ten_points_in_a_loop(tmp_path: Path, procs: list[Proc]) -> None:
    data = model_data_dir(tmp_path)
    slow = {**FAST, "BLENDSERVE_MAX_BATCH_TOKENS": "48"}  # a prompt or so a step: lines end apart
    api = Server(data, free_port(), tmp_path / "api.log", "--no-worker", **slow)
    procs.append(api)
    db = sa.create_engine(f"sqlite:///{data / 'blendserve.db'}")
    kills = []
    try:
        with httpx.Client(base_url=api.url, timeout=30) as c:
            api.wait_healthy(c)
            n = 36
            watch = Watch(c, _create(c, n, max_tokens=2), [api])
            env = {"BLENDSERVE_DATA_DIR": str(data), **slow}
            for i, (point, amount) in enumerate(KILL_POINTS):
                worker = Proc(["worker"], env, tmp_path / f"worker-{i}.log")
                before = _journaled(db, watch.batch_id)
                deadline = time.monotonic() + HANG_GUARD_S
                started = time.monotonic()
                while not (
                    (point == "seconds" and (time.monotonic() - started >= amount
                                             # a fast machine is past loading: kill it anyway
                                             or _journaled(db, watch.batch_id) > before))
                    or (point == "claimed" and _claimed_by(db, watch.batch_id, worker.pid))
                    or (point == "journaled" and _journaled(db, watch.batch_id) >= before + amount)
                ):
                    assert worker.alive() and time.monotonic() < deadline, worker.tail()
                    time.sleep(0.02)
                worker.kill9()
                kills.append((point, amount, _journaled(db, watch.batch_id)))
                batch = watch.poll()  # the API never notices
                assert batch is not None and batch["status"] in ("validating", "in_progress"), batch
            assert _journaled(db, watch.batch_id) < n, "the batch finished before the tenth kill"
            last = Proc(["worker"], env, tmp_path / "worker-last.log")
            procs.append(last)
            final = watch.until(lambda b: False, "after ten kills")
            _exactly_once(c, final, n)
    finally:
        db.dispose()
    print(f"kill -9 points (point, amount, journaled at the kill): {kills}")
    assert len(kills) == 10 and watch.counts == sorted(watch.counts)


# -- a shared run (several batches on one engine) ------------------------------------------------


def test_worker_killed_during_a_shared_run_every_batch_completes_once(
    tmp_path: Path, procs: list[Proc]
) -> None:
    data = model_data_dir(tmp_path)
    slow = {**FAST, "BLENDSERVE_MAX_BATCH_TOKENS": "48"}
    api = Server(data, free_port(), tmp_path / "api.log", "--no-worker", **slow)
    procs.append(api)
    db = sa.create_engine(f"sqlite:///{data / 'blendserve.db'}")
    n = 12
    try:
        with httpx.Client(base_url=api.url, timeout=30) as c:
            api.wait_healthy(c)
            watches = [Watch(c, _create(c, n, max_tokens=4), [api]) for _ in range(3)]
            env = {"BLENDSERVE_DATA_DIR": str(data), **slow}
            worker = Proc(["worker"], env, tmp_path / "worker-0.log")
            deadline = time.monotonic() + HANG_GUARD_S
            # kill -9 once two batches have results and the run is not over
            while sum(_journaled(db, w.batch_id) > 0 for w in watches) < 2:
                assert worker.alive() and time.monotonic() < deadline, worker.tail()
                time.sleep(0.02)
            worker.kill9()
            done_at_kill = [_journaled(db, w.batch_id) for w in watches]
            assert sum(done_at_kill) < 3 * n, "the run ended before the kill"
            procs.append(Proc(["worker"], env, tmp_path / "worker-1.log"))
            for w in watches:
                _exactly_once(c, w.until(lambda b: False, "after the kill"), n)
                assert w.counts == sorted(w.counts)
    finally:
        db.dispose()
    print(f"journaled per batch at the kill: {done_at_kill}")
