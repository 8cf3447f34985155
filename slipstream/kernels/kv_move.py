"""Move KV-cache slots: after a speculation round the accepted path's entries
go to the slots right after the root, in every layer's K and V.

The pool is [layers, 2, blocks, block_size, ...] (a KV pool or its scale pool);
for every (layer, K or V) plane the rows at slots src[i] are copied to dst[i],
all read before any is written (a source may be another move's destination).

Why a kernel: for six moved slots, `index_select` / `index_copy_` over the whole
pool (a tensor of billions of elements on a GPU) launched 28 gathers of ~5.4 us
and 28 index copies of ~2.2 us in the H200 kernel profile of an EAGLE loop round
(benchmarks/spec/README.md, "The compiled round"), ~0.2 ms of a ~1.9-ms round;
PyTorch splits such ops into pieces its 32-bit index arithmetic can address.
Here one program per plane loads the moved rows into registers, waits for all
its threads (a barrier), then stores them: one launch. Twin:
`move_rows_reference` (the two index ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import interpreting

enabled = True        # False: the twin everywhere (benchmarks compare; a failed launch sets it)


@triton.jit
def _move_rows_kernel(Pool, Src, Dst, n, plane_stride, ROW: tl.constexpr, D: tl.constexpr,
                      BLOCK: tl.constexpr):
    plane = Pool + tl.program_id(0).to(tl.int64) * plane_stride
    i = tl.arange(0, D)
    live = i < n
    src = tl.load(Src + i, mask=live, other=0)
    dst = tl.load(Dst + i, mask=live, other=0)
    for c0 in range(0, ROW, BLOCK):       # columns are independent: read all rows, then write
        c = c0 + tl.arange(0, BLOCK)
        m = live[:, None] & (c < ROW)[None, :]
        rows = tl.load(plane + src[:, None] * ROW + c[None, :], mask=m)
        tl.debug_barrier()                # every thread's loads before any thread's stores
        tl.store(plane + dst[:, None] * ROW + c[None, :], rows, mask=m)


def _raw(pool: torch.Tensor) -> torch.Tensor:
    """[planes, slots, row bytes as int16 or uint8] view of a contiguous pool."""
    planes = pool.shape[0] * pool.shape[1]
    flat = pool.reshape(planes, pool.shape[2] * pool.shape[3], -1).view(torch.uint8)
    return flat.view(torch.int16) if flat.shape[-1] % 2 == 0 else flat


def move_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              kernel: bool | None = None) -> None:
    """pool [layers, 2, blocks, block_size, ...]; src, dst [n] int64 slot indices on the
    pool's device. kernel (None: on a GPU) with a contiguous pool: one launch of the
    kernel (tests run it on a CPU under Triton's interpreter); otherwise the twin."""
    n = src.shape[0]
    if n == 0:
        return
    global enabled
    if kernel is None:
        kernel = enabled and pool.is_cuda
    if not (kernel and (pool.is_cuda or interpreting()) and pool.is_contiguous() and n <= 64):
        move_rows_reference(pool, src, dst)
        return
    raw = _raw(pool)
    row = raw.shape[-1]
    try:
        _move_rows_kernel[(raw.shape[0],)](raw, src, dst, n, raw.stride(0), ROW=row,
                                           D=max(next_pow2(n), 2),
                                           BLOCK=min(next_pow2(row), 1024))
    except Exception as e:   # noqa: BLE001 - a kernel that does not build: the twin is exact
        import warnings
        warnings.warn(f"KV slot move kernel failed, index ops from now on: {e!r}")
        enabled = False
        move_rows_reference(pool, src, dst)


def move_rows_reference(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    flat = pool.flatten(2, 3)
    if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        flat = flat.view(torch.uint8)          # (index copies lack float8 on a CPU)
    flat.index_copy_(2, dst, flat.index_select(2, src))
