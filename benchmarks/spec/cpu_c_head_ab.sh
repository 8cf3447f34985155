#!/bin/bash
# EAGLE's draft head through one C call (kernels/cpu_eagle.py) against the torch head
# (SLIPSTREAM_CPU_EAGLE=0), a chain of 3 on the default model, this CPU; the two
# alternate, three runs each (each run: plain and speculative decoding prompt by prompt).
#   bash benchmarks/spec/cpu_c_head_ab.sh OUT_DIR
OUT=${1:?usage: bash benchmarks/spec/cpu_c_head_ab.sh OUT_DIR}
mkdir -p "$OUT"
for rep in 1 2 3; do
  for on in 0 1; do
    SLIPSTREAM_CPU_EAGLE=$on slipstream bench spec --device cpu --speculative-method eagle \
      --eagle-tree 1,1,3 --eagle-depth 3 --num-prompts 8 --max-tokens 64 --out "$OUT/tmp" > /dev/null 2>&1
    mv "$OUT/tmp/results_cpu.json" "$OUT/c_head_${on}_run$rep.json"
  done
done
rm -rf "$OUT/tmp"
