"""API latency under load, and a 200 MB batch-file upload, against a real `blendserve serve`.

Starts the server on a loopback port over a fresh data dir (no worker by default; `--with-worker`
adds the embedded worker so seeded batches run on the engine while clients poll), seeds files
and batches, then:
  1. N concurrent clients (asyncio + httpx) retrieve and list files and batches for D seconds:
     p50/p99 latency, requests/s, error count (anything but a 200 is an error);
  2. one JSONL upload of ~200 MB (purpose=batch, 40,000 lines): wall time and the server's peak
     RSS (psutil, sampled every 20 ms, API process and children).

    .venv/bin/python bench/api_load.py                       # 100 clients, 30 s, 200 MB upload
    .venv/bin/python bench/api_load.py --duration 10 --upload-mb 0 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--files", type=int, default=50, help="files to seed")
    p.add_argument("--batches", type=int, default=50, help="batches to seed")
    p.add_argument("--upload-mb", type=int, default=200, help="size of the big upload; 0 skips it")
    p.add_argument("--with-worker", action="store_true", help="run the embedded worker too")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="blendserve-bench-") as tmp:
        server = start_server(Path(tmp), with_worker=args.with_worker)
        try:
            ids = seed(server["url"], args.files, args.batches)
            load = asyncio.run(run_load(server["url"], ids, args.clients, args.duration))
            upload = big_upload(server, Path(tmp), args.upload_mb) if args.upload_mb else None
        finally:
            stop_server(server)
    report = {
        "clients": args.clients,
        "duration_s": args.duration,
        "with_worker": args.with_worker,
        **load,
        "upload": upload,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if load["errors"] == 0 else 1


# --- server -------------------------------------------------------------------------------------


def start_server(tmp: Path, *, with_worker: bool) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
    env.update(
        BLENDSERVE_DATA_DIR=str(tmp / "data"),
        BLENDSERVE_HOST=HOST,
        BLENDSERVE_PORT=str(port),
        BLENDSERVE_POLICY="fcfs",
    )
    if with_worker:  # reuse the repo's converted default model instead of converting again
        models = tmp / "data" / "models"
        models.mkdir(parents=True)
        cached = ROOT / "data" / "models" / "smollm2-135m-instruct"
        if cached.is_dir():
            (models / cached.name).symlink_to(cached)
    cmd = [sys.executable, "-m", "server.cli", "serve"] + ([] if with_worker else ["--no-worker"])
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{(tmp / 'serve.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return {"url": url, "proc": proc, "log": tmp / "serve.log"}
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become healthy")


def stop_server(server: dict[str, Any]) -> None:
    proc: subprocess.Popen[bytes] = server["proc"]
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _line(i: int, pad: int = 0) -> bytes:
    body = {
        "model": "smollm2-135m-instruct",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"Say hello number {i}." + " x" * pad}],
    }
    return (
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ).encode()
        + b"\n"
    )


def seed(url: str, n_files: int, n_batches: int) -> dict[str, list[str]]:
    """Small batch files and batches over them, so retrieve and list have real rows to read."""
    files: list[str] = []
    batches: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(max(n_files, 1)):
            content = b"".join(_line(j) for j in range(3))
            r = c.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": (f"seed{i}.jsonl", content)}
            )
            r.raise_for_status()
            files.append(r.json()["id"])
        for i in range(n_batches):
            r = c.post(
                "/v1/batches",
                json={
                    "input_file_id": files[i % len(files)],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            r.raise_for_status()
            batches.append(r.json()["id"])
    return {"files": files, "batches": batches}


# --- load ---------------------------------------------------------------------------------------


async def run_load(
    url: str, ids: dict[str, list[str]], clients: int, duration: float
) -> dict[str, Any]:
    ops: list[tuple[str, Any]] = [
        ("retrieve_file", lambda: f"/v1/files/{random.choice(ids['files'])}"),
        ("list_files", lambda: "/v1/files?limit=20"),
    ]
    if ids["batches"]:
        ops += [
            ("retrieve_batch", lambda: f"/v1/batches/{random.choice(ids['batches'])}"),
            ("list_batches", lambda: "/v1/batches?limit=20"),
        ]
    latencies: dict[str, list[float]] = {name: [] for name, _ in ops}
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as c:
        stop_at = time.monotonic() + duration

        async def client_loop(seed_: int) -> None:
            rng = random.Random(seed_)
            while time.monotonic() < stop_at:
                name, path = ops[rng.randrange(len(ops))]
                t0 = time.perf_counter()
                try:
                    r = await c.get(path())
                    ok = r.status_code == 200
                    if not ok:
                        errors.append(f"{name}: HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    ok = False
                    errors.append(f"{name}: {type(e).__name__}")
                if ok:
                    latencies[name].append(time.perf_counter() - t0)

        started = time.monotonic()
        await asyncio.gather(*(client_loop(i) for i in range(clients)))
        elapsed = time.monotonic() - started
    every = sorted(x for xs in latencies.values() for x in xs)
    return {
        "requests": len(every) + len(errors),
        "requests_per_s": round((len(every) + len(errors)) / elapsed, 1),
        "p50_ms": _ms(every, 0.50),
        "p99_ms": _ms(every, 0.99),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "per_op": {
            name: {"n": len(xs), "p50_ms": _ms(sorted(xs), 0.5), "p99_ms": _ms(sorted(xs), 0.99)}
            for name, xs in latencies.items()
        },
    }


def _ms(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000, 2)


# --- upload -------------------------------------------------------------------------------------


def big_upload(server: dict[str, Any], tmp: Path, megabytes: int) -> dict[str, Any]:
    """Write a ~`megabytes` MB JSONL (40,000 lines, under the 50,000-line limit) and upload it."""
    lines = 40_000
    path = tmp / "big.jsonl"
    target = megabytes * 1_000_000
    pad = max(0, (target // lines - len(_line(0))) // 2)
    with path.open("wb") as f:
        for i in range(lines):
            f.write(_line(i, pad))
    size = path.stat().st_size
    sampler = RssSampler(server["proc"].pid)
    sampler.start()
    t0 = time.perf_counter()
    with path.open("rb") as fh, httpx.Client(base_url=server["url"], timeout=600) as c:
        r = c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", fh)})
    seconds = time.perf_counter() - t0
    sampler.stop()
    return {
        "bytes": size,
        "status": r.status_code,
        "stored_bytes": r.json().get("bytes") if r.status_code == 200 else None,
        "seconds": round(seconds, 2),
        "mb_per_s": round(size / 1e6 / seconds, 1),
        "server_rss_before_mb": round(sampler.baseline / 2**20, 1),
        "server_rss_peak_mb": round(sampler.peak / 2**20, 1),
    }


class RssSampler:
    """Peak resident memory of the API process (children included) while the upload runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.baseline = self._rss()
        self.peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        total = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def print_report(r: dict[str, Any]) -> None:
    print(
        f"{r['clients']} clients x {r['duration_s']:.0f} s"
        f"{' (worker running)' if r['with_worker'] else ''}: {r['requests']} requests, "
        f"{r['requests_per_s']} req/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
        f"errors {r['errors']} {r['error_samples'] or ''}"
    )
    for name, op in r["per_op"].items():
        print(f"  {name:15s} n={op['n']:6d}  p50 {op['p50_ms']} ms  p99 {op['p99_ms']} ms")
    u = r["upload"]
    if u:
        print(
            f"upload {u['bytes'] / 1e6:.0f} MB: HTTP {u['status']} in {u['seconds']} s "
            f"({u['mb_per_s']} MB/s); server RSS {u['server_rss_before_mb']} MB before, "
            f"peak {u['server_rss_peak_mb']} MB"
        )


if __name__ == "__main__":
    sys.exit(main())
