#!/bin/bash
# The warpgroup 4-bit kernel's ASMEM launches (A staged in shared memory, each MMA left
# running while the next group is dequantized) on an sm_90 GPU: first the kernel tests
# (ASMEM cases among them), then the kernel benchmark at 32-128 rows, where they would
# replace register-A launches if correct and faster.
#   bash benchmarks/quant/wgmma_asmem_check.sh OUT_DIR     # about 4 minutes on an H200
set -u
OUT=${1:?usage: bash benchmarks/quant/wgmma_asmem_check.sh OUT_DIR}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -rf tests/kernels/test_w4_mma_gemv.py -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
timeout 300 python3 benchmarks/quant/bench_w4_mma.py --quick --rows 128,64,32 --out "$OUT" \
  > "$OUT/kbench.log" 2>&1
grep "==" "$OUT/kbench.log"
grep -i "asmem" "$OUT/kbench.log" | head -40
