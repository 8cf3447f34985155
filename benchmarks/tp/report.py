"""bench_tp.py's summary: token comparisons, the Markdown report, and the
profile files packed into one archive."""
from __future__ import annotations

from pathlib import Path

# Collectives of one decode step on the critical path (analysis/tensor_parallel.py):
# 2 all-reduces per layer + the embedding's.
ALL_REDUCES = {"8b": (2 * 32 + 1, "8KiB"), "70b": (2 * 80 + 1, "16KiB")}


def compare(a: dict, b: dict) -> dict:
    same = [x == y for x, y in zip(a["tokens"], b["tokens"])]
    first_diff = []
    for x, y in zip(a["tokens"], b["tokens"]):
        first_diff.append(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None))
    dl = [abs(p - q) for la, lb, x, y in zip(a["logprobs"], b["logprobs"], a["tokens"], b["tokens"])
          for p, q, s, t in zip(la, lb, x, y) if s == t]
    return {"prompts_identical": sum(same), "prompts": len(same), "first_difference": first_diff,
            "max_logprob_diff_on_equal_tokens": max(dl) if dl else None}


def markdown(res: dict, stages: tuple[str, ...]) -> str:
    lines = ["# Tensor parallelism on " + ("the CPU (smoke: times mean nothing)" if res["smoke"]
                                           else "2x H200 (NCCL)"), ""]
    ar = res["stages"].get("allreduce", {})
    if "error" not in ar:
        lines += ["| all-reduce | NCCL eager us | NCCL graph us | one-shot symm graph us | bus GB/s (eager) |",
                  "|---|---|---|---|---|"]
        for k, r in ar.items():
            if isinstance(r, dict) and "eager_us" in r:
                lines.append(f"| {k} | {r['eager_us']:.1f} | {r.get('graph_us', float('nan')):.1f} "
                             f"| {r.get('symm_graph_us', float('nan')):.1f} | {r['bus_GBps_eager']:.1f} |")
        for k, r in ar.get("norm", {}).items():
            lines.append(f"Decode row sum + residual add + RMSNorm, {k}: NCCL + norm kernel "
                         f"{r['nccl_cast_norm_us']:.1f} us, fused lamport "
                         f"{r.get('fused_us', float('nan')):.1f} us (equal: {r.get('fused_correct')}"
                         f"{', ' + r['fused_error'] if 'fused_error' in r else ''}), fused flags "
                         f"{r.get('fused_flags_us', float('nan')):.1f} us (equal: "
                         f"{r.get('fused_flags_correct')}"
                         f"{', ' + r['fused_flags_error'] if 'fused_flags_error' in r else ''})")
        lines.append("")
    lines += ["| stage | decode step ms | tok/s | weights/GPU GB | copy GB/s | share of copy bw "
              "| rank 0 host waits ms/step |", "|---|---|---|---|---|---|---|"]
    for name in stages[1:]:
        r = res["stages"].get(name, {})
        if not r:
            continue   # not run (--stages)
        if "error" in r:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        if "decode_step_ms" not in r:
            continue   # a correctness-only stage
        lines.append(f"| {name} | {r['decode_step_ms']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['weight_bytes_per_gpu'] / 1e9:.2f} | {r['copy_bandwidth_GBps']:.0f} | "
                     f"{r['share_of_copy_bandwidth'] * 100:.1f}% | "
                     f"{r.get('host_wait_ms_per_step', float('nan')):.3f} |")
    for name, r in res["stages"].items():
        if name.endswith("-prof") and "error" not in r:
            p = r["rank0"]
            lines.append(f"\n{name}: {r['decode_step_ms_unprofiled']:.3f} ms a step unprofiled; "
                         f"rank 0 profiled: wall {p['wall_ms_per_step']:.3f} ms (host waits "
                         f"{p['resolve_wait_ms_per_step']:.3f}), kernels "
                         f"{p['kernel_ms_per_step']:.3f} ms, busy {p['busy_ms_per_step']} ms, "
                         f"collectives {p['collective_ms_per_step']:.3f} ms (every rank's "
                         f"tables: {name}_rank*_kernels.md in profiles.tar.gz)")
    c = res.get("correctness_8b")
    if c:
        lines += ["", f"TP=2 vs TP=1 greedy tokens (8B shape, 4 prompts x 32 tokens): "
                      f"{c['prompts_identical']}/{c['prompts']} identical; first differences "
                      f"{c['first_difference']}; max |logprob diff| on equal tokens "
                      f"{c['max_logprob_diff_on_equal_tokens']}"]
    c = res.get("correctness_8b_fp32")
    if c:
        lines += [f"The same in float32 weights and activations: {c['prompts_identical']}/"
                  f"{c['prompts']} identical; first differences {c['first_difference']}; max "
                  f"|logprob diff| on equal tokens {c['max_logprob_diff_on_equal_tokens']}"]
    s = res.get("speedup_8b_tp2")
    if s:
        lines.append(f"8B batch-1 decode, TP=2 over TP=1: {s:.2f}x (target 1.6x)")
    for name, c in res.get("fused_vs_nccl", {}).items():
        lines.append(f"{name} (sums fused into the norms) vs 8b-tp2 (NCCL): "
                     f"{c['prompts_identical']}/{c['prompts']} prompts with identical tokens "
                     f"(expected: all), first differences {c['first_difference']}; step "
                     f"{c['speedup']:.3f}x the speed of NCCL + the norm kernel"
                     + (f"; over TP=1: {c['over_tp1']:.2f}x (target 1.6x)" if c["over_tp1"] else ""))
    if res.get("fused_speedup_70b_tp2"):
        lines.append(f"70B-class TP=2 with sums fused into the norms: step "
                     f"{res['fused_speedup_70b_tp2']:.3f}x the speed with NCCL")
    s = res.get("speedup_8b_tp2_symm")
    if s:
        lines.append(f"8B batch-1 decode, TP=2 with the one-shot symmetric-memory all-reduce, "
                     f"over TP=1: {s:.2f}x")
    for size, (calls, label) in ALL_REDUCES.items():
        r = ar.get(label) if "error" not in ar else None
        if r:
            t = r.get("graph_us", r["eager_us"])
            lines.append(f"{size} decode step: {calls} all-reduces of [1, hidden] bf16 x {t:.1f} us "
                         f"= {calls * t / 1e3:.3f} ms per step "
                         f"({'CUDA graph' if 'graph_us' in r else 'eager'} timing above)")
    return "\n".join(lines) + "\n"


def pack_profiles(out: Path) -> None:
    """Every rank's profile files in one archive, profiles.tar.gz (a run's results
    come back from the GPU machine as a limited number of files)."""
    import tarfile
    files = sorted(p for p in out.iterdir() if p.name.endswith(("_kernels.json", "_kernels.md",
                                                                 "_trace.json")))
    if not files:
        return
    with tarfile.open(out / "profiles.tar.gz", "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.name)
    for p in files:
        p.unlink()
