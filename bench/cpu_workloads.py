"""Three seeded batch workloads for the engine on a CPU, as OpenAI batch JSONL files.

- chat: 64 chat requests over 4 shared system prompts (~200 tokens), user messages of 20-300
  tokens, max_tokens from {16, 64, 256}; greedy, ignore_eos (the issue's workload).
- long_short: 16 long documents (1,000-1,500 tokens, two shared instructions) asking for short
  answers (8-16 tokens), mixed with 8 short prompts asking for long generations (256-384).
- low_sharing: 48 requests with unrelated prompts of 100-800 tokens and no shared system
  prompt, max_tokens 256, greedy, ending where the model stops (lengths unknown to the planner).
- fewshot: 96 short questions behind one ~1,400-token few-shot system prompt, max_tokens 8 or
  32, greedy, ignore_eos: decodes that read a long shared prefix (the CPU finds it in cache).

    python bench/cpu_workloads.py --out bench/out/cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

WORDS = ["data", "model", "system", "user", "query", "answer", "token", "cache", "prefix", "batch", "engine", "policy", "kernel", "memory", "compute", "latency", "request", "response", "schedule", "planner", "sequence", "vector", "matrix", "layer", "weight", "output", "input", "stream", "worker", "server", "client", "file", "line", "record", "table", "river", "mountain", "garden", "window", "kitchen", "letter", "market", "history", "music", "science"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _line(i: int, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool) -> dict:
    body: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def chat(rng: random.Random, scale: int = 1) -> list[dict]:
    systems = [f"You are assistant #{i}. " + _text(rng, 190) for i in range(4)]
    return [_line(i, [{"role": "system", "content": rng.choice(systems)},
                      {"role": "user", "content": _text(rng, rng.randint(20, 300))}],
                  rng.choice((16, 64, 256)), True) for i in range(64 * scale)]


def long_short(rng: random.Random, scale: int = 1) -> list[dict]:
    asks = ["Summarise the document below in one line.", "List the three key terms of this text."]
    out = []
    for i in range(16 * scale):
        doc = _text(rng, rng.randint(1000, 1500))
        out.append(_line(i, [{"role": "user", "content": f"{asks[i % 2]}\n\n{doc}"}],
                         rng.randint(8, 16), True))
    for i in range(16 * scale, 24 * scale):
        out.append(_line(i, [{"role": "user", "content": "Write a long story about "
                              + _text(rng, rng.randint(20, 60))}], rng.randint(256, 384), True))
    rng.shuffle(out)
    return out


def low_sharing(rng: random.Random, scale: int = 1) -> list[dict]:
    out = []
    for i in range(48 * scale):
        topic = _text(rng, rng.randint(100, 800))
        out.append(_line(i, [{"role": "user", "content": f"{rng.choice(WORDS)}: {topic}\nExplain."}],
                         256, False))
    return out


def fewshot(rng: random.Random, scale: int = 1) -> list[dict]:
    shots = "Answer as in the examples.\n" + "\n".join(
        f"Q: {_text(rng, 30)}\nA: {_text(rng, 20)}" for _ in range(25))
    return [_line(i, [{"role": "system", "content": shots},
                      {"role": "user", "content": _text(rng, rng.randint(5, 40))}],
                  rng.choice((8, 32)), True) for i in range(96 * scale)]


WORKLOADS: dict[str, Callable[[random.Random, int], list[dict]]] = {
    "chat": chat, "long_short": long_short, "low_sharing": low_sharing, "fewshot": fewshot}


def write(out_dir: Path, seed: int = 0, scale: int = 1) -> dict[str, Path]:
    """Every workload as `<name>.jsonl` in out_dir; scale multiplies each one's request count
    (scale 4 no longer fits the default CPU KV pool: the order decides what waits)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in WORKLOADS.items():
        path = out_dir / f"{name}.jsonl"
        with path.open("w") as f:
            for line in make(random.Random(f"{name}-{seed}"), scale):
                f.write(json.dumps(line) + "\n")
        paths[name] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=1, help="multiply every workload's request count")
    args = ap.parse_args(argv)
    for name, path in write(args.out, args.seed, args.scale).items():
        print(f"{name}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
