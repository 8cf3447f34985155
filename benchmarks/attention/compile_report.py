"""What a kernel config compiles to on Hopper, without a GPU.

Compiles the decode (split-KV) or prefill kernel for sm_90 with Triton and the
ptxas bundled in its wheel, then reports what decides occupancy and latency
hiding: shared memory, registers and spills, programs that fit on one SM, the
K/V tiles the software pipeline keeps in flight, and which MMA and copy
instructions were chosen. A config can be ruled out here before it costs
device time (this is how the decode pipeline depth was found: with the
block-table read feeding the K/V addresses, 4 stages keep one K/V tile in
flight, 6 keep two).

    python benchmarks/attention/compile_report.py decode --block-n 64 --warps 2 --stages 6
    python benchmarks/attention/compile_report.py decode --block-m 64 --tree --warps 4
    python benchmarks/attention/compile_report.py decode --kv int8 --block-n 128 --warps 4 --stages 4
    python benchmarks/attention/compile_report.py prefill --block-m 128 --block-n 64 \\
        --warps 8 --stages 2 --maxnreg 128 --tma-store
    python benchmarks/attention/compile_report.py prefill --all-keys --paged-load prefetch32 \\
        --block-n 128 --warps 8 --stages 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KB an SM, up to 227 KB a block
REGS_PER_SM = 65536
PTR_ARGS = {  # pointer arguments and their element types
    "Q": "bf16", "KCache": "bf16", "VCache": "bf16", "Out": "bf16", "PartO": "fp32",
    "PartLse": "fp32", "CuSeqlensQ": "i32", "SeqLens": "i32", "BlockTables": "i32",
    "ContextLens": "i32", "TreeBits": "i64", "QScale": "fp32", "KScale": "fp32",
    "VScale": "fp32", "KCacheScale": "fp32", "VCacheScale": "fp32",
}
KV_TYPES = {"bf16": "bf16", "int8": "i8", "fp8": "fp8e4nv"}
FLOAT_ARGS = {"qk_scale"}


def signature(fn, consts: dict, descriptors: dict) -> tuple[dict, dict]:
    """Types for every argument, and 16-byte divisibility for pointers and
    strides (what the runtime specializes on for real tensors)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in descriptors:
            sig[name] = descriptors[name]
        elif name in PTR_ARGS:
            sig[name] = "*" + PTR_ARGS[name]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or (name.startswith("stride") and name != "stride_tb"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def decode_kernel(args):
    from slipstream.kernels import decode_attention as da
    consts = dict(GROUP=args.group, HEAD_DIM=args.head_dim, HEAD_DIM_PAD=args.head_dim,
                  BLOCK_M=args.block_m, BLOCK_N=args.block_n, PAGE_SIZE=args.page_size, SPLIT=True,
                  SLIDING=False, TREE=args.tree, PDL=False, CHAIN=True, QUANT=args.kv != "bf16",
                  KV_DOT=da.DEFAULT_KV_DOT.get(args.kv, 0), ASM=True,
                  PREFETCH=da.DEFAULT_PREFETCH)
    return da._split_kv_kernel, consts, {}


def prefill_kernel(args):
    from slipstream.kernels import prefill_attention as pa
    from slipstream.kernels.prefill_configs import PAGED_LOADS
    from slipstream.kernels.prefill_paged import TMA
    load, offs32 = PAGED_LOADS[args.paged_load]
    consts = dict(GROUP=args.group, HEAD_DIM=args.head_dim, HEAD_DIM_PAD=args.head_dim,
                  BLOCK_M=args.block_m, BLOCK_N=args.block_n, PAGE_SIZE=args.page_size,
                  CAUSAL=True, SLIDING=False, NEW_KV=not args.all_keys, USE_TMA=True, FP8=False,
                  WARP_SPECIALIZE=args.ws, TMA_STORE=args.tma_store, PAIRED=args.paired,
                  CACHE_QUANT=args.kv != "bf16", PAGED_LOAD=load, OFFS32=offs32)
    d = args.head_dim
    descriptors = {"Q": f"tensordesc<bf16[{args.block_m},{d}]>",
                   "K": f"tensordesc<bf16[{args.block_n},{d}]>",
                   "V": f"tensordesc<bf16[{args.block_n},{d}]>",
                   "OutDesc": f"tensordesc<bf16[{args.block_m},{d}]>" if args.tma_store else "*bf16"}
    cache = f"tensordesc<bf16[{args.block_n},{d}]>" if load % 4 == TMA else "*" + KV_TYPES[args.kv]
    descriptors.update(KCacheDesc=cache, VCacheDesc=cache)
    return pa._prefill_kernel, consts, descriptors


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread: spills) from the bundled ptxas."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes cumulative stack size", log)
    return regs, int(spill.group(1)) if spill else 0


def report(args) -> dict:
    fn, consts, descriptors = (decode_kernel if args.kernel == "decode" else prefill_kernel)(args)
    PTR_ARGS["KCache"] = PTR_ARGS["VCache"] = KV_TYPES[args.kv]
    sig, attrs = signature(fn, consts, descriptors)
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    options = dict(num_warps=args.warps, num_stages=args.stages)
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    regs, stack = ptxas_usage(ptx)
    shared = kernel.metadata.shared
    threads = 32 * args.warps
    per_sm = min(SMEM_PER_SM // (shared + 1024), REGS_PER_SM // (regs * threads), 64 // args.warps)
    # Depth of each multi-buffered K/V ring in shared memory (one per pipelined loop).
    buffers = sorted({int(m) for m in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)})
    return {"shared_bytes": shared, "registers": regs, "stack_bytes": stack,
            "programs_per_sm": per_sm, "kv_buffers": buffers,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async."), "tma_loads": ptx.count("cp.async.bulk.tensor")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["decode", "prefill"])
    ap.add_argument("--block-m", type=int, default=None, help="decode: 16 (one token x GQA group)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tree", action="store_true", help="decode kernel with a tree mask")
    ap.add_argument("--tma-store", action="store_true", help="prefill: bulk output store")
    ap.add_argument("--paired", action="store_true", help="prefill: two query blocks a program")
    ap.add_argument("--paged-load", default="shared",
                    help="prefill: how cached K/V tiles are fetched (prefill_configs.PAGED_LOADS)")
    ap.add_argument("--all-keys", action="store_true",
                    help="prefill: every key from the paged cache (k=None), none fresh")
    ap.add_argument("--ws", action="store_true", help="prefill: warp-specialised K/V loop (same PTX on sm_90, Triton 3.6)")
    ap.add_argument("--kv", choices=tuple(KV_TYPES), default="bf16",
                    help="KV cache dtype (int8 / fp8: 1-byte codes with per-token scales)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.block_m is None:
        args.block_m = 16 if args.kernel == "decode" else 128
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("compile_report needs compiled kernels: unset TRITON_INTERPRET")
    result = report(args)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
