"""Measures this device's dense GEMM FLOP/s and copy bandwidth for the scheduler's cost model.

Writes the `measured` hardware profile that `scheduler.cost_model.HardwareProfile.from_json`
reads: {"name": "measured", "flops", "bandwidth_bytes_per_s", "kv_capacity_bytes", ...}.

    python -m runtime.profile -o data/hardware.json [--dtype bfloat16] [--kv-memory BYTES]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    name: str  # always "measured"
    device: str  # "cpu" | "cuda:0" ...
    dtype: str
    flops: float  # dense GEMM FLOP/s, best of a few sizes
    bandwidth_bytes_per_s: float  # device copy: bytes read + written per second
    kv_capacity_bytes: int | None  # the engine's KV pool budget, when known


def _timeit(fn: Callable[[], object], device: torch.device, min_seconds: float) -> float:
    """Seconds per call of `fn`, after one warm-up call."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def measure_flops(device: torch.device, dtype: torch.dtype, min_seconds: float = 0.5) -> float:
    sizes = (1024, 2048) if device.type == "cpu" else (4096, 8192)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        dt = _timeit(lambda a=a, b=b: torch.mm(a, b), device, min_seconds)
        best = max(best, 2 * n**3 / dt)
    return best


def measure_bandwidth(device: torch.device, min_seconds: float = 0.5) -> float:
    nbytes = (256 << 20) if device.type == "cpu" else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dt = _timeit(lambda: dst.copy_(src), device, min_seconds)
    return 2 * nbytes / dt  # read + write


def measure(device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
            kv_capacity_bytes: int | None = None, min_seconds: float = 0.5) -> MeasuredProfile:
    dev = torch.device(device)
    with torch.inference_mode():
        flops = measure_flops(dev, dtype, min_seconds)
        bw = measure_bandwidth(dev, min_seconds)
    return MeasuredProfile("measured", str(dev), str(dtype).removeprefix("torch."), flops, bw,
                           kv_capacity_bytes)


def write_profile(path: str | Path, profile: MeasuredProfile) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(asdict(profile), indent=2) + "\n")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default="hardware.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv-memory", type=int, default=None, help="KV pool bytes to record")
    ap.add_argument("--seconds", type=float, default=0.5, help="minimum timing per measurement")
    args = ap.parse_args(argv)
    prof = measure(args.device, getattr(torch, args.dtype), args.kv_memory, args.seconds)
    write_profile(args.output, prof)
    print(json.dumps(asdict(prof)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
