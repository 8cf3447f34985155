#!/bin/bash
# Every test that needs a CUDA device, in four pytest processes at once (kernel
# compiles are CPU-bound, so groups overlap well): a log per group under OUT_DIR,
# then each group's summary and failures. Run from the repository root on a GPU
# machine:   bash tests/run_gpu.sh OUT_DIR [LIMIT_S]
# (An H200 from cold, 2026-12-01: the groups took about 200, 50 (before test_gluon_fp8
# and test_w8a8_gemm moved there), over 220 and 175 s; 2026-12-04: 304, 347, 209, 189 s.)
# The engine group's fixtures import gguf: install it first where it is missing
# (python3 -m pip install --no-deps gguf).
set -u
OUT=${1:?usage: bash tests/run_gpu.sh OUT_DIR [LIMIT_S]}
LIMIT=${2:-900}
mkdir -p "$OUT"
python3 -c "import gguf" 2>/dev/null || echo "note: no gguf module here: the engine group (4) will fail to import its fixtures"
export SLIPSTREAM_ATTENTION_TUNE=${SLIPSTREAM_ATTENTION_TUNE:-0}   # fixed tiles: quick compiles
GROUPS_=(
  "tests/kernels/test_prefill_attention.py tests/kernels/test_tree_attention.py tests/kernels/test_logp_topk.py tests/kernels/test_masked_attention.py tests/kernels/test_gluon_prefill.py"
  "tests/kernels/test_decode_attention.py tests/kernels/test_short_decode_attention.py tests/kernels/test_kv_store.py tests/kernels/test_rotary_kv_store.py tests/kernels/test_fused_ops.py tests/kernels/test_triton_backend.py tests/kernels/test_gluon_fp8.py tests/kernels/test_w8a8_gemm.py"
  "tests/kernels/test_kv_cache_quant.py tests/kernels/test_kv_code_paths.py tests/kernels/test_fp8_attention.py tests/kernels/test_quant_gemm.py tests/kernels/test_int_weight_gemv.py tests/kernels/test_quant_tuning.py tests/kernels/test_dense_gemv.py tests/kernels/test_w4_mma_gemv.py tests/kernels/test_kivi_decode.py tests/kernels/test_tma_gemv.py tests/kernels/test_tma_int8_gemv.py tests/kernels/test_skinny_gemm.py tests/kernels/test_few_rows.py"
  "tests/engine/test_gpu_runtime.py tests/engine/test_gpu_spec_kv.py tests/sampling/test_sampler_cuda.py"
)
i=0
for g in "${GROUPS_[@]}"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  # SIGINT at the limit: pytest stops and still prints what ran and what failed
  # (unbuffered, so a killed run's log keeps its lines).
  timeout -s INT -k 30 "$LIMIT" python3 -u -m pytest -q -rf $g -p no:cacheprovider > "$OUT/gpu_tests_$i.log" 2>&1 &
done
wait
rc=0
for j in $(seq 1 $i); do
  echo "== group $j: ${GROUPS_[$((j - 1))]}"
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests_$j.log" | tail -15
  grep -q "KeyboardInterrupt" "$OUT/gpu_tests_$j.log" && { echo "(stopped at ${LIMIT}s: the counts above are of the tests that ran)"; rc=1; }
  grep -qE " passed| failed" "$OUT/gpu_tests_$j.log" || { echo "(no summary: over ${LIMIT}s or crashed)"; rc=1; }
  grep -qE "^FAILED|^ERROR| failed" "$OUT/gpu_tests_$j.log" && rc=1
done
exit $rc
