"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each
column's rounding error onto the columns not yet quantized through the inverse
Hessian of the layer's reconstruction objective.

For a layer W [out, in] with calibration inputs X [n, in], the objective is
min ||W X^T - Q(W) X^T||^2, whose Hessian (per output row) is H = 2 X^T X.
After damping (H + lambda I, lambda = damp * mean diag H) GPTQ needs the upper
Cholesky factor U of H^-1 (H^-1 = U^T U): quantizing column i with error
e = (w_i - q_i) / U[i, i] updates the remaining columns j > i by -e * U[i, j]
(the row of U replaces H^-1[i, j] / H^-1[i, i] of the chapter's formula, in a
numerically stable form). Columns are processed in blocks of `block_size`: inside
a block the updates run column by column; the columns after the block receive the
block's accumulated errors in one matrix product (the lazy batch update).

act_order quantizes columns in order of decreasing diag(H) (the inputs with the
most energy first, while the most columns remain to absorb their error). The
result is stored in that order with the permutation, so groups stay contiguous:
the layer computes x[:, perm] @ Q^T.
"""
from __future__ import annotations

import contextlib

import torch

from slipstream.quant.primitives import QTensor, compute_qparams, quantize_codes


class HessianAccumulator:
    """H = 2/n sum_k x_k x_k^T over calibration rows (fp64 sums, running mean)."""

    def __init__(self, in_features: int):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        # x: [rows, in]
        x = x.reshape(-1, x.shape[-1]).double().cpu()
        self.h += 2.0 * x.t() @ x
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        return (self.h / max(self.n, 1)).float()


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """The column loop runs many tiny CPU ops, where intra-op threads only add
    synchronization (and, on a busy machine, waits for a core): run it on one thread."""
    if device.type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None = 128,
                  sym: bool = False, block_size: int = 128, damp: float = 0.01,
                  act_order: bool = False, clip_grid: int = 0, static_groups: bool = False,
                  clip_min: float = 0.5, clip_separate: bool = False,
                  cross: torch.Tensor | None = None, cross_scale: float = 1.0
                  ) -> tuple[QTensor, torch.Tensor | None]:
    """w: [out, in]; h: [in, in] -> (QTensor over the columns in quantization order,
    perm [in] int64 when act_order else None). group_size None: one group per row.
    clip_grid > 0: each group's range is searched (see group_qparams).
    static_groups (with act_order): every group's range is fixed up front from the weights
    in input order, so the codes are stored in input order and perm is None (the layer
    needs no gather of its input at run time); the quantization itself still runs in
    act-order. clip_min, clip_separate: the range search's smallest ratio and whether it
    shrinks the two ends of the range independently (group_qparams).
    cross [in, in] = 2/n sum (x_ref - x)^T x (asymmetric calibration, GPTAQ, Li et al.
    2025): the layer's inputs x come from the already quantized layers before it, x_ref from
    the unquantized model; the objective becomes ||W X_ref - Q X||^2, whose minimizer over
    unconstrained Q is W + W cross H^-1: GPTQ runs on that target (a column-wise pass
    needs nothing else, the rest of the objective being a constant). cross_scale scales
    the correction (1: the exact objective; 0: plain GPTQ)."""
    with _one_thread(w.device):
        return _gptq(w, h, bits, group_size, sym, block_size, damp, act_order,
                     (clip_grid, clip_min, clip_separate), static_groups and act_order,
                     None if cross is None or cross_scale == 0 else cross * cross_scale)


def group_qparams(w: torch.Tensor, d: torch.Tensor, bits: int, sym: bool, grid: int,
                  min_ratio: float = 0.5, separate: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [rows, 1] of one group w [rows, cols]: with grid > 0 the range is shrunk
    by the ratio in [min_ratio, 1] (grid + 1 steps) minimizing each row's rounding error
    weighted by d [cols] = diag(H) (GPTQ's `mse` option, Hessian-weighted: a column's
    rounding error costs the output d_j times its square). separate (asymmetric only): the
    low and the high end of the range are shrunk by ratios searched independently
    ((grid + 1)^2 candidates per row)."""
    s, z, _ = compute_qparams(w, bits, sym, "channel")
    if grid <= 0:
        return s, z
    ratios = [1.0 - (1.0 - min_ratio) * i / grid for i in range(grid + 1)]
    if separate and not sym:
        qmax = 2 ** bits - 1
        lo0 = w.amin(1, keepdim=True).clamp_max(0)
        hi0 = w.amax(1, keepdim=True).clamp_min(0)
        candidates = ((lo0 * a, hi0 * b) for a in ratios for b in ratios)
    else:
        candidates = (compute_qparams(w, bits, sym, "channel", clip=r)[:2] for r in ratios)
    best = None
    for c in candidates:
        if separate and not sym:
            si = ((c[1] - c[0]) / qmax).clamp_min(1e-10)
            zi = torch.round(-c[0] / si).clamp(0, qmax)
        else:
            si, zi = c
        q = (quantize_codes(w, si, zi, bits).float() - zi) * si
        err = ((q - w).pow(2) * d[None, :]).sum(1, keepdim=True)
        if best is None:
            best, s, z = err, si, zi
        else:
            better = err < best
            best = torch.where(better, err, best)
            s, z = torch.where(better, si, s), torch.where(better, zi, z)
    return s, z


def _gptq(w, h, bits, group_size, sym, block_size, damp, act_order, clip=(0, 0.5, False),
          static=False, cross=None):
    out_f, in_f = w.shape
    group = in_f if group_size is None else min(group_size, in_f)   # last group may be narrower
    W = w.detach().float().clone()
    H = h.detach().float().clone()
    dead = torch.diag(H) == 0            # inputs never active: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(in_f)
    diag = torch.diag(H).clone()
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(H))
    if cross is not None:
        c = cross.detach().float()
        if perm is not None:
            c = c[perm][:, perm]
        W += W @ (c @ h_inv)
    U = torch.linalg.cholesky(h_inv, upper=True)

    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    n_groups = -(-in_f // group)
    scale = torch.zeros(out_f, n_groups)
    zero = torch.zeros(out_f, n_groups)
    # Column in quantization order -> (stored column, its group).
    where = perm if static else torch.arange(in_f)
    if static:
        w_in, d_in = torch.empty_like(W), torch.empty_like(diag)
        w_in[:, perm], d_in[perm] = W, diag
        for g in range(n_groups):
            cols = slice(g * group, min((g + 1) * group, in_f))
            s, z = group_qparams(w_in[:, cols], d_in[cols], bits, sym, *clip)
            scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % group == 0:
                # The group's range from its current (error-updated) weights.
                ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :group]
                s, z = group_qparams(ahead, diag[col:col + ahead.shape[1]], bits, sym, *clip)
                scale[:, col // group], zero[:, col // group] = s[:, 0], z[:, 0]
            stored = int(where[col])
            g = stored // group
            s, z = scale[:, g:g + 1], zero[:, g:g + 1]
            wcol = W1[:, i:i + 1]
            q = quantize_codes(wcol, s, z, bits)                     # [out, 1]
            codes[:, stored] = q[:, 0]
            deq = (q.float() - z) * s
            e = (wcol - deq) / U1[i, i]
            W1[:, i:] -= e * U1[i:i + 1, i:]
            err1[:, i] = e[:, 0]
        W[:, i2:] -= err1 @ U[i1:i2, i2:]
    return QTensor(codes, scale, zero, bits, group), None if static else perm


def layer_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared output error ||x W^T - x W_hat^T||^2 / numel on inputs x [n, in]."""
    return (x.float() @ (w.float() - w_hat.float()).t()).pow(2).mean().item()


def dequantized_in_input_order(qt: QTensor, perm: torch.Tensor | None) -> torch.Tensor:
    """The quantized weight [out, in] with columns back in the layer's input order."""
    w = qt.dequantize()
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out
