"""Token embedding and the LM head (its own weight, or tied to the embedding).

Either may hold a quantization method that keeps the table quantized (one with
`supports_embedding`, e.g. GGUF blocks on the CPU): lookups then go through
`method.embedding(layer, ids)` and the LM head's product through
`method.apply(layer, hidden)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, quant_method=None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        else:
            quant_method.create_weights(self, hidden_size, [vocab_size], torch.get_default_dtype())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] int64 -> [num_tokens, hidden_size]
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class LMHead(nn.Module):
    """hidden -> logits. With `tied_to`, the weight *is* the embedding's parameter
    (one tensor, kept shared by `.to()`), so there is nothing to load for it."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 quant_method=None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tied = tied_to is not None
        # the module whose weight the product reads, and its quantization method
        self._owner = [tied_to if tied_to is not None else self]   # a list: not a submodule
        if tied_to is not None:
            self.weight = tied_to.weight
            self.quant_method = tied_to.quant_method
        else:
            self.quant_method = quant_method
            if quant_method is None:
                self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            else:
                quant_method.create_weights(self, hidden_size, [vocab_size], torch.get_default_dtype())
                self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits [n, vocab_size] in fp32 (matmul in the model dtype)
        if self.quant_method is not None:
            return self.quant_method.apply(self._owner[0], hidden).float()
        return F.linear(hidden, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
