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


def run_step(s, token=7):
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    s.update(out, sampled)
    return out


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decode():
    s, _ = sched(budget=8)
    a, b = make("a", 3), make("b", 13)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens, x.context_len) for x in out.scheduled] == \
        [("a", 3, 0), ("b", 5, 0)]
    assert [x.samples for x in out.scheduled] == [True, False]
    out = run_step(s)
    # a decodes one token; b continues its prompt with the rest of the budget
    assert [(x.request.request_id, x.num_new_tokens, x.context_len) for x in out.scheduled] == \
        [("a", 1, 3), ("b", 7, 5)]
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.scheduled[1].samples


def test_no_chunking_waits_for_budget():
    s, _ = sched(budget=8, chunked=False)
    s.add_request(make("a", 6))
    s.add_request(make("b", 6, first=200))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]


def test_max_num_seqs_limits_running():
    s, _ = sched(max_seqs=2, budget=64)
    for i, r in enumerate("abc"):
        s.add_request(make(r, 2, first=10 * i))
    out = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_frees_newest_and_recomputes_later():
    s, kv = sched(num_blocks=4, budget=64)  # 16 token slots
    a, b = make("a", 7, max_tokens=8), make("b", 7, max_tokens=8, first=200)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prompts: 2 blocks each, pool full
    assert kv.pool.num_free_blocks == 0
    out = run_step(s)  # both decode at position 7 (still inside block 2)
    out = run_step(s)  # position 8 needs a new block for a: b is preempted
    assert out.preempted == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    while a.status == RequestStatus.RUNNING:
        run_step(s)
    # b comes back and recomputes prompt + its 2 generated tokens
    out = s.schedule()
    assert out.scheduled[0].request is b and out.scheduled[0].num_new_tokens == b.num_tokens


def test_prefix_hit_skips_cached_blocks_and_leaves_last_token():
    s, kv = sched(budget=64)
    a = make("a", 9, max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert a.status.is_finished
    b = make("b", 9, max_tokens=1)  # same prompt
    s.add_request(b)
    out = run_step(s)
    x = out.scheduled[0]
    assert x.context_len == 8 and x.num_new_tokens == 1  # two full blocks hit
    assert b.status.is_finished
    c = make("c", 8, max_tokens=1)  # prompt fully cached: the last block is recomputed
    s.add_request(c)
    out = s.schedule()
    assert out.scheduled[0].context_len == 4 and out.scheduled[0].num_new_tokens == 4


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
