"""Prefill/decode disaggregation on the CPU: two processes over gloo.

The decode instance must give exactly the tokens of one plain instance, and must
have used the moved K/V: each prompt is admitted as a prefix-cache hit of the
blocks that moved, computing only its tail.
"""
import os
import signal
import time

import pytest

from slipstream import SamplingParams
from slipstream.analysis.flops import Precisions
from slipstream.analysis.kv_transfer import kv_bytes_per_token
from slipstream.analysis.model_spec import ModelSpec
from tests.engine.conftest import build_hf_model, make_llm, random_prompts
from tests.loader.checkpoints import write_hf_tokenizer

OPTS = dict(dtype="float32", device="cpu", max_model_len=256, block_size=4, num_kv_blocks=256)
HANG_LIMIT_S = 120     # tests/conftest.py: a hang ends the run with a traceback


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-llama")
    build_hf_model("llama").save_pretrained(folder)
    write_hf_tokenizer(folder)
    return folder


def _pd(folder, **kw):
    from slipstream.distributed.prefill_decode import DisaggregatedLLM
    return DisaggregatedLLM(str(folder), **{**OPTS, **kw})


def _assert_same(ref, got, tol: float) -> None:
    """Token for token equal, and each chosen token's log-prob within `tol`."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(ref, got):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            t = next(iter(la))
            assert abs(la[t].logprob - lb[t].logprob) < tol


def test_disaggregated_tokens_equal_one_instance(folder):
    prompts = random_prompts(5, 265, 3, 40, seed=1)
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"] + [5, 6, 7, 8, 9]})
    prompts.append({"prompt_token_ids": [7, 8, 9, 10]})   # no full block before its last token
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=2)
    ref = make_llm(folder).generate(prompts, greedy, use_tqdm=False)
    ref_seeded = make_llm(folder).generate(prompts[:3], seeded, use_tqdm=False)
    pd = _pd(folder)
    try:
        got = pd.generate(prompts, greedy, use_tqdm=False)
        _assert_same(ref, got, 1e-4)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
        # Every prompt's full blocks but the last token's moved and were used.
        moved = {t.request_id: t for t in pd.transfers}
        # The analysis layer's bytes per token: 2 layers x K,V x 2 KV heads x 64 x fp32.
        spec = ModelSpec.from_model_config(pd.engine.config.model_config)
        per_token = kv_bytes_per_token(spec, Precisions.parse(kv="fp32"))
        assert per_token == 2 * 2 * 2 * 64 * 4
        assert len(moved) == len(prompts)
        for out in got:
            n = len(out.prompt_token_ids)
            t = moved[out.request_id]
            assert t.tokens == (n - 1) // 4 * 4 == t.imported_tokens
            assert out.num_cached_tokens == t.tokens
            assert t.bytes == t.tokens * per_token
        got_seeded = pd.generate(prompts[:3], seeded, use_tqdm=False)
        assert ([[c.token_ids for c in o.outputs] for o in got_seeded]
                == [[c.token_ids for c in o.outputs] for o in ref_seeded])
        assert not pd.engine.has_unfinished_requests()
    finally:
        pd.shutdown()


def test_a_killed_prefill_instance_fails_its_requests_within_seconds(folder):
    from slipstream.distributed.prefill_decode import PeerDiedError
    pd = _pd(folder)
    engine = pd.engine
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        decoding = engine.add_request({"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params)
        while not engine.engine.has_unfinished_requests():   # its K/V arrived: decoding here
            engine.step()
        os.kill(pd.engine._proc.pid, signal.SIGKILL)
        pd.engine._proc.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError, match=r"prefill instance \(pid \d+\) exited with code -9"):
            engine.add_request({"prompt_token_ids": [11, 12, 13]}, params)
        assert time.monotonic() - t0 < 5
        # A request already decoding finishes on the decode instance alone, through the
        # pair's own steps.
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in done] == [decoding] and len(done[0].outputs[0].token_ids) == 40
    finally:
        pd.shutdown()


def test_prefill_dying_while_requests_wait_fails_them_not_hangs(folder):
    from slipstream.distributed.prefill_decode import PeerDiedError
    pd = _pd(folder)
    try:
        proc = pd.engine._proc
        os.kill(proc.pid, signal.SIGSTOP)     # frozen: the prompts can never come back ...
        rid = pd.engine.add_request({"prompt_token_ids": list(range(3, 40))},
                                    SamplingParams(max_tokens=4))
        pd.engine.step()
        os.kill(proc.pid, signal.SIGKILL)     # ... then gone
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError, match=r"1 request\(s\) waiting for their prompt were failed") as e:
            for _ in range(200):
                pd.engine.step()
        assert time.monotonic() - t0 < 5
        assert e.value.request_ids == [rid]
        assert not pd.engine.has_unfinished_requests()
    finally:
        pd.shutdown()


def test_options_are_checked(folder):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _pd(folder, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefill_device"):
        _pd(folder, prefill_device="cuda:1")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        _pd(folder, tensor_parallel_size=3)


def test_serve_with_a_prefill_device_answers_like_one_instance(folder, tmp_path):
    """`slipstream serve --prefill-device cpu`: the OpenAI API over a prefill/decode
    pair gives the tokens of one plain instance."""
    import json
    import urllib.request

    from slipstream import LLM
    from tests.server.conftest import ServerProcess
    prompt, n = "hello there", 8
    plain = LLM(str(folder), **OPTS).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0]
    server = ServerProcess(["--model", str(folder), "--device", "cpu", "--dtype", "float32",
                            "--max-model-len", "256", "--block-size", "4",
                            "--num-kv-blocks", "256", "--prefill-device", "cpu"],
                           tmp_path / "serve.log")
    try:
        model = json.loads(server.get("/v1/models"))["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] == plain.text, server.log()
        # The prefill process dies: the server says so and refuses new requests with a
        # 503 (a router sends them elsewhere), naming no other client's request.
        os.kill(_spawned_children(server.proc.pid)[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = 200
        while status == 200 and time.monotonic() < deadline:
            status, obj = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status in (500, 503) and "cmpl-" not in obj["error"]["message"], obj
        status, obj = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 503 and "takes no new requests" in obj["error"]["message"], obj
        import urllib.error
        with pytest.raises(urllib.error.HTTPError) as e:
            server.get("/health")
        assert e.value.code == 503
    finally:
        server.stop()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_a_quantized_kv_cache_moves(folder, kv):
    """int8 / fp8 codes move with their per-token scales (as bytes): the decode
    instance gives one instance's tokens over the same quantized cache, having
    used the moved blocks. Log-probs within 1e-3: the tail a decode instance
    computes runs in smaller products than one instance's whole prompt, and a
    last-bit difference can move a K/V code by one step (measured: 1.2e-4)."""
    prompts = random_prompts(4, 265, 10, 40, seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    ref = make_llm(folder, kv_cache_dtype=kv).generate(prompts, greedy, use_tqdm=False)
    pd = _pd(folder, kv_cache_dtype=kv)
    try:
        got = pd.generate(prompts, greedy, use_tqdm=False)
        _assert_same(ref, got, 1e-3)
        moved = {t.request_id: t for t in pd.transfers}
        for out in got:
            t = moved[out.request_id]
            assert t.tokens > 0 and out.num_cached_tokens == t.tokens == t.imported_tokens
            # per token: 2 layers x K,V x 2 KV heads x (64 one-byte codes + a 4-byte scale)
            assert t.bytes == t.tokens * 2 * 2 * 2 * (64 + 4)
    finally:
        pd.shutdown()


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_speculation_on_the_decode_instance(folder, tmp_path, method):
    """The decode instance speculates over the moved prompt blocks (an EAGLE head
    starts its context where the states it is given begin): greedy tokens equal
    one plain instance's."""
    import torch
    from slipstream.loader import open_model
    from slipstream.spec.eagle_head import EagleHead, EagleShape
    kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False)
    if method == "eagle":
        c = open_model(str(folder)).config
        torch.manual_seed(0)
        EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, 64, c.rope_theta, c.max_position_embeddings)
                  ).save(tmp_path / "e.safetensors")
        kw.update(speculative_model=str(tmp_path / "e.safetensors"), speculative_tree="3,2,6")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}] + random_prompts(3, 265, 10, 40, seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = make_llm(folder).generate(prompts, greedy, use_tqdm=False)
    pd = _pd(folder, **kw)
    try:
        got = pd.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert pd.engine.runner.speculator.stats.rounds > 0
        assert all(o.num_cached_tokens > 0 for o in got)
    finally:
        pd.shutdown()


def _spawned_children(pid: int) -> list[int]:
    """The live processes `pid` started with multiprocessing's spawn (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmd = open(f"/proc/{entry}/cmdline").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in cmd:
                kids.append(int(entry))
    return kids


def test_tensor_parallel_instances(folder):
    """Both instances over two ranks each (4 processes): every rank pair moves its
    shard of the K/V (2 KV heads: one a rank), and the pair gives one plain
    instance's tokens, having used the moved blocks. A request dropped before its
    K/V arrives has its shards received and discarded on every rank, so later
    requests' shards still land where they belong."""
    prompts = random_prompts(5, 265, 3, 40, seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    ref = make_llm(folder).generate(prompts, greedy, use_tqdm=False)
    pd = _pd(folder, tensor_parallel_size=2)
    try:
        dropped = pd.engine.add_request({"prompt_token_ids": list(range(10, 50))},
                                        SamplingParams(max_tokens=4))
        pd.engine.abort_request(dropped)
        assert dropped in pd.engine._aborted   # its K/V had not arrived: it comes, and is dropped
        got = pd.generate(prompts, greedy, use_tqdm=False)
        assert dropped not in pd.engine._aborted
        _assert_same(ref, got, 1e-4)
        moved = {t.request_id: t for t in pd.transfers}
        for out in got:
            t = moved[out.request_id]
            assert out.num_cached_tokens == t.tokens == t.imported_tokens > 0
            assert t.bytes == t.tokens * 2 * 2 * 2 * 64 * 4   # both ranks' shards
    finally:
        pd.shutdown()


def test_tensor_parallel_instances_with_an_int8_cache_and_speculation(folder):
    """Each rank's shard of int8 codes moves with its scales (as bytes), and the
    tensor-parallel decode instance speculates (n-gram) over the moved blocks:
    greedy tokens equal one plain instance's over the same cache."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}] + random_prompts(3, 265, 10, 40, seed=5)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = make_llm(folder, kv_cache_dtype="int8").generate(prompts, greedy, use_tqdm=False)
    pd = _pd(folder, tensor_parallel_size=2, kv_cache_dtype="int8", speculative_method="ngram",
             num_speculative_tokens=3, speculative_auto_off=False)
    try:
        got = pd.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert pd.engine.runner.speculator.stats.rounds > 0
        moved = {t.request_id: t for t in pd.transfers}
        for out in got:
            t = moved[out.request_id]
            assert out.num_cached_tokens == t.tokens == t.imported_tokens > 0
            assert t.bytes == t.tokens * 2 * 2 * 2 * (64 + 4)   # both ranks' codes and scales
    finally:
        pd.shutdown()


def test_a_killed_prefill_rank_fails_the_waiting_requests(folder):
    """A rank of the tensor-parallel prefill instance dies: its rank 0 stops, and
    the decode instance fails the requests waiting for their prompts within
    seconds (no hang); requests already decoding go on."""
    from slipstream.distributed.prefill_decode import PeerDiedError
    pd = _pd(folder, tensor_parallel_size=2)
    engine = pd.engine
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        decoding = engine.add_request({"prompt_token_ids": list(range(5, 20))}, params)
        while not engine.engine.has_unfinished_requests():
            engine.step()
        (rank1,) = _spawned_children(engine._proc.pid)
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        waiting = engine.add_request({"prompt_token_ids": list(range(3, 30))}, params)
        done = []
        with pytest.raises(PeerDiedError, match=r"prefill instance .* 1 request\(s\) waiting") as e:
            for _ in range(10_000):
                done += [o for o in engine.step() if o.finished]
        assert e.value.request_ids == [waiting]
        assert time.monotonic() - t0 < 15
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert [o.request_id for o in done] == [decoding] and len(done[0].outputs[0].token_ids) == 30
    finally:
        pd.shutdown()
