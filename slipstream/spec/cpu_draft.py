"""EAGLE's draft head on a CPU: its products on GGUF blocks.

On a CPU a draft level streams its weights from memory as a target step does:
the head's decoder layer in fp32 (18 MB for the default model) and the draft
LM head as a dense fp32 copy of 16k rows of the target's head (38 MB) made a
5-level draft cost ~4 target steps. Here the draft LM head reads those rows in
the target's own blocks (Q8_0 for the default model: 10 MB) and the layer's
products after the input fusion read their weights as Q8_0 blocks (3.5 MB), both through the CPU
kernels' 16-row path. Drafts change only by the int8 rounding of the products;
verification is untouched, so greedy outputs stay those of the target.

Draft weights at 4 bits re-round those weights to Q4_1 blocks: a draft level is
bound by the bytes it streams (about 14 MB at 8 bits for the default model's head),
so half the bytes is about half the level's time; the drafts move by the coarser
rounding, the outputs do not. The heads shipped for the default model draft at 4
bits (the EAGLE head; measured: tau 2.298 against 2.309 for a chain of 3, and the CPU chain loop
1.53x plain decoding against 1.35x at 8 bits over 256-token answers); a head from a
file stays at 8 bits (Q8_0), since a small head's drafts can lose all their
acceptance at 4 (the engine tests' tiny trained heads accept nothing).
`SLIPSTREAM_CPU_DRAFT_BITS=4` or `8` sets it for every head.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix
from slipstream.spec.heads import DraftLMHead

Q4_0, Q4_1, Q8_0 = 2, 3, 8
_ENV_BITS = os.environ.get("SLIPSTREAM_CPU_DRAFT_BITS")
BITS = int(_ENV_BITS) if _ENV_BITS else None     # None: draft_bits() decides per head
if BITS not in (None, 4, 8):
    raise ValueError(f"SLIPSTREAM_CPU_DRAFT_BITS must be 4 or 8, got {BITS}")


def draft_bits(shipped: bool = False) -> int:
    """The draft weights' bits: SLIPSTREAM_CPU_DRAFT_BITS, else 4 for a shipped head, 8
    for one from a file."""
    return BITS or (4 if shipped else 8)


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


def q4_1_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [rows, cols] (cols % 32 == 0) -> GGUF Q4_1 blocks uint8 [rows, cols / 32 * 20]:
    per 32 values an fp16 step d = (max - min) / 15 and offset m = min, and the codes
    round((w - m) / d) in [0, 15], value i in the low nibble of byte i and value
    i + 16 in its high nibble."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"Q4_1 needs a multiple of 32 columns, got {cols}")
    b = w.float().reshape(rows, cols // 32, 32)
    lo = b.amin(-1, keepdim=True)
    d = ((b.amax(-1, keepdim=True) - lo) / 15).half()
    m = lo.half()
    df = d.float()
    q = torch.where(df > 0, (b - m.float()) / torch.where(df > 0, df, 1), 0).round().clamp(0, 15)
    q = q.to(torch.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat([d.view(torch.uint8).reshape(rows, cols // 32, 2),
                     m.view(torch.uint8).reshape(rows, cols // 32, 2), nib], -1)
    return out.reshape(rows, cols // 32 * 20).contiguous()


def blocks(w: torch.Tensor, bits: int | None = None) -> tuple[int, torch.Tensor]:
    """w -> (ggml type, blocks) at `bits` (default draft_bits()): Q4_1 or Q8_0."""
    return (Q4_1, q4_1_blocks(w)) if (bits or draft_bits()) == 4 else (Q8_0, q8_0_blocks(w))


class QuantLinear(nn.Module):
    """A bias-free nn.Linear whose product reads Q4_1 or Q8_0 blocks (`bits`, default
    draft_bits()): [..., in] -> [..., out] fp32."""

    def __init__(self, linear: nn.Linear, bits: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qm = QuantMatrix([blocks(linear.weight.detach(), bits)], linear.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qm.matmul(x.reshape(-1, self.in_features).float())
        return y.reshape(*x.shape[:-1], self.out_features)


class QuantDraftLMHead(DraftLMHead):
    """The draft vocabulary's rows of the target's quantized LM head: in its own blocks,
    or re-rounded to Q4_1 where `bits` (default draft_bits()) is 4 and they hold more bits."""

    def __init__(self, base: DraftLMHead, qm: QuantMatrix, bits: int | None = None):
        self.__dict__.update(base.__dict__)
        qtype, data = qm.segments[0]
        rows = QuantMatrix([(qtype, data[self.vocab.cpu()].contiguous())], qm.cols)
        if (bits or draft_bits()) == 4 and qtype not in (Q4_0, Q4_1):
            rows = QuantMatrix([(Q4_1, q4_1_blocks(rows.dequantize()))], qm.cols)
        self.rows = rows

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        return self.rows.matmul(feats.float().contiguous())


# The head's linear layers that draft from GGUF blocks on a CPU (fc_taps: EAGLE-3 heads).
QUANTIZED = ("fc", "fc_taps", "q", "k", "v", "o", "gate_up", "down")


def usable(head: nn.Module, device) -> bool:
    """Drafting on a CPU with the kernels built, the head in fp32 (its parameters'
    dtype)."""
    dtype = next(head.parameters()).dtype
    return (torch.device(device).type == "cpu" and cpu_library.load() is not None
            and dtype == torch.float32)


def quantize_head(head: nn.Module, lm_head: DraftLMHead, bits: int | None = None) -> DraftLMHead:
    """Swap the head's linear layers for block-quantized ones (`bits`, default
    draft_bits(); in place) and return the LM head to draft with (the target's own
    blocks where it holds a single-format quantized table and a draft vocabulary, at
    `bits`; else `lm_head` unchanged)."""
    for name in QUANTIZED:
        lin = getattr(head, name, None)
        if lin is None:
            continue
        if lin.out_features % 16 == 0 and lin.in_features % 32 == 0:
            setattr(head, name, QuantLinear(lin, bits))
    head.qkv_weight = None      # the fused fp32 q/k/v product would bypass the block layers
    return quantize_lm_head(lm_head, bits)


def quantize_lm_head(lm_head: DraftLMHead, bits: int | None = None) -> DraftLMHead:
    """The LM head to draft with on a CPU: with a draft vocabulary, its rows in the
    target's own blocks where the target holds its LM head as a single-format quantized
    table (a dense fp32 copy of 16k rows streams 38 MB a call, single-threaded); else
    `lm_head` unchanged."""
    owner = getattr(lm_head.target.lm_head, "_owner", [None])[0]
    qm = getattr(owner, "gguf_weight", None)
    if lm_head.vocab is not None and isinstance(qm, QuantMatrix) and len(qm.segments) == 1:
        return QuantDraftLMHead(lm_head, qm, bits)
    return lm_head
