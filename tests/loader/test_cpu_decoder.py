"""The one-call CPU decode step (kernels/cpu_decoder.py) against the model's own
forward, layer by layer through the same kernels (its twin): log-probs of the
steps it serves, for the default model and tiny models (biases, a sliding
window, several sequences at once)."""
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.kernels import cpu_decoder, cpu_library
from slipstream.kernels.tree_attention import ancestor_mask

from tests.loader.checkpoints import Q, write_gguf
from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch

needs_kernels = pytest.mark.skipif(cpu_library.load() is None, reason="no C compiler for the CPU kernels")

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]


class _Counting:
    """Counts the steps the fused decoder served."""
    def __init__(self, monkeypatch):
        self.calls = 0
        real = cpu_decoder.CPUDecoder.__call__

        def call(dec, x, batch):
            self.calls += 1
            return real(dec, x, batch)
        monkeypatch.setattr(cpu_decoder.CPUDecoder, "__call__", call)


def _run(llm, prompts, params, fused, monkeypatch):
    monkeypatch.setattr(cpu_decoder, "enabled", fused)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _compare(a, b):
    """Greedy tokens equal -> (largest, mean) difference of the common top-k log-probs."""
    diffs = []
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            common = set(lx) & set(ly)
            assert len(common) >= len(lx) // 2
            diffs += [abs(lx[i].logprob - ly[i].logprob) for i in common]
    return max(diffs), sum(diffs) / len(diffs)


@needs_kernels
def test_default_model_fused_decode_matches_layer_by_layer(monkeypatch):
    """The first decode step after the same prefill, 6 prompts decoding together.
    The two paths differ only in the order of fp32 sums (norms, rotary), but the
    int8 rounding of activations before each product makes 30 layers sensitive to
    that: nudging the step's embeddings by a relative 1e-7 moves the layer-by-layer
    path's top-10 log-probs by up to 0.27 (mean 0.065). Measured between the two
    paths: up to 0.37, mean 0.073 (later steps may part at a near tie, so only the
    first is compared). Bounds: 0.6 and mean 0.15; a wrong rotary, norm or cache
    slot moves them by whole units. (Tiny two-layer models agree to 1e-6.)"""
    count = _Counting(monkeypatch)
    llm = LLM(device="cpu", max_model_len=256)
    prompts = PROMPTS + ["1, 1, 2, 3, 5, 8,", "Once upon a time", "import numpy as np\n"]
    p = SamplingParams(max_tokens=2, temperature=0, logprobs=10, ignore_eos=True)
    fused = _run(llm, prompts, p, True, monkeypatch)
    assert count.calls == 1       # the decode step, all 6 sequences in one call
    plain = _run(llm, prompts, p, False, monkeypatch)
    assert count.calls == 1
    diffs = []
    for x, y in zip(fused, plain):
        lx, ly = x.logprobs[1], y.logprobs[1]
        common = set(lx) & set(ly)
        assert len(common) >= 8
        diffs += [abs(lx[i].logprob - ly[i].logprob) for i in common]
    assert max(diffs) < 0.6 and sum(diffs) / len(diffs) < 0.15, diffs


@needs_kernels
def test_default_model_one_token_prompt_gets_the_same_bits_alone_and_beside_another(monkeypatch):
    """A one-token prompt alone makes a step of one-token requests, which the one-call
    decoder took, while beside another prompt its step is the model's forward
    ("Once": first log-prob -0.926 alone, -0.885 beside "Twice", and token 2 differed).
    It takes the model's forward alone too now: the same tokens and log-probs, bit for
    bit; the decode steps after it stay fused."""
    count = _Counting(monkeypatch)
    llm = LLM(device="cpu", max_model_len=256)
    p = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)

    def first(prompts):
        out = llm.generate(prompts, p, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

    alone = first(["Once"])
    assert count.calls == 7        # the 7 decode steps, not the prompt's
    assert first(["Once", "Twice"]) == alone
    assert first(["Twice", "Once"]) == first(["Twice"])


@needs_kernels
@pytest.mark.parametrize("arch,qtype,window", [("llama", Q.Q4_0, None), ("qwen2", Q.Q8_0, None),
                                               ("llama", Q.Q4_1, 8)])
def test_tiny_models_fused_decode_matches_layer_by_layer(tmp_path, tiny_model, monkeypatch, arch, qtype,
                                                         window):
    """q/k/v biases (qwen2), a sliding window shorter than the context, sequences of
    different lengths decoding together. Measured: 1e-6 to 5.6e-3 (an int8 rounding
    of an activation flipped by the order of fp32 sums); the fused path with the
    window one token short moves them by 0.33. Bound 0.03."""
    count = _Counting(monkeypatch)
    path = write_gguf(tmp_path / "m.gguf", tiny_model(arch), qtype, arch=arch)
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    if window:
        for layer in llm.engine.runner.model.model.layers:
            layer.self_attn.attn.sliding_window = window
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]
    p = SamplingParams(max_tokens=10, temperature=0, logprobs=5, ignore_eos=True)
    fused = _run(llm, prompts, p, True, monkeypatch)
    assert count.calls >= 9
    plain = _run(llm, prompts, p, False, monkeypatch)
    worst, _ = _compare(fused, plain)
    assert worst < 0.03, worst


@needs_kernels
@pytest.mark.parametrize("kv", ["kivi4", "kivi2"])
def test_tiny_model_fused_decode_over_kivi_matches_layer_by_layer(tmp_path, tiny_model, monkeypatch, kv):
    """Over a KIVI cache the one-call step stores the new rows in the window pools and
    reads sealed blocks from their codes. 16-token blocks, 24 decode steps: the
    64-token prompt's first token opens a block (a new window slot), the 79-token
    prompt's first step seals a third block and later ones a fourth, the 9-token prompt
    stays in the window. The layer-by-layer path (its twin) is the torch backend's
    KIVI attention. Measured: up to 2.2e-3 (kivi4) and 8.4e-3 (kivi2), the order of
    fp32 sums flipping int8 roundings as without KIVI; bound as above."""
    count = _Counting(monkeypatch)
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q4_0, arch="llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf",
              kv_cache_dtype=kv, block_size=16, enable_prefix_caching=False)
    # (no prefix caching: the second run's prompts would read the first's sealed blocks)
    prompts = [{"prompt_token_ids": [3 + i % 50 for i in range(n)]} for n in (9, 64, 79)]
    p = SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
    fused = _run(llm, prompts, p, True, monkeypatch)
    assert count.calls >= 23
    layer = llm.engine.runner.model.attention_layers()[0]
    assert layer.kivi is not None and layer.kivi.sealed_blocks(79 + 24) == 4
    plain = _run(llm, prompts, p, False, monkeypatch)
    worst, _ = _compare(fused, plain)
    assert worst < 0.03, worst


def _depths(parents: list[int]) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def _verify_step(model, kv_dtype, tree: bool, hidden_too: bool = False, features: bool = True):
    """Two sequences prefilled (torch forward), then one step verifying drafts: a
    chain of 7 (or a tree of 9 nodes) for one, a single token for the other, run
    fused and by the model's forward from the same caches -> (fused log-probs,
    plain log-probs, fused caches, plain caches, fused calls)."""
    gen = torch.Generator().manual_seed(2)
    allocate_kv_caches(model, 40, 4, kv_dtype)
    alloc = BlockAllocator(40)
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 6] if tree else [-1, 0, 1, 2, 3, 4, 5]
    n = len(parents)
    a = Sequence(torch.randint(3, 60, (21 + n,), generator=gen).tolist(), 4, alloc)
    b = Sequence(torch.randint(3, 60, (12,), generator=gen).tolist(), 4, alloc)
    with torch.inference_mode():
        pre = make_batch([(a, 21), (b, 11)])
        model.backend.prepare(pre)
        model(pre)
        step = make_batch([(a, n), (b, 1)])
        step.features = features
        step.positions[:n] = torch.tensor([21 + d for d in _depths(parents)])
        if tree:
            mask = torch.ones(2, n, n, dtype=torch.bool).tril_()
            mask[0] = ancestor_mask(parents)
            step.tree_mask = mask
        caches = [(l.k_cache.clone(), l.v_cache.clone()) for l in model.attention_layers()]
        out = []
        for fused in (True, False):
            cpu_decoder.enabled = fused
            try:
                for l, (k, v) in zip(model.attention_layers(), caches):
                    l.k_cache.copy_(k)
                    l.v_cache.copy_(v)
                model.backend.prepare(step)
                hidden = model(step)
                out.append((model.compute_logits(hidden).log_softmax(-1),
                            [(l.k_cache.clone(), l.v_cache.clone()) for l in model.attention_layers()],
                            hidden.clone()))
            finally:
                cpu_decoder.enabled = True
    if hidden_too:
        return out[0][2], out[1][2]
    return out[0][0], out[1][0], out[0][1], out[1][1]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_1), ("qwen2", Q.Q8_0)])
def test_tiny_models_fused_verify_step_matches_layer_by_layer(tmp_path, tiny_model, monkeypatch, arch, qtype,
                                                              kv_dtype, tree):
    """A draft-verification step (chain or tree, fp32 or bf16 cache) in one call
    against the model's forward: log-probs of every row and the K/V the step
    stored. Measured: within 1e-6, except one row in some cases by up to 9.6e-3
    (an int8 rounding of an activation, or a bf16 rounding of a stored K/V,
    flipped by the order of fp32 sums, as in the decode test); caches within one
    bf16 rounding. Bounds 3e-2 (log-probs) and 2e-2 (caches). The mask itself is
    checked by tests/kernels/test_cpu_attention.py."""
    count = _Counting(monkeypatch)
    path = write_gguf(tmp_path / "m.gguf", tiny_model(arch), qtype, arch=arch)
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    model = llm.engine.runner.model
    fused, plain, kv_f, kv_p = _verify_step(model, kv_dtype, tree)
    assert count.calls == 1
    assert (fused - plain).abs().max() < 3e-2
    for (kf, vf), (kp, vp) in zip(kv_f, kv_p):
        written = ~kp.isnan()
        assert torch.equal(written, ~kf.isnan())
        torch.testing.assert_close(kf[written].float(), kp[written].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(vf[written].float(), vp[written].float(), atol=2e-2, rtol=2e-2)


@needs_kernels
def test_fused_step_returns_the_feature_taps(tmp_path, tiny_model, monkeypatch):
    """With feature taps set (an EAGLE-3 head's layers) the one-call step returns
    the final hidden states, then each tapped layer's output, as the model's
    forward does (same bound as the log-probs: int8 activation roundings)."""
    count = _Counting(monkeypatch)
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q4_1, arch="llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    model = llm.engine.runner.model
    n = model.config.num_hidden_layers
    model.set_feature_taps(range(n))
    try:
        fused, plain = _verify_step(model, torch.float32, True, hidden_too=True)
    finally:
        model.set_feature_taps(())
    assert count.calls == 1
    assert fused.shape == plain.shape == (fused.shape[0], (1 + n) * model.config.hidden_size)
    torch.testing.assert_close(fused, plain, atol=3e-2, rtol=3e-2)
    # The taps are the residual stream, not a copy of the final states.
    h = model.config.hidden_size
    assert (fused[:, h:2 * h] - fused[:, :h]).abs().max() > 0.1
    # A step whose taps no one reads (ForwardBatch.features False): the final states alone.
    model.set_feature_taps(range(n))
    try:
        fused_off, plain_off = _verify_step(model, torch.float32, True, hidden_too=True,
                                            features=False)
    finally:
        model.set_feature_taps(())
    assert count.calls == 2
    assert fused_off.shape == plain_off.shape == (fused.shape[0], h)
    torch.testing.assert_close(fused_off, fused[:, :h], atol=0, rtol=0)
    torch.testing.assert_close(plain_off, plain[:, :h], atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_verify_step_rows_equal_one_token_steps(tmp_path, tiny_model, kv_dtype):
    """A chain of 6 tokens verified in one call gives, row for row, bit for bit the
    hidden states of 6 one-token steps (the products never mix rows of x, and the
    attention visits the same keys in the same order), so greedy speculation on
    the CPU reproduces plain greedy decoding token for token."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q4_1, arch="llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    model = llm.engine.runner.model
    ids = torch.randint(3, 60, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    out = []
    for steps in ([6], [1] * 6):
        allocate_kv_caches(model, 16, 4, kv_dtype)
        seq = Sequence(ids, 4, BlockAllocator(16))
        with torch.inference_mode():
            pre = make_batch([(seq, 24)])
            model.backend.prepare(pre)
            model(pre)
            rows = []
            for n in steps:
                b = make_batch([(seq, n)])
                assert model.model.cpu_decoder.accepts(b)
                model.backend.prepare(b)
                rows.append(model(b))
        out.append(torch.cat(rows))
    assert torch.equal(out[0], out[1])


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("CTX", [55, 58, 61])
def test_tree_rows_equal_one_token_steps_along_their_paths(tmp_path, tiny_model, kv_dtype, CTX):
    """Each node of a tree verified in one call (its keys crossing a 64-key tile
    of the attention at other places than a chain's would) gives the bits of
    one-token steps along its root-to-node path."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q4_1, arch="llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    model = llm.engine.runner.model
    parents = [-1, 0, 0, 1, 1, 3, 3, 5, 5, 7, 7, 9, 9]
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 60, (CTX,), generator=gen).tolist()
    nodes = torch.randint(3, 60, (len(parents),), generator=gen).tolist()

    def prefilled():
        allocate_kv_caches(model, 24, 4, kv_dtype)
        assert 0 < 64 - CTX < len(parents)
        seq = Sequence(prompt + nodes, 4, BlockAllocator(24))
        pre = make_batch([(seq, CTX)])
        model.backend.prepare(pre)
        model(pre)
        return seq

    with torch.inference_mode():
        seq = prefilled()
        step = make_batch([(seq, len(parents))])
        step.positions[:] = torch.tensor([CTX + d for d in _depths(parents)])
        step.tree_mask = ancestor_mask(parents)[None]
        assert model.model.cpu_decoder.accepts(step)
        model.backend.prepare(step)
        tree = model(step).clone()
        for i in range(len(parents)):
            chain = []
            j = i
            while j >= 0:
                chain.insert(0, nodes[j])
                j = parents[j]
            seq = prefilled()
            seq.token_ids = prompt + chain
            for _ in chain:
                b = make_batch([(seq, 1)])
                model.backend.prepare(b)
                row = model(b)
            assert torch.equal(row[0], tree[i]), i


@needs_kernels
def test_one_call_steps_refuse_indices_outside_the_caches(tmp_path, tiny_model):
    """A slot, block id, position or length the caches do not hold is refused
    with a message before the C step reads or writes through it (it would land
    outside the caches), for decode and multi-token steps alike."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q4_1, arch="llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    model = llm.engine.runner.model
    ids = torch.randint(3, 60, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    allocate_kv_caches(model, 16, 4, torch.float32)
    seq = Sequence(ids, 4, BlockAllocator(16))

    def step(n, spoil=None):
        done = seq.num_computed
        b = make_batch([(seq, n)])
        assert model.model.cpu_decoder.accepts(b)
        if spoil:
            spoil(b)
            seq.num_computed = done         # (a refused step computes nothing)
        model.backend.prepare(b)
        return model(b)

    def bad_table(b):
        b.block_tables[0, 0] = 16
    cases = [(lambda b: b.slot_mapping.fill_(16 * 4), "slot outside"),
             (lambda b: b.slot_mapping.fill_(-2), "slot outside"),
             (bad_table, "block id outside"),
             (lambda b: b.positions.fill_(model.model.rotary_emb.cos.shape[0]), "position outside")]
    with torch.inference_mode():
        pre = make_batch([(seq, 8)])
        model.backend.prepare(pre)
        model(pre)
        for n in (1, 3):
            for spoil, what in cases:
                with pytest.raises(RuntimeError, match=what):
                    step(n, spoil)
        step(1)                                   # the caches still serve a good step
