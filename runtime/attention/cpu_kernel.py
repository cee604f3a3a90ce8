"""The CPU kernels (paged_decode.c, cpu_ops.c): built at first use, called by ctypes.

Decode attention on a CPU is a memory-bound read of every running sequence's context. Gathering
the pages into a dense copy before SDPA reads and writes that context twice more, and padding to
the longest sequence adds more; the kernel reads each page in place instead (vLLM's CPU backend
does the same with its own C++ kernels). `paged_prefill` does the same for prefill chunks, causal
(bf16 with AVX512-BF16 in its fastest path, any other dtype and CPU in plain vectorised loops).
The same library holds, from cpu_ops.c, the model's fused bf16 elementwise ops (`rms_norm`,
`rope`, `silu_mul`) and the greedy sampler's `argmax` (on AVX-512).

The shared object is compiled with the system's C compiler (`gcc -O3 -march=native -fopenmp`)
into `$BLENDSERVE_KERNEL_DIR` (default `~/.cache/blendserve/kernels`), keyed by the sources, the
flags, the compiler and the CPU, in under a second. OpenMP comes from the libgomp torch has
already loaded, so the kernel and torch's ops share one thread pool. Without a compiler
`load()` returns None and the torch backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")  # the attention
SOURCES = (SOURCE, SOURCE.with_name("cpu_ops.c"))  # compiled into one library
HEADERS = (SOURCE.with_name("cpu_common.h"),)
# Reassociation lets the dot products and sums vectorise. Not -ffast-math: linking with it sets
# flush-to-zero for the whole process (crtfastmath), changing everyone's floating point.
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC"]
NATIVE = ("-march=native",)  # the CPU the engine's library is built for: this one
LIBS = ["-lm"]
CHUNK_TOKENS = 256  # a longer context is split into chunks that run in parallel
DTYPES = {torch.bfloat16: 1, torch.float32: 0}  # dtype -> the kernel's `bf16` flag


def kernel_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "blendserve" / "kernels"
    return Path(os.environ.get("BLENDSERVE_KERNEL_DIR", default))


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag (e.g. `amx_bf16`); False where it cannot say."""
    return flag in _cpu_id().split()


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build_key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f.read_text() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *FLAGS, *NATIVE, *LIBS, version, _cpu_id()]).encode())
    return key.hexdigest()[:16]


def build_id() -> str | None:
    """What the loaded kernel was built from (source, flags, compiler, CPU), or None if none is."""
    lib = load()
    return None if lib is None else Path(lib._name).stem.removeprefix("paged_decode-")


def compile_library(sources: Iterable[Path], out: Path, cc: str = "gcc",
                    target: Sequence[str] = NATIVE) -> None:
    """Compile C `sources` into the shared object `out` with the kernel's flags, for the CPU
    `target` names (this one by default; tests build for others)."""
    subprocess.run([cc, *FLAGS, *target, *map(str, sources), "-o", str(out), *LIBS], check=True,
                   capture_output=True, text=True, timeout=120)


def _build(cc: str) -> Path:
    path = kernel_dir() / f"paged_decode-{_build_key(cc)}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        compile_library(SOURCES, out, cc)
        os.replace(out, path)  # atomic: concurrent builders each write a whole file
    return path


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built here."""
    if os.environ.get("BLENDSERVE_CPU_KERNEL", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler: CPU attention falls back to gather + SDPA")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU attention kernel not built (%s): falling back to gather + SDPA", detail)
        return None
    return declare(lib)


_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {  # the library's functions: (argument types, return type)
    "paged_decode": ([_p, _i, _p, _p, _p, _i, _p, _i, _i, _i, _i, _f, _i, _i, _i, _p, _p], _i),
    "paged_prefill": ([_p, _p, _p, _i, _p, _p, _p, _i, _i, _i, _i, _i, _f, _i, _i, _p], _i),
    "paged_prefill_supported": ([_i, _i], _i),
    "rms_norm_bf16": ([_p, _l, _p, _i, _i, _f, _i, _p], None),
    "silu_mul_bf16": ([_p, _i, _i, _i, _p], None),
    "rope_bf16": ([_p, _l, _i, _i, _i, _p, _p, _i, _p], None),
    "argmax_rows": ([_p, _l, _i, _i, _i, _i, _p], _i),
    "gemm_bf16_kind": ([], _i),
    "gemm_bf16_supported": ([_i, _i], _i),
    "gemm_bf16_pack": ([_p, _i, _i, _p], None),
    "gemm_bf16": ([_p, _l, _i, _i, _p, _p, _i, _i, _p], _i),
    "gemm_bf16_silu": ([_p, _l, _i, _i, _p, _i, _i, _p], _i),
}


def declare(lib: ctypes.CDLL, names: Iterable[str] = SIGNATURES) -> ctypes.CDLL:
    """`lib` (a build of SOURCES) with the C signatures of its functions `names` set for ctypes."""
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = SIGNATURES[name]
    return lib


def prefill_supported(lib: ctypes.CDLL, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_prefill` runs for this dtype here (every CPU the kernel builds on)."""
    return dtype in DTYPES and bool(lib.paged_prefill_supported(DTYPES[dtype], head_dim))


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_size: int, table: torch.Tensor, lens: torch.Tensor, scale: float,
                 chunk: int = CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [S, kvh, rows, hd]; k/v_cache: one layer of the pool, [pages, page_size, kvh, hd] in any
    contiguous view, q's dtype; table: [S, max_pages] int32; lens: [S] int32
    -> (out [S, kvh, rows, hd], lse [S, kvh, rows] fp32, natural log)."""
    q = q.contiguous()
    s, kvh, rows, hd = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((s, kvh, rows), dtype=torch.float32)
    rc = lib.paged_decode(q.data_ptr(), rows, k_cache.data_ptr(), v_cache.data_ptr(),
                          table.data_ptr(), table.shape[1], lens.data_ptr(), s, kvh, hd,
                          page_size, scale, chunk, DTYPES[q.dtype], torch.get_num_threads(),
                          out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for its work buffers")
    return out, lse


def paged_prefill(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_size: int, table: torch.Tensor, q_start: torch.Tensor, kv_lens: torch.Tensor,
                  scale: float, kv_heads: int) -> torch.Tensor:
    """Causal prefill attention of chunks laid one after another. q: [T, H, hd], chunk s
    its tokens q_start[s] .. q_start[s + 1] - 1 at the last positions of its kv_lens[s]; k/v_cache:
    one layer of the pool, already holding the chunks' K/V; table: [S, max_pages] int32;
    q_start: [S + 1] int32; kv_lens: [S] int32 -> out [T, H * hd]."""
    q = q.contiguous()
    t, heads, hd = q.shape
    out = torch.empty((t, heads * hd), dtype=q.dtype)
    rc = lib.paged_prefill(q.data_ptr(), q_start.data_ptr(), kv_lens.data_ptr(), len(kv_lens),
                           k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.shape[1],
                           kv_heads, heads // kv_heads, hd, page_size, scale, DTYPES[q.dtype],
                           torch.get_num_threads(), out.data_ptr())
    if rc != 0:
        raise MemoryError("paged_prefill: out of memory for its work buffers")
    return out


# The layer's elementwise ops in bf16 (cpu_ops.c): one pass each instead of a chain of torch
# ops, rounding where the chain rounds (the norm sums in its own order).

def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [rows, …] as (x, its row stride), copied unless each row is contiguous."""
    if x.stride(-1) != 1 or (x.dim() > 2 and len(x) and not x[0].is_contiguous()):
        x = x.contiguous()
    return x, x.stride(0)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] -> weight · bf16(x / rms(x)) [T, n], normalised in fp32."""
    x, stride = _rows(x)
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype)
    lib.rms_norm_bf16(x.data_ptr(), stride, weight.data_ptr(), t, n, eps,
                      torch.get_num_threads(), out.data_ptr())
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] -> silu(gate) · up [T, n]."""
    gate_up = gate_up.contiguous()
    t, n2 = gate_up.shape
    out = torch.empty((t, n2 // 2), dtype=gate_up.dtype)
    lib.silu_mul_bf16(gate_up.data_ptr(), t, n2 // 2, torch.get_num_threads(), out.data_ptr())
    return out


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] (heads contiguous within a row), cos/sin [T, hd/2] -> x rotated (rotate
    half), a new contiguous [T, heads, hd]."""
    x, stride = _rows(x)
    t, heads, hd = x.shape
    out = torch.empty((t, heads, hd), dtype=x.dtype)
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.rope_bf16(x.data_ptr(), stride, t, heads, hd, cos.data_ptr(), sin.data_ptr(),
                  torch.get_num_threads(), out.data_ptr())
    return out


def argmax(lib: ctypes.CDLL, x: torch.Tensor) -> list[int] | None:
    """The first index of each row's maximum (of its first NaN, if any) of x [R, V] in a dtype
    of DTYPES, as `x.max(-1).indices` gives; None where this build has no AVX-512 (use torch)."""
    x, stride = _rows(x)
    out = torch.empty(len(x), dtype=torch.int64)
    rc = lib.argmax_rows(x.data_ptr(), stride, len(x), x.shape[-1], DTYPES[x.dtype],
                         torch.get_num_threads(), out.data_ptr())
    return None if rc != 0 else out.tolist()


# The layers' GEMMs in bf16 on AMX tiles or AVX512-BF16 (cpu_ops.c): W packed once, a row's sums
# in one order.

GEMM_KINDS = {2: "amx-tiles", 1: "bf16-tiles"}  # gemm_bf16_kind's answers that run a GEMM


def gemm_kind(lib: ctypes.CDLL) -> str | None:
    """The GEMM `linear` runs on this CPU ("amx-tiles" | "bf16-tiles"), None where none."""
    return GEMM_KINDS.get(lib.gemm_bf16_kind())


def gemm_supported(lib: ctypes.CDLL, weight: torch.Tensor) -> bool:
    """Whether `linear` can take this [n, k] weight (bf16, on a CPU with AVX512-BF16; on AMX k a
    multiple of 32)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and bool(lib.gemm_bf16_supported(n, k))


def pack_weight(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [n, k] Linear weight in `linear`'s layout, [n/32, k/2, 32, 2]."""
    n, k = weight.shape
    weight = weight.contiguous()
    out = torch.empty((n // 32, k // 2, 32, 2), dtype=torch.bfloat16)
    lib.gemm_bf16_pack(weight.data_ptr(), n, k, out.data_ptr())
    return out


def linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] bf16 · Wᵀ (+ bias) -> [m, n] bf16, W from pack_weight."""
    x, stride = _rows(x)
    n, k = packed.shape[0] * 32, packed.shape[1] * 2
    out = torch.empty((len(x), n), dtype=torch.bfloat16)
    b = None if bias is None else bias.contiguous().data_ptr()
    rc = lib.gemm_bf16(x.data_ptr(), stride, len(x), k, packed.data_ptr(), b, n,
                       torch.get_num_threads(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"gemm_bf16 failed on a [{n}, {k}] weight (not a shape it takes on this "
                         "CPU, or out of memory)")
    return out


def linear_silu(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """silu(x · Wgᵀ) · (x · Wuᵀ) -> [m, n/2] bf16 for a packed [gate; up] weight, to the bit
    silu_mul(linear(x, packed)) but in one pass; None where the library's GEMM is not on AMX."""
    x, stride = _rows(x)
    n, k = packed.shape[0] * 32, packed.shape[1] * 2
    out = torch.empty((len(x), n // 2), dtype=torch.bfloat16)
    rc = lib.gemm_bf16_silu(x.data_ptr(), stride, len(x), k, packed.data_ptr(), n,
                            torch.get_num_threads(), out.data_ptr())
    return None if rc != 0 else out
