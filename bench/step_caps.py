"""The same prefill at each step cap on this device: is the CPU's default cap the fastest?

`default_step_tokens` gives a CPU 8,192-token steps because a CPU step pays a fixed cost and
overlaps nothing, so fewer, fuller steps should finish sooner; the device profile's step model
is linear in tokens and cannot say otherwise. A policy run at another cap changes its order as
well as its step size, and one run each on a noisy machine cannot separate the two. This times
the served model's own forward and sampling (runtime.profile.time_step) over the same tokens
cut at each cap: `--total` prompt tokens as prompts of each `--prompt-tokens` length, as many
whole prompts per step as the cap holds, or a prompt longer than the cap in cap-sized chunks
over its growing prefix. Rounds interleave the caps; the table shows each one's fastest round
(other load only ever adds time) and its seconds against the default cap's.

    python bench/step_caps.py                                   # 8,192 tokens as 512-token prompts
    python bench/step_caps.py --prompt-tokens 128,512,8192 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.profile import time_step

if TYPE_CHECKING:
    from runtime.engine import Engine

Shape = tuple[list[int], list[int]]  # (q_lens, kv_lens) of one step


def prefill_steps(total: int, cap: int, prompt: int) -> list[Shape]:
    """The steps that prefill `total` tokens as prompts of `prompt` tokens at step cap `cap`:
    whole prompts, as many as a step holds, or one prompt longer than the cap in chunks of
    `cap` tokens, each attending to the chunks before it."""
    if min(total, cap, prompt) < 1:
        raise ValueError("total, cap and prompt must be at least 1")
    steps: list[Shape] = []
    if prompt > cap:
        for start in range(0, total, prompt):
            length = min(prompt, total - start)
            for done in range(0, length, cap):
                q = min(cap, length - done)
                steps.append(([q], [done + q]))
        return steps
    per_step = cap // prompt
    lens = [prompt] * (total // prompt) + ([total % prompt] if total % prompt else [])
    for i in range(0, len(lens), per_step):
        chunk = lens[i:i + per_step]
        steps.append((chunk, list(chunk)))
    return steps


def time_caps(engine: Engine, caps: list[int], total: int, prompt: int,
              rounds: int = 2) -> dict[int, list[float]]:
    """Seconds to run `prefill_steps(total, cap, prompt)` for each cap, one entry per round;
    round k starts at the k-th cap so that no cap always runs first (or warm)."""
    seconds: dict[int, list[float]] = {cap: [] for cap in caps}
    for k in range(rounds):
        for cap in caps[k % len(caps):] + caps[:k % len(caps)]:
            seconds[cap].append(sum(time_step(engine, q, kv, reps=1)
                                    for q, kv in prefill_steps(total, cap, prompt)))
    return seconds


def main(argv: list[str] | None = None) -> int:
    from runtime.engine import default_step_tokens
    from server.config import Settings
    from server.engine_setup import EngineSetup, build_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", default="512,1024,2048,4096,8192")
    ap.add_argument("--total", type=int, default=8192, help="prompt tokens prefilled per cap")
    ap.add_argument("--prompt-tokens", default="512", help="prompt lengths, one table each")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    caps = sorted(int(c) for c in args.caps.split(","))
    engine = build_engine(Settings(), EngineSetup(model=args.model, max_batch_tokens=max(caps)),
                          with_profile=False)
    default = default_step_tokens(engine.model.device.type)
    print(f"{engine.model_name} on {engine.model.device} ({engine.dtype}), "
          f"default step cap {default}")
    for prompt in (int(p) for p in args.prompt_tokens.split(",")):
        seconds = time_caps(engine, caps, args.total, prompt, args.rounds)
        best = {cap: min(s) for cap, s in seconds.items()}
        print(f"\n### {args.total} tokens as {prompt}-token prompts\n")
        print("| step cap | steps | seconds per round | best s | ms per token | vs default cap |")
        print("|---|---|---|---|---|---|")
        for cap in caps:
            ratio = f"{best[cap] / best[default]:.3f}" if default in best else "-"
            rounds = " / ".join(f"{s:.2f}" for s in seconds[cap])
            print(f"| {cap} | {len(prefill_steps(args.total, cap, prompt))} | {rounds} | "
                  f"{best[cap]:.2f} | {1e3 * best[cap] / args.total:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
