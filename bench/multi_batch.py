"""Eight 16-line batches from two projects against one 128-line batch of the same lines.

Each phase runs on a fresh `blendserve serve` (defaults: embedded worker, blend policy, empty
prefix cache) in its own data dir, submitting through the HTTP API:

1. `one`: the 128 lines as one batch;
2. `shared`: the same lines as 8 batches of 16 (alternating projects alpha/beta), created
   together; the worker runs them on its engine at once (server/shared_run.py);
3. `serial`: the 8 batches again with BLENDSERVE_WORKER_MAX_INFLIGHT_TOKENS=1, so no batch
   joins a running one: the one-batch-at-a-time behaviour this replaces.

Wall time is from the first create to the last batch `completed`, polled every 0.2 s.

    python bench/multi_batch.py [--json-out bench/out/multi_batch.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.cpu_workloads import _text
from tests.server.live_process import Server, free_port, model_data_dir

KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789"}


def lines(seed: int = 0) -> list[dict[str, Any]]:
    """128 chat lines over 4 shared system prompts, max_tokens 16/32/64, greedy, ignore_eos."""
    rng = random.Random(seed)
    systems = [f"You are assistant #{i}. " + _text(rng, 150) for i in range(4)]
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "system", "content": rng.choice(systems)},
                                   {"role": "user", "content": _text(rng, rng.randint(20, 120))}],
                      "max_tokens": rng.choice((16, 32, 64)), "temperature": 0,
                      "ignore_eos": True}} for i in range(128)]


def phase(name: str, groups: list[tuple[str, list[dict[str, Any]]]],
          env: dict[str, str]) -> dict[str, Any]:
    """One fresh server; create every (project, lines) batch, wait for all; wall and usage."""
    with tempfile.TemporaryDirectory() as tmp:
        data = model_data_dir(Path(tmp))
        server = Server(data, free_port(), Path(tmp) / "serve.log", BLENDSERVE_API_KEYS=",".join(
            f"{k}:{p}" for p, k in KEYS.items()), **env)
        try:
            clients = {p: httpx.Client(base_url=server.url, timeout=60,
                                       headers={"Authorization": f"Bearer {k}"})
                       for p, k in KEYS.items()}
            server.wait_healthy(clients["alpha"])
            files = []
            for project, group in groups:
                raw = "".join(json.dumps(x) + "\n" for x in group).encode()
                up = clients[project].post("/v1/files", data={"purpose": "batch"},
                                           files={"file": ("in.jsonl", raw)})
                files.append((project, up.json()["id"]))
            started = time.monotonic()
            ids = []
            for project, fid in files:
                r = clients[project].post("/v1/batches", json={
                    "input_file_id": fid, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})
                ids.append((project, r.json()["id"]))
            done: dict[str, dict[str, Any]] = {}
            while len(done) < len(ids):
                if not server.alive():
                    raise RuntimeError(f"the server exited:\n{server.tail()}")
                for project, bid in ids:
                    if bid not in done:
                        b = clients[project].get(f"/v1/batches/{bid}").json()
                        if b["status"] in ("completed", "failed", "expired", "cancelled"):
                            done[bid] = {**b, "_seconds": time.monotonic() - started}
                time.sleep(0.2)
            wall = max(b["_seconds"] for b in done.values())
            for c in clients.values():
                c.close()
        finally:
            server.stop()
    usage = [b["usage"] for b in done.values()]
    return {
        "phase": name, "batches": len(ids), "wall_s": round(wall, 2),
        "statuses": sorted({b["status"] for b in done.values()}),
        "completed": sum(b["request_counts"]["completed"] for b in done.values()),
        "cached_tokens": sum(u["input_tokens_details"]["cached_tokens"] for u in usage),
        "batches_with_cached_tokens": sum(u["input_tokens_details"]["cached_tokens"] > 0
                                          for u in usage),
        "per_batch_s": sorted(round(b["_seconds"], 1) for b in done.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    all_lines = lines()
    eight = [("alpha" if k % 2 == 0 else "beta", all_lines[k * 16:(k + 1) * 16]) for k in range(8)]
    results = [
        phase("one (128 lines, 1 batch)", [("alpha", all_lines)], {}),
        phase("shared (8 x 16 lines, together)", eight, {}),
        phase("serial (8 x 16, one batch at a time)", eight,
              {"BLENDSERVE_WORKER_MAX_INFLIGHT_TOKENS": "1"}),
    ]
    one = results[0]["wall_s"]
    print("| phase | batches | wall s | vs one batch | completed | cached tokens | per-batch end s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['phase']} | {r['batches']} | {r['wall_s']} | {r['wall_s'] / one:.2f}x | "
              f"{r['completed']} | {r['cached_tokens']} | {r['per_batch_s']} |")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
