"""SchedulerOutput -> one forward pass -> sampled tokens.

`execute` only launches: it applies the step's deltas to the persistent input
batch, packs and copies the inputs, runs the model (replaying a CUDA graph for
decode-only steps), samples, and starts one non-blocking copy of the sampled
ids to pinned host memory. It returns a `StepHandle`; `resolve` waits for that
copy (the step's only wait on the device) and turns it into a `StepOutput`.
Between the two the host is free to schedule and launch the next step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from slipstream.attention.selector import create_backend
from slipstream.config import EngineConfig
from slipstream.distributed import comm
from slipstream.distributed.parallel import rank_shape
from slipstream.layers.sampler import Sampler, compute_prompt_logprobs
from slipstream.models.registry import model_class
from slipstream.runner import memory
from slipstream.runner.cuda_graph import DecodeGraphs
from slipstream.runner.input_batch import InputBatch, StepPlan
from slipstream.runner.piecewise import PiecewiseGraphs, piecewise_mode
from slipstream.runner.sampling_state import SamplingState
from slipstream.step_data import SchedulerOutput, StepOutput, TokenLogprobs


@dataclass
class StepHandle:
    """A launched step: what `resolve` needs once its copies land."""
    req_ids: list[str]                  # requests that sampled, in row order of `tokens`
    rows: np.ndarray
    tokens: torch.Tensor                # [num_samples] int64, host (pinned on CUDA)
    logprobs: tuple | None              # host (ids, logprobs, ranks) tensors, or None
    logprob_req: dict[str, int]         # request id -> its row in `logprobs`, with k
    prompt_logprobs: dict[str, tuple]   # request id -> (start, host tensors, k)
    done: torch.cuda.Event | None
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # verified drafts + 1
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)   # of those tokens
    spec_counts: dict[str, tuple[int, int]] = field(default_factory=dict)   # (drafted, accepted)


class ModelRunner:
    def __init__(self, config: EngineConfig, weights, quant_method_for=None, tp=None):
        """tp: this rank's `TPGroup` under tensor parallelism (None: one process). Every
        rank then runs the same steps; the KV pool is sized for the rank's heads, with
        the same number of blocks on every rank."""
        self.config = config
        self.tp = tp
        self.device, self.dtype = config.device, config.dtype
        if self.device.type == "cuda":
            from slipstream.runner.blas import prefer_unsplit_gemms
            prefer_unsplit_gemms()      # before the first product makes cuBLAS's workspace
        mc, sc, cc = config.model_config, config.scheduler, config.cache
        self.backend = create_backend(config.attention_backend, self.device)
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = model_class(mc.architecture)(mc, self.backend, quant_method_for, tp=tp)
        load_into = getattr(weights, "load_into", None)   # random weights (loader/dummy.py)
        load_into(self.model) if load_into else self.model.load_weights(weights)
        self.model.eval()
        if tp is not None and self.device.type == "cuda":   # collective: every rank builds it
            from slipstream.distributed import symm_all_reduce
            comm.use_small_all_reduce(tp.device_group,
                                      symm_all_reduce.build(tp.device_group, self.device, self.dtype))
        if tp is not None:   # collective too; None unless asked for (SLIPSTREAM_FUSED_...)
            from slipstream.distributed import all_reduce_norm
            fused = all_reduce_norm.build(tp.device_group, self.device, mc.hidden_size, self.dtype)
            if fused is not None and hasattr(self.model, "fuse_all_reduce_norm"):
                self.model.fuse_all_reduce_norm(fused)
        self.vocab_size = mc.vocab_size
        self.sampler = Sampler()
        rank_config = config
        if tp is not None:
            rank_config = replace(config, model_config=rank_shape(mc, tp.size))
        pieces = piecewise_mode(config, tp, self.backend.name)
        # Captured pieces keep a full step's working memory in their graph pool, beside
        # what eager steps use: the KV pool leaves room for both.
        self.plan = memory.plan_kv_cache(self.model, rank_config, graph_pool=pieces == "graphs")
        if tp is not None:   # rank 0's scheduler hands out block ids valid on every rank
            self.plan.num_blocks = comm.all_reduce_min(self.plan.num_blocks, tp.cpu_group)
        self.num_blocks = self.plan.num_blocks
        self.kv_cache = memory.allocate_kv_cache(self.num_blocks, cc, rank_config.model_config,
                                                 self.dtype, self.device)
        # [layers, 2, blocks, block_size, kv_heads] fp32 beside int8 / fp8 codes, else None
        self.kv_scales = memory.allocate_kv_scales(self.num_blocks, cc, rank_config.model_config,
                                                   self.device)
        self.kv_kivi = memory.allocate_kivi(self.num_blocks, cc, rank_config.model_config,
                                            self.dtype, self.device, sc)
        memory.bind_kv_cache(self.model.attention_layers(), self.kv_cache, self.kv_scales,
                             self.kv_kivi)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens,
                                      cc.block_size, self.device)
        self.sampling = SamplingState(sc.max_num_seqs, mc.vocab_size, self.device)
        self._prompt_lp: dict[str, int] = {}   # request id -> k, while its prompt is scored
        # Seeded streams of preempted requests, until they come back.
        self._parked: dict[str, torch.Generator] = {}
        self.graphs = None
        # (not over a KIVI cache: its window slots are handed out on the host each step)
        if (self.device.type == "cuda" and not config.enforce_eager
                and self.backend.name == "triton" and self.kv_kivi is None):
            self.graphs = DecodeGraphs(self.model, self.backend, rank_config.model_config,
                                       sc.max_num_seqs, sc.max_model_len)
        self.piecewise = None
        if pieces == "eager" or (pieces == "graphs" and self.graphs is not None):
            self.piecewise = PiecewiseGraphs(
                self.model, sc.max_num_batched_tokens, self.device, mode=pieces,
                pool=self.graphs.pool if pieces == "graphs" else None)
        self.speculator = None
        if config.speculative.enabled:
            from slipstream.spec.speculator import Speculator
            self.speculator = Speculator(config, self.model, self.kv_cache, self.input_batch,
                                         self.sampling, self.kv_scales, tp)

    # ---- state ------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> dict[str, int]:
        ib = self.input_batch
        preempted = set(sched.preempted_req_ids)
        for rid in sched.finished_req_ids:
            if self.kv_kivi is not None and rid in ib.row_of:   # seal or drop its window blocks
                r = ib.row_of[rid]
                blocks = ib.block_table[r, :ib.num_blocks[r]].tolist()
                for store in self.kv_kivi:
                    store.finish(blocks)
            row = ib.remove(rid)
            if row is not None:
                if rid in preempted and self.sampling.generators[row] is not None:
                    self._parked[rid] = self.sampling.generators[row]
                self.sampling.remove(row)
            self._prompt_lp.pop(rid, None)
            if rid not in preempted:
                self._parked.pop(rid, None)
            if self.speculator is not None:
                self.speculator.remove(rid)
        starts = {}
        for r in sched.new_requests:
            if self.speculator is not None:
                self.speculator.add(r.req_id)
            row = ib.add(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids)
            self.sampling.add(row, r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids,
                              self._parked.pop(r.req_id, None))
            if r.params.prompt_logprobs is not None:
                self._prompt_lp[r.req_id] = r.params.prompt_logprobs
            starts[r.req_id] = r.num_computed_tokens
        for r in sched.cached_requests:
            ib.append_blocks(ib.row_of[r.req_id], r.new_block_ids)
            starts[r.req_id] = r.num_computed_tokens
        return starts

    # ---- one step -----------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepHandle:
        t0 = time.perf_counter()
        starts = self._update_states(sched)
        spec = self.speculator
        if spec is not None:
            spec.stage(sched.spec_drafts, starts)
        counts = sched.num_scheduled_tokens
        bucket = None
        if self.graphs is not None and not self._prompt_lp and all(n == 1 for n in counts.values()):
            bucket = self.graphs.bucket_for(len(counts))
        # One request verifying drafts: a CUDA graph per row count (spec/speculator.py).
        tree_graph = (bucket is None and self.graphs is not None and spec is not None
                      and not self._prompt_lp and spec.graphable(counts))
        plan = self.input_batch.plan(sched, starts, num_pad_seqs=bucket or int(tree_graph),
                                     graph=bucket is not None or tree_graph)
        batch = plan.batch
        if spec is not None:
            spec.patch(plan, static=tree_graph)
        if plan.num_pending:  # tokens sampled by a step whose output the host has not seen
            batch.input_ids[plan.pending_dst] = self.input_batch.last_sampled[plan.pending_src]
        hidden = None
        if bucket is not None:
            hidden = self.graphs.run(batch, bucket)                      # [bucket, hidden]
        elif tree_graph:
            hidden = self.graphs.run_tree(batch)                         # None: graphs off
        if hidden is None:
            self.backend.prepare(batch)
            pw = self.piecewise
            if (pw is not None and pw.enabled and not batch.is_decode_only
                    and batch.tree_mask is None and pw.bucket_for(batch.num_tokens) is not None):
                hidden = pw.run(batch)                                   # graphs around attention
            else:
                # Feature taps only where drafting reads this step's states.
                batch.features = spec is None or spec.needs_features()
                hidden = self.model(batch)                               # [num_tokens, hidden]
        handle = StepHandle(plan.sample_req_ids, plan.sample_rows, None, None, {}, {}, None)
        logits_indices = batch.logits_indices
        if spec is not None:
            handle.spec_tokens, handle.spec_logprobs, handle.spec_counts = spec.verify(plan, hidden)
            spec.keep_hidden(plan, hidden)
            if handle.spec_tokens:  # the rest sample as usual
                keep = [i for i, r in enumerate(plan.sample_req_ids) if r not in handle.spec_tokens]
                plan = dataclasses.replace(plan, sample_rows=plan.sample_rows[keep],
                                           sample_req_ids=[plan.sample_req_ids[i] for i in keep])
                logits_indices = logits_indices[keep]
                handle.req_ids, handle.rows = plan.sample_req_ids, plan.sample_rows
        if len(plan.sample_rows):
            logits = self.model.compute_logits(hidden[logits_indices])  # [S, vocab] fp32
            self._sample(plan, logits, handle)
        if self._prompt_lp:
            self._score_prompts(plan, hidden, handle)
        if self.device.type == "cuda":
            handle.done = torch.cuda.Event()
            handle.done.record()
        if spec is not None and not spec.overlapping:   # timed for the auto-off rule
            if handle.done is not None:
                handle.done.synchronize()
            spec.step_done(plan, time.perf_counter() - t0)
        return handle

    def _sample(self, plan: StepPlan, logits: torch.Tensor, handle: StepHandle) -> None:
        sb = self.sampling.build(plan.sample_rows)
        result = self.sampler(logits, sb)
        sampled = result.sampled_token_ids                                # [S] int64
        if self.tp is not None and not sb.all_greedy:
            # Rank 0's draw is the step's: every rank records the same tokens. (Greedy
            # rows need no broadcast: every rank holds the same all-gathered logits.)
            comm.broadcast(sampled, self.tp.device_group)
        self.input_batch.last_sampled.index_copy_(0, sb.rows, sampled)
        self.sampling.record_sampled(sb, plan.sample_rows, sampled)
        handle.tokens = _to_host(sampled)
        if result.logprobs is not None:
            lp = result.logprobs
            handle.logprobs = (_to_host(lp.token_ids), _to_host(lp.logprobs), _to_host(lp.ranks))
            for i, rid in enumerate(plan.sample_req_ids):
                k = int(self.sampling.num_logprobs[plan.sample_rows[i]])
                if k >= -1:
                    handle.logprob_req[rid] = (i, k)

    def _score_prompts(self, plan: StepPlan, hidden: torch.Tensor, handle: StepHandle) -> None:
        """Log-probabilities of the prompt tokens this step's chunks predict."""
        ib = self.input_batch
        loc = 0
        for rid, row, start, n in zip(plan.req_ids, plan.rows, plan.starts, plan.query_lens):
            k = self._prompt_lp.get(rid)
            last = min(start + n, ib.num_prompt[row] - 1)   # position t scores token t + 1
            if k is not None and last > start:
                m = int(last - start)
                targets = torch.from_numpy(ib.token_ids[row, start + 1:start + 1 + m].copy())
                lp = compute_prompt_logprobs(
                    self.model.compute_logits(hidden[loc:loc + m]), targets.to(self.device), k)
                handle.prompt_logprobs[rid] = (int(start), (_to_host(lp.token_ids),
                                               _to_host(lp.logprobs), _to_host(lp.ranks)), k)
            if k is not None and start + n >= ib.num_prompt[row]:
                self._prompt_lp.pop(rid)
            loc += int(n)

    def resolve(self, handle: StepHandle) -> StepOutput:
        """Wait for the step's copies and return its tokens (host)."""
        if handle.done is not None:
            handle.done.synchronize()
        out = StepOutput()
        ib = self.input_batch
        tokens = handle.tokens.tolist() if handle.tokens is not None else []
        for rid, row, t in zip(handle.req_ids, handle.rows, tokens):
            out.sampled[rid] = [t]
            if ib.req_ids[row] == rid:
                ib.append_known(row, [t])
        out.sampled.update(handle.spec_tokens)   # the input batch already holds them
        if self.speculator is not None and out.sampled:
            out.drafts = self.speculator.propose(list(out.sampled), self.input_batch.num_reqs)
        if handle.logprobs is not None:
            ids, vals, ranks = (x.tolist() for x in handle.logprobs)
            for rid, (i, k) in handle.logprob_req.items():
                out.logprobs[rid] = [TokenLogprobs.from_row(ids[i], vals[i], ranks[i], k)]
        out.logprobs.update(handle.spec_logprobs)
        out.spec_counts = handle.spec_counts
        for rid, (start, (ids, vals, ranks), k) in handle.prompt_logprobs.items():
            ids, vals, ranks = ids.tolist(), vals.tolist(), ranks.tolist()
            out.prompt_logprobs[rid] = (start, [TokenLogprobs.from_row(a, b, c, k) for a, b, c in zip(ids, vals, ranks)])
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy into pinned memory (a plain view on the CPU)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build parameters directly in the model dtype (no fp32 copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
