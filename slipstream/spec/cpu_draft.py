"""EAGLE's draft head on a CPU: its products on GGUF blocks.

On a CPU a draft level streams its weights from memory as a target step does:
the head's decoder layer in fp32 (18 MB for the default model) and the draft
LM head as a dense fp32 copy of 16k rows of the target's head (38 MB) made a
5-level draft cost ~4 target steps. Here the draft LM head reads those rows in
the target's own blocks (Q8_0 for the default model: 10 MB) and the layer's
products after the input fusion read their weights as Q8_0 blocks (3.5 MB), both through the CPU
kernels' 16-row path. Drafts change only by the int8 rounding of the products;
verification is untouched, so greedy outputs stay those of the target.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix
from slipstream.spec.heads import DraftLMHead

Q8_0 = 8


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [rows, cols] (cols % 32 == 0) -> GGUF Q8_0 blocks uint8 [rows, cols / 32 * 34]:
    per 32 values an fp16 scale amax / 127 and the values / scale rounded to int8."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"Q8_0 needs a multiple of 32 columns, got {cols}")
    b = w.float().reshape(rows, cols // 32, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, b / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8).reshape(rows, cols // 32, 2), q.view(torch.uint8)], -1)
    return out.reshape(rows, cols // 32 * 34).contiguous()


class QuantLinear(nn.Module):
    """A bias-free nn.Linear whose product reads Q8_0 blocks: [..., in] -> [..., out] fp32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qm = QuantMatrix([(Q8_0, q8_0_blocks(linear.weight.detach()))], linear.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qm.matmul(x.reshape(-1, self.in_features).float())
        return y.reshape(*x.shape[:-1], self.out_features)


class QuantDraftLMHead(DraftLMHead):
    """The draft vocabulary's rows of the target's quantized LM head, in its own blocks."""

    def __init__(self, base: DraftLMHead, qm: QuantMatrix):
        self.__dict__.update(base.__dict__)
        qtype, data = qm.segments[0]
        self.rows = QuantMatrix([(qtype, data[self.vocab.cpu()].contiguous())], qm.cols)

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        return self.rows.matmul(feats.float().contiguous())


# The head's linear layers that draft from Q8_0 blocks on a CPU (fc_taps: EAGLE-3 heads).
QUANTIZED = ("fc", "fc_taps", "q", "k", "v", "o", "gate_up", "down")


def usable(head: nn.Module, device) -> bool:
    """Drafting on a CPU with the kernels built, the head in fp32 (its parameters'
    dtype)."""
    dtype = next(head.parameters()).dtype
    return (torch.device(device).type == "cpu" and cpu_library.load() is not None
            and dtype == torch.float32)


def quantize_head(head: nn.Module, lm_head: DraftLMHead) -> DraftLMHead:
    """Swap the head's linear layers for Q8_0 ones (in place) and return the LM
    head to draft with (the target's own blocks where it holds a single-format
    quantized table and a draft vocabulary; else `lm_head` unchanged)."""
    for name in QUANTIZED:
        lin = getattr(head, name, None)
        if lin is None:
            continue
        if lin.out_features % 16 == 0 and lin.in_features % 32 == 0:
            setattr(head, name, QuantLinear(lin))
    head.qkv_weight = None      # the fused fp32 q/k/v product would bypass the Q8_0 layers
    return quantize_lm_head(lm_head)


def quantize_lm_head(lm_head: DraftLMHead) -> DraftLMHead:
    """The LM head to draft with on a CPU: with a draft vocabulary, its rows in the
    target's own blocks where the target holds its LM head as a single-format quantized
    table (a dense fp32 copy of 16k rows streams 38 MB a call, single-threaded); else
    `lm_head` unchanged."""
    owner = getattr(lm_head.target.lm_head, "_owner", [None])[0]
    qm = getattr(owner, "gguf_weight", None)
    if lm_head.vocab is not None and isinstance(qm, QuantMatrix) and len(qm.segments) == 1:
        return QuantDraftLMHead(lm_head, qm)
    return lm_head
