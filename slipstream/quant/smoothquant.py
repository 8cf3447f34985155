"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights so both
quantize well to int8.

    Y = X W^T = (X diag(s)^-1) (W diag(s))^T,   s_j = max|X_j|^alpha / max|W_j|^(1-alpha)

where j runs over input channels, max|W_j| is taken over every layer that reads X
(q, k and v together; gate and up together). The division of X is folded into the
operation that produces it (quant/folding.py: the RMSNorm before qkv_proj and
gate_up_proj, the rows of v before o_proj, the rows of up before down_proj, whose
input, silu(gate) * up, carries the largest outliers), so the smoothed model costs
nothing extra; it computes exactly what the original computes before rounding.

alpha is either one value for every layer or searched per fold site (`search_alpha`):
the value on a grid in [0, 1] whose int8 W8A8 product has the smallest output error on
calibration inputs, or no smoothing at all if that is better on those inputs. The smoothed weights
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


def w8a8_output_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor) -> float:
    """Mean squared output error of int8 W8A8 (weights per output channel, activations per
    token) after smoothing by s, on inputs x [n, in], summed over the layers that read x."""
    from slipstream.quant.primitives import quantize_int8_rows
    xs = x.float() / s[None, :]
    xq, xsc = quantize_int8_rows(xs)
    x_hat = xq.float() * xsc
    err = 0.0
    for w in weights:
        ws = w.float() * s[None, :]
        wq, wsc = quantize_int8_rows(ws)
        err += (x_hat @ (wq.float() * wsc).t() - xs @ ws.t()).pow(2).mean().item()
    return err


def search_alpha(x: torch.Tensor, act_absmax: torch.Tensor, weights: list[torch.Tensor],
                 grid: int = 10, tie=None) -> tuple[float | None, torch.Tensor, list[float]]:
    """The migration strength with the smallest W8A8 output error on the calibration sample
    x [n, in]: no smoothing (alpha None, s = 1), then alpha in {0, 1/grid, ..., 1}
    -> (alpha, s, errors in that order). `tie(v, op)` makes per-channel statistics equal
    where one scale must serve several channels (GQA)."""
    tie = tie or (lambda v, op: v)
    a_max = tie(act_absmax.float(), "max")
    w_max = tie(torch.stack([w.float().abs().amax(0) for w in weights]).amax(0), "max")
    ones = torch.ones_like(a_max)
    best = (w8a8_output_error(x, weights, ones), None, ones)
    errors = [best[0]]
    for i in range(grid + 1):
        alpha = i / grid
        s = (a_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1.0 - alpha))
        s = s.clamp_min(1e-5)
        err = w8a8_output_error(x, weights, s)
        errors.append(err)
        if err < best[0]:
            best = (err, alpha, s)
    return best[1], best[2], errors
