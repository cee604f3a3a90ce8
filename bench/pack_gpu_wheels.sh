#!/usr/bin/env bash
# Packs what the H200 device machine lacks for the `cuda` extra into wheels/gpu-site.tar.xz,
# which bench/gpu_check.sh unpacks there. Run here (needs the network), once:
#     bench/pack_gpu_wheels.sh
# The flashinfer wheel alone is 59 MiB and a device call carries 64 MiB with the tree, so the
# wheels are unpacked and re-compressed (FlashInfer's JIT sources and headers are text: ~18 MiB).
# The image already has torch, numpy, ninja, einops, click, requests, tabulate, packaging,
# nvidia-ml-py and cuda-bindings; flashinfer's other light dependencies come along. Left out:
# nccl-extensions and the cutlass-dsl compiler libraries (~200 MiB; multi-GPU and CuTe-DSL
# kernels only, not the paged prefill/decode kernels the runtime uses).
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-python cuda-tile nccl4py
      nvidia-cudnn-frontend nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
      nvidia-cutlass-dsl-libs-core==4.8.1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/whl" $PKGS
mkdir -p "$tmp/site" wheels
for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
tar -C "$tmp/site" -cf - . | xz -T0 -9 > wheels/gpu-site.tar.xz
ls -l --block-size=K "$tmp"/whl/*.whl wheels/gpu-site.tar.xz
