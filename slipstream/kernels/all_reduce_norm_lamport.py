"""The fused all-reduce + residual add + RMSNorm of two ranks (all_reduce_norm.py)
without flags: the data is its own signal, as in TensorRT-LLM's "Lamport"
all-reduce and NCCL's LL protocol.

Each inbox row holds the marker -0.0 (bits 0x80000000) while empty. A rank
pushes its partial row into the peer's inbox (-0.0 sent as +0.0, so a written
element never reads as empty) and polls its own inbox until no element of the
row is the marker: one one-way NVLink trip, no release fence, no flag round
trip. It then marks the row empty again for a later call. Rows rotate over
three slots per row index, chosen by a per-row call count held on each GPU:
the peer can be at most one call ahead (it cannot finish call k+1 before this
rank pushed k+1, which it does after finishing k), so while this rank reads
slot k % 3 the peer writes at most slot (k+1) % 3, and slot (k+2) % 3 was
emptied at call k-1.

Sums: this rank adds its own fp32 value and the peer's as received; -0.0 sent
as +0.0 changes no sum but -0.0 + -0.0 (+0.0 here); both ranks still get the
same bits (a + b' = b + a'). The norm is kernels/rms_norm.py's, as in the flag
version. A poll gives up after 30 s (a dead peer: garbage, no hang).
On Hopper it is launched early (programmatic dependent launch) and reads
nothing before `gdc_wait`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.all_reduce_norm import (add_norm_store, clock_ns, inbox_width, spin_args,
                                                waited)
from slipstream.kernels.runtime import pdl_supported

EMPTY = -(1 << 31)   # int32 bits of -0.0
SLOTS = 3


@triton.jit
def _all_reduce_norm_lamport_kernel(X, Res, W, Out, ResOut, Inbox, PeerInbox, Count, eps,
                    stride_x, stride_r, stride_o, stride_ro, max_rows,
                    N: tl.constexpr, BLOCK: tl.constexpr, SPIN: tl.constexpr,
                    PDL: tl.constexpr, EMPTY_BITS: tl.constexpr, TIMED: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PDL:   # launched early (as the kernel before ends): wait for it before reading data
        gdc_wait()
    # This row index's calls so far (only this program writes it; read after the wait:
    # two of these kernels back to back, the count must be the earlier one's).
    k = tl.load(Count + row)
    at = ((k % 3) * max_rows + row).to(tl.int64) * BLOCK + cols
    mine = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    bits = mine.to(tl.int32, bitcast=True)
    tl.store(PeerInbox + at, tl.where(bits == EMPTY_BITS, 0, bits), mask=mask)
    got = tl.load(Inbox + at, mask=mask, other=0, volatile=True)
    start = clock_ns(TIMED)
    spent = start - start
    while (tl.max((got == EMPTY_BITS).to(tl.int32), axis=0) > 0) & (spent < SPIN):
        got = tl.load(Inbox + at, mask=mask, other=0, volatile=True)
        spent = waited(start, spent, TIMED)
    tl.debug_barrier()
    tl.store(Inbox + at, tl.full([BLOCK], EMPTY_BITS, tl.int32), mask=mask)   # for call k + 3
    tl.store(Count + row, k + 1)
    add_norm_store(mine, got.to(tl.float32, bitcast=True), Res, W, Out, ResOut, eps, row, cols,
                   mask, stride_r, stride_o, stride_ro, N)


def new_inbox(max_rows: int, hidden: int, device, alloc=torch.empty) -> torch.Tensor:
    """An empty inbox: [SLOTS * max_rows, inbox_width(hidden)] int32 of the marker.
    alloc(*size, dtype=, device=): where it lives (symmetric memory on GPUs)."""
    inbox = alloc(SLOTS * max_rows, inbox_width(hidden), dtype=torch.int32, device=device)
    return inbox.fill_(EMPTY)


def all_reduce_rms_norm_lamport(partial: torch.Tensor, residual: torch.Tensor,
                                weight: torch.Tensor, eps: float, inbox: torch.Tensor,
                                peer_inbox: torch.Tensor, count: torch.Tensor,
                                spin_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As all_reduce_norm.all_reduce_rms_norm; inbox / peer_inbox: new_inbox()'s, this
    rank's and the peer's (mapped); count: [max_rows] int32 zeros, this rank's."""
    num_tokens, hidden = partial.shape
    max_rows = count.shape[0]
    if (num_tokens > max_rows or inbox.shape != (SLOTS * max_rows, inbox_width(hidden))
            or inbox.dtype != torch.int32):
        raise ValueError(f"all_reduce_rms_norm_lamport: {num_tokens} rows of {hidden} do not "
                         f"fit an inbox of {tuple(inbox.shape)} ({max_rows} rows)")
    assert partial.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    assert residual.shape == partial.shape
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    pdl = pdl_supported(partial)
    timed, spin = spin_args(partial, spin_limit)
    if num_tokens > 0:
        width = inbox.shape[1]
        _all_reduce_norm_lamport_kernel[(num_tokens,)](
            partial, residual, weight, out, res_out, inbox, peer_inbox, count, eps,
            partial.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), max_rows,
            N=hidden, BLOCK=width, SPIN=spin, PDL=pdl, EMPTY_BITS=EMPTY, TIMED=timed,
            launch_pdl=pdl,
            num_warps=max(1, min(16, width // 256)))
    return out, res_out
