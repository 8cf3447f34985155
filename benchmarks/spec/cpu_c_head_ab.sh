#!/bin/bash
# EAGLE's draft head through one C call (kernels/cpu_eagle.py) against the torch head
# (SLIPSTREAM_CPU_EAGLE=0) on the default model, this CPU; the two alternate, three runs
# each (each run: plain and speculative decoding prompt by prompt, 8 prompts x 64 tokens).
#   bash benchmarks/spec/cpu_c_head_ab.sh OUT_DIR [METHOD [bench spec options]]
# METHOD eagle (default: a chain of 3, --eagle-tree 1,1,3 --eagle-depth 3) or peagle
# (default: --peagle-tokens 4).
OUT=${1:?usage: bash benchmarks/spec/cpu_c_head_ab.sh OUT_DIR [METHOD [options]]}
METHOD=${2:-eagle}
shift $(( $# < 2 ? $# : 2 ))
if [ $# -eq 0 ]; then
  if [ "$METHOD" = peagle ]; then set -- --peagle-tokens 4; else set -- --eagle-tree 1,1,3 --eagle-depth 3; fi
fi
mkdir -p "$OUT"
for rep in 1 2 3; do
  for on in 0 1; do
    SLIPSTREAM_CPU_EAGLE=$on slipstream bench spec --device cpu --speculative-method "$METHOD" \
      "$@" --num-prompts 8 --max-tokens 64 --out "$OUT/tmp" > /dev/null 2>&1
    mv "$OUT/tmp/results_cpu.json" "$OUT/${METHOD}_c_head_${on}_run$rep.json"
  done
done
rm -rf "$OUT/tmp"
for f in "$OUT"/${METHOD}_c_head_*_run*.json; do
  python3 -c "import json, sys; r = [x for x in json.load(open(sys.argv[1]))['results'] if x['method'] == sys.argv[2]][0]; print(sys.argv[1], r['speedup'], r['tau'], r['identical'])" "$f" "$METHOD"
done
