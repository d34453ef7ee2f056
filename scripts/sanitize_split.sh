#!/usr/bin/env bash
# initcheck on each KD hidden-state configuration alone (scripts/probe_sanitize_split.py), in parallel.
out=${OUT:-/tmp/sanitize_split}; mkdir -p "$out"
for V in 1000 4099; do for dt in float32 bfloat16; do for norm in topk full tail; do for cc in "0 None" "0.5 4" "0 4" "0.5 None"; do
  set -- $cc
  ( timeout 400 compute-sanitizer --tool initcheck --print-limit 3 python scripts/probe_sanitize_split.py $V $dt $norm $1 $2 \
      > "$out/kd-$V-$dt-$norm-$1-$2.log" 2>&1
    echo "$V $dt $norm ce=$1 chunk=$2 rc=$? $(grep -m1 'ERROR SUMMARY' "$out/kd-$V-$dt-$norm-$1-$2.log")" >> "$out/summary.txt" ) &
  while [ "$(jobs -r | wc -l)" -ge 14 ]; do sleep 1; done
done; done; done; done
wait; sort "$out/summary.txt"
