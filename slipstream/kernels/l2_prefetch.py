"""Weights into L2 ahead of their matmul, on a side stream, while the step runs
kernels that leave the memory idle.

At batch 1 a decode step of an 8B model spends a tenth of its time in kernels
that read almost nothing from HBM: rotary + KV store and attention over a short
context (about 8 us a layer), the add + RMSNorm and SiLU * up kernels, the
split-K reductions. The weights the next matmul will stream are known in
advance and never written during a step, so a small kernel on a second stream
can ask L2 for them while those kernels run: the matmul then finds part or all
of its weight in L2 (50 MB on an H100/H200; o_proj of Llama-3-8B is 32 MiB).

`prefetch_l2(t, nbytes, every)` asks for the lines of the first `nbytes` of a
contiguous tensor (`every` = k: one line in k, spreading a partial prefetch over
the whole tensor). Lines are requested with `prefetch.global.L2`: nothing returns to registers, so the kernel is a stream of requests and ends
as soon as they are issued. `SidePrefetch` forks the side stream off the
current one (the fork point orders the prefetch after the kernels already
queued) and joins it back once, at the end of the forward, so the prefetch
never delays a kernel of the step; inside a CUDA graph capture the fork and the
join become graph edges.

No-op off CUDA (CPU steps, the Triton interpreter): a prefetch changes no
value, only where a later read finds its bytes.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slipstream.kernels.runtime import interpreting

LINE = 128            # bytes of one L2 line request
LINES_PER_PROGRAM = 1024


@triton.jit
def _prefetch_kernel(P, n_lines, step_bytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    i = tl.program_id(0) * LINES + tl.arange(0, LINES)
    i = tl.minimum(i, n_lines - 1)                    # the tail repeats the last line
    ptrs = P + i.to(tl.int64) * step_bytes
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                  "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                  "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, every: int = 1,
                evict_last: bool = False) -> int:
    """Ask L2 for the first `nbytes` of `t` (all of it: None), one 128-byte line
    in `every` (`evict_last`: lines kept before others). Returns the bytes
    requested (0 where nothing was launched)."""
    if not t.is_cuda or interpreting() or not t.is_contiguous() or t.numel() == 0:
        return 0
    size = t.numel() * t.element_size()
    span = size if nbytes is None else min(int(nbytes), size)
    step = LINE * max(1, int(every))
    n_lines = span // step
    if n_lines <= 0:
        return 0
    grid = (triton.cdiv(n_lines, LINES_PER_PROGRAM),)
    _prefetch_kernel[grid](t.view(-1).view(torch.uint8), n_lines, step,
                           LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last, num_warps=4)
    return n_lines * LINE


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a linear layer's matmul streams (its parameters and buffers,
    largest first): the weight, or packed codes with their scales."""
    ts = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
          if t is not None and t.is_cuda and t.is_contiguous()]
    return sorted(ts, key=lambda t: -t.numel() * t.element_size())


class SidePrefetch:
    """A side stream for one forward's prefetches: `fetch` forks at the current
    point of the main stream, `join` (once, at the end) makes the main stream
    wait for every prefetch issued."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.forked = False
        self.plan: dict = {}

    def ahead(self, name: str, module: torch.nn.Module) -> int:
        """Prefetch `module` (the weight called `name` in the plan) as the plan says."""
        nbytes = plan_bytes(self.plan, name)
        if nbytes is False:
            return 0
        return self.fetch(module, nbytes, int(self.plan.get("every") or 1))

    def fetch(self, module: torch.nn.Module, nbytes: int | None, every: int = 1) -> int:
        """Prefetch `module`'s tensors, at most `nbytes` in all (None: all)."""
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        self.forked = True
        left, asked = nbytes, 0
        with torch.cuda.stream(self.stream):
            for t in module_tensors(module):
                if left is not None and left <= 0:
                    break
                n = prefetch_l2(t, left, every)
                asked += n
                if left is not None:
                    left -= max(n * every, LINE)
        return asked

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.forked = False


# ---- which weights, how much ------------------------------------------------------

# Weight -> MiB asked for at its fork point (None: the whole tensor). Fork points in
# a decoder layer: o_proj after the qkv matmul (rotary, KV store and attention run
# beside it), gate_up after o_proj (add + RMSNorm beside it), down after gate_up
# (SiLU * up), the next layer's qkv after down (add + RMSNorm).
DEFAULT_PLAN = {"o_proj": None}
WEIGHTS = ("o_proj", "gate_up", "down", "qkv")


def parse_plan(text: str) -> dict[str, float | None] | None:
    """`SLIPSTREAM_L2_PREFETCH`: "0" / "" off, "1" the default plan, or
    "o_proj=all,gate_up=8,down=8,qkv=16,every=2" (MiB each; `every` k: one line
    in k of the share). Returns the plan, or None (off)."""
    text = (text or "").strip()
    if text in ("", "0"):
        return None
    if text == "1":
        return dict(DEFAULT_PLAN)
    plan: dict[str, float | None] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in WEIGHTS + ("every",) or not value:
            raise ValueError(f"SLIPSTREAM_L2_PREFETCH: expected name=MiB with name in "
                             f"{', '.join(WEIGHTS)} or every=k, got {part!r}")
        plan[name] = None if value == "all" else float(value)
    return plan


def plan_bytes(plan: dict, name: str) -> int | None | bool:
    """Bytes to ask for `name` (None: all of it), or False: not in the plan."""
    if name not in plan:
        return False
    mib = plan[name]
    return None if mib is None else int(mib * (1 << 20))


PLAN = parse_plan(os.environ.get("SLIPSTREAM_L2_PREFETCH", ""))
