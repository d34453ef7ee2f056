#!/usr/bin/env bash
# Every family under every compute-sanitizer tool, in parallel; logs and a summary under $OUT.
# Usage: OUT=dir bash scripts/sanitize_all.sh [tools...]
set -u
out=${OUT:-/tmp/sanitize}
mkdir -p "$out"
tools=${*:-memcheck initcheck racecheck synccheck}
for tool in $tools; do
  for fam in sae kd vq; do
    ( s=$(date +%s)
      timeout 540 compute-sanitizer --tool "$tool" --error-exitcode 3 python tests/sanitize_cases.py "$fam" \
        > "$out/$fam-$tool.log" 2>&1
      rc=$?
      echo "$fam $tool rc=$rc $(( $(date +%s) - s ))s $(grep -m1 'ERROR SUMMARY' "$out/$fam-$tool.log")" >> "$out/summary.txt"
    ) &
  done
done
wait
sort "$out/summary.txt"
