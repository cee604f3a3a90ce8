"""One decode step's attention on this CPU (or, with --prefill, one step's prefill chunks'): the
kernel as it is against another revision's.

Builds the kernel library (`runtime/attention/paged_decode.c` and the sources beside it) from
the working tree and from `--base` (a git revision) with cpu_kernel's flags, and times every
layer's decode attention of one step over a KV pool of scattered pages, the two libraries
alternated in one process, each round's time kept and the third-fastest of `--rounds` shown
(other load only ever adds time). Beside them, a plain AVX2 read of the same pages, all heads,
K and V (a few lines of C built here too): the memory floor of a kernel that reads the context
once. `--cached` reuses one layer's pool for every layer, so a small context stays in the
CPU's caches: the kernels' math alone.
The shape defaults to SmolLM2-135M's (30 layers, 3 KV heads of 3 query rows, head size 64,
16-token pages) and a chat step's 30 decodes over 600 tokens, in fp32 (the engine's dtype on a
CPU without AVX-512 BF16).

    python bench/cpu_decode_attention.py --base 2a256f1
    python bench/cpu_decode_attention.py --base 2a256f1 --seqs 4 --cached
    python bench/cpu_decode_attention.py --base d230cf1 --dtype bfloat16 --prefill 512 \
        --seqs 2 --context 1024 --layers 4
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import torch

from runtime.attention import cpu_kernel

PLAIN_READ = r"""
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
float plain_read(const float *k, const float *v, const int32_t *table, int max_pages,
                 const int32_t *lens, int seqs, int row, int ps, int threads) {
    float total = 0.f;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+:total)
    for (int s = 0; s < seqs; s++) {
        __m256 a = _mm256_setzero_ps(), b = a;
        for (int pos = 0; pos < lens[s]; pos++) {
            size_t off = ((size_t)table[(size_t)s * max_pages + pos / ps] * ps + pos % ps) * row;
            for (int d = 0; d < row; d += 8) {
                a = _mm256_add_ps(a, _mm256_loadu_ps(k + off + d));
                b = _mm256_add_ps(b, _mm256_loadu_ps(v + off + d));
            }
        }
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(a, b));
        total += t[0];
    }
    return total;
}
"""


def build(sources: list[Path], out: Path) -> ctypes.CDLL:
    cpu_kernel.compile_library(sources, out)
    return ctypes.CDLL(str(out))


def checkout_kernel(rev: str, folder: Path) -> list[Path]:
    """The kernel library's C sources (and headers) as they were at `rev`, written into folder
    (a revision from before the split into several files has paged_decode.c alone)."""
    folder.mkdir()
    sources = []
    for path in (*cpu_kernel.SOURCES, *cpu_kernel.HEADERS):
        rel = path.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=False,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            (folder / path.name).write_text(shown.stdout)
            if path.suffix == ".c":
                sources.append(folder / path.name)
    if not sources:
        raise SystemExit(f"no kernel sources at {rev}")
    return sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True,
                    help="git revision whose kernel to compare against (one with the same functions)")
    ap.add_argument("--seqs", type=int, default=30)
    ap.add_argument("--context", type=int, default=600, help="tokens of KV each decode reads")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--rows", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cached", action="store_true", help="one layer's pool for every layer")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time prefill instead: each sequence a chunk of its last N tokens "
                         "(causal, over --context tokens)")
    args = ap.parse_args(argv)
    if not 0 <= args.prefill <= args.context:
        ap.error("--prefill takes 0 (decode) up to --context tokens")

    dtype = getattr(torch, args.dtype)
    s, ps, kvh, hd = args.seqs, args.page_size, args.kv_heads, args.head_dim
    pages = -(-args.context // ps)
    gen = torch.Generator().manual_seed(0)
    n_pools = 1 if args.cached else args.layers
    pools = [torch.randn(2, s * pages, ps, kvh, hd, generator=gen).to(dtype) for _ in range(n_pools)]
    table = torch.randperm(s * pages, generator=gen).to(torch.int32).view(s, pages).contiguous()
    lens = torch.full((s,), args.context, dtype=torch.int32)
    q = torch.randn(s, kvh, args.rows, hd, generator=gen).to(dtype)
    n = args.prefill
    qp = torch.randn(s * n, kvh * args.rows, hd, generator=gen).to(dtype)  # [T, H, hd]
    q_start = torch.arange(0, s * n + 1, max(n, 1), dtype=torch.int32)[: s + 1]
    fn = "paged_prefill" if n else "paged_decode"
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        base = build(checkout_kernel(args.base, Path(tmp) / "base"), Path(tmp) / "base.so")
        tree = build(list(cpu_kernel.SOURCES), Path(tmp) / "tree.so")
        libs = {args.base: cpu_kernel.declare(base, [fn]),
                "working tree": cpu_kernel.declare(tree, [fn])}
        (Path(tmp) / "read.c").write_text(PLAIN_READ)
        reader = build([Path(tmp) / "read.c"], Path(tmp) / "read.so")
        p, i = ctypes.c_void_p, ctypes.c_int
        reader.plain_read.argtypes = [p, p, p, i, p, i, i, i, i]
        reader.plain_read.restype = ctypes.c_float

        def step(name: str) -> torch.Tensor | None:
            out = None
            for layer in range(args.layers):
                k, v = pools[layer % n_pools]
                if name == "plain read":
                    reader.plain_read(k.data_ptr(), v.data_ptr(), table.data_ptr(), pages,
                                      lens.data_ptr(), s, kvh * hd, ps, threads)
                elif n:
                    out = cpu_kernel.paged_prefill(libs[name], qp, k, v, ps, table, q_start, lens,
                                                   hd**-0.5, kvh)
                else:
                    out, _ = cpu_kernel.paged_decode(libs[name], q, k, v, ps, table, lens,
                                                     hd**-0.5)
            return out

        names = [*libs, "plain read"] if dtype == torch.float32 and not n else list(libs)
        times: dict[str, list[float]] = {n: [] for n in names}
        outs = {}
        for _ in range(args.rounds):
            for name in names:
                start = time.perf_counter()
                outs[name] = step(name)
                times[name].append(time.perf_counter() - start)
    read = s * args.context * kvh * hd * 2 * pools[0].element_size() * args.layers
    base_s = sorted(times[args.base])[min(2, args.rounds - 1)]
    what = f"{s} prefill chunks of {n}" if n else f"{s} decodes"
    print(f"{what} x {args.context} tokens, {args.layers} layers, {kvh} KV heads x "
          f"{args.rows} rows, head size {hd}, {args.dtype}, {threads} threads"
          f"{', cached' if args.cached else ''}: {read / 1e6:.0f} MB of KV a step")
    print("| kernel | ms a step | GB/s of KV | against the base |")
    print("|---|---|---|---|")
    for name in names:
        t = sorted(times[name])[min(2, args.rounds - 1)]
        rate = "-" if n else f"{read / t / 1e9:.1f}"  # prefill reads each tile for many queries
        print(f"| {name} | {t * 1e3:.1f} | {rate} | {t / base_s:.2f}x |")
    base_out, tree_out = outs[args.base], outs["working tree"]
    if base_out is not None and tree_out is not None:
        diff = (base_out.float() - tree_out.float()).abs().max().item()
        print(f"largest difference between the two kernels' outputs: {diff:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
