"""The merge of split-KV partial results (FlashDecoding's second kernel).

Each split of a request's keys left a partial output o_s (normalised over its
keys) and the log-sum-exp lse_s of its scores (base 2); the merged output is
    out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max).
Tested through the split path (tests/kernels/test_decode_attention.py, against
reference.py's unsplit attention).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slipstream.kernels.decode_configs import MAX_SPLITS
from slipstream.kernels.attention_tile import next_pow2


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(PartO, PartLse, Out, num_splits,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    # One program per (token, head, BLOCK_D channels): many small programs, so
    # the merge costs about one L2 round trip.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if PDL:  # launched early (programmatic dependent launch): wait for the splits' writes
        gdc_wait()
        # Only now may the next split kernel launch: at the merge's start it would
        # take SM slots from the splits still streaming (measured: 67% of copy
        # bandwidth against 84% at B=1 L=32k).
        gdc_launch_dependents()
    lse = tl.load(PartLse + tok * stride_lt + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    o = tl.load(PartO + tok * stride_pt + head * stride_ph + s[:, None] * stride_ps + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.math.exp2(lse - tl.max(lse, 0))
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=d_ok)



def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 num_splits: int, head_dim: int, head_dim_pad: int, pdl: bool) -> None:
    """out[t, h] <- the merge of part_o[t, h, :num_splits] ([tokens, heads, splits, D]
    fp32) weighted by part_lse ([tokens, heads, splits] fp32). pdl: launched early
    (programmatic dependent launch) after the split kernel."""
    num_tokens, num_heads = part_o.shape[:2]
    block_d = min(32, head_dim_pad)
    _merge_splits_kernel[(num_tokens, num_heads, triton.cdiv(head_dim, block_d))](
        part_o, part_lse, out, num_splits, *part_o.stride()[:3], *part_lse.stride()[:2],
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        SPLITS_PAD=max(next_pow2(num_splits), MAX_SPLITS), PDL=pdl, num_warps=1,
        launch_pdl=pdl)


def split_kv_scratch(num_tokens: int, num_heads: int, num_splits: int, head_dim: int,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs and log-sum-exps of the splits (fp32)."""
    return (torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device))
