"""The fused all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py):
the kernel on the CPU interpreter, two processes sharing the inboxes and flags
as two GPUs share symmetric memory; and the layers' hand-over in a TP=2 engine
through the plain-PyTorch twin (gloo)."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from slipstream import SamplingParams
from slipstream.kernels import reference
from tests.distributed.test_tensor_parallel import _assert_same, _generate, split_kv_folder  # noqa: F401


def _rank(rank, protocol, calls, weight, inboxes, flags, outs):
    os.environ["TRITON_INTERPRET"] = "1"
    from slipstream.kernels.all_reduce_norm import all_reduce_rms_norm
    from slipstream.kernels.all_reduce_norm_lamport import all_reduce_rms_norm_lamport
    for i, (residual, partials) in enumerate(calls):
        if protocol == "flags":
            out, res = all_reduce_rms_norm(partials[rank], residual, weight, 1e-5, inboxes[rank],
                                           inboxes[1 - rank], flags[rank], flags[1 - rank],
                                           spin_limit=1 << 16)
        else:   # flags[rank]: this rank's call counts
            out, res = all_reduce_rms_norm_lamport(partials[rank], residual, weight, 1e-5,
                                                   inboxes[rank], inboxes[1 - rank], flags[rank],
                                                   spin_limit=1 << 16)
        outs[rank][i][0][: len(out)] = out
        outs[rank][i][1][: len(out)] = res


@pytest.mark.parametrize("protocol", ["flags", "lamport"])
@pytest.mark.parametrize("partial_dtype", [torch.float32, torch.float16])
def test_kernel_two_ranks_consecutive_calls(protocol, partial_dtype):
    """Calls of 3, 1, 4, 2, 2, 3, 1 rows in a row (inboxes and flags reused with no
    reset, the lamport slots going round twice): both ranks get the twin's result
    bit for bit; the flags end as they began, the inboxes empty."""
    from slipstream.kernels.all_reduce_norm import inbox_width
    from slipstream.kernels.all_reduce_norm_lamport import EMPTY, new_inbox
    torch.manual_seed(0)
    hidden, max_rows, dt = 96, 4, torch.float16
    weight = torch.randn(hidden).to(dt)
    if protocol == "flags":
        inboxes = [torch.zeros(max_rows, inbox_width(hidden)).share_memory_() for _ in range(2)]
        start = torch.tensor([0] * max_rows + [1] * max_rows, dtype=torch.int32)
    else:
        inboxes = [new_inbox(max_rows, hidden, "cpu").share_memory_() for _ in range(2)]
        start = torch.zeros(max_rows, dtype=torch.int32)
    flags = [start.clone().share_memory_() for _ in range(2)]
    calls = [(torch.randn(n, hidden).to(dt), [torch.randn(n, hidden).to(partial_dtype)
                                              for _ in range(2)]) for n in (3, 1, 4, 2, 2, 3, 1)]
    calls[0][1][0][0, :5] = -0.0   # the lamport marker's bits, sent as +0.0
    outs = [[tuple(torch.zeros(max_rows, hidden, dtype=dt).share_memory_() for _ in range(2))
             for _ in calls] for _ in range(2)]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, protocol, calls, weight, inboxes, flags, outs))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for i, (residual, partials) in enumerate(calls):
        n = len(residual)
        want_out, want_res = reference.all_reduce_rms_norm(partials, residual, weight, 1e-5)
        for r in range(2):
            assert torch.equal(outs[r][i][0][:n], want_out), (i, r)
            assert torch.equal(outs[r][i][1][:n], want_res), (i, r)
    if protocol == "flags":
        assert all(torch.equal(f, start) for f in flags)
    else:   # every row index's calls counted; every slot empty again
        counts = torch.tensor([sum(n > j for n in (3, 1, 4, 2, 2, 3, 1)) for j in range(max_rows)],
                              dtype=torch.int32)
        assert all(torch.equal(f, counts) for f in flags)
        assert all(bool((b == EMPTY).all()) for b in inboxes)


def test_inbox_too_small_is_refused():
    from slipstream.kernels.all_reduce_norm import all_reduce_rms_norm
    x = torch.zeros(5, 8)
    inbox, flags = torch.zeros(4, 8), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        all_reduce_rms_norm(x, x, torch.ones(8), 1e-5, inbox, inbox, flags, flags)


def test_tp2_with_sums_in_the_norms_matches_tp1(split_kv_folder, monkeypatch):
    """Every row-parallel output goes to the norm after it unreduced (the twin sums
    it there): TP=2 still gives TP=1's tokens and log-probs."""
    _, ref = _generate(split_kv_folder, 1)
    monkeypatch.setenv("SLIPSTREAM_FUSED_ALL_REDUCE_NORM", "reference")
    llm, got = _generate(split_kv_folder, 2)
    try:
        model = llm.engine.runner.model
        layers = model.model.layers
        op = layers[0].mlp.down_proj.defer_to
        assert op is not None and op.calls > 0
        assert layers[-1].self_attn.o_proj.defer_to is op and model.model.norm.reduce is op
        _assert_same(ref, got)
    finally:
        llm.engine.shutdown()


_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from slipstream.kernels.all_reduce_norm import _all_reduce_norm_kernel
from slipstream.kernels.all_reduce_norm_lamport import EMPTY, _all_reduce_norm_lamport_kernel
t = lambda dt: torch.empty(8, dtype=dt)
bf16, f32, i32 = t(torch.bfloat16), t(torch.float32), t(torch.int32)
args = dict(X=f32, Res=bf16, W=bf16, Out=bf16, ResOut=bf16, eps=1e-5, stride_x=4096,
            stride_r=4096, stride_o=4096, stride_ro=4096, max_rows=64)
if sys.argv[1] == "flags":
    k, args = _all_reduce_norm_kernel, dict(args, Inbox=f32, PeerInbox=f32, Flags=i32, PeerFlags=i32)
    const = dict(N=4096, BLOCK=4096, SPIN=30 * 10**9, PDL=True, TIMED=True)
else:
    k, args = _all_reduce_norm_lamport_kernel, dict(args, Inbox=i32, PeerInbox=i32, Count=i32)
    const = dict(N=4096, BLOCK=4096, SPIN=30 * 10**9, PDL=True, EMPTY_BITS=EMPTY, TIMED=True)
sig = {n: "constexpr" if n in const else mangle_type(args[n]) for n in k.arg_names}
c = triton.compile(ASTSource(k, sig, const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=16))
print(c.asm["ptx"])
"""


@pytest.mark.parametrize("protocol", ["flags", "lamport"])
def test_kernel_compiles_for_sm90(protocol):
    """What the interpreter cannot show: the flags compile to system-scope acquire /
    release atomics (visible across the NVLink pair), the lamport polls to volatile
    loads, and the early launch waits."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", _COMPILE, protocol], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ptx = run.stdout
    assert "griddepcontrol.wait" in ptx and "%globaltimer" in ptx
    if protocol == "flags":
        assert "atom.global.acquire.sys.cas.b32" in ptx
        assert "atom.global.sys.release.exch.b32" in ptx or "atom.global.release.sys.exch.b32" in ptx
    else:
        assert "ld.volatile.global" in ptx and "atom" not in ptx


def test_build_options(monkeypatch):
    """On by default, but only for two CUDA ranks: nothing to build on the CPU; a bad
    value is refused by name."""
    from slipstream.distributed import all_reduce_norm
    monkeypatch.delenv(all_reduce_norm.ENV, raising=False)
    assert all_reduce_norm.build(object(), torch.device("cpu"), 64, torch.float32) is None
    monkeypatch.setenv(all_reduce_norm.ENV, "0")
    assert all_reduce_norm.build(object(), torch.device("cuda", 0), 64, torch.bfloat16) is None
    monkeypatch.setenv(all_reduce_norm.ENV, "yes")
    with pytest.raises(ValueError, match="SLIPSTREAM_FUSED_ALL_REDUCE_NORM"):
        all_reduce_norm.build(object(), torch.device("cpu"), 64, torch.float32)
