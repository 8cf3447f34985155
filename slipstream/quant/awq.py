"""AWQ (Lin et al., 2023): activation-aware weight quantization.

The rounding error of input channel j reaches the output multiplied by x_j, so
channels with large activations matter most. AWQ multiplies weight column j by
s_j > 1 for those channels (finer relative rounding) and divides the activation by
s_j, an exact equivalence before rounding:

    x W^T = (x diag(s)^-1) (W diag(s))^T

with s = mean|x|^alpha, alpha chosen on a grid in [0, 1] to minimize the layer's
output error on calibration inputs once W diag(s) is quantized. The division of x
is folded into the operation that produces x (quant/folding.py): the RMSNorm weight
before qkv_proj and gate_up_proj, the rows of up_proj before down_proj, the rows of
v_proj before o_proj (with GQA one scale per value channel, shared by the heads of
its group).

Then AWQ's clipping search (`search_clip`): each group's range is shrunk by the ratio
whose quantized weights give the smallest output error on the calibration inputs
(outliers in a group of 128 stretch its step for the other 127 weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.quant.primitives import fake_quantize


@dataclass
class AWQSearch:
    scales: torch.Tensor     # [in] the chosen s (divide x by it, multiply W's columns)
    alpha: float
    errors: list[float]      # output MSE at each candidate of the grid
    grid: list[float]
    duo: bool = False        # the chosen s divides by mean|w|^(1 - alpha) too


def awq_scales(x_abs_mean: torch.Tensor, alpha: float,
               w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s = mean|x|^alpha (or, with w_mean, AutoAWQ's duo scaling mean|x|^alpha /
    w_mean^(1 - alpha)), normalized so that max(s) * min(s) = 1 (keeps W's range centred)."""
    s = x_abs_mean.float().clamp_min(1e-4).pow(alpha)
    if w_mean is not None:
        s = (s / (w_mean.float().pow(1.0 - alpha) + 1e-4)).clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's per-input-channel weight magnitude: |w| relative to its group's max |w|,
    averaged over the output rows -> [in]. w [out, in]; a narrower last group is its own."""
    w = w.float().abs()
    out, cols = w.shape
    pad = -cols % group_size
    g = torch.nn.functional.pad(w, (0, pad)).view(out, -1, group_size)
    rel = g / (g.amax(-1, keepdim=True) + 1e-6)
    return rel.view(out, -1)[:, :cols].mean(0)


def search_scales(w: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = False, grid: int = 20,
                  x_abs_mean: torch.Tensor | None = None,
                  w_mean: torch.Tensor | None = None,
                  gram: torch.Tensor | None = None) -> AWQSearch:
    """w: [out, in]; x: [n, in] calibration inputs (a sample is enough), or x None and
    gram [in, in] = X^T X / n of all of them (with x_abs_mean).
    alpha = 0 (s = 1, plain RTN) is on the grid, so the result is never worse than RTN
    on these inputs. With w_mean [in] (weight_mean, tied like x_abs_mean where the fold
    site needs it) the duo-scaled candidates join the grid; the lowest output error wins."""
    w = w.float()
    mean = x.float().abs().mean(0) if x_abs_mean is None else x_abs_mean.float()
    # mean over rows and outputs of (x dw^T)^2 = sum((dw G) * dw) / out, G = X^T X / n
    gram = _gram(x) if gram is None else gram.float()
    alphas = [i / grid for i in range(grid + 1)]
    cands = [(a, None) for a in alphas]
    if w_mean is not None:
        cands += [(a, w_mean) for a in alphas]
    errors = []
    for a, wm in cands:
        s = awq_scales(mean, a, wm)
        w_hat = fake_quantize(w * s[None, :], bits, sym, "group", group_size) / s[None, :]
        dw = w_hat - w
        errors.append(((dw @ gram) * dw).sum().item() / w.shape[0])
    best = min(range(len(cands)), key=errors.__getitem__)
    a, wm = cands[best]
    return AWQSearch(awq_scales(mean, a, wm), a, errors, alphas, wm is not None)


def _gram(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x.t() @ x / x.shape[0]


def search_clip(w: torch.Tensor, x: torch.Tensor | None, bits: int = 4, group_size: int = 128,
                sym: bool = False, grid: int = 10, min_ratio: float = 0.5,
                gram: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ's weight clipping: per (output row, group), the max-|w| shrink ratio in
    [min_ratio, 1] whose quantized group gives the smallest output error on x. Returns w
    clamped to the chosen ranges (quantize it next). w [out, in], x [n, in] (or x None and
    gram [in, in] = X^T X / n)."""
    w = w.float()
    gram = _gram(x) if gram is None else gram.float()
    out, cols = w.shape
    pad = -cols % group_size
    if pad:   # zero columns leave every range and every product unchanged
        w = torch.nn.functional.pad(w, (0, pad))
        gram = torch.nn.functional.pad(gram, (0, pad, 0, pad))
    groups = w.shape[1] // group_size
    wg = w.view(out, groups, group_size)
    # Output error of a group's weight error dw: mean_n (x_n . dw)^2 = dw^T G dw with
    # G = X^T X / n of the group's inputs (its diagonal block), instead of x @ dw.
    gram = torch.stack([gram[g * group_size:(g + 1) * group_size,
                             g * group_size:(g + 1) * group_size] for g in range(groups)])
    amax = wg.abs().amax(-1, keepdim=True)                      # [out, groups, 1]
    best_err = torch.full((out, groups), float("inf"))
    best = amax.clone()
    for i in range(grid + 1):
        mx = amax * (1.0 - (1.0 - min_ratio) * i / grid)
        wc = torch.maximum(torch.minimum(wg, mx), -mx)
        q = fake_quantize(wc.reshape(out, -1), bits, sym, "group", group_size)
        dw = (q.view(out, groups, group_size) - wg)             # error of the clipped weights
        err = torch.einsum("ogk,gkl,ogl->og", dw, gram, dw)      # [out, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], mx, best)
    wc = torch.maximum(torch.minimum(wg, best), -best).reshape(out, -1)
    return wc[:, :cols]
