"""CPU products with GGUF-quantized weights (launchers for `cpu_quant.c`).

A `QuantMatrix` is a weight W [rows, cols] kept in GGUF's block layout: one or
more segments (the q/k/v or gate/up shards of a fused layer, each in its own
format) stacked along the rows. Each segment's data is a uint8 tensor
[seg_rows, row_bytes], often a view of the memory-mapped file.

    y = qm.matmul(x)          # x: [m, cols] fp32 -> [m, rows] fp32
    w = qm.dequantize()       # [rows, cols] fp32
    e = qm.get_rows(ids)      # ids: [n] int64 -> [n, cols] fp32

Every m runs the kernel: x is quantized to int8 blocks once, and each weight
block meets four rows of x while it sits in registers. The twins in
`cpu_reference.py` dequantize with the `gguf` package's numpy code.
"""
from __future__ import annotations

import ctypes
import sys

import torch

from slipstream.kernels import cpu_library

# ggml type id -> (elements per block, bytes per block)
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34),
          12: (256, 144), 13: (256, 176), 14: (256, 210)}
QUANTIZED = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
Q4X16, Q8X16 = 100, 101    # Q4_0 / Q4_1 and Q8_0 repacked by cpu_q4x16.c / cpu_q8x16.c (kernel-internal)


class _Arena:
    """Memory for repacked weights: views into large blocks that Linux backs with
    2 MiB pages (madvise MADV_HUGEPAGE), so streaming ~100 MB of weights a token
    walks ~50 page-table entries instead of ~25,000 (measured on the default model,
    all products of a decode step at 1 thread: ~10% faster than on 4 KiB pages)."""
    BLOCK = 64 << 20
    HUGE = 2 << 20

    def __init__(self):
        self.base: torch.Tensor | None = None
        self.free = 0
        self._madvise = None
        if sys.platform.startswith("linux"):
            try:
                self._madvise = ctypes.CDLL(None, use_errno=True).madvise
                self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                self._madvise = None

    def take(self, nbytes: int) -> torch.Tensor:
        # -> uint8 [nbytes], 64-byte aligned, untouched (pages arrive as it is written)
        nbytes = (nbytes + 63) // 64 * 64
        if self.base is None or self.free + nbytes > self.base.numel():
            size = max(self.BLOCK, nbytes) + self.HUGE
            self.base = torch.empty(size, dtype=torch.uint8)
            ptr = self.base.data_ptr()
            self.free = (-ptr) % self.HUGE              # start on a 2 MiB boundary
            if self._madvise is not None:
                self._madvise(ptr + self.free, (size - self.free) // self.HUGE * self.HUGE, 14)  # MADV_HUGEPAGE
        out = self.base[self.free:self.free + nbytes]
        self.free += nbytes
        return out


_arena = _Arena()


def row_bytes(qtype: int, cols: int) -> int:
    qk, nbytes = BLOCKS[qtype]
    if cols % qk:
        raise ValueError(f"{cols} columns is not a whole number of {qk}-element blocks")
    return cols // qk * nbytes


class QuantMatrix:
    def __init__(self, segments: list[tuple[int, torch.Tensor]], cols: int):
        """segments: (ggml type id, uint8 [seg_rows, row_bytes]) in output order."""
        lib = cpu_library.load()
        if lib is None:
            raise RuntimeError(f"CPU kernels unavailable: {cpu_library.error()}")
        if not 1 <= len(segments) <= 8:
            raise ValueError("a QuantMatrix holds 1 to 8 segments")
        self.cols = cols
        self.segments = []
        for qtype, data in segments:
            if qtype not in BLOCKS:
                raise ValueError(f"ggml type {qtype} has no CPU kernel")
            data = data.contiguous()
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(qtype, cols):
                raise ValueError(f"segment of type {qtype}: expected uint8 [rows, {row_bytes(qtype, cols)}], "
                                 f"got {data.dtype} {tuple(data.shape)}")
            self.segments.append((qtype, data))
        self.rows = sum(d.shape[0] for _, d in self.segments)
        self._lib = lib
        # what the products read: Q4_0 / Q4_1 / Q8_0 repacked for 16 rows at a time where
        # every segment has whole groups of 16 rows, else the file's blocks
        self.kernel_segments = self.segments
        if all(d.shape[0] % 16 == 0 for _, d in self.segments) and cols % 32 == 0:
            self.kernel_segments = [self._repack(q, d) if q in (2, 3, 8) else (q, d) for q, d in self.segments]
        n = len(self.segments)
        # argument arrays built once; the data tensors they point into live in kernel_segments
        self._types = (ctypes.c_int * n)(*[q for q, _ in self.kernel_segments])
        self._ptrs = (ctypes.c_void_p * n)(*[d.data_ptr() for _, d in self.kernel_segments])
        self._rows = (ctypes.c_int64 * n)(*[d.shape[0] for _, d in self.kernel_segments])

    def _repack(self, qtype: int, data: torch.Tensor) -> tuple[int, torch.Tensor]:
        # -> (kernel type, uint8 [rows, row_bytes]: 16 rows' blocks interleaved)
        if qtype == 8:
            out = _arena.take(data.numel())[:data.numel()].view(data.shape)
            rc = self._lib.ss_repack_q8x16(data.data_ptr(), data.shape[0], self.cols, out.data_ptr())
            kind = Q8X16
        else:   # Q4_0 gains an offset: 20 bytes a block, as Q4_1
            n = data.shape[0] * (self.cols // 32 * 20)
            out = _arena.take(n)[:n].view(data.shape[0], self.cols // 32 * 20)
            rc = self._lib.ss_repack_q4x16(qtype, data.data_ptr(), data.shape[0], self.cols, out.data_ptr())
            kind = Q4X16
        assert rc == 0, "repacking rejected its arguments"
        return kind, out

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.segments)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [m, cols] fp32 -> [m, rows] fp32
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == self.cols
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.rows, dtype=torch.float32)
        rc = self._lib.ss_matmul(len(self.segments), self._types, self._ptrs, self._rows, self.cols,
                                 x.data_ptr(), m, y.data_ptr(), self.rows)
        assert rc == 0, "ss_matmul rejected its arguments"
        return y

    def dequantize(self) -> torch.Tensor:
        # -> [rows, cols] fp32
        out = torch.empty(self.rows, self.cols, dtype=torch.float32)
        r = 0
        for qtype, data in self.segments:
            n = data.shape[0]
            rc = self._lib.ss_dequant(qtype, data.data_ptr(), n, self.cols, out[r:].data_ptr())
            assert rc == 0
            r += n
        return out

    def get_rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [n] int64, each in [0, rows) -> [n, cols] fp32
        assert len(self.segments) == 1, "row lookup is for unfused matrices (embeddings)"
        ids = ids.to(torch.int64).contiguous()
        qtype, data = self.segments[0]
        out = torch.empty(ids.shape[0], self.cols, dtype=torch.float32)
        rc = self._lib.ss_get_rows(qtype, data.data_ptr(), self.cols, ids.data_ptr(), ids.shape[0],
                                   out.data_ptr())
        assert rc == 0
        return out
