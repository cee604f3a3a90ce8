"""Output tokens/s of our engine vs transformers, on the chat workload of issue 2, in one run.

Workload: N requests (default 256), each = one of 4 shared system prompts (~200 tokens) + a user
message of 20-300 tokens, max_tokens drawn from {16, 64, 256}, greedy, ignore_eos. Systems:
  ours      the `blendserve run` pipeline (server.pipeline.run_lines over an Engine)
  hf-static transformers `generate`, file order, padded static batches of 32 (each batch runs to
            its largest max_tokens; only the requested tokens count as output)
  hf-cb     transformers continuous batching (`init_continuous_batching` manager, per-request
            max_new_tokens)
All use the same dtype (default bfloat16 on CPUs with AVX512-BF16, else float32).

    .venv/bin/python bench/runtime_throughput.py                  # full run (~tens of minutes)
    .venv/bin/python bench/runtime_throughput.py --requests 32 --systems ours,hf-cb
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.engine import Engine, EngineConfig, resolve_dtype
from runtime.loader import DEFAULT_MODEL, default_model_folder, load_model

WORDS = ["data", "model", "system", "user", "query", "answer", "token", "cache", "prefix", "batch", "engine", "policy", "kernel", "memory", "compute", "latency", "request", "response", "schedule", "planner", "sequence", "vector", "matrix", "layer", "weight", "output", "input", "stream", "worker", "server", "client", "file", "line", "record", "table"]


def build_workload(tokenizer, n: int, seed: int) -> list[tuple[list[dict], int]]:
    """(chat messages, max_tokens) per request; prompts are sized in tokens of `tokenizer`."""
    rng = random.Random(seed)

    def text_of(tokens: int) -> str:
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
            words.extend(rng.choice(WORDS) for _ in range(max(1, (tokens - len(words)) // 2)))
        while len(words) > 1 and len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > tokens:
            words.pop()
        return " ".join(words)

    systems = [f"You are assistant #{i}. " + text_of(200) for i in range(4)]
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": text_of(rng.randint(20, 300))}]
        out.append((msgs, rng.choice((16, 64, 256))))
    return out


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--requests", str(args.requests), "--seed", str(args.seed), "--policy", args.policy,
           "--dtype", args.dtype, "--max-batch-tokens", str(args.max_batch_tokens),
           "--data-dir", args.data_dir]
    if args.kv_memory is not None:
        out += ["--kv-memory", str(args.kv_memory)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model, workload, args) -> tuple[float, int]:
    from server.batch_input import BatchLine
    from server.pipeline import run_lines

    engine = Engine(model, EngineConfig(max_batch_tokens=args.max_batch_tokens, dtype=args.dtype,
                                        kv_memory_bytes=args.kv_memory))
    lines = [BatchLine(i + 1, f"r{i}", {"model": model.name, "messages": m, "max_tokens": d,
                                        "temperature": 0, "ignore_eos": True})
             for i, (m, d) in enumerate(workload)]
    t0 = time.perf_counter()
    tokens = 0
    for res in run_lines(lines, engine, endpoint="/v1/chat/completions", policy=args.policy):
        if not res.ok:
            raise RuntimeError(f"request failed: {res.record}")
        tokens += res.output_tokens
    dt = time.perf_counter() - t0
    print(f"  ours: {engine.stats}", file=sys.stderr)
    return dt, tokens


def load_hf(args):
    from transformers import AutoModelForCausalLM

    folder = default_model_folder(Path(args.data_dir))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(args.dtype, "cpu")).eval()


def run_hf_static(hf, prompts, max_tokens, pad_id: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for b in range(0, len(prompts), 32):
            ps, ds = prompts[b : b + 32], max_tokens[b : b + 32]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ds),
                              min_new_tokens=max(ds), do_sample=False, pad_token_id=pad_id)
            if out.shape[1] != width + max(ds):
                raise RuntimeError(f"HF generate stopped early: {out.shape[1] - width} of {max(ds)} tokens")
            tokens += sum(ds)
    return time.perf_counter() - t0, tokens


def run_hf_cb(hf, prompts, max_tokens) -> tuple[float, int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1,
                           pad_token_id=0)
    t0 = time.perf_counter()
    tokens = 0
    with hf.continuous_batching_context_manager(generation_config=gen, block=True, timeout=60) as mgr:
        for i, (p, d) in enumerate(zip(prompts, max_tokens)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=d)
        for _ in range(len(prompts)):
            res = mgr.get_result(timeout=7200)  # the first result can take many minutes on CPU
            if res is None:
                raise RuntimeError("transformers CB returned no result")
            tokens += len(res.generated_tokens)
    return time.perf_counter() - t0, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="ours,hf-static,hf-cb")
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: fastest on this CPU)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--kv-memory", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    ap.add_argument("--json", action="store_true", help="print one JSON line (used per child)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch.")
    model = load_model(DEFAULT_MODEL, data_dir=Path(args.data_dir))
    workload = build_workload(model.tokenizer, args.requests, args.seed)
    prompts = [model.tokenizer.apply_chat_template(m) for m, _ in workload]
    max_tokens = [d for _, d in workload]
    if not args.json:
        print(f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
              f"output tokens {sum(max_tokens)}, dtype {args.dtype}, threads {torch.get_num_threads()}",
              file=sys.stderr)
    results: dict[str, tuple[float, int, float]] = {}
    systems = args.systems.split(",")
    if len(systems) > 1:  # one child process per system: separate, comparable peak RSS
        for name in systems:
            cmd = [sys.executable, __file__, "--systems", name, "--json"] + _passthrough(args)
            line = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            results.update({k: tuple(v) for k, v in json.loads(line.splitlines()[-1]).items()})
    elif systems[0] == "ours":
        dt, tok = run_ours(model, workload, args)
        results["blendserve"] = (dt, tok, peak_rss_mb())
    else:
        hf = load_hf(args)
        if systems[0] == "hf-static":
            pad = min(model.tokenizer.eos_token_ids) if model.tokenizer.eos_token_ids else 0
            dt, tok = run_hf_static(hf, prompts, max_tokens, pad)
            results["hf generate (static 32)"] = (dt, tok, peak_rss_mb())
        elif systems[0] == "hf-cb":
            dt, tok = run_hf_cb(hf, prompts, max_tokens)
            results["hf continuous batching"] = (dt, tok, peak_rss_mb())
        else:
            raise SystemExit(f"unknown system {systems[0]!r}")
    if args.json:
        for name, (dt, tok, rss) in results.items():  # survives a later failure of the parent
            print(f"  {name}: {tok / dt:.1f} tok/s ({dt:.1f} s, peak RSS {rss:.0f} MB)", file=sys.stderr)
        print(json.dumps(results))
        return 0
    for name, (dt, tok, _) in results.items():
        print(f"  {name}: {tok / dt:.1f} tok/s ({dt:.1f} s)", file=sys.stderr)
    ours = results.get("blendserve")
    print("| system | output tokens | seconds | output tok/s | blendserve speed-up | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for name, (dt, tok, rss) in results.items():
        ratio = f"{(ours[1] / ours[0]) / (tok / dt):.2f}x" if ours else "-"
        print(f"| {name} | {tok} | {dt:.1f} | {tok / dt:.1f} | {ratio} | {rss:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
