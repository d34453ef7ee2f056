# The four float64 argument-type mutants that the CPU tier cannot see (the Triton interpreter keeps
# Python floats unrounded), each applied on a GPU machine and run against the tests meant to catch it.
# Usage on the GPU machine, repo root, $OUT set: bash scripts/gpu_float64_argument_mutants.sh (line numbers as of session 39).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
log=$OUT/gpu_session39_E_float64_argument_mutants_h200.log
mut() {  # id file line old new tests -k
  id=$1 f=$2 n=$3 old=$4 new=$5 file=$6 k=$7
  cp $f /tmp/orig.py
  python3 - "$f" "$n" "$old" "$new" <<'PY'
import sys
f, n, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lines = open(f).read().split("\n")
assert old in lines[n - 1], (lines[n - 1], old)
lines[n - 1] = lines[n - 1].replace(old, new)
open(f, "w").write("\n".join(lines))
PY
  res=$(timeout 150 python3 -m pytest -q -m "gpu or not gpu" $file -p no:cacheprovider -k "$k" 2>&1 | tail -1)
  cp /tmp/orig.py $f
  echo "$id mutant ($f:$n '$old' -> '$new'): $res" | tee -a $log
}
mut K21 sparsefuse/kd/kernels.py 566 "items_value: tl.float64," "items_value," tests/test_kd.py "float64_num_items_in_batch_is_not_rounded"
mut K24 sparsefuse/kd/kernels.py 329 "inv_t: tl.float64," "inv_t," tests/test_kd.py "out_of_range_id_without_checks_kernels_match_reference or (test_from_logits and dtype1)"
mut K44 sparsefuse/kd/kernels.py 453 "temperature: tl.float64," "temperature," tests/test_kd.py "out_of_range_id_without_checks_kernels_match_reference"
mut K14 sparsefuse/sae/kernels.py 505 "eps: tl.float64," "eps," tests/test_sae_modules.py "row_ops_take_eps_in_the_accumulation_dtype"
echo "clean:" | tee -a $log
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_kd.py tests/test_sae_modules.py -p no:cacheprovider -k "float64_num_items_in_batch_is_not_rounded or out_of_range_id_without_checks_kernels_match_reference or (test_from_logits and dtype1) or row_ops_take_eps_in_the_accumulation_dtype" 2>&1 | tail -1 | tee -a $log
