"""`LLM.generate` of one prompt through the EAGLE loop (opt-in:
`speculative_device_loop=True` with `speculative_method="eagle"`); the CLI's
`generate` and `chat` stream through it too (`Engine.loop_path`, `on_text`).

The loop (spec/eagle_loop.py) runs each speculation round as one CUDA graph
with no host round trip (on a CPU, a chain whose head drafts in C takes
spec/cpu_loop.py: each round a few C calls); this path hands it the requests it
can answer as the engine would: one prompt, no penalties, log probabilities,
logit bias or min_tokens, and greedy (the engine's tokens), or on a CPU also
sampled with temperature, top-k, top-p, min-p and a seed (the engine's
distribution, through spec/verify.py's `verify_chain`). Stops are the engine's
own (EOS, stop token ids, stop strings, max_tokens, through `Request.check_stop`
and the incremental detokenizer), checked after each batch of rounds; tokens
past a stop are dropped. Everything else (several prompts, sampling on a GPU,
serving) takes the engine's path. The speculator's counters (tau, acceptance
per depth) count the loop's rounds too.
"""
from __future__ import annotations

import logging
import time

from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from slipstream.engine.request import Request, RequestStatus
from slipstream.spec.cpu_loop import CPUChainLoop
from slipstream.spec.eagle_loop import EagleLoop

log = logging.getLogger("slipstream")


class LoopPath:
    def __init__(self, engine):
        self.engine = engine
        # One loop per length class (a power of two >= 256): static buffers, the head's
        # past and the target's split-KV launch are sized by it.
        self.loops: dict[int, EagleLoop] = {}
        self.loop: EagleLoop | CPUChainLoop | None = None   # the last one used
        self.cpu_loop: CPUChainLoop | None = None

    def _loop_for(self, length: int):
        spec = self.engine.config.speculative
        if self._cpu_chain(spec):
            if self.cpu_loop is None:
                self.cpu_loop = CPUChainLoop(self.engine, spec.num_speculative_tokens)
            self.loop = self.cpu_loop
            return self.loop
        cap = self.engine.max_model_len
        size = min(max(256, 1 << (length - 1).bit_length()), cap)
        if size not in self.loops:
            if spec.loop_compile:
                log.info("EAGLE loop for sequences up to %d tokens: its round compiles at its "
                         "first prompt (torch.compile, about 20-60 s; cached on disk after that)",
                         size)
            self.loops[size] = EagleLoop(self.engine, spec.model, spec.num_speculative_tokens,
                                         spec.eagle_topk, spec.eagle_beam, spec.eagle_max_nodes,
                                         max_len=size, compile_expansion=spec.loop_compile)
        self.loop = self.loops[size]
        return self.loop

    def _cpu_chain(self, spec) -> bool:
        """A chain (top-k 1) on a CPU whose EAGLE head drafts in C: spec/cpu_loop.py."""
        runner = self.engine.runner
        return (runner.device.type == "cpu" and spec.eagle_topk == 1
                and getattr(runner.speculator.proposer, "cpu_head", None) is not None)

    def accepts(self, prompts: list, params: list) -> bool:
        if len(prompts) != 1 or self.engine.has_unfinished_requests():
            return False
        p = params[0]
        # The CPU chain loop also samples (through verify_chain); the EAGLE
        # loop's round picks argmaxes on the device.
        sampled_ok = self._cpu_chain(self.engine.config.speculative)
        return (p.n == 1 and (p.is_greedy or sampled_ok) and not p.has_penalties
                and p.logprobs is None and p.prompt_logprobs is None and not p.logit_bias
                and p.min_tokens == 0)

    def generate(self, prompt, params, on_text=None) -> RequestOutput:
        """on_text(text): called with the text so far (what a stop string may still
        take back held back) after each batch of rounds, for streaming."""
        engine = self.engine
        text, ids = engine.tokenize(prompt)
        arrival = time.monotonic()
        req = Request("loop", ids, params, engine.eos_token_ids, engine.max_model_len, None,
                      prompt=text)
        detok = IncrementalDetokenizer(engine.tokenizer, ids, params)
        first_time = None

        def take(tokens: list[int]) -> bool:
            nonlocal first_time
            first_time = first_time or time.monotonic()
            for t in tokens:          # as Engine._absorb_token does
                req.append_token(t)
                stopped = req.check_stop()
                by_token = stopped and req.status == RequestStatus.FINISHED_STOPPED
                if not by_token or detok.include_stop:
                    s = detok.add_tokens([t])
                    if s is not None:
                        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, s
                        stopped = True
                if stopped:
                    return True
            if on_text is not None:
                on_text(detok.visible_text(False))
            return False
        loop = self._loop_for(len(ids) + req.max_tokens)
        loop.generate(ids, req.max_tokens, done=take, params=params)
        detok.flush()
        self._count(loop.accepted)
        comp = CompletionOutput(index=0, text=detok.text, token_ids=list(req.output_token_ids),
                                finish_reason=req.status.finish_reason,
                                stop_reason=req.stop_reason)
        return RequestOutput(request_id=str(next(engine._ids)), prompt=text,
                             prompt_token_ids=ids, outputs=[comp], finished=True,
                             metrics=RequestMetrics(arrival, first_time, time.monotonic()))

    def _count(self, accepted: list[int]) -> None:
        spec = self.engine.runner.speculator
        if spec is None:
            return
        st, d, n = spec.stats, self.loop.depth, self.loop.nodes
        # (a chain of the CPU loop drafts fewer tokens near max_tokens)
        drafted = getattr(self.loop, "drafted", None) or [n] * len(accepted)
        for a, k in zip(accepted, drafted):
            st.rounds += 1
            st.drafted += k
            st.accepted += a
            st.emitted += a + 1
            st.record(d if k == n else k, a)
