#!/usr/bin/env bash
# The GPU tier and the benchmarks in one device call. Usage (on the GPU machine, repo root):
#   [TIER=all] bash scripts/gpu_run.sh "<pytest files>" "<bench families>"
# Logs, JUnit XML and benchmark results go to $OUT (or ./gpu_out).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-gpu_out}; mkdir -p "$out"
tests=${1:-tests}; families=${2:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
# TIER=all also runs the CPU tier's tests on the GPU (they take CUDA tensors there: float64 on CUDA,
# for one, is only covered by them)
marker=gpu; [ "${TIER:-gpu}" = all ] && marker="gpu or not gpu"
python3 -m pytest -q -m "$marker" $tests --junitxml="$out/gpu_tests.xml" -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
if [ -n "$families" ]; then
  python3 -m sparsefuse bench $families --out "$out" 2>&1 | tee "$out/bench.log" | grep -v "^|" | tail -60
fi
