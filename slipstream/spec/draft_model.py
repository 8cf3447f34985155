"""A separate, smaller model drafts k tokens autoregressively.

Any model slipstream loads can draft if it shares the target's tokenizer;
`load_draft_model(path, num_layers=N)` also builds a draft from the first N
layers of a checkpoint plus its final norm and LM head (a self-speculative,
early-exit draft: the only draft available for a model that ships alone).

Each call first catches the draft's own KV cache up with the request's real
tokens (the ones it had not seen, including the tokens accepted last step)
and drafts the first token in that same forward, then runs k - 1 one-token
steps for all requests together. Drafts are the draft model's argmax (q is
one-hot, which the verifier handles losslessly for any sampling settings).
"""
from __future__ import annotations

import dataclasses

import torch

from slipstream.attention.selector import create_backend
from slipstream.layers.argmax import row_argmax
from slipstream.runner.model_runner import default_dtype
from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.draft_cache import DraftKVCache
from slipstream.spec.tree import DraftTree


def load_draft_model(path: str | None, device: torch.device | str, dtype: torch.dtype,
                     num_layers: int | None = None, backend_name: str | None = None):
    """Load a Llama-family model (HF folder, GGUF; None = the default model) to
    draft with; `num_layers` keeps only its first layers (early exit)."""
    from slipstream.loader import open_model
    from slipstream.models.registry import model_class
    files = open_model(path)
    mc = files.config
    keep = mc.num_hidden_layers
    if num_layers is not None:
        if not 1 <= num_layers <= mc.num_hidden_layers:
            raise ValueError(f"draft num_layers must be in [1, {mc.num_hidden_layers}], "
                             f"got {num_layers}")
        keep = num_layers
        mc = dataclasses.replace(mc, num_hidden_layers=keep)
    device = torch.device(device)
    backend = create_backend(backend_name, device)
    with torch.device(device), default_dtype(dtype):
        model = model_class(mc.architecture)(mc, backend)

    def weights():
        for name, t in files.weights():
            if name.startswith("model.layers."):
                if int(name.split(".")[2]) >= keep:
                    continue
            yield name, t
    model.load_weights(weights())
    return model.eval()


class DraftModelProposer:
    needs_hidden = False

    def __init__(self, model, num_speculative_tokens: int = 4, num_blocks: int = 2048,
                 block_size: int = 16):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.model = model
        self.k = num_speculative_tokens
        param = next(model.parameters())
        self.device = param.device
        self.cache = DraftKVCache(model, num_blocks, block_size, param.dtype, param.device)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def _forward(self, batch) -> torch.Tensor:
        self.model.backend.prepare(batch)
        hidden = self.model(batch)                                    # [tokens, hidden]
        last = batch.query_start_loc[1:].long() - 1
        return row_argmax(self.model.compute_logits(hidden[last]))     # [num_seqs]

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        if not requests:
            return []
        ks = [self.k if r.num_tokens is None else r.num_tokens for r in requests]
        entries = []
        for r in requests:
            length = len(r.token_ids)
            c = min(self.cache.num_cached.get(r.request_id, 0), length - 1)
            new = torch.tensor(list(r.token_ids[c:]), dtype=torch.int64)
            entries.append((r.request_id, new, c, None))
        drafted = [self._forward(self.cache.batch(entries))]          # [num_seqs] each
        lengths = [len(r.token_ids) for r in requests]
        for step in range(1, max(ks)):
            entries = [(r.request_id, drafted[-1][i:i + 1], lengths[i] + step - 1, None)
                       for i, r in enumerate(requests)]
            drafted.append(self._forward(self.cache.batch(entries)))
        for r, n in zip(requests, lengths):
            self.cache.num_cached[r.request_id] = n   # drafted slots are rewritten next call
        tokens = torch.stack(drafted, dim=1)                           # [num_seqs, max k]
        return [DraftTree.chain(tokens[i, :k]) for i, k in enumerate(ks)]


@register_proposer("draft")
def _make(spec, device, dtype, block_size=16, **_):
    model = load_draft_model(spec.model, device, dtype, spec.draft_num_layers)
    return DraftModelProposer(model, spec.num_speculative_tokens, spec.draft_num_blocks, block_size)
