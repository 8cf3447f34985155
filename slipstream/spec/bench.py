"""`slipstream bench spec`: speculative decoding against plain decoding.

Each prompt (one per line, chat template applied) is answered greedily at
the given batch sizes, plainly and with each method, the two runs
alternating prompt by prompt in one process; reported per method: tokens/s,
speedup over the interleaved plain run, tau (tokens per verification round),
accepted and drafted tokens per round, acceptance at each draft depth, and
the fraction of outputs token-identical to plain decoding.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "spec" / "prompts.txt"

WARM_UP = ["Explain how a bicycle gear works, step by step.",
           "List five uses of a paper clip and say why each works."]

METHODS = {
    # name -> engine options
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4),
    "draft": dict(speculative_method="draft", num_speculative_tokens=3,
                  speculative_draft_layers=8),
    "medusa": dict(speculative_method="medusa", speculative_tree="3,2,1"),
    "eagle": dict(speculative_method="eagle", num_speculative_tokens=5,
                  speculative_tree="4,4,16"),
    # EAGLE with every round of a single greedy prompt on the device (spec/loop_path.py).
    # Tree: the best of the H200 loop runs (depth 3, top-10, beam 10, 40 nodes).
    "eagle-loop": dict(speculative_method="eagle", num_speculative_tokens=3,
                       speculative_tree="10,10,40", speculative_device_loop=True),
    # Parallel drafting: a chain of 4 from one head pass (spec/peagle.py).
    "peagle": dict(speculative_method="peagle", num_speculative_tokens=4),
    # The widest tree one verification graph takes (64 rows), 7 levels deep.
    "eagle-wide": dict(speculative_method="eagle", num_speculative_tokens=7,
                       speculative_tree="10,10,63"),
}


def _run(llm, prompts, params, batch: int) -> tuple[list[list[int]], float, int]:
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        outs.extend(o.outputs[0].token_ids for o in res)
    secs = time.perf_counter() - t0
    return outs, secs, sum(len(o) for o in outs)


def _interleaved(base, llm, prompts, params, batch: int, repeats: int = 1):
    """Plain and speculative runs alternate batch by batch, so that load from
    other processes on a shared machine hits both alike; `repeats` times over
    (which of the two goes first alternates). Returns the first repeat's
    outputs, the summed seconds and the plain / speculative time ratio of
    each repeat."""
    plain_s = spec_s = 0.0
    ref, outs, ratios = [], [], []
    for rep in range(repeats):
        ps = ts = 0.0
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            if rep % 2:
                o, t, _ = _run(llm, chunk, params, batch)
                r, s, _ = _run(base, chunk, params, batch)
            else:
                r, s, _ = _run(base, chunk, params, batch)
                o, t, _ = _run(llm, chunk, params, batch)
            if not rep:
                ref += r
                outs += o
            ps += s
            ts += t
        plain_s += ps
        spec_s += ts
        ratios.append(ps / ts)
    return ref, plain_s, outs, spec_s, ratios



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--speculative-method", "--methods", dest="methods",
                   default="ngram,draft,medusa,eagle,peagle", help="comma-separated methods")
    p.add_argument("--prompts", default=None, help="one prompt per line "
                   "(default: benchmarks/spec/prompts.txt, or the training prompts)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, outputs checked against plain decoding's; "
                        "above 0 each request samples with seed 0 (tokens differ from plain "
                        "decoding's, their distribution does not)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="at batch > 1, time the plain / speculative pair this many times "
                        "(median speedup reported; short batched runs are noisy)")
    p.add_argument("--auto-off", action="store_true",
                   help="let the roofline rule switch speculation off (always on at batch > 1)")
    p.add_argument("--out", default=None, help="directory for results_<device>.{json,md}")
    p.add_argument("--medusa-head", default=None, help="Medusa head file (default: shipped)")
    p.add_argument("--eagle-head", default=None, help="EAGLE head file (default: shipped)")
    p.add_argument("--peagle-head", default=None,
                   help="parallel-drafting EAGLE head file (default: shipped)")
    p.add_argument("--eagle-tree", default=None,
                   help="EAGLE tree 'topk,beam,nodes' (default 4,4,16)")
    p.add_argument("--eagle-depth", type=int, default=None, help="EAGLE tree depth (default 5)")
    p.add_argument("--eagle-min-prob", type=float, default=None,
                   help="EAGLE: drafts below this path probability not verified "
                        "(speculative_draft_min_prob; default off)")
    p.add_argument("--medusa-tree", default=None, help="Medusa top-k per head (default 3,2,1)")
    p.add_argument("--ngram-tokens", type=int, default=None, help="n-gram chain length (default 4)")
    p.add_argument("--peagle-tokens", type=int, default=None,
                   help="parallel-drafting chain length (default 4)")
    p.add_argument("--profile", action="store_true",
                   help="after each timed run, one more run of up to 4 prompts under cProfile: "
                        "profiles_<device>.txt (top 40, ms per round by part) in --out")
    p.add_argument("--eagle-graphs", action="store_true",
                   help="EAGLE's tree expansion from a CUDA graph (speculative_draft_graphs)")
    p.add_argument("--loop-compile", action="store_true",
                   help="eagle-loop: the expansion and round parts through torch.compile "
                        "(speculative_compile)")
    p.add_argument("--no-sync-check", dest="sync_check", action="store_false",
                   help="CUDA: skip counting the synchronizing calls of a speculation round")


def run(args, model=None, heads: dict | None = None, stem: str | None = None) -> int:
    """`model`/`heads` override --model and the shipped heads (the smoke test)."""
    heads = dict(heads or {})
    for name in ("medusa", "eagle", "peagle"):
        if getattr(args, f"{name}_head", None):
            heads[name] = getattr(args, f"{name}_head")
    model = model if model is not None else args.model
    import torch
    from slipstream import LLM, SamplingParams

    smoke = stem == "smoke"
    prompts_file = Path(args.prompts) if args.prompts else DEFAULT_PROMPTS
    if not prompts_file.is_file():   # an installed package has no benchmarks/ folder
        prompts_file = Path(__file__).parent / "data" / "train_prompts.txt"
    texts = [s.strip() for s in prompts_file.read_text().splitlines() if s.strip()]
    texts = texts[:args.num_prompts] if args.num_prompts else texts
    common = dict(device=args.device, dtype=args.dtype, max_model_len=256 if smoke else 1024,
                  seed=0)
    base_extra, spec_extra = {}, {}
    if args.device == "cpu":
        common["kv_cache_memory"] = 256 << 20
    else:
        # Two engines live at once (plain and one method). gpu_memory_utilization
        # is the process's share of the card: the second engine's pool gets what
        # is left of its share after the first.
        base_extra, spec_extra = dict(gpu_memory_utilization=0.3), dict(gpu_memory_utilization=0.65)
    temperature = getattr(args, "temperature", 0.0)
    params = SamplingParams(temperature=temperature, top_p=getattr(args, "top_p", 1.0),
                            seed=0 if temperature > 0 else None, max_tokens=args.max_tokens,
                            ignore_eos=True)

    if getattr(args, "profile", False) and args.out:
        (Path(args.out) / f"profiles_{args.device}.txt").unlink(missing_ok=True)
    base = LLM(model, **common, **base_extra)
    tok = base.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": t}]), add_special_tokens=False)} for t in texts]
    cfg = base.engine.config
    env = dict(device=args.device, device_name=(torch.cuda.get_device_name() if args.device == "cuda"
                                                else platform.processor() or platform.machine()),
               dtype=str(cfg.dtype).removeprefix("torch."), torch=torch.__version__,
               model=cfg.model, prompts=len(prompts), max_tokens=args.max_tokens,
               attention_backend=base.engine.runner.backend.name,
               sampling=("greedy" if params.is_greedy else
                         f"sampled (temperature {params.temperature}, top-p {params.top_p}, seed 0)"))
    results = []
    sets = {}
    # Warm-up prompts outside the measured set (no prefix-cache hits in the timed runs).
    args.warm_prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": t}]), add_special_tokens=False)} for t in WARM_UP]
    _run(base, args.warm_prompts, SamplingParams(temperature=0.0, max_tokens=16), 1)
    for batch in args.batch:
        reps = -(-batch // len(prompts))
        ps = (prompts * reps)[:batch] if batch > len(prompts) else prompts
        sets[batch] = ps
        if batch > 1:   # graphs and kernels for this batch size, outside the timed runs
            _run(base, _warm_set(args, batch), SamplingParams(temperature=0.0, max_tokens=16), batch)
        ref, plain_s, n_tok = _run(base, ps, params, batch)
        row = dict(batch=batch, method="plain", tokens=n_tok, seconds=round(plain_s, 3),
                   tokens_per_s=round(n_tok / plain_s, 2), speedup=1.0)
        if getattr(args, "profile", False):
            row["profile"] = _profile(args, base, None, ps, params, batch, "plain")
        results.append(row)
        print(json.dumps(row), flush=True)
    for name in args.methods.split(","):
        if name not in METHODS:
            raise ValueError(f"--speculative-method: unknown {name!r}; choose from {sorted(METHODS)}")
        opts = dict(METHODS[name])
        if name in ("eagle", "eagle-loop") and getattr(args, "eagle_tree", None):
            opts["speculative_tree"] = args.eagle_tree
        if name in ("eagle", "eagle-loop") and getattr(args, "eagle_depth", None):
            opts["num_speculative_tokens"] = args.eagle_depth
        if name in ("eagle", "eagle-loop") and getattr(args, "eagle_min_prob", None):
            opts["speculative_draft_min_prob"] = args.eagle_min_prob
        if name == "medusa" and getattr(args, "medusa_tree", None):
            opts["speculative_tree"] = args.medusa_tree
        if name in ("ngram", "peagle") and getattr(args, f"{name}_tokens", None):
            opts["num_speculative_tokens"] = getattr(args, f"{name}_tokens")
        kind = opts["speculative_method"]
        if kind == "eagle" and getattr(args, "eagle_graphs", False):
            opts["speculative_draft_graphs"] = True
        if name == "eagle-loop" and getattr(args, "loop_compile", False):
            opts["speculative_compile"] = True
        if kind in heads:
            opts["speculative_model"] = heads[kind]
        if name == "draft" and smoke:
            opts["speculative_draft_layers"] = 1
        try:
            _method(LLM, model, common, spec_extra, opts, args, prompts, sets, base, params,
                    name, results)
        except Exception as e:   # one method failing must not lose the others' rows
            import traceback
            traceback.print_exc()
            row = dict(method=name, error=f"{type(e).__name__}: {e}"[:300])
            results.append(row)
            print(json.dumps(row), flush=True)
        import gc
        gc.collect()
        if args.device != "cpu":
            torch.cuda.empty_cache()
        _write(args, stem or f"results_{args.device}", env, results, quiet=True)
    _write(args, stem or f"results_{args.device}", env, results)
    return 0


def _method(LLM, model, common, spec_extra, opts, args, prompts, sets, base, params, name,
            results) -> None:
    try:
        llm = LLM(model, **common, **spec_extra, **opts, speculative_auto_off=args.auto_off)
    except ValueError as e:   # e.g. no trained head ships for this model
        row = dict(method=name, error=str(e))
        results.append(row)
        print(json.dumps(row), flush=True)
        return
    from slipstream import SamplingParams
    spec = llm.engine.runner.speculator
    # Warm-up long enough that the verification graphs of the usual row counts
    # (and EAGLE's drafting graph) are captured before anything is timed.
    _run(llm, args.warm_prompts, SamplingParams(temperature=0.0,
                                                 max_tokens=min(args.max_tokens, 48)), 1)
    for batch in args.batch:
        ps = sets[batch]
        # At batch > 1 the roofline rule decides (the target: never slower than plain).
        spec.governor.auto_off = args.auto_off or batch > 1
        if batch > 1:
            _run(llm, _warm_set(args, batch), SamplingParams(temperature=0.0, max_tokens=16), batch)
        spec.stats.__init__()
        repeats = max(1, getattr(args, "repeats", 1)) if batch > 1 else 1
        ref, plain_s, outs, secs, ratios = _interleaved(base, llm, ps, params, batch, repeats)
        n, n_tok = sum(len(o) for o in outs), sum(len(o) for o in ref)
        plain_s, secs = plain_s / repeats, secs / repeats
        st = spec.stats
        row = dict(batch=batch, method=name, options=opts, tokens=n, seconds=round(secs, 3),
                   tokens_per_s=round(n / secs, 2),
                   plain_tokens_per_s=round(n_tok / plain_s, 2),
                   speedup=round(plain_s / secs * n / n_tok, 3),
                   identical=(sum(a == b for a, b in zip(outs, ref)) / len(ref)
                              if params.is_greedy else None),
                   rounds=st.rounds, tau=round(st.tau, 3),
                   mean_accepted=round(st.accepted / max(st.rounds, 1), 3),
                   drafted_per_round=round(st.drafted / max(st.rounds, 1), 2),
                   acceptance_per_position=[round(a, 3) for a in st.acceptance_per_position],
                   draft_seconds=round(st.draft_time, 3))
        if repeats > 1:
            ratios = sorted(r * n / n_tok for r in ratios)
            row["speedup_runs"] = [round(r, 3) for r in ratios]
            row["speedup_median"] = round(ratios[len(ratios) // 2], 3)
            row["speedup_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        if getattr(args, "profile", False):
            row["profile"] = _profile(args, llm, spec, ps, params, batch, name)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.device != "cpu" and getattr(args, "sync_check", True):
        from slipstream.spec.bench_profile import count_syncs
        spec.governor.auto_off = False
        row = dict(batch=1, method=name, check="sync", **count_syncs(llm, prompts[0], params))
        results.append(row)
        print(json.dumps(row), flush=True)


def _warm_set(args, batch: int) -> list:
    return (args.warm_prompts * batch)[:batch]


def _profile(args, llm, spec, prompts, params, batch: int, name: str) -> dict:
    from slipstream.spec.bench_profile import profile_run
    ps = prompts[:max(batch, min(4, len(prompts)))]
    out = Path(args.out) / f"profiles_{args.device}.txt" if args.out else None
    return profile_run(lambda: _run(llm, ps, params, batch), out, name, batch, spec)


def _write(args, stem: str, env: dict, results: list, quiet: bool = False) -> None:
    if args.out is None:
        if not quiet:
            print(json.dumps(dict(env=env, results=results), indent=1))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    lines = [f"# Speculative decoding, {env['device_name']} ({args.device}, {env['dtype']})", "",
             f"{env['prompts']} chat prompts, {env.get('sampling', 'greedy')}, {args.max_tokens} tokens each; torch "
             f"{env['torch']}; speedup = plain seconds / method seconds, the two runs alternating "
             "prompt by prompt in one process (plain tok/s is the interleaved plain run).", "",
             "| batch | method | tok/s | plain tok/s | speedup | tau | accepted/round | "
             "drafted/round | acceptance by position | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    checks = [r for r in results if "check" in r]
    for r in sorted(results, key=lambda r: r.get("batch", 0)):
        if "check" in r:
            continue
        if "error" in r:
            lines.append(f"| | {r['method']} | error: {r['error']} ||||||||")
            continue
        lines.append(f"| {r['batch']} | {r['method']} | {r['tokens_per_s']} | "
                     f"{r.get('plain_tokens_per_s', '')} | {r['speedup']}"
                     + (f" (median of {len(r['speedup_runs'])}: {r['speedup_median']}, "
                        f"{r['speedup_range'][0]}-{r['speedup_range'][1]})"
                        if "speedup_median" in r else "") + " | "
                     f"{r.get('tau', '')} | {r.get('mean_accepted', '')} | "
                     f"{r.get('drafted_per_round', '')} | {r.get('acceptance_per_position', '')} | "
                     f"{'' if r.get('identical') is None else r['identical']} |")
    for r in checks:
        lines += ["", f"Synchronizing CUDA calls per speculation round ({r['method']}, batch 1, "
                  f"torch.cuda.set_sync_debug_mode): {r.get('syncs_per_round', r.get('skipped'))}; "
                  f"places {r.get('sync_places', {})}; a round in mode 'error': "
                  f"{r.get('error_mode_round')}"]
    profiled = [r for r in results if "profile" in r]
    if profiled:
        lines += ["", "Per-round split under cProfile (ms per verification round; plain: per step):", ""]
        for r in profiled:
            parts = ", ".join(f"{p['part'].strip()} {p['ms_per_round' if r['method'] != 'plain' else 'ms_per_step']}"
                              for p in r["profile"]["split"])
            lines.append(f"- {r['method']} batch {r['batch']}: {parts}")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))
