"""LlamaForCausalLM against Hugging Face transformers on the same random weights,
and prefill / chunked prefill / decode / batching against each other."""
from __future__ import annotations

import pytest
import torch

from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
from tests.models.tiny_models import VARIANTS, make_hf_model, make_ours

BLOCK_SIZE = 4
NUM_BLOCKS = 32
SEQ_LEN = 13   # longer than Mistral's window (5), not a multiple of the block size


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request):
    hf = make_hf_model(request.param)
    return request.param, hf, make_ours(hf)


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, steps) -> torch.Tensor:
    """Logits [num_tokens, vocab] of one step."""
    with torch.inference_mode():
        batch = make_batch(steps)
        model.backend.prepare(batch)
        hidden = model(batch)
        assert hidden.shape == (batch.num_tokens, model.config.hidden_size)
        return model.compute_logits(hidden[batch.logits_indices])


def _fresh(model, seed: int = 0) -> BlockAllocator:
    allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    return BlockAllocator(NUM_BLOCKS, seed)


def test_prefill_logprobs_match_hf(pair):
    name, hf, ours = pair
    ids = _tokens(ours.config.vocab_size, SEQ_LEN, seed=1)
    alloc = _fresh(ours)
    logits = _run(ours, [(Sequence(ids, BLOCK_SIZE, alloc), SEQ_LEN)])
    assert logits.dtype == torch.float32
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got_lp, ref_lp = logits.log_softmax(-1), ref.log_softmax(-1)
    # Random weights give a real spread of log-probs, so agreement is not trivial.
    assert ref_lp.std() > 0.5
    diff = (got_lp - ref_lp).abs().max().item()
    assert diff < 1e-4, f"{name}: max |logprob diff| {diff:.2e}"


def test_decode_after_prefill_matches_full_prefill(pair):
    name, _, ours = pair
    ids = _tokens(ours.config.vocab_size, SEQ_LEN, seed=2)
    full = _run(ours, [(Sequence(ids, BLOCK_SIZE, _fresh(ours, 0)), SEQ_LEN)])

    # Prefill 3, a chunk of 4 with context, then one token at a time.
    seq = Sequence(ids, BLOCK_SIZE, _fresh(ours, 1))
    parts = [_run(ours, [(seq, 3)]), _run(ours, [(seq, 4)])]
    parts += [_run(ours, [(seq, 1)]) for _ in range(SEQ_LEN - 7)]
    stepped = torch.cat(parts)
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4, msg=name)


def test_mixed_batch_matches_separate_runs(pair):
    name, _, ours = pair
    vocab = ours.config.vocab_size
    a_ids, b_ids, c_ids = _tokens(vocab, 11, 3), _tokens(vocab, 9, 4), _tokens(vocab, 6, 5)
    alone = [_run(ours, [(Sequence(x, BLOCK_SIZE, _fresh(ours, 0)), len(x))])
             for x in (a_ids, b_ids, c_ids)]

    alloc = _fresh(ours, 2)
    a, b, c = (Sequence(x, BLOCK_SIZE, alloc) for x in (a_ids, b_ids, c_ids))
    first = _run(ours, [(a, 10), (b, 6)])
    # One step mixing a decode (a), a prefill chunk with context (b), a fresh prompt (c).
    second = _run(ours, [(a, 1), (b, 3), (c, 6)])
    torch.testing.assert_close(first[:10], alone[0][:10], atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(first[10:], alone[1][:6], atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(second[:1], alone[0][10:], atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(second[1:4], alone[1][6:], atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(second[4:], alone[2], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("variant", ["llama3_rope", "qwen2_bias"])
def test_bf16_model_tracks_fp32_hf(variant):
    """The bf16 path (weights converted by the loaders, RoPE tables cast) stays close."""
    hf = make_hf_model(variant)
    ours = make_ours(hf, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours.model.rotary_emb.cos.dtype == torch.bfloat16
    ids = _tokens(ours.config.vocab_size, SEQ_LEN, seed=6)
    allocate_kv_caches(ours, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16)
    logits = _run(ours, [(Sequence(ids, BLOCK_SIZE, BlockAllocator(NUM_BLOCKS)), SEQ_LEN)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert logits.dtype == torch.float32
    assert (logits.log_softmax(-1).exp() - ref.softmax(-1)).abs().max() < 0.05
