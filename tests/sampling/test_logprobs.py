"""Logprobs of sampled and prompt tokens against a direct float64 computation
(tolerance 1e-5 absolute on log-probabilities)."""
import pytest
import torch

from slipstream.layers.logprobs import compute_prompt_logprobs, gather_logprobs
from slipstream.layers.sampler import Sampler, SamplingBatch
from slipstream.sampling_params import SamplingParams


def direct(logits_row, token, k):
    """(token logprob, 1-based rank, top-k ids, top-k logprobs) of one row, by hand."""
    logprobs = torch.log_softmax(logits_row.double(), dim=-1)
    order = sorted(range(logprobs.numel()), key=lambda v: -logprobs[v].item())
    rank = sum(1 for v in range(logprobs.numel()) if logprobs[v] >= logprobs[token])
    return logprobs[token].item(), rank, order[:k], [logprobs[v].item() for v in order[:k]]


def check_row(tensors, row, logits_row, token, k):
    lp, rank, top_ids, top_lps = direct(logits_row, token, k)
    assert tensors.token_ids[row, 0].item() == token
    assert tensors.ranks[row].item() == rank
    assert tensors.token_ids[row, 1:k + 1].tolist() == top_ids
    got = tensors.logprobs[row, :k + 1].double()
    torch.testing.assert_close(got, torch.tensor([lp, *top_lps], dtype=torch.float64),
                               rtol=0, atol=1e-5)


def test_sampled_logprobs_use_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.8, logprobs=5),
              SamplingParams(temperature=1.3, top_p=0.5, presence_penalty=2.0),
              SamplingParams(min_p=0.1, frequency_penalty=-1.0, logprobs=0),
              SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=1),
              SamplingParams(temperature=2.0, logprobs=2)]
    prompts = [list(range(10))] * 6
    outputs = [[3, 3, 7]] * 6
    batch = SamplingBatch.build(params, prompts, outputs, [None] * 6, 40, "cpu")
    out = Sampler()(logits, batch)
    k = batch.max_num_logprobs
    assert k == 5
    assert out.logprobs.token_ids.shape == (6, k + 1) == out.logprobs.logprobs.shape
    assert out.logprobs.token_ids.dtype == torch.int64 and out.logprobs.ranks.shape == (6,)
    for row in range(6):
        check_row(out.logprobs, row, logits[row], out.sampled_token_ids[row].item(), k)
    assert out.logprobs.ranks[0].item() == 1  # greedy without penalties picks rank 1


def test_no_logprobs_requested_means_none():
    batch = SamplingBatch.build([SamplingParams()] * 2, [[1]] * 2, [[]] * 2, [None] * 2, 9, "cpu")
    assert batch.max_num_logprobs is None
    assert Sampler()(torch.randn(2, 9), batch).logprobs is None


def test_whole_vocabulary_logprobs():
    logits = torch.randn(3, 11)
    batch = SamplingBatch.build([SamplingParams(logprobs=-1)] * 3, [[1]] * 3, [[]] * 3,
                                [None] * 3, 11, "cpu")
    out = Sampler()(logits, batch)
    assert out.logprobs.token_ids.shape == (3, 12)
    for row in range(3):
        check_row(out.logprobs, row, logits[row], out.sampled_token_ids[row].item(), 11)


def test_tied_tokens_share_the_worse_rank():
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), -1)
    tensors = gather_logprobs(logprobs, 1, torch.tensor([2]))
    assert tensors.ranks.tolist() == [2]
    assert tensors.token_ids[0, 0].item() == 2


@pytest.mark.parametrize("num_logprobs", [0, 1, 4])
def test_prompt_logprobs_match_a_direct_computation(num_logprobs):
    torch.manual_seed(2)
    prompt = torch.randint(0, 50, (13,))
    logits = torch.randn(12, 50) * 2  # row t predicts prompt token t + 1
    tensors = compute_prompt_logprobs(logits, prompt[1:], num_logprobs)
    assert tensors.token_ids.shape == (12, num_logprobs + 1)
    for t in range(12):
        check_row(tensors, t, logits[t], prompt[t + 1].item(), num_logprobs)


def test_tolists():
    tensors = gather_logprobs(torch.log_softmax(torch.randn(2, 5), -1), 2, torch.tensor([0, 4]))
    ids, lps, ranks = tensors.tolists()
    assert [row[0] for row in ids] == [0, 4] and len(lps[1]) == 3 and len(ranks) == 2
