"""RMSNorm with Hugging Face semantics: normalise in fp32, cast back, then scale.

On CUDA tensors one Triton kernel (`kernels/rms_norm.py`) does the residual add
and the norm together; elsewhere the plain torch ops below run, which are also
the kernel's twin (`kernels.reference.rms_norm`).

`quant` ("int8" / "fp8", set by the model when a W8A8 layer reads the output, see
quant/activation.py): the normed rows come out quantized per token (`QuantizedRows`), on
CUDA from the same kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.layers import decode_gemv


class RMSNorm(nn.Module):
    # None: the fused kernel on CUDA tensors, torch ops elsewhere; True/False forces
    # one path (tests run the kernel on the CPU under TRITON_INTERPRET=1).
    use_kernel: bool | None = None
    quant: str | None = None
    # Under tensor parallelism: the fused all-reduce + residual add + norm
    # (distributed/all_reduce_norm.py) for a PartialSum input (the residual given).
    reduce = None
    # Set by the model where only a plain linear layer reads the output (its
    # `gemv_role`): at one row on Hopper the norm is left to that layer's GEMV
    # (layers/decode_gemv.py).
    fold: str | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> normed x.

        With `residual` [num_tokens, hidden]: first x = x + residual (in the model
        dtype, as HF adds the residual), then returns (norm(x), x), the new residual.
        """
        if self.fold and x.shape[0] == 1 and decode_gemv.row_fits(x, self.fold) \
                and x.dtype == self.weight.dtype:
            if residual is None:
                return decode_gemv.FoldedNorm(x, None, self.weight, self.eps, None)
            out = torch.empty_like(x)   # the new residual stream, written by the GEMV
            return decode_gemv.FoldedNorm(x, residual, self.weight, self.eps, out), out
        if self.reduce is not None and not isinstance(x, torch.Tensor):
            # x: a row-parallel layer's PartialSum; the all-reduce is fused in here
            return self.reduce(x.partial, residual, self.weight, self.eps)
        if x.is_cuda if self.use_kernel is None else self.use_kernel:
            from slipstream.kernels.rms_norm import rms_norm
            out = rms_norm(x, self.weight, self.eps, residual, self.quant)
            if self.quant is None:
                return out
            from slipstream.quant.activation import QuantizedRows
            (q, s), res = (out, None) if residual is None else out
            rows = QuantizedRows(q, s, x.dtype)
            return rows if residual is None else (rows, res)
        if residual is not None:
            x = x + residual
        out = self._norm(x)
        if self.quant is not None:
            from slipstream.quant.activation import quantize_activation
            out = quantize_activation(out, self.quant)
        return out if residual is None else (out, x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
