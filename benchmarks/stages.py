"""Stages of a benchmark, each in its own process under a time limit, shared by
the two-GPU benchmarks (tp/bench_tp.py, pd/bench_pd.py): a stuck stage is cut
off and reported, the others still run, and the results are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class StageRunner:
    def __init__(self, script: str, stage_limits_s: dict[str, float], total_limit_s: float):
        self.script, self.limits, self.total = script, stage_limits_s, total_limit_s
        self.start = time.perf_counter()

    def run(self, stage: str, smoke: bool) -> dict:
        """`python SCRIPT --stage STAGE [--smoke]`, whose last stdout line is its JSON result."""
        cmd = [sys.executable, self.script, "--stage", stage] + (["--smoke"] if smoke else [])
        # NVLink multicast (NVLS) stays off on the two-GPU machine.
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   NCCL_NVLS_ENABLE="0")
        t0 = time.perf_counter()
        limit = min(self.limits[stage], self.total - (t0 - self.start))
        if limit < 20:
            return {"error": f"skipped: the run's {self.total} s were spent"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return {"error": f"timed out after {limit:.0f} s\n{err[-12000:]}", "wall_s": limit}
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:], "wall_s": time.perf_counter() - t0}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["wall_s"] = time.perf_counter() - t0
        return result
