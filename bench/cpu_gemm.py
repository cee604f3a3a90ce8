"""The layers' bf16 GEMMs on this CPU: the kernel library's `gemm_bf16` against oneDNN's packed
linear (or, with `--base`, against the same library at another git revision), alternated in one
process.

Times one decode step's GEMMs of a model's shape (SmolLM2-135M by default: 30 layers of qkv,
o, gate_up and down, then the lm_head), each layer its own random weights so that they stream
from memory as in a real step, at several row counts; the second-fastest of `--rounds` each.
Needs a CPU with AVX512-BF16 (elsewhere the kernel's GEMM does not run and the engine keeps
oneDNN's); on one with AMX both run on AMX tiles.

    python bench/cpu_gemm.py
    python bench/cpu_gemm.py --rows 1,8,32,128,2048 --rounds 5
    python bench/cpu_gemm.py --base 96f36ab --rows 8,32,64   # the kernel at a revision instead
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cpu_decode_attention import build, checkout_kernel
from runtime.attention import cpu_kernel
from runtime.model import _packed_linear


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--qkv", type=int, default=960, help="the fused q/k/v projection's width")
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="2,16,32,64")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--base", metavar="REV", help="compare the kernel library as it was at this "
                    "git revision instead of oneDNN")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return _compare(args, Path(tmp))


def _compare(args: argparse.Namespace, tmp: Path) -> int:
    lib = cpu_kernel.load()
    h, inter = args.hidden, args.intermediate
    shapes = [(args.qkv, h), (h, h), (2 * inter, h), (h, inter)]  # (out, in) of each GEMM
    if lib is None or not all(lib.gemm_bf16_supported(n, k) for n, k in [*shapes, (args.vocab, h)]):
        raise SystemExit("the kernel's bf16 GEMM does not run here (AVX512-BF16, widths % 32; "
                         "on AMX k % 32)")
    gen = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)

    plain = [[weight(n, k) for n, k in shapes] for _ in range(args.layers)] + [[weight(args.vocab, h)]]

    def kernel(lib: ctypes.CDLL) -> tuple[list[list[torch.Tensor]], Callable[..., torch.Tensor]]:
        return ([[cpu_kernel.pack_weight(lib, w) for w in ws] for ws in plain],
                lambda x, w: cpu_kernel.linear(lib, x, w))

    if args.base:
        base = build(checkout_kernel(args.base, tmp / "base"), tmp / "base.so")
        packs = {args.base: kernel(cpu_kernel.declare(base)), "kernel": kernel(lib)}
    else:
        packs = {"oneDNN": ([[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
                             for ws in plain], _packed_linear), "kernel": kernel(lib)}
    print(f"{args.layers} layers of {shapes} + lm_head {args.vocab}, bf16, "
          f"{torch.get_num_threads()} threads, the kernel's {cpu_kernel.gemm_kind(lib)} GEMM")
    ref = next(iter(packs))
    print(f"| rows | {ref} layers ms | kernel layers ms | ratio | {ref} lm_head ms | "
          "kernel lm_head ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (h, inter)}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in packs}
        for _ in range(args.rounds):
            for name, (weights, linear) in packs.items():
                start = time.perf_counter()
                for layer in weights[:-1]:
                    for (_, k), w in zip(shapes, layer):
                        linear(xs[k], w)
                mid = time.perf_counter()
                linear(xs[h], weights[-1][0])
                times[name].append((mid - start, time.perf_counter() - mid))
        pick = min(1, args.rounds - 1)
        (a, al), (b, bl) = (tuple(sorted(col)[pick] for col in zip(*times[n])) for n in packs)
        print(f"| {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x | {al * 1e3:.2f} | "
              f"{bl * 1e3:.2f} | {bl / al:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
