"""4-bit weights at decode batch sizes on tensor cores (Gluon, sm_80+): y = x W^T for up to
64 rows of x, W int4 in groups of 128 inputs with a scale and a zero each.

The fp32 GEMV (int_weight_gemv.py) spends about five instructions a code; at 4 TB/s a
4-bit weight arrives at 8e12 codes/s, more than those instructions can take. Here a code
costs 2.6 (one 64-row block a program; its sm_90 SASS), most of them on the weight:
the weight is the A operand of mma.m16n8k16 (16 rows x 16 inputs; the rows of x, padded
to a power of two >= 8, are B), laid out in memory so that each thread's 128-bit loads
hold exactly its A fragments, and turned into 16-bit floats in registers, never through
shared memory:

  * a 32-bit word holds one fragment, eight codes: one mask-and-OR (LOP3) of the word,
    or of it shifted by 4, 8, 12, gives two codes as the 16-bit floats OFFSET + code
    (bf16 0x4300 | c = 128 + c, fp16 0x6400 | c = 1024 + c), exact;
  * the group's products then hold OFFSET + code; the group's sum of x (one more mma,
    with A all ones, shared by the program's blocks) takes out OFFSET + zero per row:
    y += scale * acc - scale * (OFFSET + zero) * sum(x), in fp32;
  * which code sits at which nibble, and which input of x it meets, is fixed by the
    kernel's reshapes: `pack_w4_mma` builds the words by the same bit moves, so each
    load, unpack and reshape is a register-only move (checked when the kernel compiles:
    the layout conversions must be trivial).

Layout of the words of one block of 64 rows (16 a warp) for one group (128 inputs):
thread p = 32 w + 4 g + t (warp w, lane 4 g + t) holds eight int32 words, word
4 K2 + 2 K1 + K0 at nibble 4 e + 2 q + h the code of row 16 w + 8 h + g and mma input
k = 16 K + 8 q + 2 t + e (K = 4 K2 + 2 K1 + K0, the mma's k-tile), which is x's column
32 t + 4 K + 2 q + e (so each thread reads x as 64 contiguous bytes).

A program takes NT consecutive blocks (1, 2 or 4). Split over K when the programs alone
are too few; the last program of a row block to finish adds the partial sums (a counter
per block, left at zero), so a call is one kernel, graph-capturable. Twins:
`emulate_w4_mma` (the kernel's arithmetic in PyTorch, from the packed words) and
reference.int_weight_linear (the plain product). Measured: benchmarks/quant/README.md.
More rows on sm_90: w4_wgmma_gemm.py (the same packed words, warpgroup MMAs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)

GROUP = 128          # inputs a group (and a program's step over K)
WARPS = 4
BLOCK_ROWS = 16 * WARPS      # rows of one block (16 a warp)

try:   # Gluon ships with Triton >= 3.5; CPU-only installs may lack the NVIDIA parts
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAVE_GLUON = True
except ImportError:   # pragma: no cover
    HAVE_GLUON = False


# ---- the bit moves shared by the packer and the kernel -------------------------------------
# One (group, row tile) after the unpack, as the kernel's tensor [128 threads, 8, 2, 2, 2]:
# thread bits (MSB first) w1 w0 g2 g1 g0 t1 t0; then the unpacked element's bits K2 K1 e
# (its word pair and its half of the 32-bit register), K0 (which word of the pair),
# h and q (which nibble pair of the word). `_unpack` and the join tree in `_a_tile` fix
# this; `pack_w4_mma` puts the codes where it reads them.
_W_BITS = ["w1", "w0", "g2", "g1", "g0", "t1", "t0", "K2", "K1", "e", "K0", "h", "q"]
_A_ROWS = ["w1", "w0", "h", "g2", "g1", "g0"]             # row 16 w + 8 h + g
_A_COLS = ["K2", "K1", "K0", "q", "t1", "t0", "e"]        # mma input 16 K + 8 q + 2 t + e
W_PERM = tuple(_W_BITS.index(b) for b in _A_ROWS + _A_COLS)
# x of one group as [8 rows, 128 columns]: row bits g2 g1 g0, column bits t1 t0 K2 K1 K0
# q e (column 32 t + 4 K + 2 q + e), to B = [128 mma inputs, 8 rows].
_X_BITS = ["g2", "g1", "g0", "t1", "t0", "K2", "K1", "K0", "q", "e"]
X_PERM = tuple(_X_BITS.index(b) for b in _A_COLS + ["g2", "g1", "g0"])
# (spelled out in the kernel, which takes them as literals)
assert W_PERM == (0, 1, 11, 2, 3, 4, 7, 8, 10, 12, 5, 6, 9)
assert X_PERM == (5, 6, 7, 8, 3, 4, 9, 0, 1, 2)
# Memory: [block, group, thread, word], the word's nibbles (MSB first) e q h.
_CODE_DIMS = ["blk", "w1", "w0", "h", "g2", "g1", "g0", "grp",
              "t1", "t0", "K2", "K1", "K0", "q", "e"]            # codes [rows, k] as bits
_WORD_DIMS = ["blk", "grp", "w1", "w0", "g2", "g1", "g0", "t1", "t0",
              "K2", "K1", "K0", "e", "q", "h"]                  # words, then nibble bits


@dataclass
class W4Mma:
    """A weight packed for the kernel: words [blocks of 64 rows, groups, 128, 8] int32,
    scales and zeros transposed to [groups, rows] (fp32, uint8), rows padded to a multiple
    of 64 with zero codes and zero scales."""
    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    n: int
    k: int


def pack_w4_mma(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> W4Mma:
    """codes uint8 [n, k] (< 16), scales fp32 [n, k / 128], zeros uint8 [n, k / 128] or
    None (symmetric: 8) -> W4Mma."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP):
        raise ValueError(f"pack_w4_mma: k={k} must be a multiple of {GROUP} with one scale a group")
    blocks = -(-n // BLOCK_ROWS)
    pad = blocks * BLOCK_ROWS - n
    groups = k // GROUP
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, 0, 0, pad))
    c = c.view(blocks, *[2] * 6, groups, *[2] * 7)
    c = c.permute(*[_CODE_DIMS.index(d) for d in _WORD_DIMS])
    c = c.reshape(blocks, groups, 128, 8, 8)                      # [.., word, nibble]
    shift = 4 * torch.arange(8, device=c.device, dtype=torch.int64)
    words = (c << shift).sum(-1)                                  # < 2^32
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    s = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad)).t().contiguous()
    z = (torch.full_like(codes[:, :groups], 8) if zeros is None else zeros).to(torch.uint8)
    z = torch.nn.functional.pad(z, (0, 0, 0, pad)).t().contiguous()
    return W4Mma(words.contiguous(), s, z, n, k)


def unpack_w4_mma(p: W4Mma) -> torch.Tensor:
    """codes uint8 [n, k] back from the packed words (the packer's inverse)."""
    blocks, groups = p.words.shape[:2]
    shift = 4 * torch.arange(8, device=p.words.device, dtype=torch.int64)
    c = (p.words.to(torch.int64)[..., None] >> shift) & 0xF         # [.., word, nibble]
    c = c.view(blocks, groups, *[2] * 13)
    c = c.permute(*[_WORD_DIMS.index(d) for d in _CODE_DIMS])
    return c.reshape(blocks * BLOCK_ROWS, groups * GROUP)[:p.n].to(torch.uint8)


def emulate_w4_mma(x: torch.Tensor, p: W4Mma, offset: float = 128.0) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (fp32): products of OFFSET + code, less
    (OFFSET + zero) x the group's sum of x, times the scale, summed over groups."""
    codes = unpack_w4_mma(p).float()                            # [n, k]
    m = x.shape[0]
    xf = x.float()
    groups = p.k // GROUP
    acc = torch.einsum("mgk,ngk->mng", xf.view(m, groups, GROUP),
                       (codes + offset).view(p.n, groups, GROUP))
    xsum = xf.view(m, groups, GROUP).sum(-1)                    # [m, groups]
    s = p.scales[:, :p.n].t()                                   # [n, groups]
    z = p.zeros[:, :p.n].t().float()
    y = (s[None] * acc - (s * (offset + z))[None] * xsum[:, None, :]).sum(-1)
    return y.to(x.dtype)


# ---- the dequantizer (products with more rows: the weight for cuBLAS) ------------------------

@triton.jit
def _dequantize_kernel(Wb, S, Z, Out, N, K, stride_s):
    """Program (block, group): the 64 x 128 weights of one block's group. Thread p of the
    GEMV held rows 16 w + 8 h + g and, for each, the 32 contiguous columns 32 t + c
    (c = 4 K + 2 q + e: word K, nibble 4 e + 2 q + h), so the output is written as rows
    of 32 contiguous values."""
    blk = tl.program_id(0)
    grp = tl.program_id(1)
    p = tl.arange(0, 128)[:, None, None]                     # thread 32 w + 4 g + t
    h = tl.arange(0, 2)[None, :, None]
    c = tl.arange(0, 32)[None, None, :]
    words = tl.load(Wb + ((blk.to(tl.int64) * (K // 128) + grp) * 128 + p) * 8 + (c >> 2))
    nib = 4 * (c & 1) + 2 * ((c >> 1) & 1) + h
    codes = ((words >> (4 * nib)) & 0xF).to(tl.float32)
    row = blk * 64 + 16 * (p >> 5) + 8 * h + ((p >> 2) & 7)
    s = tl.load(S + grp * stride_s + row)
    z = tl.load(Z + grp * stride_s + row).to(tl.float32)
    col = grp * 128 + 32 * (p & 3) + c
    tl.store(Out + row.to(tl.int64) * K + col, ((codes - z) * s).to(Out.dtype.element_ty),
             mask=row < N)


def dequantize_w4_mma(p: W4Mma, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [n, k] in `dtype` from the packed words."""
    out = torch.empty(p.n, p.k, dtype=dtype, device=p.words.device)
    _dequantize_kernel[(p.words.shape[0], p.k // GROUP)](p.words, p.scales, p.zeros, out, p.n, p.k,
                                                          p.scales.stride(0), num_warps=4)
    return out


# ---- the kernel ----------------------------------------------------------------------------

if HAVE_GLUON:
    def _layouts(mb: int):
        """The mma layouts for [64 rows, 8 MB columns], and the load layouts of a 64-row
        block's words [128 threads, 8] and of x [8 MB rows, 128 columns]."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                        instr_shape=[16, 8])
        a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        wb = gl.DistributedLinearLayout(     # a thread's 8 words in registers (2 x 128 bits)
            reg_bases=[[0, 1], [0, 2], [0, 4]],
            lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
            warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 8])
        xl = gl.DistributedLinearLayout(     # 32 contiguous columns a thread, rows 8+ registers
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]]
            + [[8 << i, 0] for i in range(mb.bit_length() - 1)],
            lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[8 * mb, 128])
        return mma, a, b, wb, xl

    @gluon.jit
    def _unpack(words, DT: gl.constexpr):
        """int32 words [128, 8] -> eight DT tensors [128, 8]: output 4 c + s of the word
        pair (2 i, 2 i + 1) is one register, nibbles s and s + 4 of word 2 i + c as
        OFFSET + code (elements 2 i and 2 i + 1), by one mask-and-OR into the mantissas
        of OFFSET (LOP3 0xEA: a & b | c)."""
        if DT == gl.bfloat16:
            out = gl.inline_asm_elementwise(
                asm=UNPACK_ASM_BF16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words],
                dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            out = gl.inline_asm_elementwise(
                asm=UNPACK_ASM_F16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words],
                dtype=(gl.float16,) * 8, is_pure=True, pack=2)
        return out

    @gluon.jit
    def _a_tile(words, DT: gl.constexpr, A_L: gl.constexpr):
        """One 64-row block's A operand [64, 128] for one group from its words [128, 8]."""
        o0, o1, o2, o3, o4, o5, o6, o7 = _unpack(words, DT)
        w = gl.join(gl.join(gl.join(o0, o4), gl.join(o1, o5)),
                    gl.join(gl.join(o2, o6), gl.join(o3, o7)))    # [128, 8, K0, h, q]
        w = gl.reshape(w, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        w = gl.permute(w, (0, 1, 11, 2, 3, 4, 7, 8, 10, 12, 5, 6, 9))   # W_PERM
        w = gl.reshape(w, [64, 128])
        return gl.convert_layout(w, A_L, assert_trivial=True)

    @gluon.jit
    def _b_tile(xt, MB: gl.constexpr, B_L: gl.constexpr):
        """x of one group [8 MB, 128] -> the B operand [128 mma inputs, 8 MB rows of x]
        (X_PERM, with the row bits above 8 ahead of g2 g1 g0)."""
        if MB == 1:
            xt = gl.permute(gl.reshape(xt, [2] * 10), (5, 6, 7, 8, 3, 4, 9, 0, 1, 2))
        elif MB == 2:
            xt = gl.permute(gl.reshape(xt, [2] * 11), (6, 7, 8, 9, 4, 5, 10, 0, 1, 2, 3))
        elif MB == 4:
            xt = gl.permute(gl.reshape(xt, [2] * 12), (7, 8, 9, 10, 5, 6, 11, 0, 1, 2, 3, 4))
        else:
            xt = gl.permute(gl.reshape(xt, [2] * 13), (8, 9, 10, 11, 6, 7, 12, 0, 1, 2, 3, 4, 5))
        return gl.convert_layout(gl.reshape(xt, [128, 8 * MB]), B_L, assert_trivial=True)

    @gluon.jit
    def _stage(w_ptrs, S, Z, blk, rows, nblocks, num_groups, stride_s, g, ok):
        """Block blk's words [128, 8], scales and zeros [64] for group g (a block past the
        last reads the last one again; it is not stored)."""
        blk = gl.minimum(blk, nblocks - 1)
        n = blk * 64 + rows
        at = (blk.to(gl.int64) * num_groups + g) * 1024
        sat = g.to(gl.int64) * stride_s
        return (gl.load(w_ptrs + at, mask=ok, other=0, eviction_policy="evict_first"),
                gl.load(S + sat + n, mask=ok, other=0.0), gl.load(Z + sat + n, mask=ok, other=0))

    @gluon.jit
    def _stages(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s, g, ok,
                NT: gl.constexpr):
        """_stage of each of the program's NT blocks."""
        a = _stage(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s, g, ok)
        if NT == 1:
            out = (a,)
        elif NT == 2:
            out = (a, _stage(w_ptrs, S, Z, blk0 + 1, rows, nblocks, num_groups, stride_s, g, ok))
        else:
            out = (a, _stage(w_ptrs, S, Z, blk0 + 1, rows, nblocks, num_groups, stride_s, g, ok),
                   _stage(w_ptrs, S, Z, blk0 + 2, rows, nblocks, num_groups, stride_s, g, ok),
                   _stage(w_ptrs, S, Z, blk0 + 3, rows, nblocks, num_groups, stride_s, g, ok))
        return out

    @gluon.jit
    def _group_sum(y, st, bt, xsum, zero, OFFSET: gl.constexpr, DT: gl.constexpr,
                   A_L: gl.constexpr):
        """y + one group's products for a 64-row block (st: its words, scales, zeros):
        scale x (sum of (OFFSET + code) x) less scale x (OFFSET + zero) x sum(x)."""
        words, s, z = st
        acc = mma_v2(_a_tile(words, DT, A_L), bt, zero)
        sz = s * (OFFSET + z.to(gl.float32))
        return y + s[:, None] * acc - sz[:, None] * xsum

    @gluon.jit
    def _accumulate(ys, st, bt, xsum, zero, OFFSET: gl.constexpr, DT: gl.constexpr,
                    A_L: gl.constexpr, NT: gl.constexpr):
        y0 = _group_sum(ys[0], st[0], bt, xsum, zero, OFFSET, DT, A_L)
        if NT == 1:
            out = (y0,)
        elif NT == 2:
            out = (y0, _group_sum(ys[1], st[1], bt, xsum, zero, OFFSET, DT, A_L))
        else:
            out = (y0, _group_sum(ys[1], st[1], bt, xsum, zero, OFFSET, DT, A_L),
                   _group_sum(ys[2], st[2], bt, xsum, zero, OFFSET, DT, A_L),
                   _group_sum(ys[3], st[3], bt, xsum, zero, OFFSET, DT, A_L))
        return out

    @gluon.jit
    def _x_group(X, stride_xm, M, MB: gl.constexpr, X_L: gl.constexpr):
        """Pointers to the first group of x's 8 MB rows [8 MB, 128] and their mask (rows
        past M read as zeros); group g is at + 128 g."""
        xm = gl.arange(0, 8 * MB, layout=gl.SliceLayout(1, X_L))
        xk = gl.arange(0, 128, layout=gl.SliceLayout(0, X_L))
        return X + xm[:, None] * stride_xm + xk[None, :], (xm < M)[:, None] & (xk < 128)[None, :]

    @gluon.jit
    def _w4_mma_kernel(X, Wb, S, Z, Y, Part, Count, M, N, stride_xm, stride_s, num_groups,
                       nblocks, groups_per_split, split,
                       NT: gl.constexpr, MB: gl.constexpr, SPLIT: gl.constexpr,
                       DEPTH: gl.constexpr, PDL: gl.constexpr, OFFSET: gl.constexpr,
                       DT: gl.constexpr,
                       MMA_L: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                       WB_L: gl.constexpr, X_L: gl.constexpr):
        """Program (i, j): 64-row blocks NT i .. NT i + NT - 1, groups of split j; each
        group's words, scales and zeros are requested DEPTH groups ahead of their use.
        PDL: launched while the kernel before still runs (programmatic dependent launch);
        the first groups' weights, which no kernel writes, are requested before waiting
        for it, x and every write after."""
        pid = gl.program_id(0)
        sp = gl.program_id(1)
        g0 = sp * groups_per_split
        g1 = gl.minimum(g0 + groups_per_split, num_groups)
        x_ptrs, x_ok = _x_group(X, stride_xm, M, MB, X_L)
        p = gl.arange(0, 128, layout=gl.SliceLayout(1, WB_L))
        b = gl.arange(0, 8, layout=gl.SliceLayout(0, WB_L))
        w_ptrs = Wb + p[:, None] * 8 + b[None, :]
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_L))
        blk0 = pid * NT
        ones = gl.full([64, 128], 1.0, DT, A_L)
        zero = gl.zeros([64, 8 * MB], gl.float32, MMA_L)
        y = gl.zeros([64, 8 * MB], gl.float32, MMA_L)
        if NT == 1:
            ys = (y,)
        elif NT == 2:
            ys = (y, y)
        else:
            ys = (y, y, y, y)
        pipe = (_stages(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s, g0, True, NT),)
        if DEPTH > 1:
            pipe = pipe + (_stages(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s,
                                   g0 + 1, g0 + 1 < g1, NT),)
        if DEPTH > 2:
            pipe = pipe + (_stages(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s,
                                   g0 + 2, g0 + 2 < g1, NT),)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        for g in range(g0, g1):
            cur = pipe[0]
            nxt = _stages(w_ptrs, S, Z, blk0, rows, nblocks, num_groups, stride_s, g + DEPTH,
                          g + DEPTH < g1, NT)
            if DEPTH == 1:
                pipe = (nxt,)
            elif DEPTH == 2:
                pipe = (pipe[1], nxt)
            else:
                pipe = (pipe[1], pipe[2], nxt)
            # x is read by every program (an L2 hit): loaded in the step that uses it, as
            # a value carried over the loop would be repacked (PRMT) for the mma
            bt = _b_tile(gl.load(x_ptrs + g * 128, mask=x_ok, other=0.0), MB, B_L)
            xsum = mma_v2(ones, bt, zero)                     # the group's sum of x, every row
            ys = _accumulate(ys, cur, bt, xsum, zero, OFFSET, DT, A_L, NT)
        cols = gl.arange(0, 8 * MB, layout=gl.SliceLayout(0, MMA_L))
        for t in gl.static_range(NT):
            _finish(ys[t], Y, Part, sp, blk0 * 64 + t * 64, rows, cols, M, N, SPLIT)
        if SPLIT:
            _reduce(Y, Part, Count, pid, blk0 * 64, rows, cols, M, N, split, NT, MB, MMA_L)

    @gluon.jit
    def _finish(y, Y, Part, sp, row0, rows, cols, M, N, SPLIT: gl.constexpr):
        """This program's sums for 64 rows: the output (no split) or its partial [M, N]."""
        n = row0 + rows
        ok = (n < N)[:, None] & (cols < M)[None, :]
        at = cols[None, :] * N + n[:, None]
        if SPLIT:
            gl.store(Part + sp.to(gl.int64) * M * N + at, y, mask=ok)
        else:
            gl.store(Y + at, y.to(Y.dtype.element_ty), mask=ok)

    @gluon.jit
    def _reduce(Y, Part, Count, pid, row0, rows, cols, M, N, split, NT: gl.constexpr,
                MB: gl.constexpr, MMA_L: gl.constexpr):
        """The last program of a row block to finish adds the partial sums (four loads in
        flight at a time), then puts the counter back to zero."""
        gl.thread_barrier()
        arrived = gl.atomic_add(Count + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            for t in gl.static_range(NT):
                n = row0 + t * 64 + rows
                ok = (n < N)[:, None] & (cols < M)[None, :]
                at = Part + cols[None, :] * N + n[:, None]
                step = M * N
                total = gl.zeros([64, 8 * MB], gl.float32, MMA_L)
                for s_ in range(0, split, 4):
                    a0 = gl.load(at + s_ * step, mask=ok, other=0.0, cache_modifier=".cg")
                    a1 = gl.load(at + (s_ + 1) * step, mask=ok & (s_ + 1 < split), other=0.0,
                                 cache_modifier=".cg")
                    a2 = gl.load(at + (s_ + 2) * step, mask=ok & (s_ + 2 < split), other=0.0,
                                 cache_modifier=".cg")
                    a3 = gl.load(at + (s_ + 3) * step, mask=ok & (s_ + 3 < split), other=0.0,
                                 cache_modifier=".cg")
                    total += (a0 + a1) + (a2 + a3)
                gl.store(Y + cols[None, :] * N + n[:, None], total.to(Y.dtype.element_ty), mask=ok)
            gl.atomic_xchg(Count + pid, 0, sem="relaxed", scope="gpu")


def _unpack_asm(scaled: bool) -> str:
    """PTX: two words of eight 4-bit codes -> eight 16-bit pairs MAGIC + code (lop3 ORs the
    nibbles of 0x000F000F into the magic's mantissa); scaled: then minus the zero pair
    ($10 even outputs, $11 odd) and times the scale pair ($12, $13)."""
    dst = ["c%d" % i for i in range(8)] if scaled else ["$%d" % i for i in range(8)]
    src = ["$8", "a4", "a8", "a12", "$9", "b4", "b8", "b12"]
    lines = [".reg .b32 a4, a8, a12, b4, b8, b12, m%s;" % (", " + ", ".join(dst) if scaled else ""),
             "mov.b32 m, MAGIC;"]
    lines += ["shr.b32 %s%d, $%d, %d;" % (r, b, w, b) for r, w in (("a", 8), ("b", 9))
              for b in (4, 8, 12)]
    lines += ["lop3.b32 %s, %s, 0x000F000F, m, 0xEA;" % (d, s_) for d, s_ in zip(dst, src)]
    if scaled:
        lines += ["sub.rn.TYPE c%d, c%d, $%d;" % (i, i, 10 + i % 2) for i in range(8)]
        lines += ["mul.rn.TYPE $%d, c%d, $%d;" % (i, i, 12 + i % 2) for i in range(8)]
    return "{\n    " + "\n    ".join(lines) + "\n}"


_UNPACK_ASM = _unpack_asm(False)
UNPACK_ASM_BF16 = _UNPACK_ASM.replace("MAGIC", "0x43004300")     # 128 + code
UNPACK_ASM_F16 = _UNPACK_ASM.replace("MAGIC", "0x64006400")      # 1024 + code
if HAVE_GLUON:
    UNPACK_ASM_BF16, UNPACK_ASM_F16 = gl.constexpr(UNPACK_ASM_BF16), gl.constexpr(UNPACK_ASM_F16)
_OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0}    # the unpack's 16-bit floats
MAX_ROWS = 64                                               # 8 column blocks of 8
# Early launch (PDL) measured on the H200: no faster alone, 3% slower through the engine
# (bench_w4_mma.py --quick, bench_decode_step.py :nopdl); off unless SLIPSTREAM_W4_MMA_PDL=1.
_PDL = os.environ.get("SLIPSTREAM_W4_MMA_PDL", "0") not in ("", "0")


def column_blocks(m: int) -> int:
    """Column blocks of 8 for m rows of x: a power of two."""
    return 1 << max(0, -(-m // 8) - 1).bit_length()


def default_config(p: W4Mma, m: int, sms: int) -> dict:
    """64-row blocks a program (NT) and the K split: measured on the H200 at batch 1
    (bench_w4_mma.py, commit fb14c1b), one block a program with a split giving about four
    programs an SM is the sweep's best on three Llama-3-8B shapes and 6% from it on
    o_proj (whose best, half that split, is among the tuner's candidates)."""
    blocks = p.words.shape[0]
    groups = p.k // GROUP
    split = 1
    while blocks * split < 4 * sms and groups // (split * 2) >= 2:
        split *= 2
    return dict(NT=1, SPLIT=split, DEPTH=1)


def kernel_args(x: torch.Tensor, p: W4Mma, y: torch.Tensor, part: torch.Tensor,
                count: torch.Tensor, nt: int, split: int, depth: int = 1, pdl: bool = False):
    """Arguments and constexprs of one launch (shared by the launcher and the sm_90
    compile check)."""
    groups = p.k // GROUP
    per = -(-groups // split)
    mb = column_blocks(x.shape[0])
    mma, a, b, wb, xl = _layouts(mb)
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    args = dict(X=x, Wb=p.words, S=p.scales, Z=p.zeros, Y=y, Part=part, Count=count,
                M=x.shape[0], N=p.n, stride_xm=x.stride(0), stride_s=p.scales.stride(0),
                num_groups=groups, nblocks=p.words.shape[0], groups_per_split=per, split=split)
    consts = dict(NT=nt, MB=mb, SPLIT=split > 1, DEPTH=depth, PDL=pdl, OFFSET=_OFFSET[x.dtype],
                  DT=dt, MMA_L=mma, A_L=a, B_L=b, WB_L=wb, X_L=xl)
    return args, consts


def _output(x: torch.Tensor, p: W4Mma, max_rows: int, name: str, config: dict | None):
    """Checks x against the weight; the empty output and the launch's config."""
    from slipstream.kernels.runtime import num_sms
    m, k = x.shape
    if m > max_rows or k != p.k or x.dtype not in _OFFSET or x.stride(1) != 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} against k={p.k}: at most "
                         f"{max_rows} rows, bf16/fp16, unit column stride")
    y = torch.empty(m, p.n, dtype=x.dtype, device=x.device)
    return y, (config or (default_config(p, m, num_sms(x.device.index or 0)) if m else None))


def _grid(x: torch.Tensor, p: W4Mma, y: torch.Tensor, split: int, blocks_per_program: int):
    """(splits with no empty program, programs, partial sums' buffer, arrival counters)."""
    from slipstream.kernels.int_weight_gemv import _counters
    groups = p.k // GROUP
    split = -(-groups // -(-groups // split))
    programs = -(-p.words.shape[0] // blocks_per_program)
    part = y if split == 1 else torch.empty(split, *y.shape, dtype=torch.float32, device=x.device)
    return split, programs, part, _counters(x.device, programs) if split > 1 else p.scales


def w4_mma_gemv(x: torch.Tensor, p: W4Mma, config: dict | None = None) -> torch.Tensor:
    """x [m <= 64, k] bf16/fp16 (CUDA, sm_80+) -> y [m, n] = x W^T. config: NT (64-row
    blocks a program: 1, 2 or 4), SPLIT (K splits), DEPTH (groups loaded ahead: 1-3),
    PDL (launched early where the GPU allows; default off, see _PDL); default_config
    when None."""
    from slipstream.kernels.runtime import pdl_supported
    y, cfg = _output(x, p, MAX_ROWS, "w4_mma_gemv", config)
    if y.numel() == 0:
        return y
    nt, depth = cfg["NT"], cfg.get("DEPTH", 1)
    split, programs, part, count = _grid(x, p, y, cfg["SPLIT"], nt)
    pdl = pdl_supported(x) and cfg.get("PDL", _PDL)
    args, consts = kernel_args(x, p, y, part, count, nt, split, depth, pdl)
    _w4_mma_kernel[(programs, split)](*args.values(), **consts, num_warps=WARPS, launch_pdl=pdl)
    return y
