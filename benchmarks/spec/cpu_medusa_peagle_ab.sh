#!/bin/bash
# Medusa and P-EAGLE heads, two sets, on this CPU with the default model: `bench spec`
# with each set in turn, N runs each (a run times plain and speculative decoding prompt
# by prompt, 8 chat prompts x 64 tokens; Medusa a chain of 3, P-EAGLE 3 drafts), then
# speedup, tau and the identical fraction of each run.
#   bash benchmarks/spec/cpu_medusa_peagle_ab.sh OUT_DIR OLD_DIR NEW_DIR [RUNS]
# (each DIR holds smollm2-135m-instruct.{medusa,peagle}.safetensors)
OUT=${1:?usage: bash benchmarks/spec/cpu_medusa_peagle_ab.sh OUT_DIR OLD_DIR NEW_DIR [RUNS]}
OLD=${2:?}; NEW=${3:?}; RUNS=${4:-2}
PY=${PYTHON:-python}
mkdir -p "$OUT"
for rep in $(seq 1 $RUNS); do
  for h in old new; do
    if [ $h = old ]; then D=$OLD; else D=$NEW; fi
    $PY -m slipstream.cli bench spec --device cpu --speculative-method medusa,peagle \
      --medusa-head $D/smollm2-135m-instruct.medusa.safetensors --medusa-tree 1,1,1 \
      --peagle-head $D/smollm2-135m-instruct.peagle.safetensors --peagle-tokens 3 \
      --num-prompts 8 --max-tokens 64 --out $OUT/tmp > /dev/null 2>&1
    mv $OUT/tmp/results_cpu.json $OUT/${h}_run$rep.json
  done
done
rm -rf $OUT/tmp
for f in $OUT/*_run*.json; do
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
    if r['method'] != 'plain': print(sys.argv[1], r['method'], r['speedup'], r['tau'], r['acceptance_per_position'], r['identical'])" "$f"
done
