#!/usr/bin/env bash
# The EAGLE loop (every round on the device, one CUDA graph per round) against
# plain decoding on a GPU, per tree shape, with a kernel profile of one round;
# then `LLM.generate` with the loop (eagle-loop), the engine's speculation
# round (eagle) and n-gram at batch 1 and 64, each against plain decoding.
#
#   bash benchmarks/spec/gpu_late.sh OUT_DIR          # H200, under 4 minutes
#   SMOKE=1 bash benchmarks/spec/gpu_late.sh /tmp/x   # CPU check, tiny model
# MODEL=path picks the target (default: the installed SmolLM2-135M-Instruct).
#
# Writes to OUT_DIR: env.txt, loop.log, loop_cuda.{json,md}, kernels_cuda.txt,
# bench.log, results_cuda.{json,md}. Each part has its own time limit.
set -u
OUT=${1:-benchmarks/spec/results/gpu_late}
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ date -u; nvidia-smi -L 2>/dev/null; git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1
if [ -n "${SMOKE:-}" ]; then
  LOOP="--smoke --trees 3,10,10,40;2,4,4,8 --compile-trees 2,4,4,8"
  BENCH="--smoke --batch 1 2 --speculative-method eagle-loop,eagle,ngram --no-sync-check"
else
  LOOP="--device cuda --max-tokens 128 --kernel-profile --trees 3,10,10,40;4,10,10,48;2,16,16,32 --compile-trees 3,10,10,40"
  BENCH="--device cuda --batch 1 64 --max-tokens 128 --speculative-method eagle-loop,eagle,ngram --eagle-depth 3 --eagle-tree 10,10,40 --eagle-graphs --no-sync-check"
fi
echo "== bench_loop $LOOP" | tee "$OUT/loop.log"
timeout "${T_LOOP:-140}" $PY benchmarks/spec/bench_loop.py $LOOP ${MODEL:+--model $MODEL} --out "$OUT" >> "$OUT/loop.log" 2>&1
echo "loop exit: $? at $(date -u +%T)" | tee -a "$OUT/loop.log"
cat "$OUT"/loop_*.md 2>/dev/null
head -3 "$OUT"/kernels_cuda.txt 2>/dev/null
echo "== bench_spec $BENCH" | tee "$OUT/bench.log"
timeout "${T_BENCH:-95}" $PY benchmarks/spec/bench_spec.py $BENCH ${MODEL:+--model $MODEL} --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench exit: $? at $(date -u +%T)" | tee -a "$OUT/bench.log"
cat "$OUT"/results_*.md "$OUT"/smoke.md 2>/dev/null
