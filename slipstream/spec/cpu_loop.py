"""EAGLE chains of one request on a CPU, each round a few C calls.

The engine's speculation round (spec/speculator.py) serves batches on any device:
it packs the step, stacks the trees, verifies through tensor ops, drafts through
the proposer's bookkeeping and updates the scheduler, about 2 ms of host work a
round on a 2-core CPU, where the verification step itself costs about 5 ms. For
one greedy prompt on a CPU whose EAGLE head drafts in C (kernels/cpu_eagle.py),
this loop keeps only the round's arithmetic. With the root at position P (the
cache holding 0 .. P - 1) and the chain's drafts d_1 .. d_D:

  1. the target over root, d_1 .. d_D at P .. P + D: the one-call CPU step
     (kernels/cpu_decoder.py), whose rows are bit for bit those of one-token
     steps, so the emitted tokens are plain greedy decoding's;
  2. the LM head over those D + 1 rows and each row's argmax; a = the longest
     prefix of the drafts equal to the argmax before each; emitted d_1 .. d_a and
     the argmax after d_a, the next root. A sampled request's chain is verified
     by the verifier's chain walk (spec/verify.py `verify_chain`: d_i accepted
     with probability p_i(d_i), p_i under the request's temperature, top-k, top-p
     and min-p, a rejection drawing from p_i without d_i, a bonus token from p_D
     after a whole chain), so its tokens are distributed as plain sampling's (a
     seed makes them repeatable, not equal to plain decoding's draws). With
     SLIPSTREAM_CPU_SAMPLED_DRAFTS=1 the chain is drawn from the head's softmax
     at the request's temperature (q_i) instead, accepted with probability
     min(1, p_i(d_i) / q_i(d_i)), a rejection drawing from
     norm(max(0, p_i - q_i)). The accepted drafts' K/V already sit at their
     positions (a chain moves nothing);
  3. the head over the a + 1 new pairs (f_j, t_{j+1}), j = P .. P + a, then the
     next chain from the root (both C calls); with `speculative_draft_min_prob`
     the chain stops before the first draft whose path the head gives less than
     that probability (EAGLE-2's dynamic depth on a chain: confident text drafts
     deep, uncertain text costs no verification rows), possibly before any.

The prompt takes the engine's prefix cache as an engine step would (the hit
blocks are read, the rest computed; its full blocks are then findable), and the
head's context starts where the computed rows do, as the proposer's catch-up
does after a hit. `LoopPath` (spec/loop_path.py) picks this loop on a CPU for a
chain (`speculative_tree` with top-k 1) when the head drafts in C; the EAGLE
loop (spec/eagle_loop.py) serves everything else.
"""
from __future__ import annotations

import math
import os
import time

import torch

from slipstream.batch import ForwardBatch
from slipstream.engine.request import Request
from slipstream.layers.argmax import row_argmax
from slipstream.layers.sampler import SamplingBatch, draw, make_generator, row_distribution
from slipstream.sampling_params import SamplingParams
from slipstream.spec.verify import verify_chain


# A sampled request's chain: the head's argmax chain, verified as one-hot drafts (p(d)
# a draft); "1": drawn from the head's softmax at the request's temperature and
# verified against it (min(1, p / q) a draft), which measured slower on the default
# model (temperature 0.7, top-p 0.9: 1.228x plain against 1.277x, tau 2.29 against
# 2.23, chains longer under the min-prob cut; benchmarks/spec/README.md).
SAMPLED_DRAFTS = os.environ.get("SLIPSTREAM_CPU_SAMPLED_DRAFTS", "0") == "1"


class CPUChainLoop:
    def __init__(self, engine, depth: int):
        runner = engine.runner
        proposer = runner.speculator.proposer
        if getattr(proposer, "cpu_head", None) is None:
            raise ValueError("the CPU chain loop needs the EAGLE head on its C path")
        if depth < 1:
            raise ValueError(f"the CPU chain loop needs at least one draft, got {depth}")
        self.model, self.backend = runner.model, runner.backend
        self.head, self.cpu_head, self.embed = proposer.head, proposer.cpu_head, proposer.embed
        self.kv = engine.scheduler.kv                # its prefix cache and block pool
        self.hasher = getattr(engine, "_hasher", None)          # None: no prefix caching
        self.bs = engine.config.cache.block_size
        self.limit = engine.max_model_len           # positions the rotary tables cover
        self.depth = self.nodes = depth
        self.min_logp = proposer.min_logp      # speculative_draft_min_prob (-inf: off)
        self.seconds = {"prefill": 0.0, "rounds": 0.0}
        self.rounds = self.emitted = 0
        self.batches = self._count = 0
        self.accepted: list[int] = []      # per round of the last generate: drafts accepted
        self.drafted: list[int] = []       # and drafted

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, done=None,
                 params: SamplingParams | None = None) -> list[int]:
        """Continuation of `prompt`, max_tokens long, or shorter once
        `done(new_tokens)` (called after every round) returns True. params: the
        request's sampling (temperature, top-k, top-p, min-p, seed); None or greedy
        params: greedy decoding. Penalties, logit bias and min_tokens are not taken."""
        p = len(prompt)
        self._sb = self._gen = None
        if params is not None and not params.is_greedy:
            if params.has_penalties or params.logit_bias or params.min_tokens:
                raise ValueError("cpu chain loop: penalties, logit_bias and min_tokens take "
                                 "the engine's path")
            self._gen = make_generator(params, "cpu")
            self._sb = SamplingBatch.build([params], [prompt], [[]], [self._gen],
                                           self.model.config.vocab_size, "cpu")
        if p + max_tokens > self.limit:
            raise ValueError(f"cpu chain loop: prompt + max_tokens must be <= {self.limit}")
        t0 = time.perf_counter()
        self._end = p + max_tokens          # position after the last token asked for
        # The engine's own bookkeeping for the sequence's blocks: the prompt's cached
        # blocks (the last token always left to compute), fresh ones after them, the
        # prompt's full blocks registered for later prompts.
        self._count += 1
        req = Request(f"cpu-loop-{self._count}", prompt, SamplingParams(max_tokens=max_tokens),
                      (), self.limit, self.hasher)
        hits = self.kv.get_computed_blocks(req)
        c = len(hits) * self.bs
        if not self.kv.allocate_slots(req, p + max_tokens + self.depth + 1 - c, hits):
            raise RuntimeError(f"cpu chain loop: not enough free KV blocks for "
                               f"{p + max_tokens + self.depth + 1} tokens")
        try:
            table = torch.tensor([self.kv.block_ids(req.request_id)], dtype=torch.int32)
            self._slot_of = (table[0].long()[:, None] * self.bs + torch.arange(self.bs)).flatten()
            self._table = table
            s = self.head.shape
            n = p + max_tokens + self.depth + 2
            self._hk = torch.zeros(n, s.num_kv_heads, s.head_dim)
            self._hv = torch.zeros_like(self._hk)
            self._ones = torch.ones(n, dtype=torch.bool)
            out = [self._prefill(prompt, c)]
            t1 = time.perf_counter()
            self.accepted, self.drafted = [], []
            stop = done is not None and done(out)
            while len(out) < max_tokens and not stop:
                new = self._round()
                out.extend(new)
                self.rounds += 1
                self.emitted += len(new)
                stop = done is not None and done(new)
            self.batches += 1
            self.seconds["prefill"] += t1 - t0
            self.seconds["rounds"] += time.perf_counter() - t1
            return out[:max_tokens]
        finally:
            self.kv.free(req)

    def _batch(self, ids: torch.Tensor, start: int) -> ForwardBatch:
        """ids [t] at positions start .. start + t - 1 after `start` cached tokens."""
        t = ids.shape[0]
        pos = torch.arange(start, start + t)
        return ForwardBatch(
            input_ids=ids, positions=pos,
            query_start_loc=torch.tensor([0, t], dtype=torch.int32),
            seq_lens=torch.tensor([start + t], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            slot_mapping=self._slot_of[start:start + t], block_tables=self._table,
            logits_indices=torch.arange(t), max_query_len=t, max_seq_len=start + t,
            query_lens_cpu=[t], seq_lens_cpu=[start + t])

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        batch = self._batch(ids, start)
        self.backend.prepare(batch)
        return self.model(batch)

    def _pairs(self, hidden: torch.Tensor, toks: torch.Tensor, start: int) -> None:
        """The head over pairs (hidden row i, toks[i]) at start + i (its rows: from
        position h0 on); the new root's feature and the next chain."""
        n, r = toks.shape[0], start - self._h0
        past = (self._hk[:r], self._hv[:r], self._ones[:r]) if r else (None,) * 3
        f, k, v = self.cpu_head.rows(self.embed(toks), self.head.target_feature(hidden),
                                     torch.arange(start, start + n), *past)
        self._hk[r:r + n] = k
        self._hv[r:r + n] = v
        root = start + n                  # the root's position: the pairs end before it
        d = min(self.depth, self._end - 1 - root)       # no drafts past max_tokens
        if d < 1:
            self._drafts = []
            return
        h = self._hk[:r + n], self._hv[:r + n], self._ones[:r + n]
        if self._sb is not None and SAMPLED_DRAFTS:
            t = float(self._sb.temperature[0])
            tokens, self._q = self.cpu_head.sample_chain(f[-1], *h, root, d, t, self._gen,
                                                         self.min_logp)
            self._drafts = tokens.tolist()
            return
        tokens, _ = self.cpu_head.chain(f[-1], *h, root, d, 1, self.min_logp)
        self._drafts = tokens[:, 0].tolist()

    def _prefill(self, prompt: list[int], c: int) -> int:
        """The prompt after its c cached tokens."""
        p = len(prompt)
        ids = torch.tensor(prompt, dtype=torch.int64)
        hidden = self._forward(ids[c:], c)                                 # [P - c, width]
        logits = self.model.compute_logits(hidden[-1:])
        if self._sb is None:
            first = int(row_argmax(logits)[0])
        else:
            first = draw(*row_distribution(logits, self._sb), self._gen)
        self._root, self._pos, self._h0 = first, p, c
        self._pairs(hidden, torch.cat([ids[c + 1:], torch.tensor([first])]), c)
        return first

    def _round(self) -> list[int]:
        drafts, P = self._drafts, self._pos
        ids = torch.tensor([self._root] + drafts, dtype=torch.int64)
        hidden = self._forward(ids, P)                                     # [D + 1, width]
        logits = self.model.compute_logits(hidden)
        if self._sb is None:
            best = row_argmax(logits).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == best[a]:
                a += 1
            emitted = drafts[:a] + [best[a]]
        else:
            q = None
            if SAMPLED_DRAFTS:
                q = lambda i: (self.cpu_head.vocab, self._q[i])   # noqa: E731
            emitted = verify_chain(lambda i: row_distribution(logits[i:i + 1], self._sb),
                                   drafts, self._gen, q, self.model.config.vocab_size)
            a = len(emitted) - 1
        self.accepted.append(a)
        self.drafted.append(len(drafts))
        self._root, self._pos = emitted[-1], P + a + 1
        self._pairs(hidden[:a + 1], torch.tensor(emitted, dtype=torch.int64), P)
        return emitted
