"""4-bit weights at 9 to 128 rows of x by warpgroup MMA (Gluon, sm_90 only): y = x W^T.

The GEMV of w4_mma_gemv.py feeds x to mma.sync from registers, eight rows a column
block, so its work grows with the rows; from 32-64 rows it lost to bf16 cuBLAS. Here
the product is turned around: for each group of 128 inputs, the 4-bit words of 64 (or
128: two warpgroups) output rows, in the same packed layout (`pack_w4_mma`), are
unpacked and dequantized in registers, (code - zero) x scale by one packed `sub` and
one `mul` a register (inline PTX, bf16x2 or f16x2: the difference exact, one
rounding), and become wgmma's A operand; x's rows (padded to 16) are staged in
shared memory as B, their columns relabelled into the unpack's input order without
moving data. The accumulator stays fp32 across the groups; K splits add their partial
sums as the GEMV's do (the last program of a tile to finish). Launch: NT tiles a
program, WGS warpgroups (64 rows each) a tile, SPLIT, ASMEM (A staged in shared
memory so each MMA runs on while the next group is dequantized).
`quant_gemm.w4_mma_product` tunes over this kernel, the GEMV and dequantize + cuBLAS.
Measured: benchmarks/quant/README.md ("A warpgroup-MMA kernel for 9-128 rows").
"""
from __future__ import annotations

import torch

from slipstream.kernels.w4_mma_gemv import (GROUP, HAVE_GLUON, WARPS, W4Mma, _grid, _OFFSET,
                                            _output, _unpack_asm, column_blocks)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from slipstream.kernels.w4_mma_gemv import _finish, _x_group

# The unpack of w4_mma_gemv.py, then minus the zero pair and times the scale pair.
_UNPACK_SCALED_ASM = _unpack_asm(True)
UNPACK_SCALED_ASM_BF16 = _UNPACK_SCALED_ASM.replace("MAGIC", "0x43004300").replace("TYPE", "bf16x2")
UNPACK_SCALED_ASM_F16 = _UNPACK_SCALED_ASM.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2")
WG_MAX_ROWS = 128                   # rows of x (16 column blocks of 8)

if HAVE_GLUON:
    UNPACK_SCALED_ASM_BF16 = gl.constexpr(UNPACK_SCALED_ASM_BF16)
    UNPACK_SCALED_ASM_F16 = gl.constexpr(UNPACK_SCALED_ASM_F16)

    @gluon.jit
    def _stage_wg(w_ptrs, S, Z, blk, wblk, lo, nblocks, num_groups, stride_s, g, ok,
                  OFFSET: gl.constexpr, DT: gl.constexpr):
        """One tile's words [128 WGS, 8] for group g (block blk + wblk for thread p, wblk =
        p // 128; blocks past the last read as zeros), and each thread's two rows' (lo and
        lo + 8) OFFSET + zero and scale in 16 bits, for the unpack."""
        ok = ok & (blk + wblk < nblocks)
        at = (blk.to(gl.int64) * num_groups + g) * 1024
        r = g.to(gl.int64) * stride_s + blk * 64 + lo
        z0 = gl.load(Z + r, mask=ok, other=0).to(gl.float32) + OFFSET
        z1 = gl.load(Z + r + 8, mask=ok, other=0).to(gl.float32) + OFFSET
        s0 = gl.load(S + r, mask=ok, other=0.0)
        s1 = gl.load(S + r + 8, mask=ok, other=0.0)
        return (gl.load(w_ptrs + at, mask=ok[:, None], other=0, eviction_policy="evict_first"),
                z0.to(DT), z1.to(DT), s0.to(DT), s1.to(DT))

    @gluon.jit
    def _stages_wg(w_ptrs, S, Z, blk0, wblk, lo, nblocks, num_groups, stride_s, g, ok,
                   OFFSET: gl.constexpr, DT: gl.constexpr, NT: gl.constexpr,
                   WGS: gl.constexpr):
        a = _stage_wg(w_ptrs, S, Z, blk0, wblk, lo, nblocks, num_groups, stride_s, g, ok,
                      OFFSET, DT)
        if NT == 1:
            out = (a,)
        else:
            out = (a, _stage_wg(w_ptrs, S, Z, blk0 + WGS, wblk, lo, nblocks, num_groups,
                                stride_s, g, ok, OFFSET, DT))
        return out

    @gluon.jit
    def _scaled_a_tile(st, DT: gl.constexpr, A_L: gl.constexpr, WGS: gl.constexpr):
        """The A operand [64 WGS, 128] of one tile and group: the dequantized weight
        (code - zero) x scale in 16 bits (the difference exact, one rounding in the
        product), by two more packed ops a register after the unpack; the unpack's outputs
        4 c + s hold rows lo (s even) or lo + 8 (s odd)."""
        words, z0, z1, s0, s1 = st
        if DT == gl.bfloat16:
            o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
                asm=UNPACK_SCALED_ASM_BF16,
                constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                args=[words, z0[:, None], z1[:, None], s0[:, None], s1[:, None]],
                dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
                asm=UNPACK_SCALED_ASM_F16,
                constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                args=[words, z0[:, None], z1[:, None], s0[:, None], s1[:, None]],
                dtype=(gl.float16,) * 8, is_pure=True, pack=2)
        w = gl.join(gl.join(gl.join(o0, o4), gl.join(o1, o5)),
                    gl.join(gl.join(o2, o6), gl.join(o3, o7)))    # [128 WGS, 8, K0, h, q]
        if WGS == 1:
            w = gl.reshape(w, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
            w = gl.permute(w, (0, 1, 11, 2, 3, 4, 7, 8, 10, 12, 5, 6, 9))   # W_PERM
        else:   # the warpgroup bit ahead of W_PERM's rows
            w = gl.reshape(w, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
            w = gl.permute(w, (0, 1, 2, 12, 3, 4, 5, 8, 9, 11, 13, 6, 7, 10))
        w = gl.reshape(w, [64 * WGS, 128])
        return gl.convert_layout(w, A_L, assert_trivial=True)

    @gluon.jit
    def _mma_inputs(xt, MB: gl.constexpr):
        """x's group [8 MB rows, 128 columns] with its columns in the mma's input order
        (input 16 K + 8 q + 2 t + e is column 32 t + 4 K + 2 q + e; X_PERM's column bits):
        registers relabelled, no data moved."""
        xt = gl.reshape(xt, [8 * MB, 2, 2, 2, 2, 2, 2, 2])       # columns t1 t0 K2 K1 K0 q e
        xt = gl.permute(xt, (0, 3, 4, 5, 6, 1, 2, 7))            # K2 K1 K0 q t1 t0 e
        return gl.reshape(xt, [8 * MB, 128])

    @gluon.jit
    def _w4_wgmma_kernel(X, Wb, S, Z, Y, Part, Count, M, N, stride_xm, stride_s, num_groups,
                         nblocks, groups_per_split, split,
                         NT: gl.constexpr, WGS: gl.constexpr, MB: gl.constexpr,
                         SPLIT: gl.constexpr, ASMEM: gl.constexpr, OFFSET: gl.constexpr,
                         DT: gl.constexpr, MMA_L: gl.constexpr, A_L: gl.constexpr,
                         WB_L: gl.constexpr, X_L: gl.constexpr, XS_L: gl.constexpr,
                         AS_L: gl.constexpr):
        """Program (i, j): NT tiles of WGS 64-row blocks (one a warpgroup), groups of split
        j. Each group: the weight dequantized in registers as A, x (8 MB rows, columns in
        the mma's input order) as B from shared memory, accumulated over the groups in
        fp32. x has three buffers: a group's x is stored while earlier groups' are read.
        At 128 rows ptxas needs about 232 registers a thread (the accumulator 64, A 32,
        x 32 with two warpgroups): one program an SM.
        Each MMA is waited on at once: its A operand lives in registers, which the next
        group's dequantization rewrites. Left running (is_async), with the A operands kept
        alive by the wait that retires them one group later (the wait's deps), 105 of 177
        launches measured wrong on the H200 and none faster (benchmarks/quant/README.md).
        ASMEM (one tile a program) stages A in shared memory instead (two buffers, stored
        before the group's barrier), so the MMA reads no registers and is left running:
        the wait after each issue retires the previous group's, whose A and x buffers the
        next group then rewrites. Compiled and checked for sm_90 (tests/kernels/
        sm90_compile.py); not yet run on a GPU, so the engine's tuner does not weigh it."""
        pid = gl.program_id(0)
        sp = gl.program_id(1)
        g0 = sp * groups_per_split
        g1 = gl.minimum(g0 + groups_per_split, num_groups)
        x_ptrs, x_ok = _x_group(X, stride_xm, M, MB, X_L)
        xbuf = gl.allocate_shared_memory(DT, [3, 8 * MB, 128], XS_L)
        if ASMEM:
            abuf = gl.allocate_shared_memory(DT, [2, 64 * WGS, 128], AS_L)
        p = gl.arange(0, 128 * WGS, layout=gl.SliceLayout(1, WB_L))
        b = gl.arange(0, 8, layout=gl.SliceLayout(0, WB_L))
        wblk = p // 128
        w_ptrs = Wb + (wblk.to(gl.int64) * num_groups * 1024 + (p % 128) * 8)[:, None] + b[None, :]
        lo = 64 * wblk + 16 * ((p % 128) // 32) + (p // 4) % 8     # a thread's first row
        blk0 = pid * NT * WGS
        acc0 = gl.zeros([64 * WGS, 8 * MB], gl.float32, MMA_L)
        acc1 = acc0
        cur = _stages_wg(w_ptrs, S, Z, blk0, wblk, lo, nblocks, num_groups, stride_s, g0,
                         True, OFFSET, DT, NT, WGS)
        xt = gl.load(x_ptrs + g0 * 128, mask=x_ok, other=0.0)
        for g in range(g0, g1):
            nxt = _stages_wg(w_ptrs, S, Z, blk0, wblk, lo, nblocks, num_groups, stride_s,
                             g + 1, g + 1 < g1, OFFSET, DT, NT, WGS)
            buf = xbuf.index(g % 3)
            buf.store(_mma_inputs(xt, MB))
            xt = gl.load(x_ptrs + (g + 1) * 128, mask=x_ok & (g + 1 < g1), other=0.0)
            if ASMEM:     # A through shared memory: the MMA runs on while the next group
                a_s = abuf.index(g % 2)   # is dequantized; wait(1) frees the buffers of g - 1
                a_s.store(_scaled_a_tile(cur[0], DT, A_L, WGS))
            fence_async_shared()
            gl.thread_barrier()
            xs = buf.permute((1, 0))
            if ASMEM:
                acc0 = warpgroup_mma(a_s, xs, acc0, is_async=True)
                acc0 = warpgroup_mma_wait(1, deps=[acc0])
            else:
                a0 = _scaled_a_tile(cur[0], DT, A_L, WGS)
                acc0 = warpgroup_mma(a0, xs, acc0)
                if NT == 2:
                    acc1 = warpgroup_mma(_scaled_a_tile(cur[1], DT, A_L, WGS), xs, acc1)
            cur = nxt
        if ASMEM:
            acc0 = warpgroup_mma_wait(0, deps=[acc0])
        rows = gl.arange(0, 64 * WGS, layout=gl.SliceLayout(1, MMA_L))
        cols = gl.arange(0, 8 * MB, layout=gl.SliceLayout(0, MMA_L))
        _finish(acc0, Y, Part, sp, blk0 * 64, rows, cols, M, N, SPLIT)
        if NT == 2:
            _finish(acc1, Y, Part, sp, (blk0 + WGS) * 64, rows, cols, M, N, SPLIT)
        if SPLIT:
            _reduce_wg(Y, Part, Count, pid, blk0 * 64, rows, cols, M, N, split, NT, WGS, MB,
                       MMA_L)

    @gluon.jit
    def _reduce_wg(Y, Part, Count, pid, row0, rows, cols, M, N, split, NT: gl.constexpr,
                   WGS: gl.constexpr, MB: gl.constexpr, MMA_L: gl.constexpr):
        """_reduce for tiles of 64 WGS rows."""
        gl.thread_barrier()
        arrived = gl.atomic_add(Count + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            for t in gl.static_range(NT):
                n = row0 + t * 64 * WGS + rows
                ok = (n < N)[:, None] & (cols < M)[None, :]
                at = Part + cols[None, :] * N + n[:, None]
                total = gl.zeros([64 * WGS, 8 * MB], gl.float32, MMA_L)
                for s_ in range(0, split, 2):
                    a0 = gl.load(at + s_ * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                    a1 = gl.load(at + (s_ + 1) * M * N, mask=ok & (s_ + 1 < split), other=0.0,
                                 cache_modifier=".cg")
                    total += a0 + a1
                gl.store(Y + cols[None, :] * N + n[:, None], total.to(Y.dtype.element_ty), mask=ok)
            gl.atomic_xchg(Count + pid, 0, sem="relaxed", scope="gpu")


def _wg_layouts(mb: int, wgs: int, dt):
    """The warpgroup-MMA layouts for [64 WGS rows, 8 MB columns] (A from registers in the
    same per-warp fragments as mma.m16n8k16's), the word load layout [128 WGS threads, 8],
    x's load layout (32 contiguous columns a thread, its rows over lanes, warps, then
    registers) and its shared layout (B, K-major)."""
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS * wgs, 1],
                                    instr_shape=[16, 8 * mb, 16])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    wb = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4]],
        lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
        warp_bases=[[32, 0], [64, 0]] + ([[128, 0]] if wgs == 2 else []), block_bases=[],
        shape=[128 * wgs, 8])
    row_bases = [[1 << i, 0] for i in range((8 * mb).bit_length() - 1)]
    warp_bits = (WARPS * wgs).bit_length() - 1
    warps = (row_bases[3:3 + warp_bits] + [[0, 0]] * warp_bits)[:warp_bits]
    xl = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + row_bases[3 + warp_bits:],
        lane_bases=[[0, 32], [0, 64]] + row_bases[:3],
        warp_bases=warps, block_bases=[], shape=[8 * mb, 128])
    xs = gl.NVMMASharedLayout.get_default_for([8 * mb, 128], dt)
    a_s = gl.NVMMASharedLayout.get_default_for([64 * wgs, 128], dt)
    return mma, a, wb, xl, xs, a_s


def wg_kernel_args(x: torch.Tensor, p: W4Mma, y: torch.Tensor, part: torch.Tensor,
                   count: torch.Tensor, nt: int, wgs: int, split: int, asmem: bool = False):
    """Arguments and constexprs of one launch of the warpgroup kernel."""
    groups = p.k // GROUP
    per = -(-groups // split)
    mb = max(2, column_blocks(x.shape[0]))
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    mma, a, wb, xl, xs, a_s = _wg_layouts(mb, wgs, dt)
    args = dict(X=x, Wb=p.words, S=p.scales, Z=p.zeros, Y=y, Part=part, Count=count,
                M=x.shape[0], N=p.n, stride_xm=x.stride(0), stride_s=p.scales.stride(0),
                num_groups=groups, nblocks=p.words.shape[0], groups_per_split=per, split=split)
    consts = dict(NT=nt, WGS=wgs, MB=mb, SPLIT=split > 1, ASMEM=asmem,
                  OFFSET=_OFFSET[x.dtype], DT=dt,
                  MMA_L=mma, A_L=a, WB_L=wb, X_L=xl, XS_L=xs, AS_L=a_s)
    return args, consts


def wgmma_supported(x: torch.Tensor) -> bool:
    """The warpgroup kernel runs on sm_90 (Hopper) only."""
    return HAVE_GLUON and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def w4_wgmma_gemm(x: torch.Tensor, p: W4Mma, config: dict | None = None) -> torch.Tensor:
    """x [m <= 128, k] bf16/fp16 (CUDA, sm_90) -> y [m, n] = x W^T by warpgroup MMAs, the
    weight unpacked and dequantized in registers (scale rounded to 16 bits, then one
    rounding of (code - zero) x scale: the dequantized weight's precision), x staged in
    shared memory. config: NT (tiles a program: 1 or 2), WGS (warpgroups, 64 rows each,
    a tile: 1 or 2), SPLIT (K splits), ASMEM (NT=1 only: the dequantized weight staged in
    shared memory, so each MMA runs while the next group is dequantized); default_config
    when None."""
    y, cfg = _output(x, p, WG_MAX_ROWS, "w4_wgmma_gemm", config)
    if y.numel() == 0:
        return y
    nt, wgs = cfg["NT"], cfg.get("WGS", 1)
    split, programs, part, count = _grid(x, p, y, cfg["SPLIT"], nt * wgs)
    asmem = bool(cfg.get("ASMEM"))
    if asmem and nt != 1:
        raise ValueError("w4_wgmma_gemm: ASMEM takes one tile a program (NT=1)")
    args, consts = wg_kernel_args(x, p, y, part, count, nt, wgs, split, asmem)
    _w4_wgmma_kernel[(programs, split)](*args.values(), **consts, num_warps=WARPS * wgs)
    return y
