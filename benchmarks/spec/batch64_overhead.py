"""Batch 64 with speculation on but switched off by the auto-off rule: does it cost
anything against plain decoding, and where does the time go?

A SmolLM2-135M-shaped model with random weights (no weight files needed), 64
requests of random token prompts x 128 greedy tokens: the plain engine, n-gram
and EAGLE (the shipped head) each answer them five times, the order alternating;
then one profiled run each (cProfile of the host, torch.profiler kernel counts
and kernel time against wall time). Speculating engines first run one prompt
at batch 1 with the rule off (as `bench spec` warms up), then with it on.

    python benchmarks/spec/batch64_overhead.py OUT_DIR      # CUDA, ~1 minute (B64_REPEATS=5, B64_TOKENS=128: outputs a request)

Writes OUT_DIR/b64.json, cprofile_<engine>.txt, kernels_<engine>.txt."""
import cProfile, io, json, os, pstats, sys, time
import torch
from slipstream import LLM, SamplingParams
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
folder = os.path.join(out, "smolshape"); os.makedirs(folder, exist_ok=True)
json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
               intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"), open(f"{folder}/config.json", "w"))
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=g).tolist()}
           for n in torch.randint(20, 60, (64,), generator=g)]
P = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("B64_TOKENS", 128)), ignore_eos=True)
W = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
common = dict(load_format="dummy", device="cuda", seed=0, num_kv_blocks=4096, max_model_len=2048)
engines = {"plain": LLM(folder, **common)}
from slipstream.spec.heads import SHIPPED, SHIPPED_DIR
for m in ("ngram", "eagle"):
    # (a model of the default model's shape: the shipped head fits it, named by path)
    head = dict(speculative_model=str(SHIPPED_DIR / SHIPPED[m])) if m in SHIPPED else {}
    engines[m] = LLM(folder, speculative_method=m, speculative_auto_off=False, **head, **common)
    engines[m].generate(prompts[:1], W, use_tqdm=False)          # batch-1 rounds, as the bench warms up
    engines[m].engine.runner.speculator.governor.auto_off = True
for llm in engines.values():
    llm.generate(prompts, W, use_tqdm=False)
res = {k: [] for k in engines}
order = list(engines)
for r in range(int(os.environ.get("B64_REPEATS", 5))):
    for name in (order if r % 2 == 0 else order[::-1]):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        o = engines[name].generate(prompts, P, use_tqdm=False)
        torch.cuda.synchronize(); s = time.perf_counter() - t0
        res[name].append(round(sum(len(x.outputs[0].token_ids) for x in o) / s, 1))
print(json.dumps(res), flush=True)
rep = {"tok_s": res}
for name, llm in engines.items():
    pr = cProfile.Profile(); pr.enable()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    open(f"{out}/cprofile_{name}.txt", "w").write(s.getvalue())
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize(); wall = time.perf_counter() - t0
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    rep[name] = dict(kernels=len(ev), kernel_ms=round(sum(e.device_time for e in ev) / 1e3, 2), wall_ms=round(wall * 1e3, 1))
    open(f"{out}/kernels_{name}.txt", "w").write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    spec = llm.engine.runner.speculator
    if spec is not None:
        rep[name]["spec"] = dict(rounds=spec.stats.rounds, quiet=spec.governor.quiet,
                                 overlapping=spec.overlapping)
print(json.dumps(rep), flush=True)
json.dump(rep, open(f"{out}/b64.json", "w"), indent=1)
