#!/usr/bin/env bash
# Session 25: bisect the KD initcheck report, racecheck hazard details, run-to-run bit identity.
export PYTHONPATH=$PWD
OUT=$OUT/split bash scripts/sanitize_split.sh > $OUT/split_summary.txt 2>&1 &
for fam in vq sae; do
  timeout 500 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 6 \
    python tests/sanitize_cases.py $fam > $OUT/race-$fam.log 2>&1 &
done
python scripts/probe_race_determinism.py > $OUT/determinism.jsonl 2>&1
wait
cat $OUT/split_summary.txt; cat $OUT/determinism.jsonl
for fam in vq sae; do grep -v "Host Frame" $OUT/race-$fam.log | head -60; done
