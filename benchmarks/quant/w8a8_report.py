"""Markdown of bench_w8a8_prefill.py's results."""
from __future__ import annotations


def _gemm_tables(k: dict) -> list[str]:
    lines = [f"## GEMMs at M={k['m']} ({k['device']}, torch {k['torch']})", "",
             "Correctness first (rel. Frobenius error vs the twin); failing or erroring "
             "candidates are not timed. CUDA-graph replay, median.", "",
             "| shape | kernel | config | rel err | us | TFLOP/s | x bf16 |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    base = {r["shape"]: r["ms"] for r in k["gemm"] if r["kernel"] == "bf16" and "ms" in r}
    best = {}
    for r in k["gemm"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['kernel']} | {r['config']} | error: "
                         f"{r['error'][:60]} | | | |")
            continue
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['kernel']} | {r['config']} | {r['rel_err']:.2e} "
                         "FAILED | | | |")
            continue
        b = base.get(r["shape"])
        x = f"{b / r['ms']:.2f}" if b else ""
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['config'] or ''} | "
                     f"{r['rel_err']:.1e} | {r['ms'] * 1e3:.1f} | {r['tflops']:.0f} | {x} |")
        key = (r["shape"], r["kernel"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    lines += ["", "### Best per kernel, and the 32-layer sum (4 GEMMs per layer)", "",
              "| kernel | " + " | ".join(base) + " | 32 layers ms | x bf16 |",
              "| --- |" + " ---: |" * (len(base) + 2)]
    kernels = sorted({kk for _, kk in best}, key=lambda s: (s != "bf16", s))
    total_bf16 = 32 * sum(base.values())
    for kern in kernels:
        cells = [best.get((s, kern)) for s in base]
        if any(c is None for c in cells):
            continue
        tot = 32 * sum(c["ms"] for c in cells)
        lines.append(f"| {kern} | " + " | ".join(
            f"{c['ms'] * 1e3:.1f} us ({c['config'] or '-'})" for c in cells) +
            f" | {tot:.2f} | {total_bf16 / tot:.2f} |")
    return lines


def _producer_table(k: dict) -> list[str]:
    lines = ["", f"## Quantizing producers at M={k['m']}: unfused (kernel + quantize_rows) vs "
             "fused", "", "| producer | kind | codes max diff | share differing | scale rel err "
             "| plain us | unfused us | fused us | saved per layer us |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in k["producers"]:
        t = (f"{r['plain_ms'] * 1e3:.1f} | {r['unfused_ms'] * 1e3:.1f} | "
             f"{r['fused_ms'] * 1e3:.1f} | {(r['unfused_ms'] - r['fused_ms']) * 1e3:.1f}"
             if r["ok"] else "FAILED | | |")
        lines.append(f"| {r['producer']} | {r['kind']} | {r['code_max_diff']:g} | "
                     f"{r['code_diff_share']:.2e} | {r['scale_rel_err']:.1e} | {t} |")
    return lines


def _host_table(k: dict) -> list[str]:
    if not k.get("host"):
        return []
    return ["", f"## Host time per launch at M={k['m']} (enqueue only, best of 3 x 50 calls)",
            "", "| path | host us |", "| --- | ---: |"] + [
        f"| {r['path']} | {r['host_us']:.1f} |" for r in k["host"]]


def _e2e_tables(rows: list[dict]) -> list[str]:
    graphs = any(r.get("graphs") for r in rows)
    mode = "CUDA graphs: the prompt step in pieces around attention" if graphs else "enforce_eager"
    lines = ["", f"## End to end: one 2048-token prompt to its first token ({mode}, "
             "dummy Llama-3-8B; smoke: tiny)", "",
             "| variant | prefill ms | tok/s | x bf16 | fused producers | profiled wall ms "
             "| GPU kernel ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = next((r for r in rows if r.get("variant") == "bf16" and not r.get("failed")), None)
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['variant']} | failed | | | | | |")
            continue
        x = f"{r['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}" if base else ""
        p = r.get("profile", {})
        lines.append(f"| {r['variant']} | {r['prefill_ms']:.2f} | {r['prefill_tokens_per_s']:.0f}"
                     f" | {x} | {r['fused_producers']} | {p.get('wall_ms', float('nan')):.2f} | "
                     f"{p.get('gpu_kernel_ms', float('nan')):.2f} |")
    for r in rows:
        if r.get("failed") or "profile" not in r:
            continue
        lines += ["", f"### {r['variant']}: top kernels of one profiled prefill", "",
                  "| kernel | ms | calls |", "| --- | ---: | ---: |"]
        lines += [f"| `{t['kernel']}` | {t['ms']:.3f} | {t['calls']} |"
                  for t in r["profile"]["top"]]
        if r.get("tuned"):
            lines += ["", "Configurations chosen by tuning (key: kernel, N, K, dtypes, "
                      "[mode,] token bucket):", ""]
            lines += [f"- {k}: {v}" for k, v in r["tuned"].items()]
        if "table" in r["profile"]:
            lines += ["", "```", r["profile"]["table"], "```"]
    return lines


def markdown(result: dict) -> str:
    lines = ["# W8A8 prefill: kernels and end to end", ""]
    if "kernels_failed" in result:
        lines += ["## Kernel part FAILED", "", "```", result["kernels_failed"], "```", ""]
    if "kernels" in result:
        lines += _gemm_tables(result["kernels"]) + _producer_table(result["kernels"])
        lines += _host_table(result["kernels"])
    if "e2e" in result:
        lines += _e2e_tables(result["e2e"])
    return "\n".join(lines) + "\n"
