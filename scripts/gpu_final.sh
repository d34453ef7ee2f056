#!/usr/bin/env bash
# The end-of-session GPU calls (each fits one 10-minute device call). Everything lands in $OUT.
#   bash scripts/gpu_final.sh bench   # `sparsefuse bench sae`
#   bash scripts/gpu_final.sh public  # scripts/compare_public.py, when .ext/ holds flex-sae's two kernel
#                                     # files (carried, never committed)
#   bash scripts/gpu_final.sh tests   # the SAE tests at every tier (CPU tests on CUDA too), then the
#                                     # rest of the GPU tier
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case "${1:-}" in
  bench)
    timeout 560 python3 -m sparsefuse bench sae --out "$OUT" > "$OUT/sae_bench.log" 2>&1
    grep -E "sparsefuse|Hierarchical over|bf16 over" "$OUT/sae_bench.log" | tail -16 ;;
  public)
    timeout 560 python3 scripts/compare_public.py .ext > "$OUT/compare_public.log" 2>&1
    grep -E "^\| (topk|hier)|flex-sae" "$OUT/compare_public.log" ;;
  tests)
    sae="tests/test_sae.py tests/test_sae_linear.py tests/test_sae_modules.py"
    python3 -m pytest -q -m "gpu or not gpu" $sae -p no:cacheprovider > "$OUT/sae_tier_all.log" 2>&1
    tail -n 1 "$OUT/sae_tier_all.log"
    python3 -m pytest -q -m gpu tests -p no:cacheprovider $(printf -- "--ignore=%s " $sae) > "$OUT/gpu_tier_rest.log" 2>&1
    tail -n 1 "$OUT/gpu_tier_rest.log" ;;
  *) echo "usage: bash scripts/gpu_final.sh bench|public|tests" >&2; exit 2 ;;
esac
