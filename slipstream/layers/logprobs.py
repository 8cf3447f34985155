"""Log-probabilities of chosen tokens plus their top-k alternatives (vLLM semantics).

Both users share `gather_logprobs`:
  sampled tokens  the sampler passes log_softmax of the raw model logits (before
                  penalties, temperature and filtering: vLLM's "raw_logprobs")
                  and the tokens it sampled;
  prompt tokens   `compute_prompt_logprobs` passes the logits at prompt positions
                  and the prompt tokens they predict.

Column 0 of every output row is the chosen token; columns 1..k are the k most
likely tokens, in descending order. The chosen token may also appear among
them (vLLM keeps the duplicate; the output layer merges it). The chosen token's
rank is the number of tokens at least as likely, #{v : logprob[v] >= logprob[chosen]},
so the argmax has rank 1 and tied tokens share the worse rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [num_rows, k + 1] int64; column 0 is the chosen token
    logprobs: torch.Tensor   # [num_rows, k + 1] float32
    ranks: torch.Tensor      # [num_rows] int64, 1-based rank of the chosen token

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Host copies (one sync each; call off the sampling hot path). A request
        that asked for j <= k alternatives keeps the first j + 1 columns of its row."""
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    # logits: [num_rows, vocab] -> [num_rows, vocab] float32
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """logprobs: [num_rows, vocab] float32; token_ids: [num_rows] int64 (chosen
    tokens); num_logprobs: k >= 0, or -1 for the whole vocabulary. No host sync."""
    vocab = logprobs.shape[-1]
    k = vocab if num_logprobs == -1 else min(num_logprobs, vocab)
    topk_logprobs, topk_ids = torch.topk(logprobs, k, dim=-1)
    chosen = token_ids.to(torch.int64).unsqueeze(-1)              # [num_rows, 1]
    chosen_logprobs = logprobs.gather(-1, chosen)                 # [num_rows, 1]
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)             # [num_rows]
    return LogprobsTensors(
        token_ids=torch.cat((chosen, topk_ids), dim=1),
        logprobs=torch.cat((chosen_logprobs, topk_logprobs), dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs of one request (or any run of positions).

    logits: [num_positions, vocab], row t computed at prompt position t, so it
    predicts token t + 1; target_token_ids: [num_positions] int64, the prompt
    tokens at positions 1..num_positions (vLLM reports None for position 0,
    which nothing predicts). The runner may call this chunk by chunk to bound
    the [num_positions, vocab] float32 temporary.
    """
    assert logits.shape[0] == target_token_ids.shape[0]
    return gather_logprobs(compute_logprobs(logits), num_logprobs, target_token_ids)
