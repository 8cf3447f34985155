"""The k most likely tokens of each row of logits, with their log-probabilities.

`torch.log_softmax(x, -1).topk(k)` for the few rows an EAGLE tree level drafts
over its vocabulary (16,384 columns): on the H200 that was a log-softmax, a
sort of 256-value pieces and a sort of the pieces' winners, ~13 us a level in
the compiled round's kernel profile (benchmarks/spec/README.md). Here two
launches:

  1. a program per (row, piece of the row): the piece's max and sum of
     exp(x - max) (its share of the log-sum-exp), and its top k by k max
     reductions over one int64 key per value: the value's bits made orderable
     as a signed integer above, the complement of its column below, so the
     largest key is the largest value and, among equal values, the first
     column (what a stable descending sort gives; columns below 2^31);
  2. a program per row: the log-sum-exp from the pieces' shares, and the top k
     of the pieces' winners by the same keys; values minus the log-sum-exp.

Twin: `logp_topk_reference` (log_softmax, then a stable descending sort cut to
k). Values agree to fp32 rounding; indices agree exactly (ties to the first
column on both sides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import next_pow2

PIECE = 1024          # columns a first-stage program takes (a power of two)
MAX_K = 64


@triton.jit
def _orderable_key(x, col):
    """fp32 values and their int32 columns -> int64 keys: larger value first,
    then smaller column."""
    b = x.to(tl.int32, bitcast=True)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)              # signed order = float order
    return (s.to(tl.int64) << 32) + (0x7FFFFFFF - col.to(tl.int64))


@triton.jit
def _key_value(key):
    s = (key >> 32).to(tl.int32)
    b = s ^ ((s >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _key_column(key):
    return 0x7FFFFFFF - (key - ((key >> 32) << 32))


@triton.jit
def _top_keys(key, K: tl.constexpr, KP: tl.constexpr):
    """The K largest of the keys (distinct, or the lowest int64: none), in slots
    0..K-1 of a [KP] vector, by K max reductions."""
    j = tl.arange(0, KP)
    best = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    for i in tl.static_range(K):
        top = tl.max(key, 0)
        best = tl.where(j == i, top, best)
        key = tl.where(key == top, -9223372036854775807 - 1, key)
    return best


@triton.jit
def _piece_kernel(X, stride_x, n_cols, Keys, Max, Sum, K: tl.constexpr, KP: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    pieces = tl.num_programs(1)
    col = piece * BLOCK + tl.arange(0, BLOCK)
    ok = col < n_cols
    x = tl.load(X + row.to(tl.int64) * stride_x + col, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
    tl.store(Max + row * pieces + piece, m)
    tl.store(Sum + row * pieces + piece, s)
    key = tl.where(ok, _orderable_key(x, col), -9223372036854775807 - 1)
    best = _top_keys(key, K, KP)
    tl.store(Keys + (row * pieces + piece) * KP + tl.arange(0, KP), best)


@triton.jit
def _merge_kernel(Keys, Max, Sum, Values, Indices, pieces, K: tl.constexpr, KP: tl.constexpr,
                  PP: tl.constexpr, CP: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, PP)
    p_ok = p < pieces
    m = tl.load(Max + row * pieces + p, mask=p_ok, other=float("-inf"))
    s = tl.load(Sum + row * pieces + p, mask=p_ok, other=0.0)
    gm = tl.max(m, 0)
    lse = gm + tl.log(tl.sum(tl.where(p_ok, s * tl.exp(m - gm), 0.0), 0))
    c = tl.arange(0, CP)
    key = tl.load(Keys + row * pieces * KP + c, mask=c < pieces * KP,
                  other=-9223372036854775807 - 1)
    best = _top_keys(key, K, KP)
    j = tl.arange(0, KP)
    jk = j < K
    tl.store(Values + row * K + j, _key_value(best) - lse, mask=jk)
    tl.store(Indices + row * K + j, _key_column(best), mask=jk)


def logp_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] logits (any float dtype, last dim contiguous), 1 <= k <= min(n, 64).
    Returns (values [rows, k] fp32 log-probabilities, descending; indices [rows, k] int64)."""
    rows, n = x.shape
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"logp_topk: k must be in [1, min(columns, {MAX_K})], got {k} for {n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    block = min(PIECE, next_pow2(n))
    pieces = triton.cdiv(n, block)
    kp = next_pow2(k)
    dev = x.device
    keys = torch.empty(rows, pieces, kp, dtype=torch.int64, device=dev)
    pmax = torch.empty(rows, pieces, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    values = torch.empty(rows, k, dtype=torch.float32, device=dev)
    indices = torch.empty(rows, k, dtype=torch.int64, device=dev)
    if rows == 0:
        return values, indices
    _piece_kernel[(rows, pieces)](x, x.stride(0), n, keys, pmax, psum, K=k, KP=kp, BLOCK=block,
                                  num_warps=4 if block >= 512 else 1)
    _merge_kernel[(rows,)](keys, pmax, psum, values, indices, pieces, K=k, KP=kp,
                           PP=next_pow2(pieces), CP=next_pow2(pieces * kp), num_warps=1)
    return values, indices


def logp_topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(x, -1, dtype=torch.float32)
    s = logp.sort(dim=-1, descending=True, stable=True)
    return s.values[..., :k], s.indices[..., :k]


@torch.library.custom_op("slipstream::logp_topk", mutates_args=())
def logp_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_topk as one opaque op for torch.compile'd callers."""
    return logp_topk(x, k)


@logp_topk_op.register_fake
def _(x, k):
    rows = x.shape[0]
    return (x.new_empty(rows, k, dtype=torch.float32), x.new_empty(rows, k, dtype=torch.int64))
