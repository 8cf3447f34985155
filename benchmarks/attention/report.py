"""Turn the benchmark's result dict into Markdown tables."""
from __future__ import annotations


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def _ratio(a, b):
    return None if a is None or not b else a / b


def prefill_rows(res) -> list[str]:
    rows = ["| case | N | B | causal | SDPA flash | SDPA cuDNN | ours | ours / flash | ours / cuDNN | rel err |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    dense = {r["N"]: r for r in res["prefill"] if r["case"] == "dense" and r["causal"]}
    for r in res["prefill"]:
        ours = r.get("ours_tflops")
        if r["case"] == "dense":
            fl, cu = r.get("sdpa_flash_tflops"), r.get("sdpa_cudnn_tflops")
            n, b, causal = r["N"], r["B"], r["causal"]
        elif r["case"] == "varlen":
            fl, cu = r.get("sdpa_flash_loop_tflops"), r.get("sdpa_cudnn_loop_tflops")
            n, b, causal = f"{min(r['lengths'])}-{max(r['lengths'])}", len(r["lengths"]), True
        else:  # paged: against dense SDPA at the same total length
            d = dense.get(r["context"] + r["new"], {})
            fl, cu = d.get("sdpa_flash_tflops"), d.get("sdpa_cudnn_tflops")
            n, b, causal = f"{r['context']}+{r['new']}", r["B"], True
        rows.append(f"| {r['case']} | {n} | {b} | {causal} | {_f(fl)} | {_f(cu)} | {_f(ours)} | "
                    f"{_f(_ratio(ours, fl), '{:.2f}x')} | {_f(_ratio(ours, cu), '{:.2f}x')} | "
                    f"{_f(r.get('err_vs_sdpa'), '{:.1e}')} |")
    return rows


def decode_rows(res) -> list[str]:
    rows = ["| B | L | splits | ours (us) | ours % copy BW | unchained % | SDPA (us) | SDPA % copy BW "
            "| speed-up | rel err |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["decode"]:
        rows.append(f"| {r['B']} | {r['L']} | {r['splits_auto']} | {_f(r['ours_us'], '{:.1f}')} | "
                    f"{_f(r['ours_pct_copy_bw'], '{:.0f}%')} | "
                    f"{_f(r.get('ours_unchained_pct_copy_bw'), '{:.0f}%')} | "
                    f"{_f(r.get('sdpa_us'), '{:.1f}')} | "
                    f"{_f(r.get('sdpa_pct_copy_bw'), '{:.0f}%')} | "
                    f"{_f(_ratio(r.get('sdpa_us'), r['ours_us']), '{:.2f}x')} | "
                    f"{_f(r['err_vs_fp32'], '{:.1e}')} |")
    return rows


def _sweeps(res) -> list[str]:
    out = []
    for r in res.get("sweeps", []):
        head = f"{r['case']} N={r.get('N')} causal={r.get('causal')}" if r["case"] == "dense" \
            else f"decode B={r['B']} L={r['L']}"
        out.append(f"\n**{head}**\n")
        for name, v in sorted(r["sweep"].items(), key=lambda kv: -kv[1].get("tflops", kv[1].get("pct_copy_bw", 0))):
            out.append(f"- {name}: {v}")
    tree = res.get("tree_sweep")
    if tree and "sweep" in tree:
        out.append(f"\n**tree B={tree['B']} context={tree['context']} nodes={tree['nodes']}**\n")
        for name, v in sorted(tree["sweep"].items(), key=lambda kv: -kv[1].get("pct_copy_bw", 0)):
            out.append(f"- {name}: {v}")
    return out


def markdown(res) -> str:
    m, c = res["meta"], res["ceilings"]
    lines = [f"# Attention kernels: {m['device']}, {m['date_utc']}", "",
             f"torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, commit {m['commit']}.",
             f"Tests on the GPU: {res.get('tests', {}).get('summary')}", "",
             f"Ceilings measured in this run: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s "
             f"(read + write), bf16 matmul 8192^3 {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s.", "",
             "## Prefill (bf16, hdim 128, 16 heads, TFLOP/s)", "", *prefill_rows(res), "",
             "## Decode (bf16, GQA 32/8, hdim 128, page 16; % of measured copy bandwidth)", "",
             *decode_rows(res), ""]
    t = res.get("tree")
    if t:
        lines += ["## Tree verification", "",
                  f"B={t['B']}, context {t['context']}, {t['nodes']}-node tree: {t['ours_us']:.1f} us, "
                  f"{t['ours_pct_copy_bw']:.0f}% of copy BW, rel err {t['err_vs_fp32']:.1e}.", ""]
    f = res.get("fp8")
    if f:
        lines += ["## FP8 (QK^T in e4m3), accuracy against exact attention (fp64)", "",
                  f"Data: {f['data']}; B={f['B']}, N={f['N']}, causal. Relative error ||out - exact|| / ||exact||:", ""]
        lines += [f"- {k[4:]}: {v:.2e}" for k, v in f.items() if k.startswith("err_")]
        lines += ["", f"Speed (TFLOP/s): bf16 kernel {f['bf16_tflops']:.0f}, FP8 kernel {f['fp8_kernel_tflops']:.0f}, "
                  f"FP8 with rotation and quantisation {f['fp8_with_rotation_and_quant_tflops']:.0f}.", ""]
    sweeps = _sweeps(res)
    if sweeps:
        lines += ["## Config sweeps", *sweeps, ""]
    return "\n".join(lines)


def short_table(res) -> str:
    return "\n".join(prefill_rows(res) + [""] + decode_rows(res))
