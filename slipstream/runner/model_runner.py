"""SchedulerOutput -> one forward pass -> sampled tokens (StepOutput)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from slipstream.attention.selector import create_backend
from slipstream.config import EngineConfig
from slipstream.engine.scheduler import ScheduledRequest, SchedulerOutput
from slipstream.layers.sampler import Sampler, SamplingBatch, compute_prompt_logprobs
from slipstream.models.registry import model_class
from slipstream.runner import memory
from slipstream.batch import build_forward_batch


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its rank, and
    the top alternatives (ids and log-probs, best first)."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> (index of the first prompt position scored, records)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, weights, quant_method_for=None):
        self.config = config
        self.device, self.dtype = config.device, config.dtype
        mc = config.model_config
        self.backend = create_backend(config.attention_backend, self.device)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(mc.architecture)(mc, self.backend, quant_method_for)
        load_into = getattr(weights, "load_into", None)   # random weights (loader/dummy.py)
        load_into(self.model) if load_into else self.model.load_weights(weights)
        self.model.eval()
        self.num_blocks = memory.num_kv_blocks(config.cache, mc, config.scheduler, self.dtype, self.device)
        self.kv_cache = memory.allocate_kv_cache(self.num_blocks, config.cache, mc, self.dtype, self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.sampler = Sampler()
        self.vocab_size = mc.vocab_size

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        scheduled = sched.scheduled
        prompt_rows = [self._prompt_logprob_offsets(s) for s in scheduled]
        batch = build_forward_batch(scheduled, self.config.cache.block_size, self.device, prompt_rows)
        self.backend.prepare(batch)
        hidden = self.model(batch)                                   # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_rows, vocab] fp32
        samplers = [s for s in scheduled if s.samples]
        out = StepOutput()
        if samplers:
            out = self._sample(samplers, logits[:len(samplers)], out)
        if any(prompt_rows):
            self._prompt_logprobs(scheduled, prompt_rows, logits[len(samplers):], out)
        return out

    def _sample(self, samplers: list[ScheduledRequest], logits: torch.Tensor,
                out: StepOutput) -> StepOutput:
        reqs = [s.request for s in samplers]
        sb = SamplingBatch.build(
            [r.params for r in reqs], [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs], [r.generator for r in reqs],
            self.vocab_size, self.device, self.config.model_config.eos_token_ids)
        result = self.sampler(logits, sb)
        tokens = result.sampled_token_ids.tolist()  # the step's one host sync
        for r, t in zip(reqs, tokens):
            out.sampled[r.request_id] = t
        if result.logprobs is not None:
            entries = _unpack(result.logprobs)
            for i, r in enumerate(reqs):
                if r.params.logprobs is not None:
                    out.logprobs[r.request_id] = _trim(entries[i], r.params.logprobs)
        return out

    @staticmethod
    def _prompt_logprob_offsets(s: ScheduledRequest) -> list[int]:
        """Offsets of this step's new tokens whose logits score a prompt token."""
        req = s.request
        if not req.wants_prompt_logprobs:
            return []
        last = min(s.context_len + s.num_new_tokens, req.num_prompt_tokens - 1)
        return list(range(0, max(0, last - s.context_len)))

    def _prompt_logprobs(self, scheduled, prompt_rows, logits: torch.Tensor, out: StepOutput) -> None:
        row = 0
        for s, offsets in zip(scheduled, prompt_rows):
            if not offsets:
                continue
            req = s.request
            start = s.context_len + offsets[0] + 1
            targets = torch.tensor(req.prompt_token_ids[start:start + len(offsets)], device=logits.device)
            lp = compute_prompt_logprobs(logits[row:row + len(offsets)], targets, req.params.prompt_logprobs)
            out.prompt_logprobs[req.request_id] = (
                start - 1, [_trim(e, req.params.prompt_logprobs) for e in _unpack(lp)])
            row += len(offsets)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters directly in the model dtype (no fp32 copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _unpack(lp) -> list[TokenLogprobs]:
    """LogprobsTensors (column 0: the chosen token; then the top-k) -> host records."""
    ids, vals, ranks = lp.tolists()
    return [TokenLogprobs(i[0], v[0], r, i[1:], v[1:]) for i, v, r in zip(ids, vals, ranks)]


def _trim(e: TokenLogprobs, k: int) -> TokenLogprobs:
    if k < 0:  # -1: the whole vocabulary
        return e
    return TokenLogprobs(e.token_id, e.logprob, e.rank, e.top_ids[:k], e.top_logprobs[:k])
