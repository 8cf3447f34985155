"""SASS of the batch-1 weight-streaming GEMV's loop (kernels/int_weight_gemv.py) for sm_90,
compiled on any machine by Triton's bundled ptxas and nvdisasm: instructions a 4-bit code,
with and without the manual prefetch of the next tile, at 64 and 128 rows a program.

    python benchmarks/quant/gemv_sass.py [--json OUT]

The loop is the largest backward branch's body; a warp's instructions over the codes its
tile holds (BLOCK_N x TILE codes a program, over num_warps warps)."""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from slipstream.kernels.int_weight_gemv import _gemv_kernel  # noqa: E402
from kv_decode_sass import disassemble, loop_counts  # noqa: E402
BF16, F32 = torch.empty(8, dtype=torch.bfloat16), torch.empty(8)


def sass(block_n: int, warps: int, prefetch: bool, stages: int = 1) -> str:
    words, u8, i32 = (torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.uint8),
                      torch.empty(8, dtype=torch.int32))
    args = dict(X=BF16, W=words, Scales=F32, Zeros=u8, Y=BF16, Part=F32, Count=i32, M=1,
                N=28672, K=4096, num_groups=32, stride_w=512, stride_xm=4096, stride_ym=28672,
                tiles_per_split=16, reg0=0)
    fn, consts = _gemv_kernel, dict(BITS=4, HAS_ZEROS=True, TILE=128, GROUP_TILES=1, BLOCK_M=1,
                                    BLOCK_N=block_n, SPLIT_K=2, PREFETCH=prefetch,
                                    STAGES=stages)
    sig = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in fn.arg_names}
    # What a launch specializes on: 16-byte aligned pointers, integers divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (isinstance(args[n], torch.Tensor)
                                     or (args[n] and args[n] % 16 == 0))}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return disassemble(k)


def loop_ops(text: str) -> collections.Counter:
    """The largest loop's opcode counts (the GEMV's loop over K tiles)."""
    return max(loop_counts(text), key=lambda ops: sum(ops.values()), default=collections.Counter())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = []
    for block_n, warps, prefetch, stages in ((64, 4, False, 1), (64, 4, True, 1),
                                             (128, 4, False, 3), (64, 2, False, 1)):
            ops = loop_ops(sass(block_n, warps, prefetch, stages))
            total = sum(ops.values())
            codes_per_warp = block_n * 128 / warps
            row = {"stages": stages, "block_n": block_n, "warps": warps, "prefetch": prefetch,
                   "loop_instructions": total,
                   "instructions_a_code": round(total * 32 / codes_per_warp, 3),
                   "top": ops.most_common(10)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
