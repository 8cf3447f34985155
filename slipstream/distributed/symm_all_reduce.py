"""All-reduce of small tensors through symmetric memory: one kernel that reads
every rank's buffer over NVLink peer-to-peer and sums (PyTorch's
`symm_mem.one_shot_all_reduce`), instead of NCCL's ring or tree protocol.

A decode step of an 8B model at TP=2 runs 65 all-reduces of one [tokens,
hidden] row each (16 KiB at hidden 4096, bf16); NCCL took 17.7 us for such a
call inside a CUDA graph on the H200 pair (benchmarks/tp), 1.1 ms a step,
against 1.9 ms of weight reads per GPU. vLLM and SGLang use this same kernel
for small sums; it needs no NVLink multicast (which stays off), only
peer-to-peer access between the GPUs.

Each rank stages its tensor in a buffer allocated once, collectively, in
symmetric memory (`max_bytes`, for the model's dtype); larger tensors, other
dtypes and non-CUDA tensors go to NCCL. Built only after a check at start-up
that its sum equals NCCL's on every rank; any failure keeps NCCL. The copy in,
the kernel and its barrier are all device work, so it is captured in the
decode graphs like the NCCL call it replaces.

Off unless `SLIPSTREAM_SYMM_ALL_REDUCE=1`: it has not yet completed a run on
the H200 pair (the benchmark's all-reduce stage, which also times it, ran
past its 60 s limit in its one run there, cause not found), so NCCL stays the
default until it is measured.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 1 << 20   # decode and small prefill rows; more goes to NCCL


class SymmAllReduce:
    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = MAX_BYTES):
        # Multicast objects are never needed here; make sure none is created.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        # The model's dtype, and float32: decode steps sum fp32 partials
        # (layers/linear.py), which a buffer of the model dtype alone never took.
        self.dtypes = (dtype, torch.float32)
        self.max_bytes = max_bytes
        self.max_numel = max_bytes // torch.tensor([], dtype=dtype).element_size()
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        # The kernel reads in 16-byte vectors (a 2-byte tensor fails: "input size must be
        # at least 4-byte aligned").
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in self.dtypes and nbytes <= self.max_bytes
                and x.is_contiguous() and nbytes % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=x.view(-1))
        return x


def build(group, device: torch.device, dtype: torch.dtype) -> SymmAllReduce | None:
    """A checked SymmAllReduce for `group` (collective: every rank calls it), or
    None where it is off, unavailable, or its sum differs from NCCL's."""
    if os.environ.get("SLIPSTREAM_SYMM_ALL_REDUCE") != "1" or device.type != "cuda":
        return None
    ok, ar = 1, None
    try:
        ar = SymmAllReduce(group, device, dtype)
        g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
        for numel, dt in ((8, dtype), (4096, dtype), (ar.max_numel // 3 // 8 * 8, dtype),
                          (4096, torch.float32)):
            x = torch.randn(numel, generator=g, device=device).to(dt)
            want = x.clone()
            dist.all_reduce(want, group=group)
            got = ar(x.clone())
            torch.cuda.synchronize(device)
            if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                ok = 0
    except Exception as exc:   # no symmetric memory, no peer access, an older torch
        log.warning("symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
        ok = 0
    agree = torch.tensor([ok], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)   # every rank or none
    if not agree.item():
        return None
    log.info("small all-reduces use symmetric memory (one-shot, up to %d bytes)", MAX_BYTES)
    return ar
