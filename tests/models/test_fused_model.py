"""The model with its fused kernels (add + RMSNorm, in-place rotary, SiLU * up,
forced on under TRITON_INTERPRET=1 on the CPU) against the same model on its
plain torch path, over a prefill and a decode step, for every architecture
variant. fp32: max |logit diff| < 1e-4 (only fp32 operation order differs)."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.runtime import interpreting
from slipstream.layers.activation import SiluAndMul
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
from tests.models.tiny_models import VARIANTS, make_hf_model, make_ours

BLOCK_SIZE, NUM_BLOCKS, SEQ_LEN = 4, 32, 11
# The kernels run here on CPU tensors, which only the interpreter takes; on a GPU
# machine benchmarks/runtime/bench_fused_ops.py checks the model on the device.
pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _use_kernels(model, on: bool) -> None:
    n = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            m.use_kernel = on
            n += 1
    assert n > 0


def _prefill_then_decode(model, ids: list[int]) -> torch.Tensor:
    allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    seq = Sequence(ids, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS, 0))
    out = []
    with torch.inference_mode():
        for n in (len(ids) - 1, 1):   # a prefill, then one decode step
            batch = make_batch([(seq, n)])
            model.backend.prepare(batch)
            out.append(model.compute_logits(model(batch)[batch.logits_indices]))
    return torch.cat(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_path_matches_torch_path(variant):
    model = make_ours(make_hf_model(variant))
    ids = torch.randint(0, model.config.vocab_size, (SEQ_LEN,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    _use_kernels(model, False)
    want = _prefill_then_decode(model, ids)
    _use_kernels(model, True)
    got = _prefill_then_decode(model, ids)
    assert want.std() > 0.5   # random weights: a real spread of logits
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"{variant}: max |logit diff| {diff:.2e}"


def test_decode_layer_launch_budget(monkeypatch):
    """A decode step of the fused path launches at most 10 kernels per decoder
    layer: norm, qkv GEMM, rotary + KV store, attention (counted as 2), o_proj
    GEMM, add + norm, gate_up GEMM, silu * up, down GEMM. Counted on the CPU: every
    aten op that computes (not views, not allocations) stands for one CUDA
    kernel, and each Triton launcher for its kernels (attention for 2); the
    per-layer figure is the difference between a 3-layer and a 1-layer model,
    halved, so embedding, final norm and LM head drop out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from slipstream.attention import triton_backend
    from slipstream.attention.triton_backend import TritonAttentionBackend
    from slipstream.config import ModelConfig
    from slipstream.kernels import rms_norm, rotary, silu_mul
    from slipstream.loader.dummy import initialize_dummy_weights
    from slipstream.models.llama import LlamaForCausalLM

    state = {"count": 0, "inside": False}

    def launcher(fn, kernels):
        def wrapped(*a, **kw):
            if state["inside"]:
                return fn(*a, **kw)
            state["inside"] = True
            try:
                return fn(*a, **kw)
            finally:
                state["inside"] = False
                state["count"] += kernels
        return wrapped

    for mod, name, kernels in ((rms_norm, "rms_norm", 1), (rotary, "rotary_inplace", 1),
                               (silu_mul, "silu_and_mul", 1), (triton_backend, "store_kv", 1),
                               (triton_backend, "rotary_store_kv", 1),
                               (triton_backend, "split_kv_attention", 2)):
        monkeypatch.setattr(mod, name, launcher(getattr(mod, name), kernels))

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tags = getattr(func, "tags", ())
            if not state["inside"] and torch.Tag.view_copy not in tags \
                    and not func._schema.is_mutable and not _is_view_or_alloc(func):
                state["count"] += 1
            return out

    def step_ops(num_layers: int, fused: bool) -> int:
        mc = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
        model = LlamaForCausalLM(mc, TritonAttentionBackend()).eval()
        initialize_dummy_weights(model)
        _use_kernels(model, fused)
        allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
        seqs = [Sequence(list(range(1, 8)), BLOCK_SIZE, BlockAllocator(NUM_BLOCKS, 0))]
        with torch.inference_mode():
            batch = make_batch([(seqs[0], 6)])
            model.backend.prepare(batch)
            model(batch)
            batch = make_batch([(seqs[0], 1)])     # the decode step that is counted
            model.backend.prepare(batch)
            state["count"] = 0
            with CountOps():
                model(batch)
        return state["count"]

    fused = (step_ops(3, True) - step_ops(1, True)) / 2
    unfused = (step_ops(3, False) - step_ops(1, False)) / 2
    assert fused <= 10, f"{fused} kernels per layer"
    assert unfused > fused + 8, (unfused, fused)   # the count sees the torch path's ops


def test_rotary_in_kv_store_matches_separate_rotary():
    """The triton backend rotating q and k inside its KV-store kernel gives the
    logits of the separate rotary kernel (a prefill, then decode steps)."""
    from slipstream.attention.triton_backend import TritonAttentionBackend
    from slipstream.config import ModelConfig
    from slipstream.loader.dummy import initialize_dummy_weights
    from slipstream.models.llama import LlamaForCausalLM

    mc = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(mc, TritonAttentionBackend()).eval()
    initialize_dummy_weights(model)
    _use_kernels(model, True)
    ids = torch.randint(0, 64, (SEQ_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = {}
    for fused in (False, True):
        model.backend.fuses_rotary = fused
        logits[fused] = _prefill_then_decode(model, ids)
    assert logits[True].std() > 0.1
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


def _is_view_or_alloc(func) -> bool:
    name = func._schema.name
    if name in ("aten::empty", "aten::empty_strided", "aten::empty_like"):
        return True
    return any(a.alias_info is not None and not a.alias_info.is_write
               for a in func._schema.returns)
