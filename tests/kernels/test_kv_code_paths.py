"""The decode kernel's paths over a quantized cache (decode_attention KV_DOT:
0 codes -> the query's dtype, 1 codes -> fp16 operands, 2 fp16 operands with V
read as 16-bit words, 3 as 2 with int8 K in int8 dots; kernels/code_tile.py) against the fp32 twin, including
the ranges the fp16 operands must survive: a query far past fp16's range and V
scales deep in fp16's subnormals. (The inline-PTX conversions run only on a GPU;
here the same arithmetic in Triton ops.)"""
import dataclasses

import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.decode_attention import decode_attention
from tests.kernels.conftest import check_quantized_tree, quantized_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(b, fmt, kv_dot, dtype=torch.float16, splits=3):
    kc, ks, vc, vs = quantized_cache(b, fmt)
    q = b.q.to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
    decode_attention(q, kc, vc, b.seq_lens, b.block_tables, 0.125, max_seq_len=int(b.seq_lens.max()),
                     num_splits=splits, out=out, k_scale=ks, v_scale=vs, config={"KV_DOT": kv_dot})
    ref = reference.decode_attention(q.float(), kc, vc, b.seq_lens, b.block_tables, 0.125,
                                     k_scale=ks, v_scale=vs)
    return out, ref


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("kv_dot", [0, 1, 2, 3])
def test_every_path_matches_the_twin(paged_batch, close, fmt, kv_dot):
    b = paged_batch([0, 6, 40, 99], [1] * 4, 8, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, fmt, kv_dot)
    close(out, ref, 4e-3, 4e-3)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_query_runs_on_fp16_operands(paged_batch, close, fmt):
    """bf16 activations (the engine's): exact operands, only the bf16 output rounds."""
    b = paged_batch([37, 70], [1, 1], 8, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, fmt, 2, torch.bfloat16)
    close(out, ref, 1e-2, 1e-2)


@pytest.mark.parametrize("fmt,kv_dot", [("int8", 2), ("int8", 3), ("fp8", 2)])
@pytest.mark.parametrize("q_gain,v_gain,dtype", [
    (1.0e5, 1.0, torch.bfloat16), (1.0e-8, 1.0, torch.bfloat16),
    (1.0, 1.0e-3, torch.float16), (1.0, 1.0e3, torch.float16)])
def test_fp16_operands_keep_the_range(paged_batch, fmt, kv_dot, q_gain, v_gain, dtype):
    """A bf16 query past fp16's range (1e5) or below its subnormals (1e-8), V
    scales of ~3e-5 (P x scale in fp16 subnormals) or ~30."""
    b = paged_batch([45, 99], [1, 1], 8, 2, 64, 16, dtype=torch.float32, device=DEVICE)
    b = dataclasses.replace(b, q=b.q * q_gain, v_cache=b.v_cache * v_gain)
    out, ref = _run(b, fmt, kv_dot, dtype)
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < (8e-3 if dtype == torch.bfloat16 else 2e-3), err


def test_fp32_query_keeps_fp32_operands(paged_batch, close):
    """An fp32 engine asks for the fp16 path and gets the exact one (fp32 tolerance)."""
    b = paged_batch([30, 64], [1, 1], 8, 2, 64, 16, dtype=torch.float32, device=DEVICE)
    out, ref = _run(b, "int8", 2, torch.float32)
    close(out, ref, 1e-4, 1e-4)


def test_unknown_path_is_refused(paged_batch):
    b = paged_batch([5], [1], 2, 2, 64, 16, device=DEVICE)
    with pytest.raises(ValueError, match="KV_DOT"):
        _run(b, "int8", 4)


@pytest.mark.parametrize("fmt,kv_dot", [("int8", 3), ("fp8", 2), ("fp8", 3)])
def test_tree_tiles_on_the_code_paths(paged_batch, close, fmt, kv_dot):
    """Tree verification (several query tokens a request, tall tiles) asked onto the
    fp16 / int8 paths (fp8 asked for int8 K dots gets fp16 ones)."""
    check_quantized_tree(paged_batch, close, fmt, DEVICE, config={"KV_DOT": kv_dot})
