"""The CPU kernel library builds and loads for every x86-64 CPU level, not only this machine's.

The engine compiles it with -march=native at first use; a symbol defined only under one CPU
feature's #if and used outside it passes on a machine that has the feature and leaves the
library unloadable on one that lacks it (the engine then falls back to PyTorch's slower ops).
Building for each level here catches that on any x86-64 machine."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.attention import cpu_kernel

TARGETS = {
    "sse4.2 (x86-64-v2)": ["-march=x86-64-v2"],
    "avx2 (x86-64-v3)": ["-march=x86-64-v3"],
    "avx-512 without bf16 (x86-64-v4)": ["-march=x86-64-v4"],
    "avx512-bf16": ["-march=x86-64-v4", "-mavx512bf16"],
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None,
                    reason="builds x86-64 targets with gcc")
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_the_kernel_library_builds_and_loads_for_each_cpu_level(tmp_path: Path,
                                                                target: list[str]) -> None:
    probe = subprocess.run(["gcc", *target, "-E", "-x", "c", "-", "-o", os.devnull], input="",
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"this gcc does not know {' '.join(target)}")
    out = tmp_path / "kernel.so"
    cpu_kernel.compile_library(cpu_kernel.SOURCES, out, target=target)
    # Loading resolves every symbol (RTLD_NOW); nothing runs: this CPU may lack the target's.
    lib = ctypes.CDLL(str(out), mode=os.RTLD_NOW)
    assert all(hasattr(lib, name) for name in cpu_kernel.SIGNATURES)
