"""slipstream on the CPU against llama.cpp and transformers, same GGUF, same threads, one run.

    python benchmarks/cpu/bench_cpu.py [--threads 2] [--out benchmarks/cpu/results] [--smoke]

Each engine runs in its own process (so load time and peak memory are its own);
the processes are loaded one after the other, then the driver takes decode and
prefill samples round by round, every engine once a round (the order turning),
so load from other users of a shared machine falls on all engines alike.
Measured:
  - load: seconds from the load call to a model ready to run (imports excluded,
    reported apart);
  - decode: batch-1 greedy decode tokens/s, = 128 / (t(129 tokens) - t(1 token)) for
    the same prompt, so prefill and the first token cancel out (median of the rounds);
  - prefill: tokens/s over a 512-token prompt, to the first generated token (median of the rounds);
  - peak RSS after load, decode and prefill (ru_maxrss; before the perplexity pass,
    whose 1024 x vocabulary logits would dominate it);
  - perplexity: 4 windows of 1,024 tokens of a fixed text, every token scored but
    each window's first, with each engine's own kernels. Every engine gets the same
    token ids (slipstream's tokenizer of the GGUF).

Engines: slipstream as a user gets it (dtype/quantization auto: on a CPU the
GGUF blocks run through the kernels of slipstream/kernels/cpu_quant.c),
slipstream's dequantized path (fp32), llama.cpp through llama-cpp-python (built
from source with native CPU flags by this script if missing), transformers
(fp32, the GGUF dequantized by its own loader).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPT = "The history of the city of Rome begins"
LLAMA_CPP_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- one engine, inside its own process ---------------------------------------------

class Slipstream:
    def __init__(self, model, threads, quantization):
        import torch
        torch.set_num_threads(threads)
        from slipstream import LLM
        self.llm = LLM(model=model, device="cpu", max_model_len=2048, enable_prefix_caching=False,
                       **({} if quantization == "auto" else {"quantization": quantization, "dtype": "float32"}))
        cfg = self.llm.engine.config
        blocks = getattr(self.llm.engine.runner.model.lm_head, "quant_method", None) is not None
        self.label = ("GGUF blocks, " if blocks else "dequantized, ") + f"{cfg.dtype}".removeprefix("torch.")

    def generate(self, ids, n):
        from slipstream import SamplingParams
        p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        self.llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)

    def nll(self, ids):
        from slipstream import SamplingParams
        p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        out = self.llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
        lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
        return -sum(lps), len(lps)


class LlamaCpp:
    def __init__(self, model, threads, _):
        from llama_cpp import Llama
        # logits of the last position only, as a user's generate gets them (with
        # logits_all the LM head would run on every prompt token); the perplexity
        # pass opens a second instance that keeps all logits
        self.args = dict(model_path=str(model), n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.llm = Llama(**self.args, logits_all=False)
        self.scorer = None
        self.label = "GGUF blocks"

    def generate(self, ids, n):
        self.llm.reset()
        count = 0
        for _ in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            count += 1
            if count >= n:
                break

    def nll(self, ids):
        import numpy as np
        if self.scorer is None:
            from llama_cpp import Llama
            self.llm = None
            self.scorer = Llama(**self.args, logits_all=True)
        self.scorer.reset()
        self.scorer.eval(ids)
        logits = np.asarray(self.scorer.scores[:len(ids)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits).sum(axis=1))
        lp = logits[np.arange(len(ids) - 1), ids[1:]] - lse[:-1]
        return -float(lp.sum()), len(ids) - 1


class Transformers:
    def __init__(self, model, threads, _):
        import torch
        torch.set_num_threads(threads)
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        self.torch = torch
        path = Path(model)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=self.model)["tensors"]
        self.model.load_state_dict(tensors, strict=False)
        self.model.tie_weights()
        self.label = "dequantized, float32"

    def generate(self, ids, n):
        with self.torch.inference_mode():
            self.model.generate(self.torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)

    def nll(self, ids):
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([ids])).logits[0].double()
        lp = self.torch.log_softmax(logits[:-1], -1).gather(1, self.torch.tensor(ids[1:])[:, None])
        return -lp.sum().item(), len(ids) - 1


ENGINES = {"slipstream": (Slipstream, "auto"), "slipstream-dense": (Slipstream, None),
           "llama.cpp": (LlamaCpp, None), "transformers": (Transformers, None)}


def serve(name: str, model: str, threads: int, ids_path: str, smoke: bool) -> None:
    """One engine in its own process: load, then answer the driver's commands (one a
    line on stdin, one JSON line on stdout each) until 'quit'."""
    t0 = time.perf_counter()
    cls, arg = ENGINES[name]
    data = json.loads(Path(ids_path).read_text())
    prompt, long_prompt, windows = data["prompt"], data["prefill"], data["windows"]
    if cls is Slipstream:
        import torch  # noqa: F401  (imported before the clock, as for the others)
    elif cls is Transformers:
        import torch, transformers  # noqa: F401,E401
    else:
        import llama_cpp  # noqa: F401
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = cls(model, threads, arg)
    load = time.perf_counter() - t0
    n_decode = 8 if smoke else 128
    eng.generate(prompt, 2)   # warm-up
    eng.generate(long_prompt[:64], 1)

    def reply(obj):
        sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"engine": name, "weights": eng.label, "import_s": t_import, "load_s": load})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "decode":      # one sample: t(n + 1 tokens) - t(1 token), same prompt
            t = time.perf_counter(); eng.generate(prompt, 1); short = time.perf_counter() - t
            t = time.perf_counter(); eng.generate(prompt, n_decode + 1); long = time.perf_counter() - t
            reply({"short": short, "long": long, "tok_s": n_decode / (long - short)})
        elif cmd == "prefill":
            t = time.perf_counter(); eng.generate(long_prompt, 1); dt = time.perf_counter() - t
            reply({"s": dt, "tok_s": len(long_prompt) / dt})
        elif cmd == "rss":
            reply({"peak_rss_mb": _rss_mb()})
        elif cmd == "nll":
            nll = count = 0
            for w in windows:
                a, b = eng.nll(w)
                nll += a
                count += b
            reply({"nll": nll, "scored_tokens": count})
        else:
            return


class Worker:
    """The driver's handle on one engine's process."""

    def __init__(self, name, model, threads, ids_path, smoke, env):
        cmd = [sys.executable, __file__, "--threads", str(threads), "--serve", name, model, ids_path]
        self.name = name
        self.proc = subprocess.Popen(cmd + (["--smoke"] if smoke else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()})")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()


def measure(workers: list[Worker], rounds: int) -> list[dict]:
    """Decode and prefill samples taken round by round, the engines' order turning
    each round, so load from other processes falls on all of them alike."""
    samples = {w.name: {"decode": [], "prefill": []} for w in workers}
    loads = []
    for r in range(rounds):
        order = workers[r % len(workers):] + workers[:r % len(workers)]
        for w in order:
            samples[w.name]["decode"].append(w.ask("decode"))
        for w in order:
            samples[w.name]["prefill"].append(w.ask("prefill"))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{w.name} {samples[w.name]['decode'][-1]['tok_s']:.1f} / {samples[w.name]['prefill'][-1]['tok_s']:.0f}"
            for w in workers) + " tok/s decode / prefill; load " + f"{os.getloadavg()[0]:.2f}", flush=True)
        loads.append(os.getloadavg()[0])
    rows = []
    for w in workers:
        dec, pre = samples[w.name]["decode"], samples[w.name]["prefill"]
        n = len(dec)
        short, long = [d["short"] for d in dec], [d["long"] for d in dec]
        rows.append(dict(w.info, decode_tok_s=_median([d["tok_s"] for d in dec]),
                         prefill_tok_s=_median([p["tok_s"] for p in pre]),
                         decode_samples_tok_s=[d["tok_s"] for d in dec],
                         prefill_samples_tok_s=[p["tok_s"] for p in pre], rounds=n,
                         decode_times_s={"1": short, "long": long}))
    for w, row in zip(workers, rows):
        row.update(w.ask("rss"))
        nll = w.ask("nll")
        import math
        row.update(perplexity=math.exp(nll["nll"] / nll["scored_tokens"]), scored_tokens=nll["scored_tokens"])
    return rows, loads


# ---- the driver ---------------------------------------------------------------------

def ensure_llama_cpp() -> str | None:
    """llama-cpp-python's version, building it from source with native flags if missing."""
    probe = [sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"]
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        print("building llama-cpp-python from source (GGML_NATIVE=ON); this takes minutes ...", flush=True)
        env = dict(os.environ, CMAKE_ARGS=LLAMA_CPP_ARGS, FORCE_CMAKE="1")
        b = subprocess.run([sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python",
                            "--no-cache-dir", "llama-cpp-python"], env=env)
        if b.returncode != 0:
            return None
        r = subprocess.run(probe, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def machine() -> dict:
    info = {"machine": platform.machine(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["simd"] = sorted(f for f in flags if f in {"avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                                                                "avx512_bf16", "avx_vnni", "amx_bf16"})
                break
    except OSError:
        pass
    return info


def token_ids(model: str, text_path: Path, smoke: bool) -> dict:
    from slipstream.loader import open_model
    tok = open_model(model).tokenizer()
    text = text_path.read_text()
    ids = tok.encode(text, add_special_tokens=False)
    window = 64 if smoke else 1024
    if len(ids) < 4 * window:
        raise SystemExit(f"{text_path} holds {len(ids)} tokens; 4 windows of {window} need more")
    prefill = (ids * 2)[:64 if smoke else 512]
    return {"prompt": tok.encode(PROMPT, add_special_tokens=False), "prefill": prefill,
            "windows": [ids[i * window:(i + 1) * window] for i in range(4)],
            "text": str(text_path), "text_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
            "text_tokens": len(ids)}


def render(meta: dict, rows: list[dict]) -> str:
    ref = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    out = ["# CPU: slipstream vs llama.cpp and transformers", ""]
    m = meta["machine"]
    out += [f"- date: {meta['date']}; machine: {m.get('cpu', '?')}, {m['cores']} cores "
            f"({', '.join(m.get('simd', []))}); threads: {meta['threads']}",
            f"- load average at start / end: {' '.join(f'{x:.2f}' for x in m['loadavg_start'])} / "
            f"{' '.join(f'{x:.2f}' for x in meta['loadavg_end'])} (the machine is shared: figures are noisy)",
            f"- versions: {meta['versions']}",
            f"- model: {meta['model']}",
            f"- perplexity text: {meta['text']} (sha256 {meta['text_sha256']}, {meta['text_tokens']} tokens), "
            "4 windows of " + f"{meta['window']} tokens, each window's first token unscored, same ids for all",
            f"- decode: batch 1, greedy, {meta['decode_tokens']} tokens, (t({meta['decode_tokens'] + 1}) - t(1)) "
            f"over the same prompt; prefill: one prompt of {meta['prefill_tokens']} tokens to its first "
            f"output token; medians of {meta['rounds']} rounds, engines interleaved within each round",
            "", "| engine | weights | load s | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp "
            "| peak RSS MB | perplexity | vs llama.cpp |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        def rel(key, r=r):
            return f"{r[key] / ref[key]:.2f}x" if ref else ""
        ppl = f"{(r['perplexity'] / ref['perplexity'] - 1) * 100:+.2f}%" if ref else ""
        out.append(f"| {r['engine']} | {r['weights']} | {r['load_s']:.2f} | {r['decode_tok_s']:.1f} | {rel('decode_tok_s')} "
                   f"| {r['prefill_tok_s']:.0f} | {rel('prefill_tok_s')} | {r['peak_rss_mb']:.0f} "
                   f"| {r['perplexity']:.4f} | {ppl} |")
    out += ["", "Samples (tok/s, round by round): " + "; ".join(
        f"{r['engine']} decode {' '.join(f'{x:.1f}' for x in r['decode_samples_tok_s'])}, prefill "
        f"{' '.join(f'{x:.0f}' for x in r['prefill_samples_tok_s'])}" for r in rows),
        "", "1-minute load average after each round: " + " ".join(f"{x:.2f}" for x in meta["loadavg_rounds"])]
    if "kernel_build_s" in meta:
        out += ["", f"slipstream's CPU kernels were built (or found in the cache) before the engines "
                f"loaded: {meta['kernel_build_s']:.2f} s, not in load (a first run on a machine pays it once)."]
    out += ["", "Import time (not in load): " + ", ".join(f"{r['engine']} {r['import_s']:.1f} s" for r in rows), ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/cpu/results"))
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--text", default=str(TEXT), help="the perplexity text (default: the GPL-3 text "
                    "Debian ships in /usr/share/common-licenses)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that every engine runs")
    ap.add_argument("--rounds", type=int, default=5, help="decode and prefill samples per engine, interleaved")
    ap.add_argument("--serve", nargs=3, metavar=("ENGINE", "MODEL", "IDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.threads, args.serve[2], args.smoke)
        return 0
    sys.path.insert(0, str(ROOT))
    from slipstream.loader import default_model_path
    model = str(args.model or default_model_path())
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "threads": args.threads, "model": model}
    ids = token_ids(model, Path(args.text), args.smoke)
    meta.update({k: ids[k] for k in ("text", "text_sha256", "text_tokens")},
                window=len(ids["windows"][0]), decode_tokens=8 if args.smoke else 128,
                rounds=1 if args.smoke else args.rounds, prefill_tokens=len(ids["prefill"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids_path = out / "token_ids.json"
    ids_path.write_text(json.dumps(ids))
    engines = args.engines.split(",")
    versions = {}
    import torch
    versions["torch"] = torch.__version__
    if "llama.cpp" in engines:
        v = ensure_llama_cpp()
        if v is None:
            print("llama-cpp-python unavailable; skipping llama.cpp", file=sys.stderr)
            engines.remove("llama.cpp")
        else:
            versions["llama-cpp-python"] = v + " (built from source, GGML_NATIVE=ON)"
    if "transformers" in engines:
        import transformers
        versions["transformers"] = transformers.__version__
    meta["versions"] = ", ".join(f"{k} {v}" for k, v in versions.items())
    if "slipstream" in engines or "slipstream-dense" in engines:
        # a first run compiles the CPU kernels (cached after): built here, timed apart
        from slipstream.kernels import cpu_library
        t0 = time.perf_counter()
        cpu_library.load()
        meta["kernel_build_s"] = time.perf_counter() - t0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
    workers = []
    for name in engines:    # loaded one after the other: each load time is the engine's own
        print(f"loading {name} ...", flush=True)
        try:
            workers.append(Worker(name, model, args.threads, str(ids_path), args.smoke, env))
        except RuntimeError as e:
            print(f"{name} failed: {e}", file=sys.stderr)
            continue
        print(f"  load {workers[-1].info['load_s']:.2f} s (import {workers[-1].info['import_s']:.2f} s)", flush=True)
    try:
        rows, meta["loadavg_rounds"] = measure(workers, 1 if args.smoke else args.rounds)
    finally:
        for w in workers:
            w.close()
    meta["loadavg_end"] = os.getloadavg()
    ids_path.unlink()
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = render(meta, rows)
    (out / "results.md").write_text(md)
    print(md)
    return 0 if len(rows) == len(engines) else 1


if __name__ == "__main__":
    sys.exit(main())
