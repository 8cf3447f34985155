"""The runner's side of speculative decoding.

Per step, with drafts the scheduler granted (`SchedulerOutput.spec_drafts`):
  stage:   write each request's draft tokens after its root in the persistent
           input batch, so the ordinary packing lays out root + drafts with
           consecutive slots (row j of a request at slot context + j);
  patch:   tree positions (context + depth) and the tree mask;
  verify:  target logits at every root/draft row -> `spec.verify` (greedy or
           rejection sampling); the accepted path's K/V moved into place
           (trees); the input batch rolled back to the tokens really emitted;
  propose: drafts for the next step of every request that sampled, unless the
           governor turns speculation off at this batch size.
The scheduler rolls `num_computed_tokens` back past the rejected drafts when
the step's tokens arrive (their KV slots are simply rewritten later).
Speculating steps run synchronously: the next drafts need this step's tokens.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from slipstream.spec.base import ProposeRequest
from slipstream.spec.generator import SpecStats, apply_kv_moves
from slipstream.spec.governor import SpecGovernor
from slipstream.spec.selector import create_proposer
from slipstream.spec.tree import DraftTree, TreeBatch
from slipstream.spec.verify import verify


class Speculator:
    def __init__(self, config, model, kv_cache: torch.Tensor, input_batch, sampling):
        spec = config.speculative
        self.config = spec
        self.model, self.kv_cache = model, kv_cache
        self.ib, self.sampling = input_batch, sampling
        self.device = config.device
        self.block_size = config.cache.block_size
        self.proposer = create_proposer(spec.method, spec=spec, device=config.device,
                                        dtype=config.dtype, target=model,
                                        block_size=config.cache.block_size)
        self.governor = SpecGovernor(spec, config.model_config, config.device)
        self.stats = SpecStats()
        self.eligible: dict[str, bool] = {}    # request id -> may speculate at all
        self.hidden: dict[str, list[torch.Tensor]] = {}
        self._step_trees: dict[str, DraftTree] = {}
        self._static_masks: dict[tuple, torch.Tensor] = {}   # tree masks CUDA graphs read
        self._planned: int | None = None       # draft budget the engine planned for this step
        self.last_proposed = False             # the last propose call made drafts
        self.overlapping = False               # set by the engine: this step runs async

    # ---- request life -------------------------------------------------------

    def add(self, req_id: str, params) -> None:
        # Penalties and log-probabilities would have to follow each draft path;
        # such requests decode plainly. min_tokens is checked per step.
        self.eligible[req_id] = not params.has_penalties and params.logprobs is None

    def remove(self, req_id: str) -> None:
        self.eligible.pop(req_id, None)
        self.hidden.pop(req_id, None)
        self.proposer.release(req_id)

    # ---- before the forward ---------------------------------------------------

    def stage(self, drafts: dict, starts: dict[str, int]) -> None:
        """Write the granted drafts into the input batch (host)."""
        self._step_trees = {}
        ib = self.ib
        for rid, (tokens, parents) in drafts.items():
            row, s, m = ib.row_of[rid], starts[rid], len(tokens)
            assert ib.num_known[row] == ib.num_tokens[row] == s + 1, "root must be known"
            ib.token_ids[row, s + 1:s + 1 + m] = tokens
            ib.num_known[row] = ib.num_tokens[row] = s + 1 + m
            self._step_trees[rid] = DraftTree(torch.tensor(tokens, dtype=torch.int64),
                                              tuple(parents))

    def graphable(self, counts: dict[str, int]) -> bool:
        """A step a CUDA graph can run: one request, verifying drafts, and
        nothing else (the graph is keyed by its row count)."""
        from slipstream.kernels.decode_attention import MAX_TREE_NODES
        if len(counts) != 1 or len(self._step_trees) != 1:
            return False
        rid, n = next(iter(counts.items()))
        t = self._step_trees.get(rid)
        return t is not None and n == t.num_nodes + 1 <= MAX_TREE_NODES

    def patch(self, plan, static: bool = False) -> None:
        """Depth positions and the tree mask for steps that verify trees.
        static: a CUDA-graph step, whose mask (chains included) lives in a
        buffer per row count that the graph reads."""
        trees = self._step_trees
        if not trees or (not static and all(t.is_chain for t in trees.values())):
            return
        batch = plan.batch
        width = batch.max_query_len
        mask = torch.ones(len(batch.query_lens_cpu), width, width, dtype=torch.bool).tril_()
        loc = 0
        pos_idx, pos_val = [], []
        for i, (rid, s, q) in enumerate(zip(plan.req_ids, plan.starts, plan.query_lens)):
            t = trees.get(rid)
            if t is not None and not t.is_chain:
                n = t.num_nodes + 1
                mask[i, :n, :n] = t.ancestor_mask("cpu")
                pos_idx.extend(range(loc + 1, loc + n))
                pos_val.extend(int(s) + d for d in t.depths)
            loc += int(q)
        dev = batch.positions.device
        if pos_idx:
            batch.positions[torch.tensor(pos_idx, device=dev)] = torch.tensor(pos_val, device=dev)
        if static:
            buf = self._static_masks.get(mask.shape)
            if buf is None:
                buf = self._static_masks[mask.shape] = torch.empty(mask.shape, dtype=torch.bool,
                                                                   device=dev)
            buf.copy_(mask)
            batch.tree_mask = buf
        else:
            batch.tree_mask = mask.to(dev)

    # ---- after the forward ------------------------------------------------------

    def verify(self, plan, hidden: torch.Tensor) -> dict[str, list[int]]:
        """Verify every staged draft; returns request id -> emitted tokens."""
        trees = self._step_trees
        if not trees:
            return {}
        ib = self.ib
        loc = np.concatenate([[0], np.cumsum(plan.query_lens)])
        order = [i for i, rid in enumerate(plan.req_ids) if rid in trees]
        rids = [plan.req_ids[i] for i in order]
        tlist = [trees[r] for r in rids]
        width = max(t.num_nodes for t in tlist) + 1
        rows = torch.tensor([[int(loc[i]) + min(j, t.num_nodes) for j in range(width)]
                             for i, t in zip(order, tlist)], device=hidden.device)
        logits = self.model.compute_logits(hidden[rows.flatten()]).view(len(rids), width, -1)
        sb = self.sampling.build(plan.rows[order])
        out = verify(logits, TreeBatch.stack(tlist, hidden.device), sb)
        # The step's one host transfer: tokens [B, D + 1] | accepted [B, 1] | path [B, D].
        d = out.accepted_nodes.shape[1]
        packed = torch.cat([out.tokens, out.num_accepted[:, None], out.accepted_nodes], 1).tolist()
        emitted_all = [r[:d + 1] for r in packed]
        num_acc = [r[d + 1] for r in packed]
        paths = [r[d + 2:] for r in packed]
        emitted: dict[str, list[int]] = {}
        last = []
        for j, (i, rid, t) in enumerate(zip(order, rids, tlist)):
            a, row, s = num_acc[j], plan.rows[i], int(plan.starts[i])
            path = paths[j][:a]
            moves = t.kv_moves(path)
            if moves:
                apply_kv_moves(self.kv_cache, ib.block_table[row].tolist(), self.block_size, s,
                               moves)
            toks = emitted_all[j][:a + 1]
            emitted[rid] = toks
            last.append(toks[-1])
            ib.token_ids[row, s + 1:s + 2 + a] = toks
            ib.num_known[row] = ib.num_tokens[row] = s + 2 + a
            if self.proposer.needs_hidden:
                keep = [int(loc[i])] + [int(loc[i]) + node + 1 for node in path]
                self.hidden.setdefault(rid, []).append(hidden[keep])
            self.stats.rounds += 1
            self.stats.drafted += t.num_nodes
            self.stats.accepted += a
            self.stats.emitted += a + 1
            self.stats.record(t.depth, a)
        spec_rows = plan.rows[order]
        ib.last_sampled[torch.as_tensor(spec_rows, device=ib.last_sampled.device)] = \
            torch.tensor(last, device=ib.last_sampled.device)
        self.sampling.num_outputs[spec_rows] += np.asarray(num_acc) + 1
        self.governor.observe_round(sum(num_acc) + len(rids), len(rids),
                                    sum(t.num_nodes for t in tlist))
        return emitted

    def keep_hidden(self, plan, hidden: torch.Tensor) -> None:
        """Record the target states of the step's ordinary (non-draft) rows:
        one gather for the whole step (a copy: a replayed CUDA graph rewrites
        its output buffer), split per request. While steps overlap (speculation
        off) only the last row of as many requests as a probe drafts for is
        kept: EAGLE restarts its context after a gap, Medusa reads the last
        state, and the others draft again one step after speculation resumes."""
        if not self.proposer.needs_hidden:
            return
        rids, idx, counts = [], [], []
        loc = 0
        # While overlapping only the requests a probe round would draft for.
        room = self.governor.probe_requests if self.overlapping else len(plan.req_ids)
        for rid, q in zip(plan.req_ids, plan.query_lens):
            q = int(q)
            if len(rids) < room and rid not in self._step_trees and self.eligible.get(rid):
                first = loc + q - 1 if self.overlapping else loc
                rids.append(rid)
                idx.extend(range(first, loc + q))
                counts.append(loc + q - first)
            loc += q
        if not rids:
            return
        kept = hidden[torch.tensor(idx, device=hidden.device)]
        for rid, part in zip(rids, kept.split(counts)):
            self.hidden.setdefault(rid, []).append(part)

    def step_done(self, plan, seconds: float) -> None:
        """Time of the step just run, for the governor: a plain decode step,
        a step where every request verified drafts, or neither."""
        n = len(plan.req_ids)
        if not n:
            return
        spec_rows = sum(rid in self._step_trees for rid in plan.req_ids)
        if spec_rows == n:
            kind = "spec"
        elif spec_rows == 0 and all(int(q) == 1 for q in plan.query_lens):
            kind = "plain"
        else:
            kind = None
        self.governor.observe_step(seconds, n, kind)

    def wants_overlap(self, num_running: int) -> bool:
        """Called by the engine before each step: decides the draft budget for
        the drafts made after this step. True when none will be made and the
        step carries none, so the engine may overlap it with the next one
        (async scheduling); drafting needs the step's tokens first."""
        self._planned = self.governor.num_tokens(num_running)
        return self._planned == 0 and not self.last_proposed

    def _trim_hidden(self) -> None:
        # Off for now: keep only recent states (EAGLE restarts its context
        # from what it is given; Medusa reads the last one).
        for parts in self.hidden.values():
            if len(parts) > 64:
                del parts[:-64]

    def propose(self, req_ids: list[str], num_running: int) -> dict:
        """Drafts for the next step of requests that just got tokens."""
        ib = self.ib
        if self._planned is not None:       # the engine asked the governor this step
            k, self._planned = self._planned, None
        else:
            k = self.governor.num_tokens(num_running)
        self.last_proposed = False
        if k == 0:
            self._trim_hidden()
            return {}
        limit = self.governor.request_limit
        reqs = []
        for rid in req_ids:
            if limit is not None and len(reqs) >= limit:
                break
            row = ib.row_of.get(rid)
            if row is None or not self.eligible.get(rid):
                continue
            if self.sampling.num_outputs[row] < self.sampling.min_tokens[row]:
                continue
            n = int(ib.num_known[row])
            hidden = None
            if self.proposer.needs_hidden:
                parts = self.hidden.pop(rid, [])
                hidden = torch.cat(parts) if parts else None
                if hidden is None:
                    continue
            reqs.append(ProposeRequest(rid, ib.token_ids[row, :n].tolist(), hidden, k))
        if not reqs:
            return {}
        t0 = time.perf_counter()
        trees = self.proposer.propose(reqs)
        drafts = {r.request_id: (t.tokens.tolist(), t.parents)
                  for r, t in zip(reqs, trees) if t.num_nodes}
        seconds = time.perf_counter() - t0
        self.stats.draft_time += seconds
        self.governor.observe_draft(seconds, len(reqs))
        self.last_proposed = bool(drafts)
        return drafts
