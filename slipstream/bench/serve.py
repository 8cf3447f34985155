"""`slipstream bench serve`: a serving benchmark client in the style of vLLM's benchmark_serving.

Requests arrive as a Poisson process at each given rate (exponential gaps
from a fixed seed; `inf` sends them all at once). Prompt and output lengths
are drawn from log-normal laws shaped like ShareGPT conversations (median
input about 150 tokens with a long tail, median output about 120), clipped to
the limits given, and sent as token ids with `ignore_eos`, so every request
generates exactly its drawn length. Each request streams; the client records
time to first token (TTFT), the gaps between streamed tokens (ITL), time per
output token after the first (TPOT) and end-to-end latency, then reports
p50/p90/p99, request and token throughput, and goodput (requests per second
that met every latency target).

Only the standard library is used (bench/http_client.py: HTTP/1.1 over
asyncio streams), so the client runs where no HTTP package is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

from slipstream.bench.http_client import body_chunks, get_json, open_request

# ShareGPT-like length laws: log-normal (median, sigma of the log).
INPUT_MEDIAN, INPUT_SIGMA = 150.0, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA = 120.0, 0.9


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="benchmark a running server (Poisson arrivals)",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    p.add_argument("--request-rate", default="1,4,inf",
                   help="comma-separated requests/s; inf sends every request at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--min-len", type=int, default=4, help="shortest input and output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0,
                   help="requests sent at once before the measured runs (not counted)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput target for TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput target for TPOT")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default="benchmarks/serving/results", help="folder for JSON + Markdown")
    p.add_argument("--label", default=None, help="name of the result files (default: a timestamp)")
    p.set_defaults(func=run)
    return p


@dataclass
class Sample:
    prompt_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_samples(n: int, vocab: int, max_in: int, max_out: int, min_len: int,
                 seed: int, ids_seed: int | None = None) -> list[Sample]:
    """Lengths from the ShareGPT-like laws (drawn from `seed`); token ids from the middle
    of the vocabulary, drawn from `ids_seed` (default: `seed`). Runs at several rates keep
    the lengths and change the ids, so no run finds another's prompts in the prefix cache."""
    rng = random.Random(seed)
    ids = random.Random(seed if ids_seed is None else f"{seed}/{ids_seed}")
    lo, hi = max(1, vocab // 10), max(2, vocab * 9 // 10)
    out = []
    for _ in range(n):
        n_in = min(max_in, max(min_len, round(rng.lognormvariate(math.log(INPUT_MEDIAN), INPUT_SIGMA))))
        n_out = min(max_out, max(min_len, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))))
        out.append(Sample([ids.randrange(lo, hi) for _ in range(n_in)], n_out))
    return out


async def one_request(args, model: str, s: Sample) -> Result:
    r = Result(prompt_len=len(s.prompt_ids))
    body = {"model": model, "prompt": s.prompt_ids, "max_tokens": s.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    try:
        status, reader, writer, headers = await open_request(
            args.base_url, "POST", "/v1/completions", body, args.api_key)
        buf = b""
        try:
            if status != 200:
                raw = b"".join([c async for c in body_chunks(reader, headers)])
                r.error = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                return r
            async for chunk in body_chunks(reader, headers):
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        r.error = obj["error"]["message"]
                        return r
                    now = time.perf_counter()
                    if obj.get("usage"):
                        r.output_tokens = obj["usage"]["completion_tokens"]
                    if obj["choices"] and obj["choices"][0]["text"]:
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
        finally:
            writer.close()
        r.e2e = time.perf_counter() - t0
        r.ok = r.output_tokens == s.output_len
        if not r.ok:
            r.error = f"expected {s.output_len} tokens, got {r.output_tokens}"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_rate(args, model: str, samples: list[Sample], rate: float) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(s):
        if sem is None:
            return await one_request(args, model, s)
        async with sem:
            return await one_request(args, model, s)

    tasks = []
    t0 = time.perf_counter()
    for s in samples:
        tasks.append(asyncio.create_task(asyncio.wait_for(limited(s), args.timeout)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = []
    for t in tasks:
        try:
            results.append(await t)
        except asyncio.TimeoutError:
            results.append(Result(error="timed out"))
    return results, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    f = math.floor(k)
    return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)


def summarize(results: list[Result], duration: float, rate: float, args) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and (
        r.output_tokens <= 1 or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 <= args.slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {"request_rate": rate, "num_requests": len(results), "completed": len(ok),
               "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration,
               "output_token_throughput": out_tokens / duration,
               "total_token_throughput": (in_tokens + out_tokens) / duration,
               "mean_input_tokens": in_tokens / max(1, len(ok)),
               "mean_output_tokens": out_tokens / max(1, len(ok)),
               "goodput": len(good) / duration,
               "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
               "errors": sorted({r.error for r in results if not r.ok})[:5]}
    for name, vals in (("ttft_ms", [r.ttft for r in ok]), ("tpot_ms", tpot), ("itl_ms", itl),
                       ("e2e_ms", [r.e2e for r in ok])):
        summary[name] = {"mean": sum(vals) / len(vals) * 1e3 if vals else float("nan"),
                         **{f"p{q}": _pct(vals, q) * 1e3 for q in (50, 90, 99)}}
    return summary


def _environment(server_model: dict) -> dict:
    import platform
    import sys
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import os
    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "client_host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "server_model": server_model}


def _markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Serving benchmark: {env['server_model'].get('id')}", "",
             f"{env['date_utc']}, client on {env['cpu']} ({env['cpu_count']} cores), "
             f"python {env['python']}. Arguments: `{report['command']}`.", "",
             "| rate (req/s) | done / sent | req/s | out tok/s | TTFT p50/p90/p99 ms | "
             "TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | goodput req/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["runs"]:
        def trio(k):
            return "/".join(f"{s[k][f'p{q}']:.0f}" for q in (50, 90, 99))
        lines.append(f"| {s['request_rate']} | {s['completed']}/{s['num_requests']} | "
                     f"{s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} | "
                     f"{trio('ttft_ms')} | {trio('tpot_ms')} | {trio('itl_ms')} | {trio('e2e_ms')} | "
                     f"{s['goodput']:.2f} |")
    slo = report["runs"][0]["slo"] if report["runs"] else {}
    lines += ["", f"Goodput: completed requests per second with TTFT <= {slo.get('ttft_ms')} ms "
              f"and TPOT <= {slo.get('tpot_ms')} ms."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import os
    import shlex
    import sys
    try:
        rates = [float(x) for x in str(args.request_rate).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: expected rates per second separated by commas "
                         f"(or inf), got {args.request_rate!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--request-rate must list positive rates (or inf)")
    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be at least 0")
    if args.min_len < 1 or args.max_input_len < args.min_len or args.max_output_len < args.min_len:
        raise ValueError("--max-input-len and --max-output-len must be at least --min-len (>= 1)")
    models = asyncio.run(get_json(args.base_url, "/v1/models", args.api_key))
    info = models["data"][0]
    model = args.model or info["id"]
    vocab = int(info.get("vocab_size", 32000))
    max_in = min(args.max_input_len, int(info.get("max_model_len", 1 << 30)) - args.max_output_len)
    if args.warmup:   # compiles and captures happen here, not in the first measured rate
        warm = make_samples(args.warmup, vocab, max_in, args.max_output_len, args.min_len,
                            args.seed, ids_seed="warmup")
        results, _ = asyncio.run(run_rate(args, model, warm, math.inf))
        failed = [r.error for r in results if not r.ok]
        print(f"warm-up: {len(results) - len(failed)}/{len(results)} done"
              + (f"; failures: {sorted(set(failed))[:3]}" if failed else ""), file=sys.stderr)
    report = {"command": shlex.join(["slipstream"] + sys.argv[1:]),
              "args": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
              "environment": _environment(info), "runs": []}
    for i, rate in enumerate(rates):
        samples = make_samples(args.num_requests, vocab, max_in, args.max_output_len,
                               args.min_len, args.seed, ids_seed=i)
        results, duration = asyncio.run(run_rate(args, model, samples, rate))
        s = summarize(results, duration, rate, args)
        report["runs"].append(s)
        print(f"rate {rate}: {s['completed']}/{s['num_requests']} done in {duration:.1f} s, "
              f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s, "
              f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms, "
              f"goodput {s['goodput']:.2f} req/s", file=sys.stderr, flush=True)
        if s["failed"]:
            print(f"  failures: {s['errors']}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    label = args.label or time.strftime("serve-%Y%m%d-%H%M%S", time.gmtime())
    with open(os.path.join(args.out, f"{label}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"{label}.md"), "w") as f:
        f.write(_markdown(report))
    print(f"wrote {args.out}/{label}.json and .md", file=sys.stderr)
    return 0 if all(s["failed"] == 0 for s in report["runs"]) else 1
