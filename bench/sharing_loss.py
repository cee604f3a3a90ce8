"""Where blend's prefix sharing goes: its cache hits against DFS's, request by request.

DFS prefills each shared prefix once (its hits reach the prefix tree's maximum where the KV
holds the subtree it is in). This runs dfs and blend (H200 + Llama-3-8B, realistic defaults) on
one trace and, per request, subtracts the prompt tokens it found cached at its first prefill
under blend from those under DFS: what blend recomputed. The table sums that over the warm-up
sample and over the rest, and over the rest by the tenth of blend's steps the request started in.

    python bench/sharing_loss.py bench/out/traces/compute_high_sharing.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.policies import make_policy
from scheduler.simulate.__main__ import cost_model
from scheduler.simulate.executor import DEFAULT_MAX_STEP_TOKENS
from scheduler.simulate.run import RunConfig, run_trace
from scheduler.simulate.trace import read_trace

PARTS = 10  # blend's steps are cut into this many equal spans


def sharing_loss(path: Path, seed: int = 0) -> dict[str, list[tuple[str, int, int]]]:
    """{"rows": [(part, requests, tokens DFS found cached and blend did not)], "totals":
    [(policy, cached prompt tokens, prefilled tokens)]}; parts: the warm-up sample, the rest,
    and the rest by the span of blend's steps it started in."""
    entries = read_trace(path)
    cost = cost_model("h200")
    dfs, blend = (run_trace(entries, cost, RunConfig(policy, cost.kv_capacity_tokens, seed=seed,
                                                     max_step_tokens=DEFAULT_MAX_STEP_TOKENS))[1]
                  for policy in ("dfs", "blend"))
    if dfs is None or blend is None:
        raise RuntimeError("run_trace simulated nothing")
    lost = dfs.request_cached_tokens - blend.request_cached_tokens
    # the sample is the policy's seeded draw: the same policy built again draws the same
    plan = make_policy("blend", [e.request for e in entries], cost_model=cost, seed=seed,
                       kv_capacity_tokens=cost.kv_capacity_tokens,
                       step_tokens=DEFAULT_MAX_STEP_TOKENS)
    sampled = np.isin([e.request.id for e in entries], plan.warmup_request_ids)
    span = np.minimum(blend.request_first_step * PARTS // max(blend.steps, 1), PARTS - 1)
    rows = [("warm-up sample", int(sampled.sum()), int(lost[sampled].sum())),
            ("the rest", int((~sampled).sum()), int(lost[~sampled].sum()))]
    for k in range(PARTS):
        sel = ~sampled & (span == k)
        rows.append((f"the rest, started in steps {k * 10}-{k * 10 + 10}%", int(sel.sum()),
                     int(lost[sel].sum())))
    return {"rows": rows, "totals": [("dfs", dfs.cached_prompt_tokens, dfs.prefill_tokens),
                                     ("blend", blend.cached_prompt_tokens, blend.prefill_tokens)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--seed", type=int, default=0, help="the warm-up sample's draw")
    args = ap.parse_args(argv)
    out = sharing_loss(args.trace, args.seed)
    for policy, cached, prefilled in out["totals"]:
        print(f"{policy}: {cached:,} prompt tokens cached at first prefill, "
              f"{prefilled:,} prefilled")
    print("\n| requests | count | tokens DFS found cached and blend did not "
          "(negative: blend more) |")
    print("|---|---|---|")
    for part, count, tokens in out["rows"]:
        print(f"| {part} | {count} | {tokens:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
