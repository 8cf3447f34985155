"""All-reduce of two ranks' partial rows + residual add + RMSNorm in one kernel.

At tensor parallelism 2, a row-parallel layer's output is each rank's partial
product; the sum goes through an all-reduce, then the next RMSNorm adds the
residual and normalises. Here one program per row does all of it over
peer-to-peer memory (symmetric memory mapped from the other GPU, no NVLink
multicast), as TensorRT-LLM's fused all-reduce + norm does:

    wait until the peer has read my previous push     (its "free" flag, local spin)
    write my partial row into the peer's inbox        (NVLink stores)
    raise the peer's "ready" flag (release, system scope)
    wait for my "ready" flag (acquire), read the peer's row from my own inbox
    raise the peer's "free" flag (release): it may push again
    s   = (mine + peer's, fp32).to(dtype)             (as all_reduce then .to(dtype))
    r'  = (s + residual).to(dtype)                    (kernels/rms_norm.py from here on)
    out = weight * (r' * rsqrt(mean(r'^2) + eps)).to(dtype)

A raised flag is always down when raised again: I raise the peer's "ready" for
call k only after taking my "free" of k, which the peer raised after taking its
"ready" of k-1; I raise its "free" of k only after taking my "ready" of k, which
it raised after taking its "free" of k. So only the waits spin.

Both ranks add the same two fp32 numbers, so both hold the same residual stream,
bit for bit, and the result equals `all_reduce(partial)` + `rms_norm(s, w, eps,
residual)` (kernels.reference.all_reduce_rms_norm is the twin). The flags are
per row and come in consumed pairs, so consecutive calls (and CUDA graph
replays) need no epoch counter. A wait gives up after SPIN_LIMIT_NS (30 s by the GPU's
clock: a peer that died) and leaves its row unreduced rather than hang the GPU.
On Hopper the kernel is launched early (programmatic dependent launch: as the
GEMM before it ends, its launch latency hidden): it takes its "free" flag
first, and reads nothing the earlier kernels write before `gdc_wait`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import interpreting, pdl_supported

SPIN_LIMIT_NS = 30 * 10**9   # compiled: a wait gives up after 30 s (NCCL's own limit is 120 s)
SPIN_LIMIT = 1 << 24         # interpreted: after this many tries


@triton.jit
def clock_ns(TIMED: tl.constexpr):
    """The GPU's global timer (ns) where TIMED, else 0 (the interpreter runs no PTX)."""
    if TIMED:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def waited(start, spent, TIMED: tl.constexpr):
    """How long a wait begun at `start` has lasted: ns where TIMED, else tries."""
    if TIMED:
        spent = clock_ns(TIMED) - start
    else:
        spent = spent + 1
    return spent


@triton.jit
def _take_flag(F, SPIN: tl.constexpr, SEM: tl.constexpr, TIMED: tl.constexpr):
    """Wait until the flag at F is 1 and set it back to 0."""
    v = tl.atomic_cas(F, 1, 0, sem=SEM, scope="sys")
    start = clock_ns(TIMED)
    spent = start - start
    while (v != 1) & (spent < SPIN):
        v = tl.atomic_cas(F, 1, 0, sem=SEM, scope="sys")
        spent = waited(start, spent, TIMED)


@triton.jit
def _give_flag(F):
    """Raise the flag at F (release). The protocol guarantees it is 0 by then (see
    below), so no check: the exchange's result is not waited for."""
    tl.atomic_xchg(F, 1, sem="release", scope="sys")


@triton.jit
def _all_reduce_norm_kernel(X, Res, W, Out, ResOut, Inbox, PeerInbox, Flags, PeerFlags, eps,
                            stride_x, stride_r, stride_o, stride_ro, max_rows,
                            N: tl.constexpr, BLOCK: tl.constexpr, SPIN: tl.constexpr,
                            PDL: tl.constexpr, TIMED: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # Flags: [ready x max_rows | free x max_rows] int32, this rank's and the peer's.
    _take_flag(Flags + max_rows + row, SPIN, "acquire", TIMED)    # the peer read my last push
    if PDL:   # launched early (as the GEMM before ends): wait for it before reading data
        gdc_wait()
    mine = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(PeerInbox + row.to(tl.int64) * BLOCK + cols, mine, mask=mask)
    tl.debug_barrier()                                     # every thread's stores issued
    _give_flag(PeerFlags + row)                            # release: my row is there
    _take_flag(Flags + row, SPIN, "acquire", TIMED)               # the peer's row is in my inbox
    tl.debug_barrier()
    theirs = tl.load(Inbox + row.to(tl.int64) * BLOCK + cols, mask=mask, other=0.0,
                     volatile=True)
    tl.debug_barrier()                                     # every thread has read it
    _give_flag(PeerFlags + max_rows + row)                 # the peer may push again
    add_norm_store(mine, theirs, Res, W, Out, ResOut, eps, row, cols, mask,
                   stride_r, stride_o, stride_ro, N)


@triton.jit
def add_norm_store(mine, theirs, Res, W, Out, ResOut, eps, row, cols, mask,
                   stride_r, stride_o, stride_ro, N: tl.constexpr):
    """The sum's rounding, the residual add and the norm of kernels/rms_norm.py."""
    dt = Res.dtype.element_ty
    s = (mine + theirs).to(dt)
    r = tl.load(Res + row.to(tl.int64) * stride_r + cols, mask=mask, other=0.0)
    x = (s.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(ResOut + row.to(tl.int64) * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * inv_rms).to(dt).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row.to(tl.int64) * stride_o + cols, (w * normed).to(Out.dtype.element_ty),
             mask=mask)


def spin_args(x: torch.Tensor, spin_limit: int | None) -> tuple[bool, int]:
    """(TIMED, SPIN): waits timed in ns by the GPU's clock where compiled, else
    counted in tries; spin_limit overrides the default in its unit."""
    timed = x.is_cuda and not interpreting()
    return timed, spin_limit or (SPIN_LIMIT_NS if timed else SPIN_LIMIT)


def inbox_width(hidden: int) -> int:
    """Row length of an inbox for rows of `hidden` features."""
    return next_pow2(hidden)


def all_reduce_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, inbox: torch.Tensor, peer_inbox: torch.Tensor,
                        flags: torch.Tensor, peer_flags: torch.Tensor,
                        spin_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """partial: [num_tokens, hidden] (fp32 or the model dtype), this rank's share;
    residual: [num_tokens, hidden] in the model dtype; weight: [hidden].
    inbox / peer_inbox: [max_rows, inbox_width(hidden)] fp32, this rank's and the
    peer's (mapped); flags / peer_flags: [2 * max_rows] int32, ready then free,
    initialised to 0 and 1. The peer must make the same call.
    -> (normed, partial + peer's partial + residual), both [num_tokens, hidden]."""
    num_tokens, hidden = partial.shape
    max_rows, width = inbox.shape
    if num_tokens > max_rows or width != inbox_width(hidden):
        raise ValueError(f"all_reduce_rms_norm: {num_tokens} rows of {hidden} do not fit an "
                         f"inbox of {max_rows} x {width}")
    assert partial.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    assert residual.shape == partial.shape and inbox.dtype == peer_inbox.dtype == torch.float32
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    pdl = pdl_supported(partial)
    timed, spin = spin_args(partial, spin_limit)
    if num_tokens > 0:
        _all_reduce_norm_kernel[(num_tokens,)](
            partial, residual, weight, out, res_out, inbox, peer_inbox, flags, peer_flags, eps,
            partial.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), max_rows,
            N=hidden, BLOCK=width, SPIN=spin, PDL=pdl, TIMED=timed, launch_pdl=pdl,
            num_warps=max(1, min(16, width // 256)))
    return out, res_out
