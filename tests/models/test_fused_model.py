"""The model with its fused kernels (add + RMSNorm, in-place rotary, SiLU * up,
forced on under TRITON_INTERPRET=1 on the CPU) against the same model on its
plain torch path, over a prefill and a decode step, for every architecture
variant. fp32: max |logit diff| < 1e-4 (only fp32 operation order differs)."""
from __future__ import annotations

import pytest
import torch

from slipstream.layers.activation import SiluAndMul
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
from tests.models.tiny_models import VARIANTS, make_hf_model, make_ours

BLOCK_SIZE, NUM_BLOCKS, SEQ_LEN = 4, 32, 11


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
