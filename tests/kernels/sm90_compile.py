"""Compile the W8A8, weight-only and decode-step kernels for sm_90 (H100/H200) without a GPU; run as a script with
TRITON_INTERPRET=0 (test_sm90_compile.py does), since the interpreter replaces the
compiler. Prints one JSON object: check name -> "ok", "skip: ..." or the error."""
from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from slipstream.kernels.dense_gemv import _gemv_kernel as _dense_gemv_kernel
from slipstream.kernels.int_weight_gemv import _dequantize_kernel, _gemv_kernel
from slipstream.kernels.kv_move import _move_rows_kernel
from slipstream.kernels.quant_act import _quantize_rows_kernel, quant_params
from slipstream.kernels.quant_gemm import _int_weight_gemm_kernel
from slipstream.kernels.rms_norm import _rms_norm_kernel
from slipstream.kernels.rotary_kv_store import _rotary_store_kernel
from slipstream.kernels.short_decode_attention import FEW_CONFIG, MANY_CONFIG, _short_decode_kernel
from slipstream.kernels.silu_mul import _silu_mul_kernel, _silu_mul_quant_kernel
from slipstream.kernels.skinny_gemm import _skinny_kernel
from slipstream.kernels.w8a8_gemm import _w8a8_gemm_kernel, _w8a8_tma_kernel

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
BF16, F32 = torch.empty(8, dtype=torch.bfloat16), torch.empty(8)


def compile_sm90(kernel, args: dict, constexprs: dict, **options):
    sig = {n: "constexpr" if n in constexprs else mangle_type(args[n]) for n in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def gemm(kind):
    q = torch.empty(8, dtype=CODES[kind])
    args = dict(XQ=q, XS=F32, WQ=q, WS=F32, Y=BF16, M=2048, N=4096, K=4096, stride_xm=4096,
                stride_wn=4096, stride_ym=4096)
    k = compile_sm90(_w8a8_gemm_kernel, args, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                                                   GROUP_M=8, INT8=kind == "int8"),
                     num_warps=8, num_stages=3)
    assert "wgmma" in k.asm["ptx"], "no wgmma in the PTX"


def tma_gemm(kind):
    a = TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=CODES[kind]), [128, 128])
    b = TensorDescriptor.from_tensor(torch.empty(512, 256, dtype=CODES[kind]), [256, 128])
    args = dict(a_desc=a, b_desc=b, XS=F32, WS=F32, Y=BF16, M=2048, N=4096, K=4096,
                stride_ym=4096, PROGRAMS=132)
    k = compile_sm90(_w8a8_tma_kernel, args, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128,
                                                  GROUP_M=8, INT8=kind == "int8"),
                     num_warps=8, num_stages=3)
    assert "wgmma" in k.asm["ptx"] and "cp.async.bulk.tensor" in k.asm["ptx"], "no wgmma/TMA"


def producers(kind):
    q = torch.empty(8, dtype=CODES[kind])
    p = quant_params(kind)
    k = compile_sm90(_rms_norm_kernel, dict(X=BF16, Res=BF16, W=BF16, Out=q, ResOut=BF16,
                                            eps=1e-5, stride_x=4096, stride_r=4096,
                                            stride_o=4096, stride_ro=4096, S=F32),
                     dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, QUANT=True, PDL=True, **p),
                     num_warps=16)
    assert "griddepcontrol.wait" in k.asm["ptx"], "the early-launched norm does not wait"
    for one_pass, block, warps in ((False, 2048, 8), (True, 16384, 16)):
        compile_sm90(_silu_mul_quant_kernel, dict(X=BF16, Q=q, S=F32, stride_x=28672,
                                                  stride_q=14336, D=14336),
                     dict(BLOCK=block, ONE_PASS=one_pass, **p), num_warps=warps)
    compile_sm90(_quantize_rows_kernel, dict(X=BF16, Q=q, S=F32, K=4096, stride_xm=4096,
                                             stride_qm=4096),
                 dict(BLOCK=2048, **p), num_warps=8)


def weight_only(kind):
    """The tiled weight-only kernels (int4 / int8 codes, bf16 activations): the GEMV (one and
    three rows, split K, prefetched by hand and pipelined), the tensor-core kernel at both tile widths (one dot a code position
    where the tile is deep enough, the unpacked tile else) and the dequantizer."""
    bits = 4 if kind == "int4" else 8
    words, u8 = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.uint8)
    i32 = torch.empty(8, dtype=torch.int32)
    for block_m, split, prefetch, stages in ((1, 4, True, 1), (4, 1, False, 4)):
        k = compile_sm90(_gemv_kernel, dict(X=BF16, W=words, Scales=F32, Zeros=u8, Y=BF16, Part=F32,
                                        Count=i32, M=block_m, N=4096, K=4096, num_groups=32,
                                        stride_w=4096 * bits // 32, stride_xm=4096,
                                        stride_ym=4096, tiles_per_split=8, reg0=0),
                     dict(BITS=bits, HAS_ZEROS=True, TILE=128, GROUP_TILES=1, BLOCK_M=block_m,
                          BLOCK_N=64, SPLIT_K=split, PREFETCH=prefetch, STAGES=stages),
                     num_warps=2, num_stages=stages)
        # A pipelined loop streams its words through cp.async (else one tile in flight).
        assert ("cp.async" in k.asm["ptx"]) == (stages > 1), f"STAGES={stages}: cp.async?"
    for tile in (128, 32):
        k = compile_sm90(_int_weight_gemm_kernel,
                         dict(X=BF16, QW=words, Scales=F32, Zeros=u8, Y=BF16, M=64, N=4096, K=4096,
                              num_groups=32, stride_xm=4096, stride_qn=4096 * bits // 32,
                              stride_ym=4096, split_k=1, group=128),
                         dict(BITS=bits, HAS_ZEROS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=tile,
                              GROUP_M=8, TILED=True), num_warps=4, num_stages=3)
        assert "mma" in k.asm["ptx"], "no tensor-core instruction in the PTX"
    compile_sm90(_dequantize_kernel, dict(W=words, Scales=F32, Zeros=u8, Out=BF16, N=4096, K=4096,
                                          num_groups=32, reg0=0),
                 dict(BITS=bits, HAS_ZEROS=True, TILE=128, GROUP_TILES=1, BLOCK_N=32), num_warps=4)


def w4_mma(kind):
    """The tensor-core 4-bit GEMV (Gluon): 1, 16 and 64 rows, one or two blocks a program,
    split or not; its warpgroup twin at 16, 64 and 128 rows. Its layout conversions are asserted trivial when it compiles (no data
    between threads); the PTX must hold mma.sync and no shared-memory load in its loop."""
    from slipstream.kernels import w4_mma_gemv as w4
    from slipstream.kernels import w4_wgmma_gemm as wgk
    if not w4.HAVE_GLUON:
        raise FileNotFoundError("no Gluon in this Triton")
    from triton.experimental.gluon._runtime import GluonASTSource
    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    p = w4.pack_w4_mma(torch.zeros(256, 512, dtype=torch.uint8), torch.ones(256, 4), None)
    for m, nt, split in ((1, 1, 4), (16, 2, 1), (64, 1, 2)):
        x, y = torch.empty(m, 512, dtype=dt), torch.empty(m, 256, dtype=dt)
        args, consts = w4.kernel_args(x, p, y, torch.empty(split, m, 256),
                                      torch.zeros(8, dtype=torch.int32), nt, split)
        fn = w4._w4_mma_kernel
        sig = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in fn.arg_names}
        k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=w4.WARPS))
        ptx = k.asm["ptx"]
        assert ptx.count("mma.sync") == 8 * (nt + 1) * w4.column_blocks(m), "mma.sync count"
        # shared memory only for the split's arrival counter (one broadcast)
        assert ptx.count("ld.shared") == (split > 1), "operands through shared memory"
    stores = {}
    for m, nt, wgs, split, asmem in ((16, 1, 1, 1, False), (64, 2, 1, 4, False),
                                     (128, 1, 2, 2, False), (32, 2, 2, 1, False),
                                     (128, 1, 2, 2, True), (16, 1, 1, 1, True)):
        x, y = torch.empty(m, 512, dtype=dt), torch.empty(m, 256, dtype=dt)
        args, consts = wgk.wg_kernel_args(x, p, y, torch.empty(split, m, 256),
                                         torch.zeros(8, dtype=torch.int32), nt, wgs, split, asmem)
        fn = wgk._w4_wgmma_kernel
        sig = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in fn.arg_names}
        k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=w4.WARPS * wgs))
        ptx = k.asm["ptx"]
        assert ptx.count("wgmma.mma_async") == 8 * nt, "wgmma count"
        # ASMEM: one group's MMAs left in flight, the A tile (16 KB a warpgroup) stored to
        # shared memory by 8 more stmatrix.x4 a warp than the same launch without it
        assert ("wgmma.wait_group.sync.aligned 1;" in ptx) == asmem, "MMAs in flight"
        stores[m, nt, wgs, split, asmem] = ptx.count("stmatrix")
        if asmem:
            assert stores[m, nt, wgs, split, asmem] == stores[m, nt, wgs, split, False] + 8, \
                "A through shared memory"
        for op in ("sub", "mul"):     # zero points and scales applied in pairs
            name = f"{op}.rn.bf16x2" if kind == "bf16" else f"{op}.rn.f16x2"
            assert ptx.count(name) == 32 * nt, f"{name} count"


def decode_step(kind):
    """The decode step's fused kernels over a bf16 / int8 / fp8 cache: short-context
    decode attention (both launch configs; Llama-3-8B heads) and rotary + KV store;
    with bf16, the decode GEMV with its L2 prefetch."""
    cache = BF16 if kind == "bf16" else torch.empty(8, dtype=CODES[kind])
    scales = (BF16, BF16) if kind == "bf16" else (F32, F32)
    i32, i64 = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int64)
    for cfg in (FEW_CONFIG, MANY_CONFIG):
        cfg = dict(cfg)
        k = compile_sm90(_short_decode_kernel, dict(
            Q=BF16, KCache=cache, VCache=cache, KScale=scales[0], VScale=scales[1], Out=BF16,
            SeqLens=i32, BlockTables=i32, max_blocks=512, stride_qt=6144, stride_qh=128,
            stride_ot=4096, stride_oh=128, stride_cb=16384, stride_cs=1024, stride_ch=128,
            stride_sb=128, stride_ss=8, stride_bt=512, qk_scale=0.1),
            dict(GROUP=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=16, BLOCK_N=cfg.pop("BLOCK_N"),
                 PAGE_SIZE=16, QUANT=kind != "bf16", CHAIN=True, EARLY_KV=True,
                 TRIGGER=True), **cfg)
        assert "mma.sync" in k.asm["ptx"] and "griddepcontrol.wait" in k.asm["ptx"]
    k = compile_sm90(_rotary_store_kernel, dict(
        Q=BF16, K=BF16, V=BF16, Positions=i64, Cos=BF16, Sin=BF16, KCache=cache, VCache=cache,
        KScale=scales[0], VScale=scales[1], SlotMapping=i64, stride_qt=6144, stride_qh=128,
        stride_kt=6144, stride_kh=128, stride_vt=6144, stride_vh=128, stride_cp=128,
        stride_cb=16384, stride_cs=1024, stride_ch=128, stride_sb=128, stride_ss=8),
        dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_D=64, BLOCK_H=16, KV_PAD=8,
             PAGE_SIZE=16, QUANT=kind != "bf16", QMAX=127.0 if kind == "int8" else 448.0,
             IS_INT=kind == "int8", PDL=True, EARLY=True), num_warps=4)
    assert "griddepcontrol.wait" in k.asm["ptx"], "the early-launched rotary + store does not wait"
    if kind == "bf16":
        k = compile_sm90(_silu_mul_kernel, dict(X=BF16, Out=BF16, stride_x=28672, stride_o=14336),
                         dict(D=14336, BLOCK=1024, PDL=True), num_warps=4)
        assert "griddepcontrol.wait" in k.asm["ptx"], "the early-launched SiLU x up does not wait"
        k = compile_sm90(_dense_gemv_kernel, dict(X=BF16, W=BF16, Y=BF16, M=1, N=4096, K=4096,
                                                  stride_xm=4096, stride_wn=4096, stride_ym=4096),
                         dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, PREFETCH_K=1024, CHAIN=True),
                         num_warps=4, num_stages=4)
        assert "prefetch.global.L2" in k.asm["ptx"] and "griddepcontrol.wait" in k.asm["ptx"]


def kv_move(kind):
    """The speculation round's KV slot move over a 16-bit pool (int16 rows) or 8-bit codes."""
    pool = torch.empty(8, dtype=torch.int16 if kind == "16bit" else torch.uint8)
    i64 = torch.empty(8, dtype=torch.int64)
    k = compile_sm90(_move_rows_kernel, dict(Pool=pool, Src=i64, Dst=i64, n=6, plane_stride=1 << 32),
                     dict(ROW=192, D=8, BLOCK=256), num_warps=4)
    assert "bar.sync" in k.asm["ptx"], "no barrier between the loads and the stores"


def skinny(kind):
    """The few-row GEMM on tensor cores (61 or 16 rows)."""
    args = dict(X=BF16, W=BF16, Y=BF16, M=61, N=3072, K=576, stride_xm=576, stride_wn=576,
                stride_ym=3072)
    k = compile_sm90(_skinny_kernel, args, dict(BLOCK_M=64 if kind == "tree" else 16, BLOCK_N=32,
                                                BLOCK_K=64, EVEN_K=True, F32_DOT=False),
                     num_warps=4, num_stages=4)
    assert "mma" in k.asm["ptx"], "no tensor-core instructions in the PTX"


CHECKS = {f"{fn.__name__}-{kind}": (fn, kind) for fn in (gemm, tma_gemm, producers)
          for kind in ("int8", "fp8")}
CHECKS.update({f"weight_only-{kind}": (weight_only, kind) for kind in ("int4", "int8")})
CHECKS.update({f"decode_step-{kind}": (decode_step, kind) for kind in ("bf16", "int8", "fp8")})
CHECKS.update({f"w4_mma-{kind}": (w4_mma, kind) for kind in ("bf16", "fp16")})
CHECKS.update({f"kv_move-{kind}": (kv_move, kind) for kind in ("16bit", "8bit")})
CHECKS.update({f"skinny-{kind}": (skinny, kind) for kind in ("tree", "batch")})


def main() -> int:
    out = {}
    for name, (fn, kind) in CHECKS.items():
        try:
            fn(kind)
            out[name] = "ok"
        except FileNotFoundError as e:          # a Triton build without its ptxas
            out[name] = f"skip: {e}"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[-400:]}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
