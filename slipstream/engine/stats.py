"""Per-step figures of the engine, for benchmarks and the roofline comparison.

Once a benchmark sets `engine.step_stats = []`, `Engine.step` appends one
`StepStats` to it right after scheduling, so the benchmark can say which batch
sizes the scheduler actually ran and bound each step with the analysis layer.
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
    def of(cls, sched, requests: dict) -> "StepStats":
        """From a SchedulerOutput; `requests`: the scheduler's live requests by id
        (read for their prompt lengths)."""
        ctx = {r.req_id: r.num_computed_tokens for r in sched.new_requests}
        ctx.update({r.req_id: r.num_computed_tokens for r in sched.cached_requests})
        counts = sched.num_scheduled_tokens
        return cls(
            num_seqs=len(counts),
            num_tokens=sum(counts.values()),
            num_decode_seqs=sum(1 for rid, n in counts.items()
                                if n == 1 and ctx[rid] >= requests[rid].num_prompt_tokens),
            context_tokens=sum(ctx.values()),
        )
