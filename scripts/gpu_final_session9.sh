#!/usr/bin/env bash
# Session 9's GPU call: the SAE benchmark, then the SAE tests at every tier (CPU tests on CUDA too)
# and the rest of the GPU tier. Everything lands in $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m sparsefuse bench sae --out $OUT > $OUT/sae_bench.log 2>&1; grep -E "sparsefuse|Hierarchical over" $OUT/sae_bench.log | tail -14
python3 -m pytest -q -m "gpu or not gpu" tests/test_sae.py tests/test_sae_linear.py tests/test_sae_modules.py -p no:cacheprovider > $OUT/sae_tier_all.log 2>&1; tail -n 1 $OUT/sae_tier_all.log
python3 -m pytest -q -m gpu tests -p no:cacheprovider --ignore=tests/test_sae.py --ignore=tests/test_sae_linear.py --ignore=tests/test_sae_modules.py > $OUT/gpu_tier_rest.log 2>&1; tail -n 1 $OUT/gpu_tier_rest.log
