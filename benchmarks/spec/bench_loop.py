"""EAGLE with every round on the device (slipstream/spec/eagle_loop.py) against
plain decoding, batch 1, greedy, on the default model.

Per tree shape (depth, topk, beam, nodes): the plain engine (`LLM.generate`,
one CUDA graph per decode step) and the loop answer each prompt of
benchmarks/spec/prompts.txt in turn, in one process; reported: tokens/s of
both, speedup, tau (tokens per round), ms per round, and the fraction of
outputs token-identical to plain decoding (bf16 near-ties may flip).

    python benchmarks/spec/bench_loop.py --device cuda --out OUT            # H200, ~1 minute
    python benchmarks/spec/bench_loop.py --smoke --out /tmp/x               # CPU, tiny model

Writes loop_<device>.{json,md} to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

WARM = ["Explain how a bicycle gear works, step by step.",
        "List five uses of a paper clip and say why each works."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--trees", default="6,8,8,48;4,10,10,48;3,10,10,40;7,10,10,63",
                    help="';'-separated depth,topk,beam,nodes")
    ap.add_argument("--eagle-head", action="append", default=None,
                    help="head file (default: shipped); repeat to compare heads")
    ap.add_argument("--no-graphs", action="store_true", help="eager rounds")
    ap.add_argument("--compile-trees", default="",
                    help="';'-separated shapes to run once more with the expansion compiled "
                         "(torch.compile), after the others")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="CUDA: kernels of one eager round of the first tree (torch.profiler) "
                         "to kernels_cuda.txt in --out, and of the first compiled tree to "
                         "kernels_cuda_compiled.txt")
    ap.add_argument("--load-format", default=None,
                    help="dummy: random weights of --model's shape (benchmarks/runtime/"
                         "smollm2_shape.py writes the default model's): round times without "
                         "the model file (tau then means nothing)")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:module.attr=value[,module.attr=value]: each tree (and compiled "
                         "tree) also with these module settings, after the defaults; e.g. "
                         "'rows64:slipstream.kernels.decode_configs.MAX_BLOCK_M=64', or "
                         "'onestage:slipstream.spec.eagle_tree.TWO_STAGE_MIN=1000000000' (the "
                         "draft vocabulary's top-k in one stage) (repeatable)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import torch
    from slipstream import LLM, SamplingParams
    from slipstream.spec.eagle_loop import EagleLoop

    model, heads = args.model, args.eagle_head or [None]
    opts = dict(device=args.device, max_model_len=1024, seed=0)
    if args.smoke:
        import tempfile
        from bench_spec import _tiny_model
        model, tiny = _tiny_model(Path(tempfile.mkdtemp()) / "smoke-model")
        heads = [tiny["eagle"] if h is None else h for h in heads]
        args.device = opts["device"] = "cpu"
        args.max_tokens, args.num_prompts = min(args.max_tokens, 16), args.num_prompts or 2
        opts["max_model_len"], opts["dtype"] = 256, "float32"   # fp32: exact identity
    if args.load_format:
        opts["load_format"] = args.load_format
    if args.device == "cpu":
        opts["kv_cache_memory"] = 256 << 20
    else:
        opts["gpu_memory_utilization"] = 0.4
    llm = LLM(model, **opts)
    tok = llm.get_tokenizer()

    def encode(t):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]),
                          add_special_tokens=False)
    texts = [s.strip() for s in (HERE / "prompts.txt").read_text().splitlines() if s.strip()]
    prompts = [encode(t) for t in texts[:args.num_prompts] if t]
    warm = [encode(t) for t in WARM]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # The loop's length class, as spec/loop_path.py picks it (buffers and launches sized by it).
    longest = max(len(p) for p in prompts + warm) + args.max_tokens
    max_len = min(max(256, 1 << (longest - 1).bit_length()), opts["max_model_len"])

    def plain(ids):
        res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(res[0].outputs[0].token_ids)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
    for w in warm:
        plain(w)
    env = dict(device=args.device, device_name=torch.cuda.get_device_name() if args.device == "cuda"
               else "cpu", torch=torch.__version__, dtype=str(llm.engine.config.dtype),
               prompts=len(prompts), max_tokens=args.max_tokens,
               graphs=args.device == "cuda" and not args.no_graphs)
    results = []
    variants = [("", [])] + [_variant(v) for v in args.variant]
    runs = [(h, t, False, va) for h in heads for t in args.trees.split(";") if t for va in variants]
    runs += [(heads[0], t, True, va) for t in args.compile_trees.split(";") if t for va in variants]
    for head, spec, comp, (label, settings) in runs:
        d, k, b, n = (int(x) for x in spec.split(","))
        row = dict(head=head or "shipped", tree=dict(depth=d, topk=k, beam=b, nodes=n))
        if comp:
            row["compiled"] = True
        if label:
            row["variant"] = label
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in settings]
        for mod, attr, value in settings:
            setattr(mod, attr, value)
        try:
            t0 = time.perf_counter()
            loop = EagleLoop(llm, head, depth=d, topk=k, beam=b, max_nodes=n,
                             max_len=max_len, graphs=not args.no_graphs, compile_expansion=comp)
            for w in warm:
                loop.generate(w, min(args.max_tokens, 48))
            row["setup_s"] = round(time.perf_counter() - t0, 2)
            loop.rounds = loop.emitted = loop.batches = 0
            loop.seconds = {"prefill": 0.0, "rounds": 0.0}
            ps = ls = 0.0
            same = tokens = 0
            for ids in prompts:
                sync()
                t0 = time.perf_counter()
                ref = plain(ids)
                t1 = time.perf_counter()
                out = loop.generate(ids, args.max_tokens)
                t2 = time.perf_counter()
                ps, ls = ps + t1 - t0, ls + t2 - t1
                same += out == ref
                tokens += len(out)
            # Rounds alone: one long batch of replays timed on the device.
            rounds = min(64, (max_len - len(prompts[0])) // (d + 1))
            round_ms = _time_rounds(loop, prompts[0], rounds) * 1e3
            row.update(tokens=tokens, plain_tok_s=round(tokens / ps, 1),
                       loop_tok_s=round(tokens / ls, 1), speedup=round(ps / ls, 3),
                       tau=round(loop.emitted / max(loop.rounds, 1), 3),
                       round_ms=round(round_ms, 3),
                       plain_step_ms=round(ps / tokens * 1e3, 3),
                       prefill_ms=round(loop.seconds["prefill"] / len(prompts) * 1e3, 2),
                       round_ms_in_generate=round(loop.seconds["rounds"] / max(loop.rounds, 1)
                                                  * 1e3, 3),
                       batches_per_prompt=round(loop.batches / len(prompts), 1),
                       identical=round(same / len(prompts), 3),
                       graphs=loop.graph is not None, graph_matches_eager=loop.graph_matches,
                       graph_error=loop.graph_error, compile_error=loop.compile_error)
            if args.device == "cuda":
                try:
                    row["parts_ms"] = _parts(loop, prompts[0])
                except Exception as e:   # noqa: BLE001 - the row stands without it
                    row["parts_ms"] = f"{type(e).__name__}: {e}"[:200]
                first_compiled = comp and not any(r.get("compiled") for r in results)
                if args.kernel_profile and (not results or first_compiled):
                    name = "kernels_cuda_compiled.txt" if comp else "kernels_cuda.txt"
                    try:
                        _kernels(loop, prompts[0], Path(args.out) / name, spec)
                    except Exception as e:   # noqa: BLE001
                        print(f"kernel profile failed: {e!r}", flush=True)
        except Exception as e:   # noqa: BLE001 - one shape failing must not lose the others
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        for mod, attr, value in saved:
            setattr(mod, attr, value)
        results.append(row)
        print(json.dumps(row), flush=True)
        _write(args, env, results)
    return 0


def _variant(text: str) -> tuple[str, list]:
    """'LABEL:module.attr=value,...' -> (label, [(module, attr, value)]); a value takes
    the type of the attribute's current value."""
    import importlib
    label, _, body = text.partition(":")
    settings = []
    for item in filter(None, body.split(",")):
        name, _, value = item.partition("=")
        modname, _, attr = name.rpartition(".")
        mod = importlib.import_module(modname)
        cur = getattr(mod, attr)
        if isinstance(cur, bool):
            val = value.lower() in ("1", "true", "yes", "on")
        else:
            val = type(cur)(value)
        settings.append((mod, attr, val))
    return label, settings


@contextmanager
def _prefilled(loop, prompt: list[int]):
    """The loop with its KV blocks taken and `prompt` prefilled (inference mode);
    the blocks go back on exit."""
    import torch
    blocks = loop.block_pool.allocate(loop.nblocks)
    try:
        with torch.inference_mode():
            loop._use_blocks(torch.tensor([b.block_id for b in blocks], dtype=torch.int32))
            loop._prefill(prompt)
            loop.rix.zero_()
            yield
    finally:
        loop.block_pool.free(blocks[::-1])


def _time_rounds(loop, prompt: list[int], n: int) -> float:
    """Seconds per round of n rounds run back to back after `prompt`
    (GPU: replays, timed from the host after a synchronize)."""
    import torch
    if len(prompt) + n * (loop.depth + 1) > loop.max_len:
        raise ValueError("eagle loop: prompt + n rounds must fit in max_len")
    with _prefilled(loop, prompt):
        loop._step()
        sync = torch.cuda.synchronize if loop.dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        loop.rix.zero_()
        for _ in range(n):
            loop._step()
        sync()
        return (time.perf_counter() - t0) / n


def _parts(loop, prompt, n: int = 32) -> dict:
    """Milliseconds of parts of a round, each captured in a graph of its own and
    replayed n times: the target over root + tree (forward and logits), and the
    tree expansion of the head."""
    import torch
    out = {}
    with _prefilled(loop, prompt):
        loop._step()

        def target():
            loop.backend.prepare(loop.batch)
            return loop.model.compute_logits(loop.model(loop.batch)).argmax(-1)

        def draft():
            return loop._levels(loop.feat, loop.hk, loop.hv, loop.hvalid, loop.n_ctx)
        for name, fn in (("target", target), ("expansion", draft)):
            try:
                fn()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                g.replay()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    g.replay()
                torch.cuda.synchronize()
                out[name] = round((time.perf_counter() - t0) / n * 1e3, 3)
            except Exception as e:   # noqa: BLE001 - a part that does not capture
                out[name] = f"{type(e).__name__}: {e}"[:120]
    return out


def _kernels(loop, prompt, path: Path, shape: str) -> None:
    """torch.profiler over eager rounds (kernel times without launch gaps) and
    the kernel count of a round."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with _prefilled(loop, prompt):
        loop.round()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                loop.round()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The last round's kernels in launch order (what each part of the round costs).
    kernels.sort(key=lambda e: e.time_range.start)
    last = kernels[-(len(kernels) // 4):]
    order = "\n".join(f"{e.device_time:8.1f} us  {e.name[:110]}" for e in last)
    path.write_text(f"tree {shape}: {len(kernels) / 4:.0f} kernels a round, "
                    f"{sum(e.device_time for e in kernels) / 4 / 1e3:.3f} ms of kernel time "
                    "a round (eager, no launch gaps)\n\n" + table + "\n\n"
                    "## The last round's kernels in order\n\n" + order + "\n")


def _write(args, env, results) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"loop_{env['device']}"
    stem.with_suffix(".json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    lines = [f"# EAGLE loop (every round on the device), {env['device_name']}", "",
             f"{env['prompts']} chat prompts, greedy, batch 1, {env['max_tokens']} tokens; "
             f"torch {env['torch']}, {env['dtype']}; CUDA graphs: {env['graphs']}. Plain = "
             "LLM.generate in the same process, alternating prompt by prompt.", "",
             "| head | depth,topk,beam,nodes | loop tok/s | plain tok/s | speedup | tau | ms/round | "
             "plain ms/token | identical | graph | parts ms | prefill ms | ms/round in generate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["tree"]
        shape = f"{t['depth']},{t['topk']},{t['beam']},{t['nodes']}" + (
            " compiled" if r.get("compiled") else "") + (
            f" [{r['variant']}]" if "variant" in r else "")
        if "error" in r:
            lines.append(f"| {Path(r['head']).name} | {shape} | error: {r['error']} ||||||||")
            continue
        lines.append(f"| {Path(r['head']).name} | {shape} | {r['loop_tok_s']} | "
                     f"{r['plain_tok_s']} | {r['speedup']} | "
                     f"{r['tau']} | {r['round_ms']} | {r['plain_step_ms']} | {r['identical']} | "
                     f"{r['graphs']} | {r.get('parts_ms', '')} | {r.get('prefill_ms', '')} | "
                     f"{r.get('round_ms_in_generate', '')} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
