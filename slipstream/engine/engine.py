"""The engine: requests in, one scheduled forward per step, outputs back."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from slipstream.cache.kv_manager import KVCacheManager
from slipstream.cache.prefix_cache import BlockHasher
from slipstream.engine.args import EngineArgs
from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.engine import gc_heap
from slipstream.engine.outputs import (CompletionOutput, Logprob, PositionLogprobs, RequestMetrics,
                                       RequestOutput)
from slipstream.engine.request import Request, RequestStatus
from slipstream.engine.scheduler import Scheduler
from slipstream.engine.stats import StepStats
from slipstream.loader import open_model
from slipstream.quant.selector import quant_method_for
from slipstream.runner.model_runner import ModelRunner, StepHandle
from slipstream.sampling_params import SamplingParams
from slipstream.step_data import TokenLogprobs

PromptType = str | dict | list


@dataclass
class _Sequence:
    request: Request
    detok: IncrementalDetokenizer
    parent: "_Parent"
    cumulative_logprob: float = 0.0
    draft_tokens: int = 0           # speculation: draft tokens verified for it
    accepted_tokens: int = 0        # and of them accepted


class _Parent:
    """A user request: one prompt, `n` sequences sampled from it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs: list[_Sequence] = []
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.status.is_finished for s in self.seqs)


class Engine:
    def __init__(self, args: EngineArgs, world=None):
        """world: under tensor parallelism, the prefill/decode pair
        (`distributed.parallel.World`) this instance is one of; None: its own."""
        gc_heap.thaw()              # an engine dropped earlier frees its memory first
        files = open_model(args.model, args.load_format, args.seed)
        self.config = args.create_config(str(files.path), files.config)
        self.tokenizer = files.tokenizer()
        torch.manual_seed(self.config.seed)
        if self.config.parallel.tensor_parallel_size > 1:
            from slipstream.distributed.executor import TPExecutor
            self.runner = TPExecutor(args, self.config, files, quant_method_for(self.config, files),
                                     world)
        else:
            self.runner = ModelRunner(self.config, files.weights(),
                                      quant_method_for(self.config, files))
        cc = self.config.cache
        self.kv = KVCacheManager(self.runner.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self._hasher = BlockHasher(cc.block_size) if cc.enable_prefix_caching else None
        self._parents: dict[str, _Parent] = {}
        self._loop_path = None       # spec/loop_path.LoopPath, built by loop_path()
        self._seqs: dict[str, _Sequence] = {}
        self._ids = itertools.count()
        self._inflight: StepHandle | None = None   # launched, output not yet collected
        async_sched = self.config.async_scheduling
        self.async_scheduling = (self.config.device.type == "cuda" if async_sched is None
                                 else async_sched)
        # One StepStats per step that ran a forward, once a benchmark sets a list here.
        self.step_stats: list[StepStats] | None = None
        # A speculating step needs the previous step's tokens to draft: no overlap,
        # except for steps the speculator leaves plain (`_overlap_this_step`).
        self._async_allowed = self.async_scheduling
        self.async_scheduling &= not self.config.speculative.enabled
        mc = self.config.model_config
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_ids + tuple(self.tokenizer.eos_token_ids)))
        gc_heap.engine_built()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- requests -------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is text, {"prompt": text} or {"prompt_token_ids": [...]}."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        if text is not None and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            if not text:
                raise ValueError("prompt: the prompt is empty")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        vocab = self.config.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every id must be an int in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit the maximum model length of "
                f"{self.max_model_len} (at most {self.max_model_len - 1} prompt tokens leave room "
                f"to generate)")
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary."""
        vocab = self.config.model_config.vocab_size
        for name, tids in (("logit_bias", params.logit_bias or ()),
                           ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in tids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self.check_params(params)
        text, ids = self.tokenize(prompt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = _Parent(request_id, text, ids)
        for i in range(params.n):
            child_params = params if params.n == 1 else params.child(i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, child_params, self.eos_token_ids, self.max_model_len,
                          self._hasher, prompt=text)
            seq = _Sequence(req, IncrementalDetokenizer(self.tokenizer, ids, child_params), parent)
            parent.seqs.append(seq)
            self._seqs[seq_id] = seq
        self._parents[request_id] = parent
        for s in parent.seqs:
            self.scheduler.add_request(s.request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for s in parent.seqs:
            self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED)
            self._seqs.pop(s.request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so that the next requests compute their
        prompts whole (benchmarks that repeat prompts). Only while no request is
        unfinished, since running requests hold cached blocks: False, and nothing
        reset, otherwise."""
        if self.has_unfinished_requests():
            return False
        self.kv.pool.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after this)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        if gc_heap.mode() == "all":
            gc_heap.thaw()          # what the caller drops next is collectable again

    def loop_path(self):
        """The EAGLE device loop for single greedy prompts (spec/loop_path.py), built at
        the first call; None unless `speculative_device_loop` is on."""
        if not self.config.speculative.device_loop:
            return None
        if self._loop_path is None:
            from slipstream.spec.loop_path import LoopPath
            self._loop_path = LoopPath(self)
        return self._loop_path

    @property
    def spec_stats(self):
        """Speculative decoding counters (spec.generator.SpecStats: rounds, tau,
        acceptance per position, draft time), or None when speculation is off."""
        spec = self.runner.speculator
        return None if spec is None else spec.stats

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self._inflight is not None

    # ---- the step -------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled forward; return outputs of requests that moved
        (finished_only: of those that finished; a caller that reads nothing else,
        as `LLM.generate`, spares a copy of every moving request's tokens and
        text each step).

        With async scheduling the step's forward is launched, then the previous
        step's output is collected while the device runs this one: outputs lag
        the launches by one step, and the host work of scheduling, packing
        inputs, stop checks and detokenizing hides behind device time."""
        # A tensor-parallel step's collectives must meet the workers' whole: Ctrl-C
        # lands after it (the step's outputs are kept for the next call).
        guard = getattr(self.runner, "step_guard", None)
        if guard is not None:
            with guard():
                outputs = self._step(finished_only)
        else:
            outputs = self._step(finished_only)
        if not self.has_unfinished_requests():
            gc_heap.refreeze_if_grown()     # idle: a full collection costs no step
        return outputs

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        overlap, drained = self.async_scheduling, []
        spec = getattr(self.runner, "speculator", None)
        if spec is not None and self._async_allowed:
            # The batch the next drafts would be verified in: waiting requests
            # join it (a fresh batch has none running when its prefill is planned).
            q = self.scheduler
            overlap = spec.wants_overlap(min(len(q.running) + len(q.waiting),
                                             self.config.scheduler.max_num_seqs))
            spec.overlapping = overlap
            if not overlap and self._inflight is not None:
                # Drafting needs the in-flight step's tokens: collect it first.
                previous, self._inflight = self._inflight, None
                drained = self._collect(previous, finished_only)
        sched = self.scheduler.schedule()
        handle = None
        if not sched.is_empty:
            if self.step_stats is not None:
                self.step_stats.append(StepStats.of(sched, self.scheduler.requests))
            handle = self.runner.execute(sched)
        elif self._inflight is None and self.scheduler.has_unfinished:
            raise RuntimeError("no request could be scheduled: the KV cache is too small "
                               "for the waiting requests")
        if not overlap:
            return drained + (self._collect(handle, finished_only) if handle is not None else [])
        previous, self._inflight = self._inflight, handle
        return self._collect(previous, finished_only) if previous is not None else []

    def _collect(self, handle: StepHandle, finished_only: bool = False) -> list[RequestOutput]:
        result = self.runner.resolve(handle)
        for rid, (start, entries) in result.prompt_logprobs.items():
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            # After a preemption the prompt is recomputed: keep the first record.
            recorded = seq.request.prompt_logprobs
            recorded.extend(entries[max(0, len(recorded) - start):])
        before = {rid: self._seqs[rid].request.num_output_tokens
                  for rid in result.sampled if rid in self._seqs}
        for rid, (drafted, accepted) in result.spec_counts.items():
            seq = self._seqs.get(rid)
            if seq is not None:
                seq.draft_tokens += drafted
                seq.accepted_tokens += accepted
        advanced = self.scheduler.update(result.sampled, result.drafts)
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        for req in advanced:
            seq = self._seqs[req.request_id]
            parent = seq.parent
            parent.first_token_time = parent.first_token_time or now
            lps = result.logprobs.get(req.request_id) or []
            start = before[req.request_id]
            new = req.output_token_ids[start:]
            for i, token in enumerate(new):
                # A stop string may end it inside a step that accepted several tokens
                # (speculation): the tokens after it are not part of the answer.
                if self._absorb_token(seq, token, lps[i] if i < len(lps) else None,
                                      i == len(new) - 1, start + i + 1):
                    break
            touched[parent.request_id] = parent
        outputs = [self._make_output(p) for p in touched.values()
                   if p.finished or not finished_only]
        for p in touched.values():
            if p.finished:
                self._parents.pop(p.request_id, None)
                for s in p.seqs:
                    self._seqs.pop(s.request.request_id, None)
        return outputs

    def _absorb_token(self, seq: _Sequence, token: int, lp: TokenLogprobs | None,
                      last: bool, position: int) -> bool:
        """Takes output token number `position` (1-based); True when a stop string
        ended the request at it."""
        req = seq.request
        if lp is not None:
            seq.cumulative_logprob += lp.logprob
            req.logprobs.append(self._logprob_dict(lp))
        stopped_by_token = last and req.status == RequestStatus.FINISHED_STOPPED and (
            token in req.eos_token_ids or token in req.stop_token_ids)
        if not stopped_by_token or seq.detok.include_stop:
            # Like EOS, a stop string ends a request only once it has min_tokens.
            stop = seq.detok.add_tokens([token], check_stop=position >= req.params.min_tokens)
            if stop is not None:
                req.truncate_output(position)       # before the blocks are released
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
                seq.detok.flush()
                return True
        if req.status.is_finished and last:
            seq.detok.flush()
        return False

    def _logprob_dict(self, lp: TokenLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for tid, val, rank in zip(lp.top_ids, lp.top_logprobs, itertools.count(1)):
            out[tid] = Logprob(val, rank, self.tokenizer.decode([tid], skip_special_tokens=False))
        out[lp.token_id] = Logprob(lp.logprob, lp.rank,
                                   self.tokenizer.decode([lp.token_id], skip_special_tokens=False))
        return out

    def _make_output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for i, s in enumerate(parent.seqs):
            req = s.request
            done = req.status.is_finished
            completions.append(CompletionOutput(
                index=i,
                text=s.detok.visible_text(done),
                token_ids=list(req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
            ))
        first = parent.seqs[0].request
        prompt_lps = None
        if first.params.prompt_logprobs is not None:
            prompt_lps = [None] + [self._logprob_dict(e) for e in first.prompt_logprobs]
        finished = parent.finished
        extra = {}
        if self.config.speculative.enabled:   # cumulative, over the request's sequences
            drafted = accepted = 0     # (every step, every request: one plain loop)
            for s in parent.seqs:
                drafted += s.draft_tokens
                accepted += s.accepted_tokens
            extra = {"num_draft_tokens": drafted, "num_accepted_tokens": accepted}
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(parent.arrival_time, parent.first_token_time,
                                   time.monotonic() if finished else None,
                                   sum(s.request.num_preemptions for s in parent.seqs)),
            extra=extra,
        )
