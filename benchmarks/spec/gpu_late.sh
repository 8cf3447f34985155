#!/usr/bin/env bash
# The EAGLE loop (every round on the device, one CUDA graph per round) against
# plain decoding on a GPU, with the shipped head and, when present, a newer
# head; then `LLM.generate` at batch 1 with the loop (eagle-loop) and with the
# engine's speculation round (eagle), each against plain decoding.
#
#   bash benchmarks/spec/gpu_late.sh OUT_DIR [NEW_HEAD]     # H200, under 4 minutes
#   SMOKE=1 bash benchmarks/spec/gpu_late.sh /tmp/x          # CPU check, tiny model
# MODEL=path picks the target (default: the installed SmolLM2-135M-Instruct).
#
# Writes to OUT_DIR: env.txt, loop.log + loop_cuda.{json,md}, bench.log +
# results_cuda.{json,md} (engine path). Each part has its own time limit.
set -u
OUT=${1:-benchmarks/spec/results/gpu_late}
NEW=${2:-benchmarks/spec/results/h200_early_heads/smollm2-135m-instruct.eagle.safetensors}
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ date -u; nvidia-smi -L 2>/dev/null; git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1
HEADS=""
if [ -f "$NEW" ]; then HEADS="--eagle-head slipstream/spec/weights/smollm2-135m-instruct.eagle.safetensors --eagle-head $NEW"; fi
if [ -n "${SMOKE:-}" ]; then
  LOOP="--smoke"; BENCH="--smoke --batch 1 2 --speculative-method eagle-loop,eagle --no-sync-check"
else
  LOOP="--device cuda --max-tokens 128"
  BENCH="--device cuda --batch 1 --max-tokens 128 --speculative-method eagle-loop,eagle --eagle-depth 6 --eagle-tree 8,8,48 --eagle-graphs --no-sync-check"
fi
echo "== bench_loop $LOOP $HEADS" | tee "$OUT/loop.log"
timeout "${T_LOOP:-130}" $PY benchmarks/spec/bench_loop.py $LOOP $HEADS ${MODEL:+--model $MODEL} --out "$OUT" >> "$OUT/loop.log" 2>&1
echo "loop exit: $? at $(date -u +%T)" | tee -a "$OUT/loop.log"
cat "$OUT"/loop_*.md 2>/dev/null
EH=""
if [ -f "$NEW" ] && [ -z "${SMOKE:-}" ]; then EH="--eagle-head $NEW"; fi
echo "== bench_spec $BENCH $EH" | tee "$OUT/bench.log"
timeout "${T_BENCH:-95}" $PY benchmarks/spec/bench_spec.py $BENCH $EH ${MODEL:+--model $MODEL} --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench exit: $? at $(date -u +%T)" | tee -a "$OUT/bench.log"
cat "$OUT"/results_*.md "$OUT"/smoke.md 2>/dev/null
