"""Instructions a key of the decode kernel's main loop on Hopper, without a GPU.

Compiles the split-KV decode kernel (kernels/decode_attention.py) for sm_90 with
Triton and the ptxas / nvdisasm bundled in its wheel, finds the unmasked K/V loop
in the SASS (the shortest loop with MMAs: the masked one adds the masks) and counts its instructions:
warp instructions a key (loop instructions x warps / BLOCK_N) and the mix (code
conversions, shared loads, MMAs). This is how the quantized cache's paths were
compared before any device time: a loop that issues 2.5x the bf16 loop's
instructions a key cannot stream half the bytes faster.

    python benchmarks/quant/kv_decode_sass.py                      # the table below
    python benchmarks/quant/kv_decode_sass.py --kv int8 --kv-dot 3 --block-n 128 --warps 4 --stages 6 --json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "attention"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import compile_report as cr  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
# (kv, KV_DOT, ASM, BLOCK_N, warps, stages): the bf16 loop, then each quantized path.
TABLE = [("bf16", 0, True, 64, 2, 6)] + [
    (kv, dot, asm, 128, 4, 6) for kv in ("int8", "fp8")
    for dot, asm in ((0, True), (1, True), (2, False), (2, True), (3, True))
    if not (dot == 3 and kv == "fp8")]
GROUPS = {"convert": ("PRMT", "HADD2", "LOP3", "F2F", "F2FP", "I2F", "SHF.R.U32"),
          "shared_load": ("LDS", "LDSM"), "mma": ("HMMA", "IMMA")}


def compile_sass(kv, kv_dot, asm, block_n, warps, stages) -> str:
    args = argparse.Namespace(group=4, head_dim=128, block_m=16, block_n=block_n, page_size=16,
                              tree=False, kv=kv)
    fn, consts, _ = cr.decode_kernel(args)
    consts.update(KV_DOT=kv_dot if kv != "bf16" else 0, ASM=asm)
    cr.PTR_ARGS["KCache"] = cr.PTR_ARGS["VCache"] = cr.KV_TYPES[kv]
    sig, attrs = cr.signature(fn, consts, {})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    return disassemble(kernel)


def disassemble(kernel) -> str:
    """The SASS of a kernel compiled by triton.compile (nvdisasm from Triton's wheel)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(NVDISASM), "-c", path], capture_output=True, text=True,
                              check=True).stdout


def loop_counts(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop of the SASS (a label and the branch back to it)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", l))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = collections.Counter()
            for body in lines[labels[m.group(1)]:i + 1]:
                op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", body)
                if op:
                    ops[op.group(1)] += 1
            loops.append(ops)
    return loops


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the unmasked K/V loop: of the loops holding MMAs, the
    shortest (the masked one adds the masks)."""
    mma = [ops for ops in loop_counts(sass) if any(op.startswith(("HMMA", "IMMA")) for op in ops)]
    return min(mma, key=lambda ops: sum(ops.values()), default=collections.Counter())


def report(kv, kv_dot, asm, block_n, warps, stages) -> dict:
    ops = main_loop(compile_sass(kv, kv_dot, asm, block_n, warps, stages))
    total = sum(ops.values())
    row = {"kv": kv, "kv_dot": kv_dot if kv != "bf16" else 0, "asm": asm, "block_n": block_n,
           "warps": warps, "stages": stages, "loop_instructions": total,
           "warp_instructions_a_key": total * warps / block_n}
    for group, prefixes in GROUPS.items():
        row[group] = sum(n for op, n in ops.items() if op.startswith(prefixes))
    row["top"] = ops.most_common(8)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", choices=tuple(cr.KV_TYPES))
    ap.add_argument("--kv-dot", type=int, default=3)
    ap.add_argument("--no-asm", action="store_true")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kv_decode_sass needs compiled kernels: unset TRITON_INTERPRET")
    rows = [(args.kv, args.kv_dot, not args.no_asm, args.block_n, args.warps, args.stages)] \
        if args.kv else TABLE
    results = [report(*r) for r in rows]
    if args.json:
        print(json.dumps(results))
        return
    print("| KV | KV_DOT | ASM | tile | loop instr (a warp) | warp instr a key | convert | shared loads | MMA |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['kv']} | {r['kv_dot']} | {r['asm']} | N{r['block_n']} w{r['warps']} s{r['stages']} | "
              f"{r['loop_instructions']} | {r['warp_instructions_a_key']:.1f} | {r['convert']} | "
              f"{r['shared_load']} | {r['mma']} |")


if __name__ == "__main__":
    main()
