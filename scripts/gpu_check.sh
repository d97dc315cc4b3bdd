#!/usr/bin/env bash
# Every GPU check in one run (for a lent CUDA machine; CI has none): the gpu-marked tests, a launch
# profile, the LayerPipeline overlap measurement, `python -m radixkv.bench kernels` (BENCH_ARGS=--tune
# adds the tile sweep, ~1 min more) and the same with 4 chunks per call. Logs go to $OUT (default
# ./gpu-out). About 2 minutes on an H200, plus the machine's start.
# Runs from a copy of the package laid out as installed (radixkv/kernels, ...), so it needs no
# pip install and no network; the machine's own torch and triton are used.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$R/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RADIXKV_COMPILE=0
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nproc
} 2>&1 | tee "$OUT/env.txt"
PKG=$(mktemp -d)
cp -r "$R/radixkv" "$PKG/radixkv"
rm -f "$PKG"/radixkv/*.so
cp -r "$R/triton_kernels" "$PKG/radixkv/kernels"
cp -r "$R/adapters" "$PKG/radixkv/adapters"
cp -r "$R/sims" "$PKG/radixkv/sims"
cd "$PKG" || exit 1  # `python -m` puts the cwd first on sys.path: the laid-out copy, not $R/radixkv
export PYTHONPATH=$PKG
timeout 240 $PY -m pytest -p no:cacheprovider -c "$R/pyproject.toml" --rootdir "$R" -m gpu -q \
  "$R/tests/kernels" "$R/tests/tiers/test_memory_tier.py" 2>&1 | tee "$OUT/pytest.txt"
echo "pytest exit ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.txt"
timeout 60 $PY "$R/scripts/gpu_launch_profile.py" 2>&1 | tee "$OUT/launch_profile.txt"
for n in 6144 4096; do  # per-layer matmul size: compute longer, then shorter, than the loads
  timeout 60 $PY "$R/scripts/gpu_pipeline_overlap.py" $n 2>&1 | tee -a "$OUT/pipeline.txt"
done
# REPEAT=N runs the benchmark N times (a check of run-to-run spread).
for _ in $(seq "${REPEAT:-1}"); do
  timeout 300 $PY -m radixkv.bench kernels ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.txt"
  echo "bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/bench.txt"
done
# The launch-bound case: 4 chunks per call whatever their size (128 MiB calls for 256-token chunks).
timeout 120 $PY -m radixkv.bench kernels --chunks 4 2>&1 | tee "$OUT/bench_4chunks.txt"
