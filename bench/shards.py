"""One large batch on one worker, on two workers sharing it as shards, and on two workers one of
which is killed with kill -9 halfway; every custom_id must come back exactly once.

Each phase starts its own scratch Redis, an API process (`serve --no-worker`) and the workers
(`blendserve worker`, default flags, the machine's cores split between them: OMP_NUM_THREADS)
on a fresh data dir, waits until the workers have
registered, uploads the batch through the HTTP API and polls until it is `completed`. With two
live workers the batch is cut into two shards (server/shards.py); the killed worker's shard is
taken over once its claim is `BLENDSERVE_WORKER_STALL_SECONDS` (10 s here) stale.

    python bench/shards.py [--lines 2000] [--max-tokens 8] [--phases one,two,two-kill]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tests.server.live_process import Proc, Server, free_port, model_data_dir
from tests.server.scratch_services import ScratchRedis

STALL_S = "10"


def batch_lines(n: int, max_tokens: int) -> bytes:
    """n short chat lines (a few shared instructions), greedy, exactly `max_tokens` each."""
    asks = ["Name a colour.", "Give a number.", "Say a city.", "Pick an animal."]
    return "".join(json.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"{asks[i % 4]} Item {i}."}],
                 "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}) + "\n"
                   for i in range(n)).encode()


def threads_per(workers: int) -> int:
    """Workers on one machine share its cores: more torch threads than cores make each one
    wait on the others' OpenMP barriers (several times slower on a 2-core machine)."""
    return max(1, (os.cpu_count() or 1) // workers)


def ensure_profile(threads: int) -> None:
    """Measure the device profile for this thread count now, outside the timed phases (it is
    cached under data/profiles/, which every phase's data dir links to)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([str(Path(sys.executable).with_name("blendserve")), "profile"], check=True,
                   cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def run_phase(workers: int, kill_at: float | None, lines: int, max_tokens: int,
              tmp: Path, **extra_env: str) -> dict[str, Any]:
    """Returns wall seconds (create → completed), the exactly-once check and the shard cut."""
    import redis

    data = model_data_dir(tmp)
    scratch = ScratchRedis()
    scratch.start()
    env = {"BLENDSERVE_REDIS_URL": scratch.url, "BLENDSERVE_WORKER_STALL_SECONDS": STALL_S,
           "BLENDSERVE_DATA_DIR": str(data), "OMP_NUM_THREADS": str(threads_per(workers)),
           **extra_env}
    api = Server(data, free_port(), tmp / "api.log", "--no-worker", **env)
    procs: list[Proc] = [api]
    try:
        with httpx.Client(base_url=api.url, timeout=60) as c:
            api.wait_healthy(c)
            procs += [Proc(["worker"], env, tmp / f"worker-{i}.log") for i in range(workers)]
            r = redis.Redis.from_url(scratch.url)
            deadline = time.monotonic() + 300
            while sum(1 for _ in r.scan_iter(match="blendserve:worker:*")) < workers:
                if time.monotonic() > deadline or not all(p.alive() for p in procs[1:]):
                    raise RuntimeError("the workers did not all register within 300 s")
                time.sleep(0.1)
            fid = c.post("/v1/files", data={"purpose": "batch"},
                         files={"file": ("big.jsonl", batch_lines(lines, max_tokens))}).json()["id"]
            started = time.monotonic()
            bid = c.post("/v1/batches", json={"input_file_id": fid,
                                              "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}).json()["id"]
            killed = None
            db = sa.create_engine(f"sqlite:///{data / 'blendserve.db'}")
            while True:
                b = c.get(f"/v1/batches/{bid}").json()
                if b["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                if kill_at is not None and killed is None and \
                        b["request_counts"]["completed"] >= kill_at * lines:
                    procs[1].kill9()
                    killed = {"at_completed": b["request_counts"]["completed"],
                              "at_s": round(time.monotonic() - started, 1)}
                if time.monotonic() - started > 3600:
                    raise RuntimeError(f"batch {bid} still {b['status']} after an hour")
                time.sleep(0.2)
            wall = time.monotonic() - started
            with db.connect() as conn:
                cut = conn.execute(sa.text(
                    "SELECT shard, json_array_length(lines), worker_id, done FROM batch_shards"
                    " WHERE batch_id = :b ORDER BY shard"), {"b": bid}).all()
            db.dispose()
            ids: list[str] = []
            for key in ("output_file_id", "error_file_id"):
                if b[key]:
                    text = c.get(f"/v1/files/{b[key]}/content").text
                    ids += [json.loads(x)["custom_id"] for x in text.splitlines()]
    finally:
        for p in reversed(procs):
            p.stop()
        scratch.close()
    return {
        "workers": workers, "killed": killed, "status": b["status"], "wall_s": round(wall, 1),
        "exactly_once": sorted(ids) == sorted(f"c-{i}" for i in range(lines)),
        "completed": b["request_counts"]["completed"],
        "shards": [{"shard": s, "lines": n, "done": bool(d)} for s, n, _, d in cut],
    }


PHASES = {"one": (1, None), "two": (2, None), "two-kill": (2, 0.25)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    results = []
    for threads in sorted({threads_per(PHASES[name][0]) for name in args.phases.split(",")}):
        ensure_profile(threads)
    for name in args.phases.split(","):
        workers, kill_at = PHASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            res = run_phase(workers, kill_at, args.lines, args.max_tokens, Path(tmp))
        results.append({"phase": name, **res})
        print(json.dumps(results[-1]), flush=True)
    print("| phase | workers | wall s | vs one worker | status | every custom_id once | shards |")
    print("|---|---|---|---|---|---|---|")
    base = results[0]["wall_s"]
    for r in results:
        print(f"| {r['phase']} | {r['workers']} | {r['wall_s']} | {r['wall_s'] / base:.2f}x | "
              f"{r['status']} | {r['exactly_once']} | "
              f"{[s['lines'] for s in r['shards']] or '-'} |")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
