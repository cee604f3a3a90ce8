#!/usr/bin/env bash
# The whole GPU device check in one command, under ~500 s on an H200 (420 s on 2026-12-04):
#   1. install what the device lacks from wheels/ (bench/pack_gpu_wheels.sh makes
#      wheels/gpu-site.tar.xz here; plain wheels/*.whl are installed too);
#   2. bench/gpu_agreement.py: first JIT-compiles, in parallel processes, every FlashInfer module
#      the steps below use (one at a time, pytest alone ran out of 210 s; in parallel all were
#      built in 213 s), then checks flashinfer's numbers against fp64 attention and fp32 logits;
#   3. the tests marked `gpu` (FlashInfer against torch, overlap), on the compiled kernels;
#   4. bench/gpu_bench.py on dummy:llama-3-8b with the time left: decode step vs the bandwidth
#      bound, greedy agreement (vs torch and fp32), tokens/s for {dfs, blend} x overlap {off, on}.
# Results go under $OUT (the device tool's folder; bench/out/gpu elsewhere): agreement.json,
# agreement.txt, pytest.txt, gpu_report.json, bench.txt, env.txt. Run from the repo root with
# the device tool:
#   run(command="bash bench/gpu_check.sh", carry=["wheels"], timeout_s=540)
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

TOTAL=${GPU_CHECK_SECONDS:-500}  # the whole script's seconds; each step gets what is left
elapsed() { echo $(( $(date +%s) - t0 )); }
upto() { local s=$(( TOTAL - $1 - $(elapsed) )); echo $(( s > 20 ? s : 20 )); }  # leave $1 s

echo "== bench/gpu_agreement.py"
timeout "$(upto 170)" python3 bench/gpu_agreement.py --out "$OUT/agreement.json" \
  --warm-timeout-s "$(upto 230)" 2>&1 | tee "$OUT/agreement.txt"
echo "agreement rc=${PIPESTATUS[0]} at $(elapsed)s"

echo "== pytest -m gpu"
p=$(upto 60)
timeout $(( p > 150 ? 150 : p )) python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/runtime/test_flashinfer_backend.py tests/runtime/test_overlap.py 2>&1 | tee "$OUT/pytest.txt"
echo "pytest rc=${PIPESTATUS[0]} at $(elapsed)s"

echo "== bench/gpu_bench.py"
left=$(( TOTAL - $(elapsed) ))
timeout $(( left > 30 ? left : 30 )) python3 bench/gpu_bench.py --out "$OUT/gpu_report.json" \
  --deadline-s $(( left > 120 ? left - 90 : 30 )) 2>&1 | tee "$OUT/bench.txt"
echo "bench rc=${PIPESTATUS[0]} at $(elapsed)s"
