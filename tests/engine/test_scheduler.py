from slipstream.cache.kv_manager import KVCacheManager
from slipstream.cache.prefix_cache import BlockHasher
from slipstream.config import SchedulerConfig
from slipstream.engine.request import Request, RequestStatus
from slipstream.engine.scheduler import Scheduler
from slipstream.sampling_params import SamplingParams

BS = 4


def make(rid, n_prompt, max_tokens=4, hasher=True, first=100):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(0,), max_model_len=64,
                   block_hasher=BlockHasher(BS) if hasher else None)


def sched(num_blocks=16, budget=8, max_seqs=8, chunked=True, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=64, enable_chunked_prefill=chunked), kv), kv


class Step:
    """A schedule's plain step data, read back per request: (id, new tokens, context)."""

    def __init__(self, s, out):
        self.out = out
        ctx = {r.req_id: r.num_computed_tokens for r in out.new_requests}
        ctx.update({r.req_id: r.num_computed_tokens for r in out.cached_requests})
        self.rows = [(rid, n, ctx[rid]) for rid, n in out.num_scheduled_tokens.items()]
        self.samples = [rid for rid, n, c in self.rows if s.requests[rid].num_pending]

    @property
    def ids(self):
        return [r[0] for r in self.rows]


def run_step(s, token=7):
    step = Step(s, s.schedule())
    s.update({rid: [token] for rid in step.samples})
    return step


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decode():
    s, _ = sched(budget=8)
    a, b = make("a", 3), make("b", 13)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert out.rows == [("a", 3, 0), ("b", 5, 0)]
    assert out.samples == ["a"]
    assert [r.req_id for r in out.out.new_requests] == ["a", "b"]
    out = run_step(s)
    # a decodes one token; b continues its prompt with the rest of the budget
    assert out.rows == [("a", 1, 3), ("b", 7, 5)]
    assert not out.out.new_requests and [r.req_id for r in out.out.cached_requests] == ["a", "b"]
    out = run_step(s)
    assert [(rid, n) for rid, n, _ in out.rows] == [("a", 1), ("b", 1)]
    assert "b" in out.samples


def test_no_chunking_waits_for_budget():
    s, _ = sched(budget=8, chunked=False)
    s.add_request(make("a", 6))
    s.add_request(make("b", 6, first=200))
    out = run_step(s)
    assert out.ids == ["a"]


def test_max_num_seqs_limits_running():
    s, _ = sched(max_seqs=2, budget=64)
    for i, r in enumerate("abc"):
        s.add_request(make(r, 2, first=10 * i))
    out = run_step(s)
    assert len(out.rows) == 2 and len(s.waiting) == 1


def test_preemption_frees_newest_and_recomputes_later():
    s, kv = sched(num_blocks=4, budget=64)  # 16 token slots
    a, b = make("a", 7, max_tokens=8), make("b", 7, max_tokens=8, first=200)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prompts: 2 blocks each, pool full
    assert kv.pool.num_free_blocks == 0
    out = run_step(s)  # both decode at position 7 (still inside block 2)
    out = run_step(s)  # position 8 needs a new block for a: b is preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert out.ids == ["a"]
    # the same step tells the runner to drop b's state
    assert out.out.preempted_req_ids == ["b"] and out.out.finished_req_ids == ["b"]
    while a.status == RequestStatus.RUNNING:
        run_step(s)
    # b comes back as a new request and recomputes prompt + its 2 generated tokens
    out = s.schedule()
    new = out.new_requests[0]
    assert new.req_id == "b" and out.num_scheduled_tokens["b"] == b.num_tokens
    assert new.output_token_ids == [7, 7] and new.num_computed_tokens == 0


def test_prefix_hit_skips_cached_blocks_and_leaves_last_token():
    s, kv = sched(budget=64)
    a = make("a", 9, max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert a.status.is_finished
    b = make("b", 9, max_tokens=1)  # same prompt
    s.add_request(b)
    out = run_step(s)
    assert out.rows == [("b", 1, 8)]  # two full blocks hit
    assert b.status.is_finished
    c = make("c", 8, max_tokens=1)  # prompt fully cached: the last block is recomputed
    s.add_request(c)
    out = Step(s, s.schedule())
    assert out.rows == [("c", 4, 4)]


def test_no_block_leak_after_finish_and_abort():
    s, kv = sched(num_blocks=16, budget=16)
    reqs = [make(str(i), 3 + i, max_tokens=3, first=10 * i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    run_step(s)
    s.finish_request("2", RequestStatus.FINISHED_ABORTED)
    while s.has_unfinished:
        run_step(s)
    assert kv.pool.num_free_blocks == 16
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv._blocks


def test_overlapped_schedule_runs_ahead_of_pending_tokens():
    """A step scheduled before the previous step's token is known decodes the
    pending token; a request whose pending token reaches max_tokens is not
    scheduled again; the output equals the in-order run."""
    s, kv = sched(budget=16)
    a = make("a", 3, max_tokens=3)
    s.add_request(a)
    first = Step(s, s.schedule())          # prompt, samples token 1 (pending)
    assert a.num_pending == 1 and first.samples == ["a"]
    second = Step(s, s.schedule())         # decodes pending token 1 before it is known
    assert second.rows == [("a", 1, 3)] and a.num_pending == 2
    s.update({"a": [7]})                   # token 1 lands
    third = Step(s, s.schedule())          # token 3 would be the last: still scheduled
    assert third.rows == [("a", 1, 4)] and a.num_pending == 2
    s.update({"a": [8]})
    assert Step(s, s.schedule()).rows == []  # pending token 3 is the last one
    s.update({"a": [9]})
    assert a.output_token_ids == [7, 8, 9] and a.status == RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free_blocks == 16


def test_tokens_of_a_finished_request_still_in_flight_are_dropped():
    s, kv = sched(budget=16)
    a = make("a", 3, max_tokens=8)
    s.add_request(a)
    s.schedule()
    s.schedule()                            # in flight: the prompt's token and one decode
    s.update({"a": [0]})                    # EOS
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert s.update({"a": [5]}) == []       # the extra step's token is discarded
    assert a.output_token_ids == [0]
    assert s.schedule().finished_req_ids == []   # nothing runs: the news waits for a step
    s.add_request(make("b", 2))
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and list(out.num_scheduled_tokens) == ["b"]


def test_tree_drafts_become_chains_in_steps_with_prompt_chunks():
    from slipstream.engine.scheduler import Scheduler
    from slipstream.step_data import SchedulerOutput

    class R:
        request_id = "a"
        num_spec_scheduled = 3
    out = SchedulerOutput()
    #      root -> 0 (7) -> 2 (9)
    #           -> 1 (8)
    out.spec_drafts["a"] = ([7, 8, 9], (-1, -1, 0))
    req, n = Scheduler._chain_only(R(), 4, out)
    assert n == 3 and out.spec_drafts["a"] == ([7, 9], (-1, 0)) and req.num_spec_scheduled == 2
