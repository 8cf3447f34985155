"""One engine a process for the end-to-end quantization benchmarks (bench_decode_step.py,
bench_w8a8_prefill.py): each variant runs as `SCRIPT --one NAME --json PATH --model MODEL
--iters N [--smoke]`, so the kernels compiled, configurations tuned and memory held by one
never reach the next."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict | None = None) -> dict:
    """This environment with the checkout first on PYTHONPATH, plus `extra`."""
    return dict(os.environ, **(extra or {}), PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def bench_model(tmp: Path, smoke: bool, tiny_config: dict) -> str:
    """The 8B preset (random weights), or with --smoke a tiny config.json in tmp."""
    if not smoke:
        return "llama-3-8b"
    folder = tmp / "tiny"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny_config))
    return str(folder)


def run_child(script: str, name: str, model: str, iters: int, smoke: bool, tmp: Path,
              env: dict) -> dict:
    """The child's JSON result with its wall time, or {"failed": True} (printed)."""
    path = tmp / f"{name}.json"
    cmd = [sys.executable, script, "--one", name, "--json", str(path), "--model", model,
           "--iters", str(iters)] + (["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0 or not path.is_file():
        print(f"{name}: FAILED (exit {rc})", flush=True)
        return {"failed": True}
    r = json.loads(path.read_text())
    r["wall_s"] = time.perf_counter() - t0
    return r
