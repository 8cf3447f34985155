"""Compile the Gluon prefill kernel for sm_90 ahead of time, without a GPU, and
read what it compiled to.

Triton's compiler runs for a named target with its bundled LLVM and ptxas, so a
CPU-only machine (CI) can check that every kernel variant still compiles and
has the FlashAttention-3 shape: the scores' wgmma group and the previous tile's
P.V group both in flight (two commits, then `wait_group 1`) while the softmax's
exp2 runs, in the PTX and, after ptxas's scheduling, in the SASS (exp2 between
`WARPGROUP.DEPBAR.LE gsb0, 0x1` and the next `..., 0x0`).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from slipstream.kernels import gluon_prefill

SM90 = GPUTarget("cuda", 90, 32)
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def compile_prefill(config: dict | None = None, *, causal: bool = True,
                    dtype: torch.dtype = torch.bfloat16, heads: int = 16, kv_heads: int = 16,
                    tokens: int = 4096, head_dim: int = 128):
    """The compiled kernel (triton CompiledKernel: .asm["ptx"], ["cubin"],
    .metadata.shared) for one config, built from CPU tensors of the given shape."""
    q = torch.empty(tokens, heads, head_dim, dtype=dtype)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    args, consts, _ = gluon_prefill.kernel_args(q, k, k, out, cu, tokens, head_dim ** -0.5, causal,
                                                config or {}, [tokens])
    return _compile(gluon_prefill._prefill_kernel, args, consts)


def compile_paged_prefill(config: dict | None = None, *, causal: bool = True,
                          dtype: torch.dtype = torch.bfloat16, heads: int = 16, kv_heads: int = 16,
                          tokens: int = 1024, context: int = 3072, page: int = 16,
                          head_dim: int = 128):
    """compile_prefill for paged K/V (gluon_prefill_paged): one request of `tokens`
    queries after `context` cached keys, in pages of `page` tokens."""
    q = torch.empty(tokens, heads, head_dim, dtype=dtype)
    blocks = -(-(context + tokens) // page)
    cache = torch.empty(blocks, page, kv_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    kv_lens = torch.tensor([context + tokens], dtype=torch.int32)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    cfg = config if config is not None else {**gluon_prefill.CHOSEN["config"], "PERSISTENT": False}
    args, consts, _ = gluon_prefill.kernel_args(q, cache, cache, out, cu, tokens, head_dim ** -0.5,
                                                causal, cfg, paged=(kv_lens, tables))
    return _compile(gluon_prefill._prefill_kernel, args, consts)


def compile_fp8_prefill(config: dict | None = None, *, causal: bool = True,
                        out_dtype: torch.dtype = torch.bfloat16, heads: int = 16, kv_heads: int = 16,
                        tokens: int = 4096, head_dim: int = 128, fp8_v: bool = True,
                        key_perm: bool = False):
    """compile_prefill for the FP8 kernel (gluon_fp8_prefill), from CPU tensors
    (fp8_v False: QK^T-only FP8, V in out_dtype; key_perm: V^T's tokens in the order of
    the shuffle-free P operand, fp8_v only)."""
    from slipstream.kernels import gluon_fp8_prefill
    from slipstream.kernels.gluon_fp8_inputs import Fp8Inputs
    fp8 = torch.float8_e4m3fn
    q = torch.empty(tokens, heads, head_dim, dtype=fp8)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=fp8)
    vt = torch.empty(kv_heads * head_dim, tokens + (-tokens) % 16, dtype=fp8) if fp8_v else \
        torch.empty(tokens, kv_heads, head_dim, dtype=out_dtype)
    q_scale, kv_scale = torch.empty(tokens, heads), torch.empty(tokens, kv_heads)
    out = torch.empty(tokens, heads, head_dim, dtype=out_dtype)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    x = Fp8Inputs(q, k, vt, q_scale, kv_scale, kv_scale, 128, cu, torch.arange(tokens), key_perm and fp8_v)
    args, consts, _ = gluon_fp8_prefill.fp8_kernel_args(x, out, cu, tokens, head_dim ** -0.5, causal,
                                                        config or {}, [tokens])
    return _compile(gluon_fp8_prefill._fp8_prefill_kernel, args, consts)


def _compile(kernel, args, consts):
    options = {o: consts[o] for o in _OPTIONS if o in consts}
    consts = {n: v for n, v in consts.items() if n not in ("num_stages", "maxnreg")}
    values = dict(zip(kernel.arg_names, args))
    sig = {n: "constexpr" if n in consts else mangle_type(values[n]) for n in kernel.arg_names}
    return triton.compile(GluonASTSource(kernel, sig, consts), target=SM90, options=options)


def _event(line: str) -> str | None:
    m = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", line)
    if m:
        return "wait" + m.group(1)
    for pat, name in (("wgmma.mma_async", "mma"), ("wgmma.commit_group", "commit"),
                      ("ex2.approx", "exp2"), ("cp.async.bulk.tensor", "tma")):
        if pat in line:
            return name
    return None


def overlap_report(ptx: str) -> dict:
    """wgmma count, and whether exp2 (the softmax) follows a `wait_group 1`
    that was preceded by two commit groups in a row (the scores' and P.V's),
    before any `wait_group 0`. After the wait, branches are followed (the
    softmax may sit in a block placed earlier in the text)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\$L\w+):", ln.strip()))}
    events = [_event(ln) for ln in lines]
    overlapped = False
    for i, ev in enumerate(events):
        if ev != "wait1":
            continue
        before = [e for e in events[:i] if e in ("commit", "wait0", "wait1")][-2:]
        j, steps = i + 1, 0
        while j < len(lines) and steps < 20000 and before == ["commit", "commit"]:
            if events[j] == "exp2":
                overlapped = True
                break
            if events[j] == "wait0":
                break
            m = re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", lines[j])
            if m and "waitLoop" not in lines[j] and m.group(1) in labels:
                j = labels[m.group(1)]
            j, steps = j + 1, steps + 1
    return {"wgmma": events.count("mma"), "commits": events.count("commit"),
            "softmax_under_two_groups": overlapped, "tma_copies": events.count("tma")}


def ring_report(kernel) -> dict:
    """What a compiled TMA-ring GEMV (tma_gemv.py, tma_int8_gemv.py) should show: shared
    memory, TMA copies in the PTX (the ring's first fill and refills), the PDL wait and
    trigger, and register spills (STL) in the SASS."""
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "tma": ptx.count("cp.async.bulk.tensor"),
            "wait": "griddepcontrol.wait" in ptx,
            "trigger": "griddepcontrol.launch_dependents" in ptx,
            "spills": sass(kernel.asm["cubin"]).count("STL")}


def _cuobjdump() -> Path:
    import triton.backends.nvidia as nv
    return Path(nv.__file__).parent / "bin" / "cuobjdump"


def sass(cubin: bytes) -> str:
    """The cubin's SASS (cuobjdump; FileNotFoundError where Triton ships none)."""
    tool = _cuobjdump()
    if not tool.exists():
        raise FileNotFoundError(tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_overlap(cubin: bytes) -> list[int]:
    """For each `WARPGROUP.DEPBAR.LE gsb0, 0x1` in the SASS, how many MUFU.EX2
    run before the next full wait (`..., 0x0`), following unconditional
    branches and the fall-through of conditional ones. Raises FileNotFoundError
    where Triton ships no cuobjdump."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for ln in sass(cubin).splitlines()
           if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln))]
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    counts = []
    for i, (_, text) in enumerate(ins):
        if "DEPBAR.LE gsb0, 0x1" not in text:
            continue
        j, exp2, steps = i + 1, 0, 0
        while j < len(ins) and steps < 20000 and "DEPBAR.LE gsb0, 0x0" not in ins[j][1]:
            exp2 += "MUFU.EX2" in ins[j][1]
            m = re.match(r"BRA (0x[0-9a-f]+)", ins[j][1])  # unconditional only
            j = at.get(int(m.group(1), 16), j + 1) if m else j + 1
            steps += 1
        counts.append(exp2)
    return counts


def chain_depth(code: str, opcode: str) -> int:
    """The longest run of `opcode` instructions in the SASS (cuobjdump text) each of which
    reads the register the one before wrote, in program order (a register written by any
    other instruction starts over): 31 for a row max taken one value after another over
    a thread's 32, ~5 for pairwise halving."""
    depth: dict[str, int] = {}
    best = 0
    for ln in code.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+([^;]*);", ln)
        if not m:
            continue
        ops = [o.strip() for o in m.group(2).split(",")]
        if not ops or not re.fullmatch(r"R\d+", ops[0]):
            continue
        if m.group(1).split(".")[0] == opcode:
            d = 1 + max((depth.get(o.lstrip("-|"), 0) for o in ops[1:]), default=0)
            depth[ops[0]] = d
            best = max(best, d)
        else:
            depth.pop(ops[0], None)
    return best
