"""Batch-1 decode products through kernels/tma_gemv.py, with the elementwise op before
them folded in.

At one token a step the linear layers are GEMVs, bound by streaming their weights,
and the norms and SiLU between them are kernels of a few microseconds whose cost is
mostly their launch and the gap after them. On Hopper (sm_90), for a 16-bit model at
tensor-parallel size 1, a layer's unquantized products at one row can run through the
TMA GEMV instead of cuBLAS (1.0-1.2x cuBLAS per weight alone on an H200,
benchmarks/runtime/bench_tma_gemv.py), launched early under programmatic dependent
launch; by default only those it made faster in the engine (`DEFAULT_ROLES`). Where
the product after them takes it:
  * an RMSNorm (with the residual add) whose output only feeds such a product
    (`RMSNorm.fold`) returns a `FoldedNorm` instead of running: the GEMV normalises
    its input row itself and writes the residual stream (x + residual) to the
    tensor the norm returned in its place;
  * SiLU-and-multiply before the down projection (`SiluAndMul.fold`) returns a
    `FoldedSiluMul`: the GEMV computes silu(gate) * up while reading its input.
A folded input that reaches any other consumer is computed by the usual kernel
(`materialize`), so the fold changes where the work runs, not what is computed: the
GEMV rounds at the same points as the norm and SiLU kernels. Which products take
the GEMV: `SLIPSTREAM_TMA_GEMV` (see `enabled`; 0 turns it off, 1 folds everything).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

_DTYPES = (torch.bfloat16, torch.float16)


# The products that take the GEMV unless SLIPSTREAM_TMA_GEMV says otherwise: those it
# made faster through the engine (H200, batch 1, Llama-3-8B shape and SmolLM2-135M shape:
# o_proj +1.6-1.9%, with the LM head +2.1%; every product with the norms and SiLU folded
# in -2.0% / -2.7%; benchmarks/runtime/README.md).
DEFAULT_ROLES = "o,lm_head"


def enabled(role: str | None = None) -> bool:
    """SLIPSTREAM_TMA_GEMV: a comma list of the products (roles: qkv, o, gate_up, down,
    lm_head) that take the GEMV (default DEFAULT_ROLES), 1 for every product (layers
    without a role included), 0 for none."""
    v = os.environ.get("SLIPSTREAM_TMA_GEMV", DEFAULT_ROLES)
    if v in ("", "0", "1"):
        return v == "1"
    return role in v.split(",")


def row_fits(x: torch.Tensor, role: str | None = None) -> bool:
    """One 16-bit row on an sm_90 GPU (compiled kernels, not the interpreter), for a
    product of `role` the GEMV is enabled for."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in _DTYPES):
        return False
    from slipstream.kernels.runtime import capability, interpreting
    return enabled(role) and not interpreting() and capability(x.device.index or 0)[0] == 9


def weight_fits(layer: nn.Module, x_dtype: torch.dtype) -> bool:
    w = getattr(layer, "weight", None)
    return (enabled(getattr(layer, "gemv_role", None))
            and isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == x_dtype
            and w.is_contiguous() and w.shape[1] % 8 == 0 and w.data_ptr() % 16 == 0
            and w.shape[1] <= 16384
            and getattr(layer, "bias", None) is None and getattr(layer, "tp_size", 1) == 1)


def gemv(layer: nn.Module, x: torch.Tensor, **fold) -> torch.Tensor:
    """x [1, K] (or the folded op's input) times layer.weight^T through the TMA GEMV."""
    from slipstream.kernels.runtime import pdl_supported
    from slipstream.kernels.tma_gemv import descriptors_of, tma_gemv
    return tma_gemv(x, layer.weight, chain=pdl_supported(x), descriptors=descriptors_of(layer),
                    **fold)


@dataclass
class FoldedNorm:
    """rms_norm(x (+ residual)) left for the product that reads it. `residual_out`
    (returned by the norm as the new residual stream) is written by whoever computes it."""
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def gemv(self, layer: nn.Module) -> torch.Tensor:
        return gemv(layer, self.x, norm_weight=self.weight, eps=self.eps,
                    residual=self.residual, residual_out=self.residual_out)

    def materialize(self) -> torch.Tensor:
        from slipstream.kernels.rms_norm import rms_norm
        if self.residual is None:
            return rms_norm(self.x, self.weight, self.eps)
        out, s = rms_norm(self.x, self.weight, self.eps, self.residual)
        self.residual_out.copy_(s)
        return out


@dataclass
class FoldedSiluMul:
    """silu(gate) * up of x = [gate | up], left for the product that reads it."""
    x: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.x.shape[0], self.x.shape[1] // 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def gemv(self, layer: nn.Module) -> torch.Tensor:
        return gemv(layer, self.x, silu_mul=True)

    def materialize(self) -> torch.Tensor:
        from slipstream.kernels.silu_mul import silu_and_mul
        return silu_and_mul(self.x)


Folded = (FoldedNorm, FoldedSiluMul)


def linear(layer: nn.Module, x) -> torch.Tensor | None:
    """The product through the TMA GEMV where it applies (x a folded op or one row);
    None where it does not (a folded x is then computed and the caller's path runs:
    see `unfold`)."""
    if isinstance(x, Folded):
        return x.gemv(layer) if weight_fits(layer, x.dtype) else None
    if row_fits(x, getattr(layer, "gemv_role", None)) and weight_fits(layer, x.dtype):
        return gemv(layer, x)
    return None


def unfold(x):
    return x.materialize() if isinstance(x, Folded) else x
