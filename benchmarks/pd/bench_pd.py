"""Prefill/decode disaggregation on two GPUs: the KV hand-over against its estimate,
and one prefill + one decode instance against two plain instances.

    NCCL_NVLS_ENABLE=0 python benchmarks/pd/bench_pd.py [--out DIR] [--smoke]

Stages, each in its own process (a fresh GPU memory pool and process group):
  p2p     2 ranks, NCCL: send/recv of a 4k-token prompt's KV bytes (Llama-3-8B
          shape, bf16: 4080 tokens x 128 KiB), median of 10; the link's
          bandwidth measured in this run
  pd      a decode instance on cuda:0 with its prefill instance on cuda:1
          (slipstream.distributed.prefill_decode, Llama-3-8B shape, random
          weights, seed 0). First correctness: greedy tokens of 4 prompts equal
          one plain instance's (the `plain` stage runs the same prompts). Then
          the hand-over of five 4096-token prompts (after a warm-up one), each
          timed from the decode side posting its receive to the data landing,
          against the analysis layer's estimate (analysis/kv_transfer.py: KV
          bytes per token x tokens / link bandwidth, with the preset link and
          with the p2p stage's bandwidth). Then the workload below.
  plain   two plain instances, one per GPU, each given every other request.
Workload (prompt-heavy, mixed): 48 requests arriving as a Poisson stream
(seeded) at 6 requests/s, prompts of 1024-4096 tokens, outputs of 32-256 tokens
(greedy, ignore EOS). Reported per setup: output and total tokens/s over the
makespan (first arrival to last token), TTFT and inter-token latency p50/p99.

--smoke runs the same stages on the CPU (gloo) with a tiny model and a small
workload, to check the script; its times mean nothing. Writes results.json and
results.md to --out (default benchmarks/pd/results).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.stages import StageRunner  # noqa: E402
STAGES = ("p2p", "pd", "plain")
MODEL, BLOCK = "llama-3-8b", 16
CHECK_PROMPTS = [[(31 * i + 7 * j) % 1000 + 1 for j in range(40 + 24 * i)] for i in range(4)]


def _workload(smoke: bool) -> list[dict]:
    rng = random.Random(0)
    n, rate, lo, hi, out = (8, 20.0, 32, 200, (4, 16)) if smoke else (48, 6.0, 1024, 4096, (32, 256))
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        length = rng.randint(lo, hi)
        reqs.append({"id": f"r{i}", "arrival": t, "max_tokens": rng.randint(*out),
                     "prompt": [rng.randrange(1, 1000) for _ in range(length)]})
    return reqs


def _tiny_model() -> str:
    folder = Path(tempfile.mkdtemp(prefix="pd-smoke-"))
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)))
    return str(folder)


def _opts(smoke: bool, model: str) -> dict:
    opts = dict(model=model, load_format="dummy", seed=0, block_size=BLOCK, max_num_seqs=64)
    if smoke:
        return dict(opts, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=1024)
    return dict(opts, dtype="bfloat16", max_model_len=4608, gpu_memory_utilization=0.85)


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def drive(engine, reqs: list[dict], t0: float) -> dict:
    """Add each request at its arrival time, step until all finished; token timestamps."""
    from slipstream import SamplingParams
    pending, seen, first, last, itl, done = list(reqs), {}, {}, {}, [], {}
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request({"prompt_token_ids": r["prompt"]}, SamplingParams(
                max_tokens=r["max_tokens"], temperature=0, ignore_eos=True), r["id"])
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[0]["arrival"] - now)) if pending else 0.0)
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            k = n - seen.get(o.request_id, 0)
            if k > 0 and o.request_id in seen:
                itl += [(t - last[o.request_id]) / k] * k
            if o.request_id not in seen and n:
                first[o.request_id] = t
            if n:
                seen[o.request_id], last[o.request_id] = n, t
            if o.finished:
                done[o.request_id] = n
    arrival = {r["id"]: r["arrival"] for r in reqs}
    return {"ttft": [first[i] - arrival[i] for i in first], "itl": itl,
            "end": max(last.values(), default=0.0), "output_tokens": sum(done.values()),
            "prompt_tokens": sum(len(r["prompt"]) for r in reqs)}


def _summary(parts: list[dict], reqs: list[dict]) -> dict:
    ttft = [x for p in parts for x in p["ttft"]]
    itl = [x for p in parts for x in p["itl"]]
    span = max(p["end"] for p in parts) - min(r["arrival"] for r in reqs)
    out = sum(p["output_tokens"] for p in parts)
    total = out + sum(p["prompt_tokens"] for p in parts)
    return {"requests": len(reqs), "makespan_s": span, "output_tokens_per_s": out / span,
            "total_tokens_per_s": total / span,
            "ttft_p50_ms": _p(ttft, 50) * 1e3, "ttft_p99_ms": _p(ttft, 99) * 1e3,
            "itl_p50_ms": _p(itl, 50) * 1e3, "itl_p99_ms": _p(itl, 99) * 1e3}


def _check_tokens(llm) -> list[list[int]]:
    from slipstream import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in CHECK_PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- stages -------------------------------------------------------------------

def _p2p_rank(rank: int, port: int, smoke: bool, nbytes: int, queue) -> None:
    import torch
    import torch.distributed as dist
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    times = []
    for i in range(13):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
        sync()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        t = statistics.median(times[3:])
        queue.put({"bytes": nbytes, "median_s": t, "GBps": nbytes / t / 1e9})
    dist.barrier()
    dist.destroy_process_group()


def stage_p2p(smoke: bool) -> dict:
    import torch.multiprocessing as mp
    from slipstream.distributed.parallel import host_store
    store = host_store(1)   # only to find a free port
    port = store.port
    del store
    tokens = 248 if smoke else 4080
    nbytes = tokens * (2 * 2 * 2 * 32 * 4 if smoke else 32 * 2 * 8 * 128 * 2)   # tiny fp32; 8B bf16
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_rank, args=(r, port, smoke, nbytes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    return dict(result, tokens=tokens)


def stage_pd(smoke: bool) -> dict:
    from slipstream.analysis.flops import Precisions
    from slipstream.analysis.kv_transfer import get_p2p_link, kv_transfer_time
    from slipstream.distributed.prefill_decode import DisaggregatedLLM
    model = _tiny_model() if smoke else MODEL
    t0 = time.perf_counter()
    llm = DisaggregatedLLM(**_opts(smoke, model), prefill_device="cpu" if smoke else "cuda:1")
    load_s = time.perf_counter() - t0
    try:
        tokens = _check_tokens(llm)
        # The hand-over of long prompts, one at a time (nothing else running).
        from slipstream import SamplingParams
        rng = random.Random(1)
        length = 200 if smoke else 4096
        before = len(llm.transfers)
        for _ in range(6):
            llm.generate({"prompt_token_ids": [rng.randrange(1, 1000) for _ in range(length)]},
                         SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        moves = llm.transfers[before + 1:]   # the first one warmed the link up
        recv = statistics.median(t.recv_s for t in moves)
        nbytes = moves[0].bytes
        from slipstream.analysis.presets import resolve_model
        from slipstream.analysis.kv_transfer import kv_bytes_per_token
        spec = resolve_model(model)
        per_token = kv_bytes_per_token(spec, Precisions.parse(kv="fp32" if smoke else "bf16"))
        transfer = {"prompt_tokens": length, "moved_tokens": moves[0].tokens, "bytes": nbytes,
                    "bytes_per_token_engine": nbytes / moves[0].tokens,
                    "bytes_per_token_analysis": per_token,
                    "recv_median_s": recv, "recv_all_s": [t.recv_s for t in moves],
                    "import_median_s": statistics.median(t.import_s for t in moves),
                    "estimate_preset_s": kv_transfer_time(nbytes, get_p2p_link("h200-nvlink-p2p")),
                    "effective_GBps": nbytes / recv / 1e9}
        reqs = _workload(smoke)
        llm.engine.transfers.clear()
        start = time.perf_counter()
        run = drive(llm.engine, reqs, start)
        moved = sum(t.tokens for t in llm.transfers)
        return {"load_s": load_s, "tokens": tokens, "transfer": transfer,
                "workload": _summary([run], reqs), "workload_moved_tokens": moved,
                "workload_recv_s_total": sum(t.recv_s for t in llm.transfers)}
    finally:
        llm.shutdown()


def _plain_instance(index: int, smoke: bool, model: str, go, queue) -> None:
    from slipstream import LLM
    import torch
    if smoke:
        torch.set_num_threads(1)   # two instances share the host's cores
    else:
        torch.cuda.set_device(index)
    llm = LLM(**{**_opts(smoke, model), **({} if smoke else {"device": f"cuda:{index}"})})
    tokens = _check_tokens(llm) if index == 0 else None
    reqs = _workload(smoke)[index::2]
    queue.put(("ready", index))
    start = go.get()
    queue.put(("done", index, tokens, drive(llm.engine, reqs, start)))


def stage_plain(smoke: bool) -> dict:
    import torch.multiprocessing as mp
    model = _tiny_model() if smoke else MODEL
    ctx = mp.get_context("spawn")
    queue, gos = ctx.Queue(), [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_plain_instance, args=(i, smoke, model, gos[i], queue))
             for i in range(2)]
    for p in procs:
        p.start()
    for _ in range(2):
        queue.get(timeout=240)
    start = time.perf_counter() + 0.5   # perf_counter is one clock for the host's processes
    for g in gos:
        g.put(start)
    results = {}
    for _ in range(2):
        _, i, tokens, run = queue.get(timeout=240)
        results[i] = (tokens, run)
    for p in procs:
        p.join(timeout=30)
    return {"tokens": results[0][0],
            "workload": _summary([results[0][1], results[1][1]], _workload(smoke))}


# ---- driver -------------------------------------------------------------------

# Seconds each stage may take at most, and the whole run: a stuck stage is cut off
# and reported, and the results are written all the same.
STAGE_LIMIT_S = {"p2p": 45, "pd": 120, "plain": 100}
TOTAL_LIMIT_S = 235
_STAGES = StageRunner(__file__, STAGE_LIMIT_S, TOTAL_LIMIT_S)


def _markdown(res: dict) -> str:
    st = res["stages"]
    lines = ["# Prefill/decode disaggregation on " + ("the CPU (smoke: times mean nothing)"
                                                     if res["smoke"] else "2x H200 (NCCL)"), ""]
    p2p, pd, plain = st.get("p2p", {}), st.get("pd", {}), st.get("plain", {})
    for name, r in st.items():
        if "error" in r:
            lines.append(f"stage {name} failed: see results.json")
    if "error" not in p2p and p2p:
        lines.append(f"NCCL send/recv of {p2p['bytes'] / 2**20:.1f} MiB: {p2p['median_s'] * 1e3:.3f} ms "
                     f"({p2p['GBps']:.0f} GB/s)")
    tr = pd.get("transfer")
    if tr:
        lines += ["", "| KV hand-over | value |", "|---|---|",
                  f"| prompt / moved tokens | {tr['prompt_tokens']} / {tr['moved_tokens']} |",
                  f"| bytes (engine; analysis bytes/token) | {tr['bytes']} "
                  f"({tr['bytes_per_token_engine']:.0f}; {tr['bytes_per_token_analysis']:.0f}) |",
                  f"| measured (median of 5) | {tr['recv_median_s'] * 1e3:.3f} ms "
                  f"({tr['effective_GBps']:.0f} GB/s) |",
                  f"| estimate, preset link 356 GB/s | {tr['estimate_preset_s'] * 1e3:.3f} ms |"]
        if "estimate_measured_link_s" in tr:
            lines.append(f"| estimate, this run's p2p bandwidth | "
                         f"{tr['estimate_measured_link_s'] * 1e3:.3f} ms |")
        lines.append(f"| writing into the decode pool | {tr['import_median_s'] * 1e3:.3f} ms |")
    if pd.get("workload") and plain.get("workload"):
        lines += ["", "| setup | out tok/s | total tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
                  "| ITL p99 ms | makespan s |", "|---|---|---|---|---|---|---|---|"]
        for name, w in (("1 prefill + 1 decode", pd["workload"]), ("2 plain instances",
                                                                   plain["workload"])):
            lines.append(f"| {name} | {w['output_tokens_per_s']:.0f} | {w['total_tokens_per_s']:.0f} "
                         f"| {w['ttft_p50_ms']:.1f} | {w['ttft_p99_ms']:.1f} | {w['itl_p50_ms']:.2f} "
                         f"| {w['itl_p99_ms']:.2f} | {w['makespan_s']:.2f} |")
    if "tokens_equal" in res:
        lines += ["", f"greedy tokens, P/D vs one plain instance (4 prompts x 16): "
                      f"{'identical' if res['tokens_equal'] else 'DIFFERENT'} (first difference "
                      f"per prompt: {res['tokens_first_difference']})"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model")
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        fn = {"p2p": stage_p2p, "pd": stage_pd, "plain": stage_plain}[args.stage]
        print(json.dumps(fn(args.smoke)))
        return
    res = {"smoke": args.smoke, "stages": {}}
    for stage in STAGES:
        print(f"running {stage} ...", file=sys.stderr, flush=True)
        res["stages"][stage] = _STAGES.run(stage, args.smoke)
        if "error" in res["stages"][stage]:
            print(res["stages"][stage]["error"], file=sys.stderr)
    p2p, pd, plain = (res["stages"][s] for s in STAGES)
    if "error" not in p2p and "transfer" in pd:
        from slipstream.analysis.kv_transfer import kv_transfer_time
        from slipstream.analysis.tensor_parallel import Interconnect
        link = Interconnect("this run", p2p["GBps"] * 1e9, 0.0, "measured")
        pd["transfer"]["estimate_measured_link_s"] = kv_transfer_time(pd["transfer"]["bytes"], link)
    if "tokens" in pd and "tokens" in plain:
        res["tokens_equal"] = pd["tokens"] == plain["tokens"]
        # bf16 on a GPU: a batch of another composition can flip a near-tie; say where.
        res["tokens_first_difference"] = [
            next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
            for x, y in zip(pd["tokens"], plain["tokens"])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
