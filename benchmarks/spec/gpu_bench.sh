#!/usr/bin/env bash
# Benchmark every speculative method against plain decoding on a GPU with the
# shipped heads (no training), with a cProfile split per round and the count
# of synchronizing CUDA calls in a speculation round.
#
#   bash benchmarks/spec/gpu_bench.sh OUT_DIR                  # H200: ~3 minutes, capped at 225 s
#   SMOKE=1 bash benchmarks/spec/gpu_bench.sh /tmp/x           # CPU check: tiny random model
#
# Writes to OUT_DIR: env.txt, bench.log (full output), results_cuda.{json,md}
# (tok/s, speedup, tau, acceptance at batch 1 and 64; sync counts),
# profiles_cuda.txt (per method and batch: ms per round by part, cProfile top 40).
# Results are written after every method, so a run cut by the time limit still
# leaves the finished methods. Extra arguments go to bench_spec.py.
set -u
OUT=${1:-${OUT:-benchmarks/spec/results/gpu}}
shift || true
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -n "${SMOKE:-}" ]; then
  BENCH="--smoke --profile --speculative-method ngram,medusa,eagle,draft"
else
  BENCH="--device cuda --batch 1 64 --max-tokens 128 --profile --speculative-method ngram,medusa,eagle,eagle-wide,draft --eagle-depth 6 --eagle-tree 8,8,48 --medusa-tree 4,3,2 --eagle-graphs"
fi
{ date -u; nvidia-smi -L 2>/dev/null; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1
echo "== bench_spec $BENCH $*" | tee "$OUT/bench.log"
timeout "${T_BENCH:-225}" $PY benchmarks/spec/bench_spec.py $BENCH "$@" --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench exit: $? at $(date -u +%T)" | tee -a "$OUT/bench.log"
cat "$OUT"/results_*.md "$OUT"/smoke.md 2>/dev/null
grep -A16 "^# .*batch" "$OUT"/profiles_*.txt 2>/dev/null | grep -v "^--$" | head -120
