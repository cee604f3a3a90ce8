#!/usr/bin/env bash
# The whole GPU device check in one command (issue 8), about 8 minutes on an H200:
#   1. install what the device lacks from wheels/ (bench/pack_gpu_wheels.sh makes
#      wheels/gpu-site.tar.xz here; plain wheels/*.whl are installed too);
#   2. the tests marked `gpu` (FlashInfer against torch, overlap), which JIT-compile FlashInfer's
#      kernels with nvcc on first use;
#   3. bench/gpu_bench.py on dummy:llama-3-8b: decode step vs the bandwidth bound, greedy
#      agreement, tokens/s for {dfs, blend} x overlap {off, on}.
# Results go under $OUT (the device tool's folder; bench/out/gpu elsewhere): gpu_report.json,
# pytest.txt, bench.txt. Run from the repo root with the device tool:
#   run(command="bash bench/gpu_check.sh", carry=["wheels"], timeout_s=570)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
SITE=/tmp/blendserve-site
mkdir -p "$SITE"
t0=$(date +%s)
for t in wheels/*.tar.xz; do [ -f "$t" ] && tar -xJf "$t" -C "$SITE"; done
if compgen -G "wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" wheels/*.whl
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # compile for Hopper only
echo "installed in $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" \
  2>&1 | tail -3 | tee -a "$OUT/env.txt"

echo "== pytest -m gpu"
timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/runtime/test_flashinfer_backend.py tests/runtime/test_overlap.py 2>&1 | tee "$OUT/pytest.txt"
echo "pytest rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 ))s"

echo "== bench/gpu_bench.py"
left=$(( 480 - ($(date +%s) - t0) ))
timeout $(( left > 60 ? left : 60 )) python3 bench/gpu_bench.py --out "$OUT/gpu_report.json" \
  --deadline-s $(( left > 120 ? left - 90 : 30 )) 2>&1 | tee "$OUT/bench.txt"
echo "bench rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 ))s"
