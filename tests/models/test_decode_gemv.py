"""The batch-1 decode path of layers/decode_gemv.py, on the CPU.

The TMA GEMV runs only on sm_90; here the row test is widened to CPU rows and the
GEMV replaced by its twin (kernels/tma_gemv.reference), so what is checked is the
plumbing: norms and SiLU left to the products after them (the residual stream
written by the product that folds the norm, layer 0 without a residual, q/k/v
bias and other non-plain products computing the folded op themselves) give the
logits of the plain path, and only one-row steps fold."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.runtime import interpreting
from slipstream.kernels.tma_gemv import reference
from slipstream.layers import decode_gemv
from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
from tests.models.tiny_models import VARIANTS, make_hf_model, make_ours

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def _steps(model, ids: list[int], decodes: int = 3) -> torch.Tensor:
    allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    seq = Sequence(ids, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS, 0))
    out = []
    with torch.inference_mode():
        for n in [len(ids) - decodes] + [1] * decodes:
            batch = make_batch([(seq, n)])
            model.backend.prepare(batch)
            out.append(model.compute_logits(model(batch)[batch.logits_indices]))
    return torch.cat(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_folded_decode_steps_match_the_plain_path(variant, monkeypatch):
    model = make_ours(make_hf_model(variant))
    ids = torch.randint(0, model.config.vocab_size, (9,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    want = _steps(model, ids)
    calls = []
    monkeypatch.setenv("SLIPSTREAM_TMA_GEMV", "1")   # every product (the default: o_proj, LM head)

    def twin(layer, x, **fold):
        if getattr(layer, "gemv_role", None) == "lm_head":
            return reference(x, layer.weight)[0]   # (on some CPUs the head takes a table path)
        calls.append((x.shape[0], sorted(k for k, v in fold.items() if v is not None and v is not False)))
        residual_out = fold.pop("residual_out", None)
        y, s = reference(x, layer.weight, **fold)
        if residual_out is not None:
            residual_out.copy_(s)
        return y
    monkeypatch.setattr(decode_gemv, "row_fits", lambda x, role=None: x.dim() == 2 and x.shape[0] == 1)
    monkeypatch.setattr(decode_gemv, "gemv", twin)
    got = _steps(model, ids)
    assert want.std() > 0.5
    assert (got - want).abs().max().item() < 1e-5
    layers = model.config.num_hidden_layers
    kinds = [tuple(k) for _, k in calls]
    assert all(rows == 1 for rows, _ in calls)   # the prefill's rows never fold
    attn = model.model.layers[0].self_attn
    qkv_bias, o_bias = attn.qkv_proj.bias is not None, attn.o_proj.bias is not None
    # a decode step: qkv (norm folded; not with q/k/v bias), o_proj (not with a bias),
    # gate_up (norm + residual), down (SiLU), the LM head; layer 0's norm has no residual
    per_step = layers * (2 + (not qkv_bias) + (not o_bias))   # the LM head not counted
    assert len(calls) == 3 * per_step, kinds
    assert kinds.count(("silu_mul",)) == 3 * layers
    assert kinds.count(("eps", "norm_weight")) == 3 * (1 if not qkv_bias else 0)
    assert kinds.count(("eps", "norm_weight", "residual", "residual_out")) == 3 * (2 * layers - 1 - (layers - 1) * qkv_bias)


@pytest.mark.skipif(not interpreting(), reason="the norm and SiLU kernels need TRITON_INTERPRET=1 here")
def test_a_folded_input_that_no_gemv_takes_is_computed_by_its_kernel(monkeypatch):
    """Products whose weight the GEMV does not take (here gate_up and down) compute the
    folded norm / SiLU with the usual kernels, the residual stream included."""
    model = make_ours(make_hf_model(sorted(VARIANTS)[0]))
    ids = torch.randint(0, model.config.vocab_size, (9,),
                        generator=torch.Generator().manual_seed(6)).tolist()
    want = _steps(model, ids)
    taken = {id(layer.self_attn.qkv_proj) for layer in model.model.layers}

    def twin(layer, x, **fold):
        residual_out = fold.pop("residual_out", None)
        y, s = reference(x, layer.weight, **fold)
        if residual_out is not None:
            residual_out.copy_(s)
        return y
    fits = decode_gemv.weight_fits
    monkeypatch.setenv("SLIPSTREAM_TMA_GEMV", "1")
    monkeypatch.setattr(decode_gemv, "row_fits", lambda x, role=None: x.dim() == 2 and x.shape[0] == 1)
    monkeypatch.setattr(decode_gemv, "weight_fits", lambda layer, dt: id(layer) in taken and fits(layer, dt))
    monkeypatch.setattr(decode_gemv, "gemv", twin)
    got = _steps(model, ids)
    assert (got - want).abs().max().item() < 1e-4


def test_by_default_only_o_proj_and_the_lm_head_take_the_gemv(monkeypatch):
    model = make_ours(make_hf_model("llama2"))
    ids = torch.randint(0, model.config.vocab_size, (9,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    roles = []

    def twin(layer, x, **fold):
        roles.append((getattr(layer, "gemv_role", None), bool(fold)))
        return reference(x, layer.weight)[0]
    monkeypatch.delenv("SLIPSTREAM_TMA_GEMV", raising=False)
    monkeypatch.setattr(decode_gemv, "row_fits",
                        lambda x, role=None: x.dim() == 2 and x.shape[0] == 1 and decode_gemv.enabled(role))
    monkeypatch.setattr(decode_gemv, "gemv", twin)
    _steps(model, ids, decodes=1)
    layers = model.config.num_hidden_layers
    assert ("o", False) in roles and set(roles) <= {("lm_head", False), ("o", False)}
    assert roles.count(("o", False)) == layers   # (the LM head takes a table path on some CPUs)
    monkeypatch.setenv("SLIPSTREAM_TMA_GEMV", "0")
    roles.clear()
    _steps(model, ids, decodes=1)
    assert roles == []
