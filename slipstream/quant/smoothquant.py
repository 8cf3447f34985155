"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights so both
quantize well to int8.

    Y = X W^T = (X diag(s)^-1) (W diag(s))^T,   s_j = max|X_j|^alpha / max|W_j|^(1-alpha)

where j runs over input channels, max|W_j| is taken over every layer that reads X
(q, k and v together; gate and up together). The division of X is folded into the
RMSNorm weight that produces it, so the smoothed model costs nothing extra; it
computes exactly what the original computes before rounding. The smoothed weights
are then int8 per output channel and the activations int8 per token at run time
(quant/w8a8.py).
"""
from __future__ import annotations

import torch


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                  alpha: float = 0.5) -> torch.Tensor:
    """act_absmax: [in] max |x_j| over calibration tokens; weights: each [out_i, in]
    -> s [in] (clamped away from 0 so dead channels stay finite)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a value in [0, 1], got {alpha}")
    w_max = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0).clamp_min(1e-5)
    s = act_absmax.float().clamp_min(1e-5).pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp_min(1e-5)


@torch.no_grad()
def fold_into_norm(norm_weight: torch.Tensor, linear_weights: list[torch.Tensor],
                   s: torch.Tensor) -> None:
    """In place: norm weight /= s (the norm's output is X), each W[:, j] *= s_j."""
    norm_weight.div_(s.to(norm_weight.dtype))
    for w in linear_weights:
        w.mul_(s.to(w.dtype)[None, :])


@torch.no_grad()
def fold_into_rows(prev_weight: torch.Tensor, prev_bias: torch.Tensor | None,
                   weight: torch.Tensor, s: torch.Tensor) -> None:
    """In place, when X = (previous linear's output rows), e.g. up_proj before down_proj:
    the previous layer's output rows (and bias) /= s, W[:, j] *= s_j."""
    prev_weight.div_(s.to(prev_weight.dtype)[:, None])
    if prev_bias is not None:
        prev_bias.div_(s.to(prev_bias.dtype))
    weight.mul_(s.to(weight.dtype)[None, :])
