"""Integer weights streamed at decode batch sizes: a tiled word layout, a GEMV, a dequantizer.

A batch-1 decode step reads every weight once, so a 4-bit weight can be read in a quarter
of the time of a bf16 one only if the arithmetic that turns codes into products keeps up
with the memory: 2 codes a byte, at ~4 TB/s, is 8e12 codes/s against the H200's ~3.3e13
fp32 operations/s. This kernel spends four on a code (shift, mask-and-or, subtract, fused
multiply-add) and no load beyond the weight word: the layout below lets one vector of x
serve every row a thread holds.

Tiled layout (`tile_codes`): each row's codes are cut into tiles of TILE inputs; PER =
32 // bits codes share an int32 word, a tile is KP = TILE // PER words, and word i of a tile
holds the inputs k0 + j * KP + i (j = 0..PER-1) at bits [j * bits, (j + 1) * bits). Code j
of consecutive words multiplies consecutive inputs, so the j-th products of a tile take
x[k0 + j * KP : k0 + (j + 1) * KP] as one contiguous vector. A tile lies inside one
quantization group (TILE divides the group), so a row's tile has one scale and one zero.

Codes become floats without integer-to-float conversions (a quarter of the ALU rate) and
mostly without shifts: a code is masked where it lies in the word and OR-ed with the
exponent that makes the word read as the float 2^E + code (`_centred`).

int_weight_gemv: y[m, n] = sum_k x[m, k] * (code[n, k] - zero[n, g]) * scale[n, g] for a
few rows m (decode), split over K when the output rows alone are too few programs; the
last program of a column block to finish adds the partial sums (a counter per block,
left at zero for the next call), so a call is one kernel, graph-capturable.
dequantize_tiled: the bf16/fp16 weight, for products with many rows (prefill) by cuBLAS.

Plain-PyTorch twins: reference.int_weight_linear (same product from the packed codes) and
`untile_codes` (back to codes [n, k]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)

MAX_ROWS = 4            # the GEMV's largest row block; more rows go to a tensor-core kernel


def pick_tile(k: int, group_cols: int, bits: int) -> int | None:
    """The tile width for a [*, k] weight with groups of group_cols inputs: the largest of
    128, 64, 32 dividing k and the group. None: the tiled layout does not fit."""
    if bits not in (4, 8):
        return None
    for tile in (128, 64, 32):
        if k % tile == 0 and (group_cols >= k or group_cols % tile == 0):
            return tile
    return None


def tile_codes(codes: torch.Tensor, bits: int, tile: int) -> torch.Tensor:
    """codes (integers < 2^bits, [n, k]) -> int32 words [n, k * bits // 32] in the tiled layout."""
    n, k = codes.shape
    per = 32 // bits
    kp = tile // per
    c = codes.to(torch.int64).reshape(n, k // tile, per, kp)
    shifts = (torch.arange(per, device=codes.device, dtype=torch.int64) * bits).view(1, 1, per, 1)
    words = (c << shifts).sum(dim=2)                       # [n, tiles, kp], < 2^32
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).reshape(n, k // per)


def untile_codes(words: torch.Tensor, bits: int, tile: int) -> torch.Tensor:
    """The inverse of tile_codes: int32 words [n, k / per] -> uint8 codes [n, k]."""
    n, w = words.shape
    per = 32 // bits
    kp = tile // per
    shifts = (torch.arange(per, device=words.device, dtype=torch.int64) * bits).view(1, 1, per, 1)
    c = (words.to(torch.int64).reshape(n, w // kp, 1, kp) >> shifts) & ((1 << bits) - 1)
    return c.to(torch.uint8).reshape(n, w * per)


@triton.jit
def _centred(words, high, j: tl.constexpr, zero, reg0, BITS: tl.constexpr):
    """Code j of each word minus its zero, in fp32. The code is masked where it lies and
    OR-ed with the exponent of 2^E, E = 23 - (its lowest bit): the float is then 2^E + code
    exactly, and one subtraction of 2^E + zero is left. The codes too high for that
    (from bit 20 up) are read from `high` = words >> (LOW * BITS). reg0 is a runtime 0:
    added to the exponent bits it keeps them in a register, so mask and OR are one LOP3
    (which takes one immediate) instead of two."""
    LOW: tl.constexpr = 3 if BITS == 4 else 2          # codes 0..LOW-1 read in place
    if j < LOW:
        P: tl.constexpr = j * BITS
        src = words
    else:
        P: tl.constexpr = (j - LOW) * BITS
        src = high
    E: tl.constexpr = 23 - P
    f = ((src & (((1 << BITS) - 1) << P)) | (reg0 + ((127 + E) << 23))).to(tl.float32, bitcast=True)
    return f - (zero + (1 << E))


@triton.jit
def _gemv_kernel(X, W, Scales, Zeros, Y, Part, Count, M, N, K, num_groups, stride_w, stride_xm,
                 stride_ym, tiles_per_split, reg0,
                 BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, TILE: tl.constexpr,
                 GROUP_TILES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                 PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 1):
    PER: tl.constexpr = 32 // BITS
    KP: tl.constexpr = TILE // PER
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn64 = tl.where(n_ok, rn, N - 1).to(tl.int64)      # rows past N read row N - 1, unstored
    ri = tl.arange(0, KP)
    w_rows = W + rn64[:, None] * stride_w + ri[None, :]
    s_rows = (Scales + rn64 * num_groups)[:, None]
    z_rows = (Zeros + rn64 * num_groups)[:, None]
    reg0 = reg0.to(tl.uint32)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(K // TILE, t_begin + tiles_per_split)
    # One [BLOCK_N, KP] accumulator per row of x (up to 4, unrolled: a 3-D product would
    # move the weights through shared memory to match layouts).
    acc0 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
    nxt = tl.load(w_rows + t_begin * KP, eviction_policy="evict_first")
    # STAGES > 1: tl.range pipelines the loop's loads (cp.async into shared memory,
    # STAGES - 1 tiles in flight); the launch's num_stages alone leaves this loop, which
    # has no dot, unpipelined. Measured on the H200, the unpipelined loop of 64 rows on
    # 4 warps is the fastest (enough programs in flight); pipelining serves wider tiles.
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        if PREFETCH:    # the next tile's words in flight while this one is multiplied
            words = nxt.to(tl.uint32, bitcast=True)
            nxt = tl.load(w_rows + (t + 1) * KP, mask=(t + 1) < t_end, other=0,
                          eviction_policy="evict_first")
        else:
            words = tl.load(w_rows + t * KP, eviction_policy="evict_first").to(tl.uint32,
                                                                              bitcast=True)
        high = words >> ((3 if BITS == 4 else 2) * BITS)
        g = t // GROUP_TILES if GROUP_TILES > 0 else 0        # GROUP_TILES 0: one group a row
        s = tl.load(s_rows + g)                                                  # [BN, 1]
        if HAS_ZEROS:
            z = tl.load(z_rows + g).to(tl.float32)
        else:
            z = 2 ** (BITS - 1) * 1.0
        p0 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
        p1 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
        p3 = tl.zeros((BLOCK_N, KP), dtype=tl.float32)
        x_at = X + t * TILE + ri
        for j in tl.static_range(PER):
            w = _centred(words, high, j, z, reg0, BITS)                        # [BN, KP]
            p0 += w * tl.load(x_at + j * KP).to(tl.float32)[None, :]
            if BLOCK_M > 1:
                p1 += w * tl.load(x_at + stride_xm + j * KP, mask=ri < KP * (M > 1),
                                  other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 2:
                p2 += w * tl.load(x_at + 2 * stride_xm + j * KP, mask=ri < KP * (M > 2),
                                  other=0.0).to(tl.float32)[None, :]
                p3 += w * tl.load(x_at + 3 * stride_xm + j * KP, mask=ri < KP * (M > 3),
                                  other=0.0).to(tl.float32)[None, :]
        acc0 += p0 * s
        if BLOCK_M > 1:
            acc1 += p1 * s
        if BLOCK_M > 2:
            acc2 += p2 * s
            acc3 += p3 * s
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    y = tl.sum(acc0, axis=1)[None, :]                                          # [BM, BN]
    if BLOCK_M > 1:
        y = tl.where(rm[:, None] == 1, tl.sum(acc1, axis=1)[None, :], y)
    if BLOCK_M > 2:
        y = tl.where(rm[:, None] == 2, tl.sum(acc2, axis=1)[None, :], y)
        y = tl.where(rm[:, None] == 3, tl.sum(acc3, axis=1)[None, :], y)
    out = rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(Y + out, y.to(Y.dtype.element_ty), mask=ok)
    else:
        # Partial sums [SPLIT_K, BLOCK_M, N] fp32; the last program of this column block
        # (the counter's SPLIT_K-th arrival) adds them, then puts the counter back to 0.
        part_out = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(Part + split.to(tl.int64) * BLOCK_M * N + part_out, y, mask=ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(Count + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s_ in range(0, SPLIT_K):
                total += tl.load(Part + s_ * BLOCK_M * N + part_out, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(Y + out, total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(Count + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _dequantize_kernel(W, Scales, Zeros, Out, N, K, num_groups, reg0,
                       BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, TILE: tl.constexpr,
                       GROUP_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    KP: tl.constexpr = TILE // PER
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    n_ok = rn < N
    rn64 = tl.where(n_ok, rn, 0).to(tl.int64)
    ri = tl.arange(0, KP)
    words = tl.load(W + rn64[:, None] * (K // PER) + t * KP + ri[None, :]).to(tl.uint32, bitcast=True)
    high = words >> ((3 if BITS == 4 else 2) * BITS)
    g = t // GROUP_TILES if GROUP_TILES > 0 else 0
    s = tl.load(Scales + rn64 * num_groups + g)
    if HAS_ZEROS:
        z = tl.load(Zeros + rn64 * num_groups + g).to(tl.float32)[:, None]
    else:
        z = 2 ** (BITS - 1) * 1.0
    out = Out + rn64[:, None] * K + t * TILE + ri[None, :]
    for j in tl.static_range(PER):
        w = _centred(words, high, j, z, reg0.to(tl.uint32), BITS) * s[:, None]
        tl.store(out + j * KP, w.to(Out.dtype.element_ty), mask=n_ok[:, None])


def _group_tiles(k: int, group_cols: int, tile: int) -> int:
    """Tiles per quantization group; 0 when one group covers the row."""
    return 0 if group_cols >= k else group_cols // tile


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Arrival counters, one per column block, zero between calls; one buffer per stream
    (kernels on one stream run one after the other)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < blocks:
        buf = _COUNTERS[key] = torch.zeros(max(blocks, 1 << 16), dtype=torch.int32, device=device)
    return buf


def default_gemv_config(m: int, n: int, k: int, tile: int, device: torch.device) -> dict:
    """Rows per program and the K split: enough programs for about four per SM."""
    block_n = 64
    blocks = triton.cdiv(n, block_n)
    tiles = k // tile
    sms = 132
    if device.type == "cuda":
        from slipstream.kernels.runtime import num_sms
        sms = num_sms(device.index or 0)
    split = 1
    while blocks * split < 4 * sms and tiles // (split * 2) >= 4 and split < 16:
        split *= 2
    return dict(BLOCK_N=block_n, SPLIT_K=split, num_warps=4, num_stages=1)   # the sweep's best


def int_weight_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                    qzeros: torch.Tensor | None, bits: int, group_cols: int, tile: int,
                    config: dict | None = None) -> torch.Tensor:
    """x: [m <= MAX_ROWS, k] fp16/bf16/fp32; words: int32 [n, k * bits // 32] (tile_codes);
    scales: fp32 [n, groups]; qzeros: uint8 [n, groups] or None (symmetric) -> y [m, n]."""
    m, k = x.shape
    n = words.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"int_weight_gemv: at most {MAX_ROWS} rows, got {m}")
    assert words.dtype == torch.int32 and words.shape[1] * (32 // bits) == k
    assert k % tile == 0 and (group_cols >= k or group_cols % tile == 0)
    assert x.stride(1) == 1 and words.is_contiguous() and scales.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = dict(config) if config is not None else default_gemv_config(m, n, k, tile, x.device)
    block_n, split = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    block_m = triton.next_power_of_2(m)
    blocks = triton.cdiv(n, block_n)
    tiles = k // tile
    per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, per_split)            # no empty programs
    part = y if split == 1 else torch.empty(split, block_m, n, dtype=torch.float32,
                                            device=x.device)
    count = _counters(x.device, blocks) if split > 1 else scales
    _gemv_kernel[(blocks, split)](
        x, words, scales, qzeros if qzeros is not None else scales, y, part, count,
        m, n, k, scales.shape[1], words.stride(0), x.stride(0), y.stride(0), per_split, 0,
        BITS=bits, HAS_ZEROS=qzeros is not None, TILE=tile,
        GROUP_TILES=_group_tiles(k, group_cols, tile), BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT_K=split, STAGES=cfg.get("num_stages", 1), **cfg)
    return y


def dequantize_tiled(words: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                     bits: int, group_cols: int, tile: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [n, k] in `dtype` from the tiled codes."""
    n = words.shape[0]
    k = words.shape[1] * (32 // bits)
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    block_n = 32
    _dequantize_kernel[(triton.cdiv(n, block_n), k // tile)](
        words, scales, qzeros if qzeros is not None else scales, out, n, k, scales.shape[1], 0,
        BITS=bits, HAS_ZEROS=qzeros is not None, TILE=tile,
        GROUP_TILES=_group_tiles(k, group_cols, tile), BLOCK_N=block_n, num_warps=4)
    return out
