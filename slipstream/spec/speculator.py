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
A round waits on the device once: the verifier's result (and, for proposers
that draft from the verified states on the device, the next drafts) comes
back in one non-blocking copy; every host -> device copy goes through pinned
memory (spec/transfer.py), so nothing else stalls the host.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from slipstream.layers.logprobs import compute_logprobs, gather_logprobs
from slipstream.spec.base import ProposeRequest
from slipstream.spec.generator import SpecStats
from slipstream.spec.governor import SpecGovernor
from slipstream.spec.selector import create_proposer
from slipstream.spec.transfer import HostCopy, to_device
from slipstream.spec.tree import DraftTree, TreeBatch
from slipstream.spec.tree_step import TreeStepLayout, move_kv
from slipstream.spec.verify import verify
from slipstream.step_data import TokenLogprobs


class Verified(NamedTuple):
    """A step's verification, request id -> what it gave that request."""
    tokens: dict[str, list[int]]                 # the emitted tokens (accepted drafts + 1)
    logprobs: dict[str, list[TokenLogprobs]]     # their log-probabilities, where asked for
    counts: dict[str, tuple[int, int]]           # (draft tokens verified, of them accepted)


class Speculator:
    def __init__(self, config, model, kv_cache: torch.Tensor, input_batch, sampling,
                 kv_scales: torch.Tensor | None = None, tp=None):
        """tp: this rank's TPGroup under tensor parallelism. Rank 0 drafts; every rank
        verifies the staged drafts (from the step data) and moves its own K/V by rank
        0's verdict, which it broadcasts (sampled verification draws on rank 0)."""
        spec = config.speculative
        self.config = spec
        self.tp = tp
        self.follower = tp is not None and tp.rank != 0
        self.model, self.kv_cache, self.kv_scales = model, kv_cache, kv_scales
        self.ib, self.sampling = input_batch, sampling
        self.device = config.device
        self.block_size = config.cache.block_size
        # Built on every rank: a proposer's set-up may run the target's collectives
        # (reading its LM head back); only rank 0 drafts with it.
        self.proposer = create_proposer(spec.method, spec=spec, device=config.device,
                                        dtype=config.dtype, target=model,
                                        block_size=config.cache.block_size)
        if tp is not None:
            check_tp_proposer(self.proposer, spec.method)
            local_embedding(self.proposer, model)
        enable_graphs = getattr(self.proposer, "enable_graphs", None)
        if enable_graphs is not None:
            enable_graphs(spec.draft_graphs)
        self.governor = SpecGovernor(spec, config.model_config, config.device)
        self.stats = SpecStats()
        self.requests: set[str] = set()        # ids of the requests added (each may speculate)
        self.hidden: dict[str, list[torch.Tensor]] = {}
        self._step_trees: dict[str, DraftTree] = {}
        self._layout = TreeStepLayout()
        # Drafts made in `verify` (`draft_after_verify`): `propose` hands them out.
        self._early: dict[str, DraftTree] = {}
        self._planned: int | None = None       # draft budget the engine planned for this step
        self.last_proposed = False             # the last propose call made drafts
        self.overlapping = False               # set by the engine: this step runs async

    # ---- request life -------------------------------------------------------

    def add(self, req_id: str) -> None:
        # Every request may speculate: the verifier applies logit bias and the
        # penalties of each draft path (`spec.verify.constrain`), log-probabilities
        # come from the verified rows (`_path_logprobs`), and no request drafts
        # while it is short of min_tokens (`propose`).
        self.requests.add(req_id)

    def remove(self, req_id: str) -> None:
        self.requests.discard(req_id)
        self.hidden.pop(req_id, None)
        self.proposer.release(req_id)

    # ---- before the forward ---------------------------------------------------

    def stage(self, drafts: dict, starts: dict[str, int]) -> None:
        """Write the granted drafts into the input batch (host)."""
        if not drafts:
            if self._step_trees:
                self._step_trees = {}
            return
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
        """Depth positions and the tree mask for steps that verify trees
        (spec/tree_step.py). static: a CUDA-graph step."""
        if self._step_trees:
            self._layout.patch(plan, self._step_trees, static)

    # ---- after the forward ------------------------------------------------------

    def verify(self, plan, hidden: torch.Tensor) -> Verified:
        """Verify every staged draft. Everything the host does not need to see
        is queued on the device before the round's one wait (the packed result)."""
        trees = self._step_trees
        if not trees:
            if self._early:
                self._early = {}
            return Verified({}, {}, {})
        self._early = {}
        ib, dev = self.ib, hidden.device
        loc = np.concatenate([[0], np.cumsum(plan.query_lens)])
        order = [i for i, rid in enumerate(plan.req_ids) if rid in trees]
        rids = [plan.req_ids[i] for i in order]
        tlist = [trees[r] for r in rids]
        nodes = np.array([t.num_nodes for t in tlist], dtype=np.int64)
        width = int(nodes.max()) + 1
        base = loc[order].astype(np.int64)                            # [B] each request's root row
        rows = base[:, None] + np.minimum(np.arange(width)[None, :], nodes[:, None])
        spec_rows = plan.rows[order]
        idx = to_device(np.concatenate([rows.ravel(), base, spec_rows]), torch.int64, dev)
        b = len(rids)
        rows_dev, base_dev, spec_rows_dev = idx[:b * width], idx[b * width:b * (width + 1)], idx[b * (width + 1):]
        logits = self.model.compute_logits(hidden[rows_dev]).view(b, width, -1)
        sb = self.sampling.build(spec_rows)
        out = verify(logits, TreeBatch.stack(tlist, dev), sb)
        if self.tp is not None:   # one verdict: rank 0's (its draws decide sampled rows)
            from slipstream.distributed import comm
            for t in (out.tokens, out.num_accepted, out.accepted_nodes):
                comm.broadcast(t, self.tp.device_group)
        d = out.accepted_nodes.shape[1]
        if sb.penalties is not None:        # the emitted tokens join the penalty counts
            kept = torch.arange(d + 1, device=dev)[None, :] <= out.num_accepted[:, None]
            self.sampling.output_counts.index_put_(
                (sb.rows[:, None].expand(b, d + 1).reshape(-1), out.tokens.clamp_min(0).reshape(-1)),
                kept.reshape(-1).to(torch.int32), accumulate=True)
        lp_copy = None if self.follower else self._path_logprobs(logits, out, spec_rows, sb)
        parts = [out.tokens, out.num_accepted[:, None], out.accepted_nodes]
        # Proposers that can draft from the device-side result (Medusa, EAGLE) do
        # it now: their next drafts travel in the same copy.
        early_fn = None if self.follower else getattr(self.proposer, "draft_after_verify", None)
        early = None
        if early_fn is not None:
            early = early_fn(rids, [int(plan.starts[i]) for i in order], hidden, base_dev, out)
        if early is not None:
            parts.append(early[0])
        result = HostCopy(torch.cat(parts, 1))
        # Queued before the wait: the last emitted token of each request for the
        # steps that read it on the device, and the accepted rows' states.
        last = out.tokens.gather(1, out.num_accepted[:, None]).squeeze(1)
        ib.last_sampled.index_copy_(0, spec_rows_dev, last)
        kept = None
        if (self.proposer.needs_hidden and not self.follower
                and (early is None or not all(early[1]))):
            path_rows = torch.cat([out.accepted_nodes.new_zeros(b, 1), out.accepted_nodes + 1], 1)
            kept = hidden[base_dev[:, None] + path_rows.clamp_min(0)]  # [B, D + 1, hidden]
        host = result.wait()
        packed = host[:, :2 * d + 2].tolist()
        emitted: dict[str, list[int]] = {}
        counts: dict[str, tuple[int, int]] = {}
        num_acc = []
        src, dst = [], []
        for j, (i, rid, t) in enumerate(zip(order, rids, tlist)):
            r = packed[j]
            a, row, s = r[d + 1], plan.rows[i], int(plan.starts[i])
            num_acc.append(a)
            path = r[d + 2:d + 2 + a]
            for frm, to in t.kv_moves(path):
                src.append(self._slot(row, s + frm))
                dst.append(self._slot(row, s + to))
            toks = r[:a + 1]
            emitted[rid] = toks
            counts[rid] = (t.num_nodes, a)
            ib.token_ids[row, s + 1:s + 2 + a] = toks
            ib.num_known[row] = ib.num_tokens[row] = s + 2 + a
            if early is not None and early[1][j]:
                self._early[rid] = self.proposer.finish_drafts(rid, host[j, 2 * d + 2:], a)
            elif kept is not None:
                self.hidden.setdefault(rid, []).append(kept[j, :a + 1])
            self.stats.rounds += 1
            self.stats.drafted += t.num_nodes
            self.stats.accepted += a
            self.stats.emitted += a + 1
            self.stats.record(t.depth, a)
        if src:
            move_kv((self.kv_cache, self.kv_scales), src, dst, dev)
        self.sampling.num_outputs[spec_rows] += np.asarray(num_acc) + 1
        self.governor.observe_round(sum(num_acc) + len(rids), len(rids), int(nodes.sum()))
        logprobs = {}
        if lp_copy is not None:
            which, k, packed_lp = lp_copy
            packed_lp = packed_lp.wait()                  # landed with the result above
            w = (packed_lp.shape[2] - 1) // 2             # chosen token + alternatives
            for j, kj in zip(which, k):
                logprobs[rids[j]] = [TokenLogprobs.from_row(r[:w], r[w:2 * w], r[-1], kj)
                                     for r in packed_lp[j, :num_acc[j] + 1].tolist()]
        return Verified(emitted, logprobs, counts)

    def _path_logprobs(self, logits: torch.Tensor, out, spec_rows, sb):
        """Log-probabilities of the tokens each verified path emits (raw logits,
        as the sampler reports them), for the requests that asked: position i of
        a path is predicted by the row of its i-th node (the root first). Queued
        on the device; returns (indices among the verified requests, their k,
        HostCopy of [n, D + 1, 2 * (width + 1) + 1] float64), or None."""
        if sb.max_num_logprobs is None:
            return None
        ks = self.sampling.num_logprobs[spec_rows]
        which = [j for j, kj in enumerate(ks) if kj >= -1]
        if not which:
            return None
        dev = logits.device
        sel = to_device(which, torch.int64, dev)
        nodes = out.accepted_nodes[sel]
        path_rows = torch.cat([nodes.new_zeros(len(which), 1), nodes + 1], 1).clamp_min(0)
        rows = logits[sel[:, None], path_rows]                          # [n, D + 1, vocab]
        tokens = out.tokens[sel].clamp_min(0)
        lp = gather_logprobs(compute_logprobs(rows.flatten(0, 1)), int(sb.max_num_logprobs),
                             tokens.flatten())
        packed = torch.cat([lp.token_ids.double(), lp.logprobs.double(), lp.ranks[:, None].double()], 1)
        return which, [int(ks[j]) for j in which], HostCopy(packed.view(len(which), nodes.shape[1] + 1, -1))

    def _slot(self, row: int, pos: int) -> int:
        bs = self.block_size
        return int(self.ib.block_table[row, pos // bs]) * bs + pos % bs

    def _states_unread(self) -> bool:
        """No drafting will read this step's target states: the proposer reads
        none, this rank does not draft, or the governor is quiet (off at this
        batch size with no probes: its last decision, made for the drafts after
        this step (overlapping) or for this step (not); either way a request
        that drafts again first gets states from a later step, and the proposer
        restarts its context after the gap, which only costs acceptance)."""
        return not self.proposer.needs_hidden or self.follower or self.governor.quiet

    def needs_features(self) -> bool:
        """Whether this step's forward must return the feature taps beside the
        final states (`ForwardBatch.features`): only when it verifies drafts
        or its states are kept."""
        return bool(self._step_trees) or not self._states_unread()

    def keep_hidden(self, plan, hidden: torch.Tensor) -> None:
        """Record the target states of the step's ordinary (non-draft) rows:
        one gather for the whole step (a copy: a replayed CUDA graph rewrites
        its output buffer), split per request. While steps overlap (speculation
        off) only the last row of as many requests as a probe drafts for is
        kept: EAGLE restarts its context after a gap, Medusa reads the last
        state, and the others draft again one step after speculation resumes.
        Quiet (no round, no probe at this batch size): nothing is kept, and
        states kept before are dropped (after the gap they would no longer
        end at the request's root; `ProposeRequest.hidden` must)."""
        if self._states_unread():
            if self.hidden:
                self.hidden.clear()
            return
        rids, idx, counts = [], [], []
        loc = 0
        # While overlapping only the requests a probe round would draft for.
        room = self.governor.probe_requests if self.overlapping else len(plan.req_ids)
        for rid, q in zip(plan.req_ids, plan.query_lens):
            q = int(q)
            if len(rids) < room and rid not in self._step_trees and rid in self.requests:
                first = loc + q - 1 if self.overlapping else loc
                rids.append(rid)
                idx.extend(range(first, loc + q))
                counts.append(loc + q - first)
            loc += q
        if not rids:
            return
        kept = hidden[to_device(idx, torch.int64, hidden.device)]
        for rid, part in zip(rids, kept.split(counts)):
            self.hidden.setdefault(rid, []).append(part)

    def step_done(self, plan, seconds: float) -> None:
        """Time of the step just run, for the governor: a plain decode step,
        a step where every request verified drafts, or neither."""
        n = len(plan.req_ids)
        if not n:
            return
        if not self._step_trees:     # no request verified: a plain decode step or a prefill
            self.governor.observe_step(seconds, n, "plain" if plan.batch.max_query_len == 1
                                       else None)
            return
        spec_rows = sum(rid in self._step_trees for rid in plan.req_ids)
        decode = all(int(q) == 1 or plan.req_ids[i] in self._step_trees
                     for i, q in enumerate(plan.query_lens))
        if spec_rows == n:
            kind = "spec"
        elif spec_rows == 0 and all(int(q) == 1 for q in plan.query_lens):
            kind = "plain"
        elif decode:            # some requests verify, the others decode one token
            kind = "probe"
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
        if self.follower:       # rank 0's drafts arrive with the step data
            return {}
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
        early, self._early = self._early, {}
        drafts: dict = {}
        reqs = []
        for rid in req_ids:
            if limit is not None and len(reqs) + len(drafts) >= limit:
                break
            row = ib.row_of.get(rid)
            if row is None or rid not in self.requests:
                continue
            if self.sampling.num_outputs[row] < self.sampling.min_tokens[row]:
                continue
            if rid in early:        # drafted on the device during verification
                if early[rid].num_nodes:
                    drafts[rid] = (early[rid].tokens.tolist(), early[rid].parents)
                continue
            n = int(ib.num_known[row])
            hidden = None
            if self.proposer.needs_hidden:
                parts = self.hidden.pop(rid, [])
                hidden = torch.cat(parts) if parts else None
                if hidden is None:
                    continue
            reqs.append(ProposeRequest(rid, ib.token_ids[row, :n], hidden, k))
        if drafts:    # their cost is inside the verifying step's measured time
            self.governor.observe_draft(0.0, len(drafts))
        if reqs:
            t0 = time.perf_counter()
            trees = self.proposer.propose(reqs)
            # Tokens drafted on the device come back in one copy.
            on_dev = [t.tokens for t in trees if t.num_nodes and t.tokens.device.type != "cpu"]
            host = iter(HostCopy(torch.cat(on_dev)).wait().split(
                [x.shape[0] for x in on_dev])) if on_dev else None
            for r, t in zip(reqs, trees):
                if t.num_nodes:
                    toks = next(host) if t.tokens.device.type != "cpu" else t.tokens
                    drafts[r.request_id] = (toks.tolist(), t.parents)
            seconds = time.perf_counter() - t0
            self.stats.draft_time += seconds
            self.governor.observe_draft(seconds, len(reqs))
        self.last_proposed = bool(drafts)
        return drafts


def check_tp_proposer(proposer, method: str) -> None:
    """Under tensor parallelism rank 0 drafts alone, so drafting must not run the
    target's collectives: n-gram, a separate draft model, or an EAGLE / P-EAGLE head
    with a draft vocabulary (its LM head rows read back once, on every rank)."""
    lm_head = getattr(proposer, "lm_head", None)
    if method in ("medusa",) or (lm_head is not None and getattr(lm_head, "weight", None) is None):
        raise ValueError(f"speculative_method={method!r} under tensor parallelism: drafting "
                         f"would run the target's sharded LM head on rank 0 alone; use ngram, "
                         f"draft, or an EAGLE head with a draft vocabulary")


class _Table:
    """A token embedding lookup in a whole table held by this rank."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.table)


@torch.inference_mode()
def local_embedding(proposer, model) -> None:
    """Give an EAGLE-style proposer the whole token embedding table: the target's is
    split over the vocabulary, and its lookup is a collective that rank 0, drafting
    alone, cannot run. Read once, on every rank (the collective), 8k rows at a time."""
    emb = getattr(proposer, "embed", None)
    if emb is None or getattr(emb, "tp_size", 1) == 1:
        return
    vocab = model.config.vocab_size
    dev = next(model.parameters()).device
    table = torch.cat([emb(torch.arange(s, min(s + 8192, vocab), device=dev))
                       for s in range(0, vocab, 8192)])
    proposer.embed = _Table(table)
    for part in (getattr(proposer, "expander", None), getattr(proposer, "online", None)):
        if part is not None:
            part.embed = proposer.embed

