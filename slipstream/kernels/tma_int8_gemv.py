"""One row times an 8-bit weight-only (w8a16) layer on Hopper, in Gluon: kernels/tma_gemv.py's
structure over the codes of kernels/int_weight_gemv.py's tiled word layout.

y[n] = scale[n] * sum_k (code[n, k] - zero[n]) * x[k], one group a row (per-channel
scales; zero 128 for symmetric codes). The codes stay in the engine's tiled int32 words
(`tile_codes`, tiles of 128 inputs: word i of a tile holds inputs k0 + j * 32 + i in its
byte j), so a TMA box of [BLOCK_N, 64] words is two tiles, 256 inputs of BLOCK_N rows.
A program owns BLOCK_N rows and streams their words through a ring of STAGES slots, the
first copies issued before the wait on the kernel ahead (programmatic dependent launch).
x is staged once in shared memory already permuted to the words' order (row 4 t + j holds
the inputs byte j of box t's words multiply), so each byte of a word meets a contiguous
vector. A code becomes a float with no integer conversion: OR-ed into the low byte of
2^23's bits it reads as 2^23 + code, and one subtraction of 2^23 + zero leaves code - zero
exactly; per byte that is a shift, a mask-and-or, a subtraction and a multiply-add.

sm_90 only; the plain-PyTorch twin is reference.int_weight_linear over the untiled codes.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from slipstream.kernels.runtime import capability, num_sms
from slipstream.kernels.tma_gemv import DTYPES, _issue, _ring, descriptor

TILE = 128            # inputs a tile of the word layout (tile_codes)
BOX_WORDS = 64        # words a TMA box row: two tiles
DEFAULT_CONFIG = {"BLOCK_N": 16, "STAGES": 8, "num_warps": 4, "PROGRAMS": 0}
K_MAX = 16384


@gluon.jit(do_not_specialize=["N", "K"])
def _int8_gemv_kernel(w_desc, X, Scales, Zeros, Y, N, K,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SYM: gl.constexpr,
                      X_ROWS: gl.constexpr, CHAIN: gl.constexpr, num_warps: gl.constexpr):
    BW: gl.constexpr = 64                       # words a box row (BOX_WORDS)
    tile: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    vec: gl.constexpr = gl.SliceLayout(0, tile)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_k = gl.cdiv(K, 4 * BW)
    total = gl.cdiv(gl.cdiv(N, BLOCK_N) - pid, G) * n_k
    bufs, ready = _ring(w_desc, total, pid, G, n_k, BLOCK_N, BW, STAGES, CHAIN)  # codes ahead of the wait
    # x in the words' order: row 4 t + j, column i <- x[256 t + 128 (i // 32) + 32 j + i % 32]
    r = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, tile))
    i = gl.arange(0, BW, layout=vec)
    k2 = (r[:, None] // 4) * (4 * BW) + (i[None, :] // 32) * 128 + (r[:, None] % 4) * 32 + i[None, :] % 32
    x = gl.load(X + k2, mask=k2 < K, other=0.0)
    x_smem = gl.allocate_shared_memory(x.dtype, [X_ROWS, BW], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), x)
    x_rows = x_smem._reinterpret(x.dtype, [X_ROWS, BW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    gl.thread_barrier()
    n_out = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile))
    acc = gl.zeros([BLOCK_N, BW], gl.float32, tile)
    blk = pid
    bias = gl.full([BLOCK_N], 8388736.0, gl.float32, gl.SliceLayout(1, tile))  # 2^23 + 128
    if not SYM:
        z = gl.load(Zeros + blk * BLOCK_N + n_out, mask=blk * BLOCK_N + n_out < N, other=0)
        bias = 8388608.0 + z.to(gl.float32)
    for t in range(total):
        s = t % STAGES
        kk = t % n_k
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        words = bufs.index(s).load(tile)
        gl.thread_barrier()  # every warp has its words of slot s: refill it
        _issue(w_desc, bufs, ready, t + STAGES, total, pid, G, n_k, BLOCK_N, BW, STAGES)
        for j in gl.static_range(4):
            xj = x_rows.index(kk * 4 + j).load(vec).to(gl.float32)
            code = ((words >> (8 * j)) & 0xFF) | 0x4B000000      # the float 2^23 + code
            acc += (code.to(gl.float32, bitcast=True) - bias[:, None]) * xj[None, :]
        if kk == n_k - 1:  # a row block is done
            n = blk * BLOCK_N + n_out
            ok = n < N
            y = gl.sum(acc, axis=1) * gl.load(Scales + n, mask=ok, other=0.0)
            gl.store(Y + n, y.to(Y.dtype.element_ty), mask=ok)
            acc = gl.zeros([BLOCK_N, BW], gl.float32, tile)
            blk += G
            if not SYM:
                z = gl.load(Zeros + blk * BLOCK_N + n_out, mask=blk * BLOCK_N + n_out < N, other=0)
                bias = 8388608.0 + z.to(gl.float32)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))


def check_inputs(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None) -> None:
    """ValueError unless x is one 16-bit row on an sm_90 GPU and words / scales / zeros an
    8-bit per-channel layer in the tiled word layout of 128-input tiles."""
    if not (x.is_cuda and capability(x.device.index or 0)[0] == 9):
        raise ValueError("tma_int8_gemv needs an sm_90 GPU (TMA, mbarriers)")
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in DTYPES:
        raise ValueError(f"tma_int8_gemv: x must be one 16-bit row, got {tuple(x.shape)} {x.dtype}")
    n, kw = words.shape
    k = x.shape[1]
    if words.dtype != torch.int32 or not words.is_contiguous() or kw * 4 != k or k % TILE:
        raise ValueError(f"tma_int8_gemv: 8-bit words [N, K / 4] of 128-input tiles, K % 128 == 0; "
                         f"got {tuple(words.shape)} {words.dtype} for K = {k}")
    if k > K_MAX:
        raise ValueError(f"tma_int8_gemv: at most {K_MAX} inputs, got {k}")
    if scales.reshape(-1).numel() != n or (zeros is not None and zeros.reshape(-1).numel() != n):
        raise ValueError("tma_int8_gemv: one scale (and zero) a row: per-channel groups only")


def tma_int8_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                  chain: bool = False, config: dict | None = None,
                  descriptors: dict | None = None) -> torch.Tensor:
    """x [1, K] times the 8-bit layer (words [N, K / 4] from tile_codes(codes, 8, 128),
    scales [N] or [N, 1] fp32, zeros [N] uint8 or None for symmetric codes) -> [1, N].
    descriptors: where the words' TMA descriptor is kept (tma_gemv.descriptors_of)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    check_inputs(x, words, scales, zeros)
    n, k = words.shape[0], x.shape[1]
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    boxes = -(-k // (4 * BOX_WORDS))
    blocks = -(-n // cfg["BLOCK_N"])
    per_sm = cfg["PROGRAMS"]
    grid = (blocks if not per_sm else min(blocks, per_sm * num_sms(x.device.index or 0)),)
    scales = scales.reshape(-1)
    desc = descriptor(words, [cfg["BLOCK_N"], BOX_WORDS], descriptors)
    _int8_gemv_kernel[grid](desc, x.contiguous(), scales,
                            zeros.reshape(-1) if zeros is not None else scales, y, n, k,
                            BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], SYM=zeros is None,
                            X_ROWS=4 * (1 << (boxes - 1).bit_length()), CHAIN=chain,
                            num_warps=cfg["num_warps"], launch_pdl=chain)
    return y
