#!/bin/bash
# Two EAGLE heads on this CPU, the default model: `bench spec` with each head in turn,
# three runs each (a run times plain and speculative decoding prompt by prompt, 8 chat
# prompts x 64 tokens), then speedup, tau and the identical fraction of each run.
#   bash benchmarks/spec/cpu_head_ab.sh OUT_DIR OLD_HEAD NEW_HEAD [bench spec options]
# e.g. a chain of 3: ... --eagle-tree 1,1,3 --eagle-depth 3
OUT=${1:?usage: bash benchmarks/spec/cpu_head_ab.sh OUT_DIR OLD_HEAD NEW_HEAD [options]}
OLD=${2:?}; NEW=${3:?}
shift 3
PY=${PYTHON:-python}
mkdir -p "$OUT"
for rep in 1 2 3; do
  for h in old new; do
    if [ $h = old ]; then H=$OLD; else H=$NEW; fi
    $PY -m slipstream.cli bench spec --device cpu --speculative-method eagle --eagle-head $H "$@" --num-prompts 8 --max-tokens 64 --out $OUT/tmp > /dev/null 2>&1
    mv $OUT/tmp/results_cpu.json $OUT/eagle_${h}_run$rep.json
  done
done
rm -rf $OUT/tmp
for f in $OUT/eagle_*_run*.json; do
  python3 -c "import json, sys; r = [x for x in json.load(open(sys.argv[1]))['results'] if x['method'] == 'eagle'][0]; print(sys.argv[1], r['speedup'], r['tau'], r['identical'])" "$f"
done
