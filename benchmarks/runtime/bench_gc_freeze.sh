#!/usr/bin/env bash
# The throughput stage of bench_engine.py (1,000 ShareGPT-like requests, Llama-3-8B
# shape, random bf16 weights) with every engine's start-up heap frozen
# (SLIPSTREAM_GC_FREEZE=1; the server's default) and not (=0), each in its own
# process, alternating:
#   bash benchmarks/runtime/bench_gc_freeze.sh OUT [REPEATS]
# Writes OUT/freeze<0|1>_<repeat>.json (each with the collector's pauses in the
# timed run and in the warm pass) and OUT/printed.txt.
set -u
out=${1:?OUT}; repeats=${2:-2}
mkdir -p "$out"
for ((r = 0; r < repeats; r++)); do
  if ((r % 2 == 0)); then order="1 0"; else order="0 1"; fi
  for f in $order; do
    d=$(mktemp -d)
    SLIPSTREAM_GC_FREEZE=$f python benchmarks/runtime/bench_engine.py --out "$d" --stages throughput \
      > "$d/log.txt" 2>&1
    echo "== freeze $f repeat $r rc $? $(date +%T)" | tee -a "$out/printed.txt"
    if [ -f "$d/throughput.json" ]; then
      cp "$d/throughput.json" "$out/freeze${f}_$r.json"
      python - "$d/throughput.json" <<'PY' | tee -a "$out/printed.txt"
import json, sys
d = json.load(open(sys.argv[1]))
w = d["warm_pass"]
print(f"out tok/s {d['output_tokens_per_s']:.0f} elapsed {d['elapsed_s']:.2f} "
      f"pct bound {d['roofline']['pct_of_bound']:.1f} bw {d['roofline']['memory_bandwidth_GBps']:.0f} "
      f"gc timed {d['gc_pauses']} | warm: elapsed {w['elapsed_s']:.2f} gc {w['gc_pauses']} "
      f"slowest {w['slowest_steps'][:4]}")
PY
    else
      tail -5 "$d/log.txt" | tee -a "$out/printed.txt"
    fi
  done
done
