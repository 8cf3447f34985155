"""The fused all-reduce + residual add + RMSNorm of a two-rank group
(kernels/all_reduce_norm.py), over symmetric memory.

A decode step of an 8B model at TP=2 has 64 row-parallel outputs, each summed
by an all-reduce (NCCL: 9.7 us inside a CUDA graph on the H200 pair), cast from
the fp32 partial sums to bf16 (one more kernel), then added to the residual
and normalised (one more). Here one kernel does the three: each rank pushes
its partial row into the other's inbox over NVLink and reads the other's from
its own. The row-parallel layer hands its partial on unreduced
(`layers.linear.PartialSum`) and the RMSNorm after it calls this.

Each rank allocates, collectively, an inbox of `max_rows` rows (three slots
each for "lamport") and, for "flags", a flag array in symmetric memory, and
maps the peer's. Built only for two ranks
on CUDA, where symmetric memory works, after a check at start-up that its
results equal NCCL's all-reduce + the RMSNorm kernel on both ranks (bit for
bit); anything else keeps NCCL. Rows beyond `max_rows` (prefill) use NCCL.

Two protocols: "lamport" (the data is its own signal: one one-way NVLink trip)
and "flags" (ready / free flags, release / acquire). Measured on the H200 pair
(hidden 4096, in a CUDA graph; benchmarks/tp, run 5): lamport 4.1 us, flags
6.4 us, NCCL + cast + norm 11.5 us; 8B batch-1 decode at TP=2 3.00 ms a step
(lamport), 3.14 (flags), 3.51 (NCCL), TP=1 4.48; the same tokens as NCCL.
On by default where it applies, lamport first (flags if lamport fails its
check); `SLIPSTREAM_FUSED_ALL_REDUCE_NORM=flags` uses flags, `=0` keeps NCCL,
`=reference` runs the plain-PyTorch twin on any device.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_ROWS = 64   # decode batches up to this many tokens a step; more goes to NCCL
ENV = "SLIPSTREAM_FUSED_ALL_REDUCE_NORM"
PROTOCOLS = ("lamport", "flags")


class AllReduceNorm:
    """protocol: "lamport" (kernels/all_reduce_norm_lamport.py: the data is the
    signal) or "flags" (kernels/all_reduce_norm.py: ready / free flags)."""

    def __init__(self, group, device: torch.device, hidden: int, max_rows: int = MAX_ROWS,
                 protocol: str = "lamport"):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")   # never needed here
        import torch.distributed._symmetric_memory as symm_mem
        from slipstream.kernels.all_reduce_norm import inbox_width
        from slipstream.kernels.all_reduce_norm_lamport import new_inbox
        if dist.get_world_size(group) != 2:
            raise ValueError("the fused all-reduce + RMSNorm serves two ranks")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.hidden, self.max_rows, self.protocol = hidden, max_rows, protocol
        peer = 1 - dist.get_rank(group)
        if protocol == "lamport":
            self.inbox = new_inbox(max_rows, hidden, device, symm_mem.empty)
            self.count = torch.zeros(max_rows, dtype=torch.int32, device=device)
        else:
            self.inbox = symm_mem.empty(max_rows, inbox_width(hidden), dtype=torch.float32,
                                        device=device).zero_()
            self.flags = symm_mem.empty(2 * max_rows, dtype=torch.int32, device=device)
            self.flags[:max_rows] = 0   # ready: nothing pushed yet
            self.flags[max_rows:] = 1   # free: the peer may push
            handle = symm_mem.rendezvous(self.flags, group.group_name)
            self.peer_flags = handle.get_buffer(peer, (2 * max_rows,), torch.int32)
        handle = symm_mem.rendezvous(self.inbox, group.group_name)
        self.peer_inbox = handle.get_buffer(peer, tuple(self.inbox.shape), self.inbox.dtype)
        torch.cuda.synchronize(device)
        dist.barrier(group)   # both ranks' inboxes and flags set before either pushes

    def fits_rows(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows is summed here (else by NCCL)."""
        return 0 < num_tokens <= self.max_rows

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """partial: this rank's [num_tokens, hidden]; -> (normed, sum + residual)."""
        if self.protocol == "lamport":
            from slipstream.kernels.all_reduce_norm_lamport import all_reduce_rms_norm_lamport
            return all_reduce_rms_norm_lamport(partial, residual, weight, eps, self.inbox,
                                               self.peer_inbox, self.count)
        from slipstream.kernels.all_reduce_norm import all_reduce_rms_norm
        return all_reduce_rms_norm(partial, residual, weight, eps, self.inbox, self.peer_inbox,
                                   self.flags, self.peer_flags)


class ReferenceAllReduceNorm:
    """The plain-PyTorch twin on any device (gloo too): torch.distributed's
    all-reduce, then kernels.reference.all_reduce_rms_norm. Tests the layers'
    hand-over on the CPU (SLIPSTREAM_FUSED_ALL_REDUCE_NORM=reference)."""

    def __init__(self, group, max_rows: int = MAX_ROWS):
        self.group, self.max_rows, self.calls = group, max_rows, 0

    def fits_rows(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_rows

    def __call__(self, partial, residual, weight, eps):
        from slipstream.kernels import reference
        self.calls += 1
        dist.all_reduce(partial, group=self.group)
        return reference.all_reduce_rms_norm([partial], residual, weight, eps)


def _check(op: AllReduceNorm, group, device: torch.device, dtype: torch.dtype) -> bool:
    """The fused results equal NCCL's sum + the RMSNorm kernel, over several calls."""
    from slipstream.kernels.rms_norm import rms_norm
    g = torch.Generator(device=device).manual_seed(99 + dist.get_rank(group))
    shared = torch.Generator(device=device).manual_seed(7)   # the same on both ranks
    ok = True
    for rows in (1, 3, op.max_rows, 1):
        partial = torch.randn(rows, op.hidden, generator=g, device=device)
        residual = torch.randn(rows, op.hidden, generator=shared, device=device).to(dtype)
        weight = torch.randn(op.hidden, generator=shared, device=device).to(dtype)
        out, res = op(partial, residual, weight, 1e-5)
        want = partial.clone()
        dist.all_reduce(want, group=group)
        want_out, want_res = rms_norm(want.to(dtype), weight, 1e-5, residual)
        ok &= bool(torch.equal(out, want_out) and torch.equal(res, want_res))
    return ok


def build(group, device: torch.device, hidden: int, dtype: torch.dtype
          ) -> AllReduceNorm | ReferenceAllReduceNorm | None:
    """A checked AllReduceNorm for `group` (collective: every rank calls it), or
    None where it is off, not for this group or device, unavailable, or wrong.
    SLIPSTREAM_FUSED_ALL_REDUCE_NORM: unset, "1" or "lamport" (the default; the flags
    protocol if lamport fails its check), "flags", "0" (NCCL), "reference" (the
    twin, any device)."""
    mode = os.environ.get(ENV, "lamport")
    if mode not in ("0", "1", "reference") + PROTOCOLS:
        raise ValueError(f"{ENV} must be 0, 1, flags, lamport or reference, got {mode!r}")
    if mode == "reference":
        return ReferenceAllReduceNorm(group)
    if mode == "0" or device.type != "cuda" or dist.get_world_size(group) != 2 \
            or dtype not in (torch.bfloat16, torch.float16):
        return None
    for protocol in ("flags",) if mode == "flags" else ("lamport", "flags"):
        op = _build(group, device, hidden, dtype, protocol)
        if op is not None:
            log.info("row-parallel sums + residual add + RMSNorm fused (%s, up to %d rows)",
                     protocol, op.max_rows)
            return op
    return None


def _build(group, device, hidden, dtype, protocol) -> AllReduceNorm | None:
    ok, op = 1, None
    try:
        op = AllReduceNorm(group, device, hidden, protocol=protocol)
        ok = int(_check(op, group, device, dtype))
        if not ok:
            log.warning("fused all-reduce + RMSNorm (%s) differs from NCCL + RMSNorm", protocol)
    except Exception as exc:   # no symmetric memory, no peer access, an older torch
        log.warning("fused all-reduce + RMSNorm (%s) unavailable: %s", protocol, exc)
        ok = 0
    agree = torch.tensor([ok], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)   # every rank or none
    return op if agree.item() else None
