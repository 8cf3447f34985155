"""Speculative generation outside the engine: a target model, a proposer,
and the verifier, on a paged KV cache of the target's own.

It is the reference loop the engine's speculative steps follow (and what the
CPU benchmarks and the head-training data use): prefill, then rounds of
propose -> one target forward over root + draft nodes (tree mask, depth
positions) -> verify -> keep the accepted path's K/V (moved into place for
trees) -> roll `num_cached` back past the rejected nodes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from slipstream.layers.sampler import SamplingBatch, random_sample
from slipstream.sampling_params import SamplingParams
from slipstream.spec.base import Proposer, ProposeRequest
from slipstream.spec.draft_cache import DraftKVCache
from slipstream.spec.tree import DraftTree, TreeBatch
from slipstream.spec.verify import target_probs, verify


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted at depth d (count)
    drafted_at: list[int] = field(default_factory=list)   # rounds reaching depth d with a draft
    draft_time: float = 0.0
    verify_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward of a speculative round."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def record(self, depth: int, accepted: int) -> None:
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for d in range(depth):
            self.drafted_at[d] += 1
        for d in range(accepted):
            self.accepted_at[d] += 1

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted_at, self.drafted_at)]


def apply_kv_moves(pool: torch.Tensor, table: list[int], block_size: int, context_len: int,
                   moves: list[tuple[int, int]]) -> None:
    """pool: [layers, 2, blocks, block_size, ...]. Copy the K/V of verification
    row `src` to row `dst` (rows start at context_len) for every (src, dst);
    all sources are read before any destination is written."""
    if not moves:
        return
    def slot(row):
        p = context_len + row
        return table[p // block_size] * block_size + p % block_size
    flat = pool.flatten(2, 3)                                         # [layers, 2, slots, ...]
    src = torch.tensor([slot(s) for s, _ in moves], device=pool.device)
    dst = torch.tensor([slot(d) for _, d in moves], device=pool.device)
    flat.index_copy_(2, dst, flat.index_select(2, src))


class SpeculativeGenerator:
    def __init__(self, model, proposer: Proposer | None, num_blocks: int = 1024,
                 block_size: int = 16):
        self.model, self.proposer = model, proposer
        param = next(model.parameters())
        self.device = param.device
        self.cache = DraftKVCache(model, num_blocks, block_size, param.dtype, param.device)
        self.vocab = model.config.vocab_size
        self.eos = set(model.config.eos_token_ids)

    def _forward(self, entries, masks=None):
        batch = self.cache.batch(entries, masks)
        self.model.backend.prepare(batch)
        return self.model(batch)                                      # [rows, hidden]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 stats: SpecStats | None = None) -> list[list[int]]:
        if params.has_penalties or params.logit_bias or params.min_tokens:
            raise ValueError("the reference loop samples without penalties, logit bias or "
                             "min_tokens; the engine (LLM) applies them under speculation")
        stats = stats if stats is not None else SpecStats()
        n = len(prompts)
        ids = [f"r{i}" for i in range(n)]
        gens = [torch.Generator(self.device).manual_seed(params.seed + i)
                if params.seed is not None else None for i in range(n)]
        sb = SamplingBatch.build([params] * n, prompts, [[]] * n, gens, self.vocab, self.device)
        hidden = self._forward([(ids[i], torch.tensor(p), 0, None) for i, p in enumerate(prompts)])
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        probs = target_probs(self.model.compute_logits(hidden[last]), sb)
        first = random_sample(probs, sb.generators).tolist()
        tokens = [list(p) + [t] for p, t in zip(prompts, first)]
        outputs = [[t] for t in first]
        starts = [0] + last[:-1].add(1).tolist()
        new_hidden = [hidden[s:e + 1] for s, e in zip(starts, last.tolist())]
        cached = [len(p) for p in prompts]
        live = [i for i in range(n) if not self._done(outputs[i], params)]
        while live:
            t0 = time.perf_counter()
            reqs = [ProposeRequest(ids[i], tokens[i], new_hidden[i]) for i in live]
            trees = (self.proposer.propose(reqs) if self.proposer is not None
                     else [DraftTree.empty(self.device) for _ in live])
            t1 = time.perf_counter()
            entries, masks = [], []
            for i, t in zip(live, trees):
                row_tokens = torch.cat([torch.tensor(tokens[i][-1:], device=self.device),
                                        t.tokens.to(self.device)])
                entries.append((ids[i], row_tokens, cached[i], t.positions(cached[i])))
                masks.append(t.ancestor_mask())
            hidden = self._forward(entries, masks if any(not t.is_chain for t in trees) else None)
            width = max(t.num_nodes for t in trees) + 1
            rows = torch.tensor([[min(j, t.num_nodes) + s for j in range(width)]
                                 for t, s in zip(trees, self.cache_rows(entries))])
            logits = self.model.compute_logits(hidden[rows.flatten()]).view(len(live), width, -1)
            sub = _rows(sb, live)
            out = verify(logits, TreeBatch.stack(trees, self.device, self.vocab), sub)
            emitted, accepted = out.tokens.tolist(), out.accepted_nodes.tolist()
            stats.verify_time += time.perf_counter() - t1
            stats.draft_time += t1 - t0
            for j, (i, t) in enumerate(zip(live, trees)):
                a = int(out.num_accepted[j])
                path = accepted[j][:a]
                apply_kv_moves(self.cache.pool, self.cache.tables[ids[i]], self.cache.block_size,
                               cached[i], t.kv_moves(path))
                keep_rows = [0] + [node + 1 for node in path]
                start = self.cache_rows(entries)[j]
                new_hidden[i] = hidden[[start + r for r in keep_rows]]
                cached[i] += 1 + a
                stats.rounds += 1
                stats.drafted += t.num_nodes
                stats.accepted += a
                stats.record(t.depth, a)
                for tok in emitted[j][:a + 1]:
                    tokens[i].append(tok)
                    outputs[i].append(tok)
                    stats.emitted += 1
                    if self._done(outputs[i], params):
                        break
            live = [i for i in live if not self._done(outputs[i], params)]
        for i in range(n):
            if self.proposer is not None:
                self.proposer.release(ids[i])
            self.cache.release(ids[i])
        return [o[:params.max_tokens] for o in outputs]

    @staticmethod
    def cache_rows(entries) -> list[int]:
        starts, s = [], 0
        for e in entries:
            starts.append(s)
            s += e[1].shape[0]
        return starts

    def _done(self, out: list[int], params: SamplingParams) -> bool:
        if len(out) >= params.max_tokens:
            return True
        return not params.ignore_eos and out[-1] in self.eos


def _rows(sb: SamplingBatch, keep: list[int]) -> SamplingBatch:
    idx = torch.tensor(keep, device=sb.temperature.device if sb.temperature is not None else "cpu")
    def pick(t):
        return None if t is None else t[idx.to(t.device)]
    return SamplingBatch(
        num_rows=len(keep), all_greedy=sb.all_greedy, all_random=sb.all_random,
        temperature=pick(sb.temperature), top_k=pick(sb.top_k), max_top_k=sb.max_top_k,
        top_p=pick(sb.top_p), min_p=pick(sb.min_p),
        generators={j: sb.generators[i] for j, i in enumerate(keep) if i in sb.generators},
        penalties=None, min_tokens_mask=None, max_num_logprobs=None)
