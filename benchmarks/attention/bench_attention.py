"""Attention kernels on the GPU, in one run: correctness, ceilings, speed.

    python benchmarks/attention/bench_attention.py --out DIR [--sweep] [--commit SHA]

1. runs tests/kernels on the GPU (fp16 and bf16 against the plain-PyTorch twins);
2. measures the device's ceilings (device-to-device copy, bf16 matmul);
3. times prefill (dense against torch SDPA flash and cuDNN; varlen; paged KV;
   FP8), decode (paged, GQA 32/8, against SDPA on contiguous KV) and tree
   verification, each output checked against a reference first;
4. writes DIR/attention_results.json and .md, and prints the short table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

import torch  # noqa: E402
import triton  # noqa: E402

import decode_cases  # noqa: E402
import prefill_cases  # noqa: E402
from report import markdown, short_table  # noqa: E402


def ceilings() -> dict:
    try:
        from slipstream.analysis.hardware import measure_copy_bandwidth, measure_matmul_rate
    except ImportError:  # measured inline where the analysis layer is absent
        def measure_copy_bandwidth(device):
            src = torch.rand(1 << 28, device=device)
            dst = torch.empty_like(src)
            return 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)

        def measure_matmul_rate(device):
            a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
            return 2 * 8192 ** 3 / (triton.testing.do_bench(lambda: a @ b, return_mode="median") * 1e-3)
    return {"copy_bytes_per_s": measure_copy_bandwidth("cuda"),
            "bf16_matmul_flops": measure_matmul_rate("cuda")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sweep", action="store_true", help="also time explicit tile configs")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="tests, ceilings and sweeps only")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"meta": {
        "device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "commit": args.commit, "sweep": args.sweep}}

    def save():
        (args.out / "attention_results.json").write_text(json.dumps(res, indent=1))

    if not args.skip_tests:
        log("tests/kernels on the GPU")
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8",
                            str(ROOT / "tests/kernels")], capture_output=True, text=True, cwd=ROOT)
        res["tests"] = {"rc": p.returncode, "summary": p.stdout.strip().splitlines()[-1:],
                        "failures": p.stdout[-3000:] if p.returncode else ""}
        log(f"  {res['tests']['summary']} rc={p.returncode}")
        save()

    log("ceilings")
    res["ceilings"] = ceilings()
    log(f"  {res['ceilings']}")
    save()

    copy_bw = res["ceilings"]["copy_bytes_per_s"]
    if args.sweep_only:
        sweeps(res, copy_bw, log, save)
        return
    res["prefill"] = []
    for n in (1024, 4096, 16384):
        for causal in (True, False):
            log(f"prefill dense N={n} causal={causal}")
            res["prefill"].append(prefill_cases.dense(n, causal, log))
            log(f"  {res['prefill'][-1]}")
            save()
    log("prefill varlen")
    res["prefill"].append(prefill_cases.varlen(log))
    log(f"  {res['prefill'][-1]}")
    log("prefill paged")
    res["prefill"] += prefill_cases.paged(log)
    save()

    res["decode"] = []
    for b, length in ((1, 4096), (1, 32768), (1, 131072), (16, 4096), (64, 4096)):
        log(f"decode B={b} L={length}")
        res["decode"].append(decode_cases.decode(b, length, copy_bw, log))
        save()
    log("tree")
    res["tree"] = decode_cases.tree(copy_bw, log)
    log("fp8")
    res["fp8"] = prefill_cases.fp8(log)
    save()
    (args.out / "attention_results.md").write_text(markdown(res))

    # Sweeps last: an experimental config that faults the CUDA context must not
    # cost the results above.
    if args.sweep:
        sweeps(res, copy_bw, log, save)
    (args.out / "attention_results.md").write_text(markdown(res))
    log("done")
    print(short_table(res))


def sweeps(res, copy_bw, log, save) -> None:
    res["sweeps"] = []
    for b, length in ((1, 32768), (1, 4096), (16, 4096)):
        log(f"sweep decode B={b} L={length}")
        res["sweeps"].append(decode_cases.decode_sweep(b, length, copy_bw, log))
        save()
    log("sweep tree")
    res["tree_sweep"] = decode_cases.tree(copy_bw, log, sweep=True)
    save()
    for n, causal in ((4096, True), (16384, True), (4096, False), (1024, True)):
        log(f"sweep prefill N={n} causal={causal}")
        res["sweeps"].append(prefill_cases.dense_sweep(n, causal, log))
        save()


if __name__ == "__main__":
    main()
