"""One launch of each Gluon prefill kernel inside a profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section InstructionStats \\
        python benchmarks/attention/profile_gluon.py

The bf16 kernel (the config the backend picks) and the FP8 kernel (its default, on
inputs quantised beforehand) on the benchmark's shapes: hdim 128, 16 heads, 16k
tokens as 1 x 16k and 4 x 4k, causal and not. Kernels are compiled and warmed up
first, so only the launches below are profiled, in the order printed.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

from slipstream.kernels.gluon_fp8_inputs import quantize_fp8_inputs  # noqa: E402
from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill  # noqa: E402
from slipstream.kernels.gluon_prefill import gluon_prefill  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
SHAPES = [(16384, True), (4096, True), (16384, False), (4096, False)]  # (request length, causal)


def calls():
    """[(name, thunk)] for every kernel and shape."""
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, causal in SHAPES:
        q, k, v = (torch.randn(TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        cu = torch.arange(0, TOKENS + 1, n, dtype=torch.int32, device="cuda")
        lengths = [n] * (TOKENS // n)
        o = torch.empty_like(q)
        x = quantize_fp8_inputs(q, k, v, cu)
        tag = f"{TOKENS // n}x{n // 1024}k{' causal' if causal else ''}"
        out.append((f"bf16 {tag}", lambda q=q, k=k, v=v, cu=cu, n=n, c=causal, o=o, ln=lengths:
                    gluon_prefill(q, k, v, cu, n, HEAD_DIM ** -0.5, causal=c, out=o, lengths=ln)))
        out.append((f"fp8 {tag}", lambda x=x, cu=cu, n=n, c=causal, ln=lengths:
                    gluon_fp8_prefill(x, cu, n, HEAD_DIM ** -0.5, causal=c, lengths=ln)))
    return out


def main() -> None:
    todo = calls()
    for _, c in todo:  # compile and warm up outside the profiled range
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, c in todo:
        print("profiled:", name, flush=True)
        c()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
