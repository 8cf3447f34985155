"""The index of each row's maximum, in two passes over long rows."""
from __future__ import annotations

import functools

import torch


def _cpu_library():
    from slipstream.kernels import cpu_library
    return cpu_library.load()


@functools.cache
def _argmax_chunks(vocab: int, cuda: bool = True) -> int:
    """Chunks a row of `vocab` splits into for a two-pass argmax (1: one pass).
    CUDA: the largest divisor up to 256 leaving chunks of at least 128 (many
    blocks). CPU: the largest divisor up to 16 (torch's argmax over a row is a
    scalar loop; the maxima of a few long chunks are vectorised: 2.2-7x less
    time at 1-16 rows of 32k-152k vocabularies, benchmarks/cpu/bench_argmax.py)."""
    if vocab < 8192:
        return 1
    most, least_width = (256, 128) if cuda else (16, 512)
    return max(c for c in range(1, most + 1) if vocab % c == 0 and vocab // c >= least_width)


def row_argmax(x: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """x: [rows, vocab] -> [rows] int64, the first index of each row's maximum.

    On CUDA, one argmax kernel runs one block per row: 27 us for one row of a
    128k vocabulary on the H200, against a few for a pass over chunks of the row
    (maxima and their indices) and a pass over the chunk maxima. On the CPU, fp32
    rows go to the C kernels' `ss_row_argmax` where they are built (the row's
    maximum as vectors, then its first position); else the chunks' maxima are
    vectorised where torch's argmax is not (`_argmax_chunks`)."""
    rows, vocab = x.shape
    if not x.is_cuda and x.dtype == torch.float32 and chunks is None and rows:
        lib = _cpu_library()
        if lib is not None:
            x = x.contiguous()
            out = torch.empty(rows, dtype=torch.int64)
            if lib.ss_row_argmax(x.data_ptr(), rows, vocab, out.data_ptr()) == 0:
                return out
    if chunks is None:
        chunks = _argmax_chunks(vocab, x.is_cuda)
    if chunks == 1:
        return x.argmax(dim=-1)
    width = vocab // chunks
    vals, idx = x.view(rows, chunks, width).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (best * width + idx.gather(1, best)).squeeze(1)
