"""Mixed precision: choose each linear layer's bit width under a total size budget.

Sensitivity of layer l at b bits: the expected squared output error its rounding
causes on calibration inputs, err_l(b) = tr(dW H dW^T) / 2 with dW = W - RTN_b(W) and
H = 2 X^T X / n, i.e. mean_x ||x dW^T||^2 (a sum over output rows). The allocation is
the integer program

    min  sum_l err_l(b_l)   subject to   sum_l numel_l * b_l <= avg_bits * sum_l numel_l,
         b_l in the allowed widths

(a multiple-choice knapsack; "bits" count the weight codes, not the group scales;
the allowed widths default to {3, 4, 8}: the per-layer output error underrates what
2-bit layers do to the whole model's perplexity).
It is solved exactly by dynamic programming over the budget in units of the gcd of
the layer sizes (every cost is a whole number of units), and greedily (start every
layer at the fewest bits, repeatedly buy the upgrade with the most error removed per
bit); the report gives both objectives and the greedy method's optimality gap.
"""
from __future__ import annotations

import math

import torch

from slipstream.quant.calibration import CalibrationModel, InputStats
from slipstream.quant.int_weight import layer_group_cols
from slipstream.quant.primitives import fake_quantize


def sensitivity(w: torch.Tensor, h: torch.Tensor, bits: int, group_cols: int,
                sym: bool) -> float:
    dw = w.float() - fake_quantize(w.float(), bits, sym, "group", group_cols)
    return 0.5 * torch.einsum("oi,ij,oj->", dw, h, dw).item()


def solve_exact(errs: list[dict[int, float]], sizes: list[int], budget_bits: float
                ) -> list[int]:
    """Multiple-choice knapsack by DP; returns the chosen bits per item (min total error)."""
    unit = 0
    for s in sizes:
        unit = math.gcd(unit, s)
    cap = int(budget_bits // unit)
    inf = float("inf")
    best = torch.full((cap + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    choice = []
    for err, size in zip(errs, sizes):
        new = torch.full_like(best, inf)
        pick = torch.full((cap + 1,), -1, dtype=torch.int64)
        for b, e in sorted(err.items()):
            c = size * b // unit
            if c > cap:
                continue
            cand = torch.full_like(best, inf)
            cand[c:] = best[:cap + 1 - c] + e
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.full_like(pick, b), pick)
        best = new
        choice.append(pick)
    if not torch.isfinite(best).any():
        raise ValueError("avg_bits: the budget is below the smallest allowed bit width")
    c = int(torch.argmin(best))
    bits = []
    for err, size, pick in zip(reversed(errs), reversed(sizes), reversed(choice)):
        b = int(pick[c])
        bits.append(b)
        c -= size * b // unit
    return bits[::-1]


def solve_greedy(errs: list[dict[int, float]], sizes: list[int], budget_bits: float
                 ) -> list[int]:
    bits = [min(e) for e in errs]
    used = sum(s * b for s, b in zip(sizes, bits))
    if used > budget_bits:
        raise ValueError("avg_bits: the budget is below the smallest allowed bit width")
    while True:
        best, best_gain = None, 0.0
        for i, (e, s) in enumerate(zip(errs, sizes)):
            for b in sorted(e):
                if b <= bits[i] or used + s * (b - bits[i]) > budget_bits:
                    continue
                gain = (e[bits[i]] - e[b]) / (s * (b - bits[i]))
                if gain > best_gain:
                    best, best_gain = (i, b), gain
        if best is None:
            return bits
        i, b = best
        used += sizes[i] * (b - bits[i])
        bits[i] = b


def plan_bits(cm: CalibrationModel, windows, opts) -> tuple[dict[str, int], dict]:
    """Measure every layer's sensitivity on the dense model, allocate bits.
    Returns (module name -> bits, a report of both solutions)."""
    names, errs, sizes = [], [], []
    states = cm.embed(windows)
    for i in range(len(cm.layers)):
        linears = cm.linear_layers(i)
        stats = {n: InputStats(m.input_size) for n, m in linears.items()}
        cm.run_layer(i, states, stats)
        for n, m in linears.items():
            g = layer_group_cols(m.input_size, opts.group_size)
            h = stats[n].hessian
            errs.append({b: sensitivity(m.weight.data, h, b, g, opts.sym)
                         for b in opts.mixed_bits})
            sizes.append(m.weight.numel())
            names.append(n)
        if i + 1 < len(cm.layers):
            states = cm.run_layer(i, states)
    budget = opts.avg_bits * sum(sizes)
    exact = solve_exact(errs, sizes, budget)
    greedy = solve_greedy(errs, sizes, budget)

    def total(bits):
        return sum(e[b] for e, b in zip(errs, bits))

    def avg(bits):
        return sum(s * b for s, b in zip(sizes, bits)) / sum(sizes)
    t_exact, t_greedy = total(exact), total(greedy)
    report = {"avg_bits_budget": opts.avg_bits, "avg_bits_exact": avg(exact),
              "avg_bits_greedy": avg(greedy), "objective_exact": t_exact,
              "objective_greedy": t_greedy,
              "greedy_gap": (t_greedy - t_exact) / t_exact if t_exact > 0 else 0.0,
              "bits": dict(zip(names, exact))}
    return dict(zip(names, exact)), report
