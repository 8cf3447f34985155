"""The table of quality.py: perplexities, their change against the baseline, the issue's
targets, and how far the evaluation text's sampling noise could move each comparison.

Noise: perplexity is deterministic for given weights, but the evaluation text is one
sample of about 4,700 tokens. A paired block bootstrap (blocks of 64 consecutive scored
tokens, resampled with replacement, the same blocks for every method) gives a 95%
interval for each method's perplexity ratio to the baseline and for the share of the
RTN w4g128 gap a method closes. It does not cover the other source of variation, the
calibration sample (a different calibration text gives different GPTQ/AWQ weights).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

BLOCK = 64
RESAMPLES = 2000


def save_nll(out: Path, name: str, nll: list[float]) -> None:
    d = out / "nll"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.txt").write_text("\n".join(f"{v:.5f}" for v in nll) + "\n")


def load_nll(out: Path, name: str, tokens: int) -> torch.Tensor | None:
    f = out / "nll" / f"{name}.txt"
    if not f.is_file():
        return None
    t = torch.tensor([float(v) for v in f.read_text().split()], dtype=torch.float64)
    return t if t.numel() == tokens else None


def bootstrap(out: Path, rows: list[dict]) -> dict[str, dict]:
    """method -> {"ratio_ci": [lo, hi], "gap_closed_ci": [lo, hi] (w4 methods)}."""
    tokens = rows[0]["tokens"]
    nll = {r["method"]: load_nll(out, r["method"], tokens) for r in rows}
    if nll.get("baseline") is None:
        return {}
    blocks = -(-tokens // BLOCK)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, blocks, (RESAMPLES, blocks), generator=g)

    def means(t):   # mean NLL of each resample (block sums / token counts)
        pad = torch.nn.functional.pad(t, (0, blocks * BLOCK - tokens))
        sums = pad.view(blocks, BLOCK).sum(1)
        counts = torch.full((blocks,), float(BLOCK), dtype=torch.float64)
        counts[-1] = tokens - (blocks - 1) * BLOCK
        return sums[idx].sum(1) / counts[idx].sum(1)
    m = {k: means(v) for k, v in nll.items() if v is not None}
    base, rtn = m["baseline"], m.get("rtn-w4g128")
    q = lambda t: [round(float(v), 4) for v in torch.quantile(t, torch.tensor(  # noqa: E731
        [0.025, 0.975], dtype=torch.float64))]
    res = {}
    for k, v in m.items():
        if k == "baseline":
            continue
        res[k] = {"ratio_ci": q(torch.exp(v - base))}
        if rtn is not None and "w4g128" in k and k != "rtn-w4g128":
            p_b, p_r, p_m = torch.exp(base), torch.exp(rtn), torch.exp(v)
            res[k]["gap_closed_ci"] = q((p_r - p_m) / (p_r - p_b))
    return res


def target(name: str, ppl: dict[str, float]) -> str:
    b, r = ppl.get("baseline"), ppl.get("rtn-w4g128")
    p = ppl[name]
    if name in ("gptq-w4g128", "awq-w4g128") and b and r:
        closed = (r - p) / (r - b)
        return f"close half the RTN gap: closes {100 * closed:.0f}%, " + \
            ("**met**" if closed >= 0.5 else "**not met**")
    if name == "smoothquant-w8a8" and b:
        return "within 1%: " + ("**met**" if p / b - 1 <= 0.01 else "**not met**")
    if name == "kv-int8" and b:
        return "within 0.5%: " + ("**met**" if p / b - 1 <= 0.005 else "**not met**")
    return ""


def markdown(meta: dict, rows: list[dict], noise: dict[str, dict]) -> str:
    ppl = {r["method"]: r["ppl"] for r in rows}
    base = ppl.get("baseline")
    lines = ["# Perplexity by quantization method", "",
             f"{meta['model']}; text {meta['text']}, {rows[0]['tokens']} tokens scored, windows "
             f"of {meta['context']} ({meta['scoring']}). Calibration: {meta['calibration']}.", "",
             "95% interval: paired block bootstrap over the evaluation text (blocks of "
             f"{BLOCK} tokens); it covers the choice of evaluation text only, not the "
             "calibration sample.", "",
             "| method | description | ppl | vs baseline | 95% interval | target |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    for r in rows:
        rel = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else ""
        n = noise.get(r["method"]) or r.get("noise", {})   # kept rows: their saved intervals
        ci = ""
        if "ratio_ci" in n:
            lo, hi = n["ratio_ci"]
            ci = f"{100 * (lo - 1):+.1f}% .. {100 * (hi - 1):+.1f}%"
        if "gap_closed_ci" in n:
            lo, hi = n["gap_closed_ci"]
            ci += f"; gap closed {100 * lo:.0f}-{100 * hi:.0f}%"
        lines.append(f"| {r['method']} | {r['description']} | {r['ppl']:.4f} | {rel} | {ci} | "
                     f"{target(r['method'], ppl)} |")
    mixed = next((r for r in rows if r["method"] == "mixed-3.5bit" and "info" in r), None)
    if mixed and "allocation" in mixed["info"]:
        a = mixed["info"]["allocation"]
        lines += ["", f"Mixed precision at {a['avg_bits_budget']} bits: exact DP "
                  f"{a['avg_bits_exact']:.3f} bits, objective {a['objective_exact']:.6g}; greedy "
                  f"{a['avg_bits_greedy']:.3f} bits, objective {a['objective_greedy']:.6g}; "
                  f"optimality gap of the greedy allocation {100 * a['greedy_gap']:.2f}%; "
                  f"layers per width {mixed['info'].get('bits_histogram')}."]
    return "\n".join(lines) + "\n"


def nll_of(outs) -> list[float]:
    """Negative log-likelihood of every scored token of the engine's outputs."""
    res = []
    for o in outs:
        for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]):
            res.append(-pos[t].logprob)
    return res


def ppl_of(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))
