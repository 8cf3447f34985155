"""Per-step figures of the engine, for benchmarks and the roofline comparison.

`Engine.step` appends one `StepStats` to `engine.step_stats` right after
scheduling, so a benchmark can say which batch sizes the scheduler actually
ran and bound each step with the analysis layer.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    num_seqs: int           # requests in the step
    num_tokens: int         # tokens computed (prompt chunks + decode tokens)
    num_decode_seqs: int    # requests that bring one generated token (no prompt left)
    context_tokens: int     # tokens already in the KV cache, summed over the step's requests

    @classmethod
    def of(cls, sched) -> "StepStats":
        """From a SchedulerOutput (its `scheduled` requests)."""
        scheduled = sched.scheduled
        return cls(
            num_seqs=len(scheduled),
            num_tokens=sum(s.num_new_tokens for s in scheduled),
            num_decode_seqs=sum(1 for s in scheduled if s.num_new_tokens == 1
                                and s.context_len >= s.request.num_prompt_tokens),
            context_tokens=sum(s.context_len for s in scheduled),
        )
