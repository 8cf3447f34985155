"""Token embedding and the LM head (its own weight, or tied to the embedding).

Vocabulary-parallel under tensor parallelism (`tp`, size N > 1): rank r holds
rows [r * V', (r + 1) * V') of the vocabulary, V' = ceil(V / N) (rows past V
are zero padding). The embedding looks up the ids in its range, zeroes the
rest and sums over ranks with one all-reduce (exactly one rank contributes
each row, so the sum is exact); the LM head computes its slice of the logits
and all-gathers them.

Either may instead hold a quantization method that keeps the table quantized
(one with `supports_embedding`, e.g. GGUF blocks on the CPU; one process
only): lookups then go through `method.embedding(layer, ids)` and the LM
head's product through `method.apply(layer, hidden)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.layers import decode_gemv
from slipstream.layers.weight_loader import copy_checked


def _table_quant(quant_method, tp_size: int):
    if quant_method is not None and tp_size > 1 and getattr(quant_method, "dense_tables_under_tp",
                                                            False):
        return None   # the scheme hands this table over dense (GGUF: dequantized at load)
    if quant_method is not None and tp_size > 1:
        raise ValueError("a quantized embedding table is not sharded across tensor-parallel "
                         "ranks yet; use quantization=None with tensor_parallel_size > 1")
    return quant_method


class _VocabShard(nn.Module):
    """The rank's rows of a [vocab_size, hidden_size] matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, tp=None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp = tp
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)

    def _new_weight(self) -> nn.Parameter:
        w = nn.Parameter(torch.empty(self.rows_per_rank, self.hidden_size), requires_grad=False)
        w.weight_loader = self.weight_loader
        return w

    def whole_shape(self, param: nn.Parameter) -> tuple[int, int]:
        """The shape of the weight in one process."""
        return (self.vocab_size, self.hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        """loaded_weight: the whole [vocab_size, hidden_size] tensor; copies this rank's rows."""
        assert shard_id is None, "a vocabulary matrix has no fused shards"
        if self.tp_size == 1:
            copy_checked(param.data, loaded_weight)
            return
        if loaded_weight.shape[0] != self.vocab_size:
            copy_checked(param.data, loaded_weight)   # raises the shape mismatch
        n = self.vocab_end - self.vocab_start
        copy_checked(param.data[:n], loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def extra_repr(self) -> str:
        tp = (f", rows {self.vocab_start}:{self.vocab_end} of rank {self.tp_rank}/{self.tp_size}"
              if self.tp_size > 1 else "")
        return f"{self.vocab_size}, {self.hidden_size}{tp}"


class VocabEmbedding(_VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, tp=None, quant_method=None):
        super().__init__(vocab_size, hidden_size, tp)
        self.quant_method = _table_quant(quant_method, self.tp_size)
        if self.quant_method is None:
            self.weight = self._new_weight()
        else:
            self.quant_method.create_weights(self, hidden_size, [vocab_size], torch.get_default_dtype())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] int64 -> [num_tokens, hidden_size]
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        x = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return comm.all_reduce(x, self.tp.device_group)


class LMHead(_VocabShard):
    """hidden -> logits. With `tied_to`, the weight *is* the embedding's parameter
    (one tensor, kept shared by `.to()`), so there is nothing to load for it."""
    gemv_role = "lm_head"   # one row on Hopper: layers/decode_gemv.py

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 tp=None, quant_method=None):
        super().__init__(vocab_size, hidden_size, tp)
        self.tied = tied_to is not None
        # the module whose weight the product reads (a list: not a submodule)
        self._owner = [tied_to if tied_to is not None else self]
        if tied_to is not None:
            self.weight = tied_to.weight
            self.quant_method = tied_to.quant_method
        else:
            self.quant_method = _table_quant(quant_method, self.tp_size)
            if self.quant_method is None:
                self.weight = self._new_weight()
            else:
                self.quant_method.create_weights(self, hidden_size, [vocab_size],
                                                 torch.get_default_dtype())
                self.bias = None

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits [n, vocab_size] in fp32 (matmul in the model
        # dtype); fp32=False: one GPU's plain product is returned before its (exact) cast
        if self.quant_method is not None:
            return self.quant_method.apply(self._owner[0], hidden).float()
        table = self._cpu_table(hidden)
        if table is not None:
            return table.matmul(hidden.float())
        y = decode_gemv.linear(self, hidden) if hidden.shape[0] == 1 else None  # Hopper, 1 row
        y = y if y is not None else F.linear(hidden, self.weight)      # [n, rows_per_rank]
        if self.tp_size == 1 and not fp32:
            return y
        logits = y.float()
        if self.tp_size == 1:
            return logits
        logits = comm.all_gather(logits, self.tp.device_group, self.tp_size)
        return logits[:, :self.vocab_size]                       # [n, vocab_size]

    def _cpu_table(self, hidden: torch.Tensor):
        """On the CPU where the kernels' pool holds the threads (the other products run
        there: GGUF blocks, quant/cpu_blocks.py) and torch keeps one, the dense table as a
        `QuantMatrix` of floats, multiplied by the pool (fp32 dot products, the table
        read in place); None elsewhere."""
        from slipstream.kernels import cpu_library
        if (hidden.is_cuda or self.tp_size > 1 or not cpu_library.took_threads
                or cpu_library.load() is None):
            return None
        w = self.weight
        key = (w.data_ptr(), w.dtype, tuple(w.shape))
        cached = getattr(self, "_cpu_table_cache", None)
        if cached is None or cached[0] != key:
            from slipstream.kernels.cpu_quant import QuantMatrix
            qtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}.get(w.dtype)
            table = None
            if qtype is not None and w.device.type == "cpu" and w.is_contiguous():
                data = w.detach().view(torch.uint8).view(w.shape[0], -1)
                table = QuantMatrix([(qtype, data)], w.shape[1])
            cached = self._cpu_table_cache = (key, table)
        return cached[1]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tied={self.tied}"
