"""Tensor parallelism on the CPU: 2 ranks over gloo, the engine starting its worker.

TP=2 must give TP=1's greedy tokens; log-probabilities agree within LOGPROB_TOL
(the ranks sum partial products in another order than one full matmul, fp32).
"""
import os
import signal
import time

import pytest
import torch

from slipstream import SamplingParams
from slipstream.distributed.parallel import check_shardable, kv_heads_of_rank
from tests.engine.conftest import make_llm, random_prompts
from tests.loader.checkpoints import hf_config, write_hf_tokenizer

LOGPROB_TOL = 1e-4
HANG_LIMIT_S = 180     # tests/conftest.py: a hang ends the run with a traceback


def _save(folder, config, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    write_hf_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def split_kv_folder(tmp_path_factory):
    """Qwen2: 4 heads, 2 KV heads (one per rank), q/k/v biases, its own LM head;
    a vocabulary of 265 rows: 133 on rank 0, 132 + 1 padding row on rank 1."""
    cfg = hf_config("qwen2")
    return _save(tmp_path_factory.mktemp("tp-split"), cfg)


@pytest.fixture(scope="module")
def replicated_kv_folder(tmp_path_factory):
    """4 heads, 1 KV head (replicated on both ranks), the LM head tied to the embedding."""
    cfg = hf_config("llama", tie=True)
    cfg.num_key_value_heads = 1
    return _save(tmp_path_factory.mktemp("tp-mqa"), cfg)


def _generate(folder, tp, **kw):
    # Chunked prefill over small blocks, prompt and sample log-probs, mixed lengths.
    llm = make_llm(folder, tensor_parallel_size=tp, max_num_batched_tokens=24, **kw)
    prompts = random_prompts(4, 265, 5, 40, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=1)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _assert_same(ref, got):
    for a, b in zip(ref, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < LOGPROB_TOL
        for la, lb in zip((a.prompt_logprobs or [])[1:], (b.prompt_logprobs or [])[1:]):
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < LOGPROB_TOL


@pytest.mark.parametrize("which,overlap", [("split_kv_folder", False),
                                           ("replicated_kv_folder", True)])
def test_tp2_matches_tp1(request, which, overlap):
    """overlap: async scheduling, rank 0 launches step N+1 before it collects step N
    (a token still being sampled is read on the device, on every rank)."""
    folder = request.getfixturevalue(which)
    _, ref = _generate(folder, 1)
    llm, got = _generate(folder, 2, async_scheduling=overlap)
    try:
        runner = llm.engine.runner
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)   # the rank's share
        assert runner.model.lm_head.weight.shape[0] == 133      # no rank holds the whole vocab
        _assert_same(ref, got)
        # A second batch on the same engine: the workers kept their state in step.
        prompts = random_prompts(2, 265, 3, 12, seed=9)
        params = SamplingParams(max_tokens=4, temperature=0)
        again = llm.generate(prompts, params, use_tqdm=False)
        base = make_llm(folder).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in base]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def llama_bias_config(tmp_path_factory):
    """A Llama shape with attention_bias (q/k/v and o_proj biases: o_proj's is
    row-parallel, added by rank 0 only); config and tokenizer, no weights."""
    folder = tmp_path_factory.mktemp("tp-llama-bias")
    cfg = hf_config("llama")
    cfg.attention_bias = True
    cfg.save_pretrained(folder)
    write_hf_tokenizer(folder)
    return folder


def test_dummy_weights_match_and_a_killed_worker_fails_generate(llama_bias_config):
    """Random weights: each rank keeps its slice of the tensors one process draws, so
    TP=2 runs TP=1's model. Then a worker is killed while the engine is idle: the
    next generate raises at once (the liveness check before each step)."""
    from slipstream.distributed.executor import WorkerDiedError
    prompts = random_prompts(2, 265, 4, 10, seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=0)
    ref = make_llm(llama_bias_config, load_format="dummy").generate(prompts, params,
                                                                    use_tqdm=False)
    llm = make_llm(llama_bias_config, load_format="dummy", tensor_parallel_size=2)
    try:
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert o_proj.bias is not None and o_proj.weight.shape == (256, 128)
        got = llm.generate(prompts, params, use_tqdm=False)
        _assert_same(ref, got)
        (worker,) = llm.engine.runner._procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 .* exited with code -9"):
            llm.generate(prompts[0], params, use_tqdm=False)
        assert time.monotonic() - t0 < 10
        assert not llm.engine.has_unfinished_requests()   # the request was aborted
        with pytest.raises(WorkerDiedError):   # and the engine stays failed
            llm.generate(prompts[0], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_worker_killed_mid_generation_fails_the_step(split_kv_folder):
    """Without the liveness check, the step's own collectives notice the dead peer:
    the step fails within seconds, it does not hang."""
    from slipstream.distributed.executor import WorkerDiedError
    llm = make_llm(split_kv_folder, tensor_parallel_size=2)
    engine = llm.engine
    try:
        executor = engine.runner
        executor._dead_worker = lambda: None   # blind the check: only the collectives can tell
        engine.add_request({"prompt_token_ids": [5, 6, 7, 8]},
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        (worker,) = executor._procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="collective failed"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 10
    finally:
        engine.shutdown()


def test_default_model_heads_do_not_split_over_two_ranks():
    """SmolLM2-135M has 9 query heads and 3 KV heads: 2 ranks can split neither, so
    the engine refuses before starting any worker; 3 ranks would split both."""
    from slipstream.engine.args import EngineArgs
    from slipstream.loader import open_model
    files = open_model(None)   # what Engine() does before anything starts
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's "
                                         r"9 attention heads and 3 KV heads"):
        EngineArgs(device="cpu", tensor_parallel_size=2).create_config(str(files.path), files.config)
    EngineArgs(device="cpu", tensor_parallel_size=3).create_config(str(files.path), files.config)


def test_shardable_shapes_and_kv_head_placement():
    cfg = hf_config("llama")
    from tests.loader.checkpoints import VOCAB_SIZE  # noqa: F401
    from slipstream.models.hf_config import model_config_from_hf
    mc = model_config_from_hf({k: v for k, v in cfg.to_dict().items() if v is not None})
    check_shardable(mc, 2)   # 4 heads, 2 KV heads, 512 intermediate
    check_shardable(mc, 4)   # KV heads replicated on 2 ranks each
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        check_shardable(mc, 3)
    with pytest.raises(ValueError, match="at least 1"):
        check_shardable(mc, 0)
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_of_rank(8, r, 2) for r in range(2)] == [(0, 4), (4, 4)]


def test_tensor_parallel_options_are_checked(split_kv_folder):
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        make_llm(split_kv_folder, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="is not sharded yet"):
        make_llm(split_kv_folder, tensor_parallel_size=2, quantization="rtn-int4-head8")


def _prompt_drift(ref, got) -> float:
    """Mean |difference| of the prompts' teacher-forced log-probabilities."""
    diffs = [abs(la[t].logprob - lb[t].logprob)
             for a, b in zip(ref, got) for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
             for t in la.keys() & lb.keys()]
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("scheme", ["int8", "rtn-int4", "rtn-int3", "fp8"])
def test_quantized_at_load_layers_shard(split_kv_folder, scheme, monkeypatch):
    """A float checkpoint quantized at load: each rank quantizes its shard, with the
    scales one process computes (a whole row's range gathered for the row-parallel
    layers' per-row scales), so weight-only schemes give TP=1's tokens and
    log-probs; fp8 quantizes its activations per token over the rank's slice of a
    row-parallel input (finer than one process): another rounding of those
    inputs, so on this tiny random model (top log-probs 0.1 apart) greedy tokens
    may part. Its prompts' teacher-forced log-probabilities move by less than fp8
    itself moves them from the dense model (measured: mean 0.061 against 0.095);
    a wrong shard moves them by whole units. (On the CPU with the weight-only layers'
    exact products: their GGUF-block path, quant/cpu_blocks.py, needs whole 32-column
    blocks, which a rank's slice of this model's 96-wide MLP input is not.)"""
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")
    _tp2_matches_tp1(split_kv_folder, split_kv_folder, scheme == "fp8", quantization=scheme)


def _tp2_matches_tp1(folder, dense_folder, approximate: bool, **kw):
    """TP=2 of `folder` against TP=1: the same tokens and log-probs, or (approximate:
    activations quantized per rank) prompt log-probs that move less than the
    quantization itself moves them from `dense_folder`'s model."""
    _, ref = _generate(folder, 1, **kw)
    llm, got = _generate(folder, 2, **kw)
    try:
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.local_input_size * 2 == layer.input_size
        assert getattr(layer, "weight", None) is None or layer.weight.dtype != torch.float32
        if approximate:
            _, dense = _generate(dense_folder, 1)
            tp, quant = _prompt_drift(ref, got), _prompt_drift(dense, ref)
            assert 0 < tp < min(quant, 0.15), (tp, quant)
        else:
            _assert_same(ref, got)
    finally:
        llm.engine.shutdown()


def _quantized_checkpoint(folder, tmp_path, **opts):
    """`slipstream quantize` of `folder` (a little calibration text) -> the new folder."""
    from slipstream.loader import open_model
    from slipstream.quant.checkpoint import save_quantized
    from slipstream.quant.quantizer import QuantizeOptions, quantize_model
    files = open_model(str(folder))
    q = QuantizeOptions(seq_len=32, num_windows=2, **opts)
    cm, report = quantize_model(files, q, " ".join(["the quick brown fox jumps"] * 40))
    return save_quantized(cm.model, files, tmp_path / "q", report.layers, q.method)


@pytest.mark.parametrize("opts", [dict(method="gptq", bits=4, group_size=128, act_order=False),
                                  dict(method="rtn", bits=8, group_size=None, sym=True),
                                  dict(method="smoothquant")])
def test_checkpoints_of_slipstream_quantize_shard(split_kv_folder, tmp_path, opts, monkeypatch):
    """A checkpoint written by `slipstream quantize` loads sharded: packed codes and
    group scales split along the input of row-parallel layers, per-row scales whole
    on every rank. Weight-only: TP=1's tokens and log-probs; W8A8 (SmoothQuant)
    within its activation rounding, as fp8 above."""
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")    # as in test_quantized_at_load_layers_shard
    folder = _quantized_checkpoint(split_kv_folder, tmp_path, **opts)
    _tp2_matches_tp1(folder, split_kv_folder, opts["method"] == "smoothquant")


def test_act_order_checkpoints_do_not_split_along_the_input(split_kv_folder, tmp_path):
    folder = _quantized_checkpoint(split_kv_folder, tmp_path, method="gptq", bits=4,
                                   act_order=True)
    from slipstream.distributed.executor import WorkerDiedError
    with pytest.raises((ValueError, WorkerDiedError), match="act-order|exited"):
        make_llm(folder, tensor_parallel_size=2)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_shard(split_kv_folder, tmp_path, fmt, monkeypatch):
    """GPTQ / AWQ tensors in the Hugging Face layout: a column-parallel rank takes its
    share of each fused shard's packed outputs, a row-parallel one its share of the
    inputs (codes, groups, g_idx renumbered): TP=1's tokens and log-probs."""
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")    # as in test_quantized_at_load_layers_shard
    from tests.quant.test_hf_checkpoint import write
    write(split_kv_folder, tmp_path / "q", fmt)
    _tp2_matches_tp1(tmp_path / "q", split_kv_folder, False)


def test_act_order_gptq_does_not_split_along_the_input(split_kv_folder, tmp_path):
    from slipstream.distributed.executor import WorkerDiedError
    from tests.quant.test_hf_checkpoint import write
    write(split_kv_folder, tmp_path / "q", "gptq", act_order=True)
    with pytest.raises((ValueError, WorkerDiedError)):
        make_llm(tmp_path / "q", tensor_parallel_size=2)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_blocks_shard(split_kv_folder, tmp_path, qtype):
    """A GGUF file's blocks on the CPU kernels, split per rank (rows of the
    column-parallel layers, whole blocks of columns of the row-parallel ones; the
    tables dense): TP=1's greedy tokens. Log-probs differ a little: TP=1's LM
    head runs on blocks (activations quantized per block) where the ranks' is
    dense, and its decode steps take the one-call C decoder (measured: up to
    1.2e-3), far less than the quantization itself moves them."""
    from transformers import AutoModelForCausalLM
    from tests.loader.checkpoints import Q, write_gguf
    hf = AutoModelForCausalLM.from_pretrained(split_kv_folder)
    path = write_gguf(tmp_path / "m.gguf", hf, getattr(Q, qtype), arch="qwen2")
    _, ref = _generate(path, 1)
    llm, got = _generate(path, 2)
    llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    _tp2_matches_tp1(path, split_kv_folder, True)


def test_kivi_cache_shards_with_the_heads(split_kv_folder):
    """A KIVI cache under tensor parallelism: each rank quantizes its own KV heads
    (keys per channel, values per token, both within a head): TP=1's tokens and
    log-probs, over prompts long enough for sealed (quantized) blocks."""
    prompts = random_prompts(3, 265, 70, 100, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1)
    kw = dict(kv_cache_dtype="kivi4", block_size=16, max_num_batched_tokens=32)
    ref = make_llm(split_kv_folder, **kw).generate(prompts, params, use_tqdm=False)
    llm = make_llm(split_kv_folder, tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.runner.model.model.layers[0].self_attn.num_kv_heads == 1
        _assert_same(ref, llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_speculation_under_tensor_parallelism(split_kv_folder, tmp_path, method):
    """Rank 0 drafts; every rank verifies the step's drafts and moves its own K/V by
    rank 0's broadcast verdict: greedy tokens equal TP=1's plain decoding, and sampled
    requests run through (their draws are rank 0's)."""
    from slipstream.loader import open_model
    from slipstream.spec.eagle_head import EagleHead, EagleShape
    kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False)
    if method == "eagle":   # a draft vocabulary: drafting reads its own copy of the LM rows
        c = open_model(str(split_kv_folder)).config
        torch.manual_seed(0)
        EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, 64, c.rope_theta, c.max_position_embeddings)
                  ).save(tmp_path / "e.safetensors", torch.arange(0, 265, 2))
        kw.update(speculative_model=str(tmp_path / "e.safetensors"), speculative_tree="3,2,6")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}] + random_prompts(3, 265, 10, 30, seed=4)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = make_llm(split_kv_folder).generate(prompts, greedy, use_tqdm=False)
    llm = make_llm(split_kv_folder, tensor_parallel_size=2, **kw)
    try:
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert llm.engine.runner.speculator.stats.rounds > 0
        sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
        outs = llm.generate(prompts, sampled, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


def test_medusa_is_refused_under_tensor_parallelism(split_kv_folder, tmp_path):
    from slipstream.distributed.executor import WorkerDiedError
    from slipstream.spec.medusa import MedusaHeads
    from slipstream.loader import open_model
    c = open_model(str(split_kv_folder)).config
    MedusaHeads(c.hidden_size, 2).save(tmp_path / "m.safetensors")
    with pytest.raises((ValueError, WorkerDiedError)):
        make_llm(split_kv_folder, tensor_parallel_size=2, speculative_method="medusa",
                 speculative_model=str(tmp_path / "m.safetensors"))


def test_pieces_under_tensor_parallelism(split_kv_folder, monkeypatch):
    """The pieces around attention (runner/piecewise.py, here without graphs) hold
    the row-parallel layers' all-reduces and the vocabulary-parallel embedding:
    TP=2 through them gives TP=1's tokens (chunked prompts beside decodes)."""
    from slipstream.runner import piecewise
    _, ref = _generate(split_kv_folder, 1)
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "eager")   # the workers inherit it
    used = []
    run = piecewise.PiecewiseGraphs.run
    monkeypatch.setattr(piecewise.PiecewiseGraphs, "run",
                        lambda self, batch: used.append(batch.num_tokens) or run(self, batch))
    llm, got = _generate(split_kv_folder, 2)
    try:
        assert used   # rank 0's prompt steps went through the pieces
        _assert_same(ref, got)
    finally:
        llm.engine.shutdown()


def test_torchrun_ranks_generate_as_one_process(split_kv_folder, tmp_path):
    """Launched by torchrun (one process a rank): rank 0 generates rank-1-assisted
    what a single process generates."""
    import subprocess
    import sys
    script = tmp_path / "tp_run.py"
    script.write_text(
        "import os, sys\n"
        "from slipstream import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], tensor_parallel_size=2, device='cpu', dtype='float32',\n"
        "              max_model_len=256, block_size=4, num_kv_blocks=256)\n"
        "    out = llm.generate([{'prompt_token_ids': [5, 6, 7, 8, 9]}],\n"
        "                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)\n"
        "    print('TOKENS', out[0].outputs[0].token_ids, flush=True)\n"
        "    llm.engine.shutdown()\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    from tests.server.conftest import free_port
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script), str(split_kv_folder)],
                       capture_output=True, text=True, env=env, timeout=150)
    # Rank 1 leaves without the interpreter's teardown, where torch.distributed's C++
    # side now and then aborted ("terminate called without an active exception").
    assert r.returncode == 0, r.stdout + r.stderr
    got = [line for line in r.stdout.splitlines() if line.startswith("TOKENS")]
    want = make_llm(split_kv_folder).generate(
        [{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert got == [f"TOKENS {want}"]


def test_an_engine_dropped_without_shutdown_leaves_no_group_behind(split_kv_folder):
    import gc
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    first = make_llm(split_kv_folder, tensor_parallel_size=2)
    want = first.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    del first                                   # no shutdown()
    gc.collect()
    second = make_llm(split_kv_folder, tensor_parallel_size=2)
    try:
        assert second.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        second.shutdown()
    assert not torch.distributed.is_initialized()
