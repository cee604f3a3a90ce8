"""Throw-away PostgreSQL and Redis servers on free ports, for fault tests that stop and restart
them: the shared instances on 5432/6379 serve other suites at the same time and stay untouched."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.server.live_process import free_port


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        pytest.skip(f"PostgreSQL's {name} is not installed (/usr/lib/postgresql/*/bin)")
    return found[-1]


def _as_postgres(args: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the `postgres` user."""
    if os.geteuid() != 0:
        return args
    if shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start a scratch PostgreSQL")
    return ["runuser", "-u", "postgres", "--", *args]


class ScratchPostgres:
    """initdb into a fresh folder (trust auth), then `start()` / `stop()` as often as a test
    likes; `close()` stops it and removes the folder. The folder is not under pytest's tmp dir,
    which only root may enter, and the server runs as `postgres`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="blendserve-pg-"))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self.dir = self.root / "pgdata"
        self.port = free_port()
        self.log = self.root / "postgres.log"
        subprocess.run(
            _as_postgres(
                [
                    _pg_bin("initdb"),
                    "-D",
                    str(self.dir),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            _as_postgres([_pg_bin("pg_ctl"), "-D", str(self.dir), *args]),
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off"
        self._ctl("-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "immediate") -> None:
        """`immediate` is a crash as far as clients can tell: connections just drop."""
        self._ctl("-m", mode, "-w", "stop")

    def close(self) -> None:
        try:
            self.stop("fast")
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)


class ScratchRedis:
    """`redis-server` on a free port, keeping nothing on disk: a restart comes back empty."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.kill()
