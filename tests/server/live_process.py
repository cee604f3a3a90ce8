"""`blendserve serve` / `blendserve worker` as real child processes for tests that need the
multi-process set-up (crash, fault, metrics and browser tests): each with its own environment,
log file and a data dir that reuses the cached default model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.loader import DEFAULT_MODEL, default_model_folder

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("completed", "failed", "expired", "cancelled")


def fixed_length_requests(n: int, prefix: str, max_tokens: int) -> bytes:
    """A batch input file of `n` chat requests that each generate exactly `max_tokens` tokens;
    custom_ids are `{prefix}-0` … `{prefix}-{n-1}`."""
    from tests.server.conftest import batch_line

    return "".join(
        batch_line(
            f"{prefix}-{i}",
            f"Tell a long story about the number {i}.",
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0,
        )
        + "\n"
        for i in range(n)
    ).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_data_dir(root: Path) -> Path:
    """`root/data` with the default model's cached conversion linked in (no 10 s re-convert) and
    the repo's device-profile cache (the worker measures a profile once, not once per test)."""
    data = root / "data"
    (data / "models").mkdir(parents=True, exist_ok=True)
    link = data / "models" / DEFAULT_MODEL
    if not link.exists():
        link.symlink_to(default_model_folder(REPO / "data").resolve())
    profiles = REPO / "data" / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    if not (data / "profiles").exists():
        (data / "profiles").symlink_to(profiles.resolve())
    return data


class Proc:
    """One `python -m server.cli ARGS` child with BLENDSERVE_* taken only from `env`."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        full = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
        full.update({"OMP_NUM_THREADS": "2", **env})
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", *args],
            cwd=REPO,
            env=full,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Server(Proc):
    """`blendserve serve` on `port` (with its embedded worker unless `--no-worker` is passed)."""

    def __init__(self, data_dir: Path, port: int, log: Path, *extra: str, **env: str) -> None:
        super().__init__(
            ["serve", *extra],
            {"BLENDSERVE_DATA_DIR": str(data_dir), "BLENDSERVE_PORT": str(port), **env},
            log,
        )
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self, client: httpx.Client, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s  # hang guard
        while time.monotonic() < deadline:
            assert self.alive(), self.tail()
            try:
                if client.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server did not become healthy\n{self.tail()}")

    def wait_worker_up(self, client: httpx.Client, timeout_s: float = 240) -> None:
        """Until /metrics shows a worker publishing figures: its engine is loaded and its device
        profile measured (up to a minute the first time on a slow CPU), so a test's clock starts
        with a worker ready to claim."""
        deadline = time.monotonic() + timeout_s  # hang guard
        while time.monotonic() < deadline:
            assert self.alive(), self.tail()
            try:
                if "\nblendserve_worker_up{" in client.get(f"{self.url}/metrics").text:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"no worker came up\n{self.tail()}")
