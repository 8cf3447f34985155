"""Where a speculative round's time goes, and how often it waits on the device.

`profile_run`: cProfile around a method's timed generation; writes the top
40 functions by cumulative time and a per-round split (milliseconds per
verification round spent in the engine's and the speculator's parts; on a
GPU a part that waits on the device carries that wait).

`count_syncs` (CUDA only): steps one request through the engine and, after
warm-up, runs single speculation rounds under
`torch.cuda.set_sync_debug_mode("warn")`, counting the synchronizing CUDA
calls of each round and where they come from. The round's one intended wait
(the accepted tokens: a pinned non-blocking copy, then an event wait) is not
a synchronizing call in that mode, so the target is 0. A last round runs in
mode "error", which raises on the first such call.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
import warnings
from pathlib import Path

# (file suffix, function) -> label of the per-round split, in call order.
SPLIT = [
    ("engine/scheduler.py", "schedule", "  schedule"),
    ("runner/model_runner.py", "execute", "  execute"),
    ("runner/input_batch.py", "plan", "    pack inputs"),
    ("spec/speculator.py", "stage", "    stage drafts"),
    ("spec/speculator.py", "patch", "    tree positions + mask"),
    ("runner/cuda_graph.py", "run_tree", "    verification graph"),
    ("spec/speculator.py", "verify", "    verify + accept"),
    ("spec/speculator.py", "keep_hidden", "    keep target states"),
    ("runner/model_runner.py", "_sample", "    sample (non-drafting rows)"),
    ("spec/speculator.py", "step_done", "    step timing"),
    ("engine/engine.py", "_collect", "  collect (resolve, update, detokenize)"),
    ("runner/model_runner.py", "resolve", "    resolve"),
    ("spec/speculator.py", "propose", "      propose (drafting)"),
    ("engine/scheduler.py", "update", "    scheduler update"),
]


def _split(stats: pstats.Stats, rounds: int, steps: int) -> list[dict]:
    rows = []
    for suffix, func, label in SPLIT:
        cum, calls = 0.0, 0
        for (file, _line, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
            if name == func and file.replace("\\", "/").endswith(suffix):
                cum += ct
                calls += nc
        if calls:
            rows.append(dict(part=label, calls=calls,
                             ms_per_round=round(1e3 * cum / max(rounds, 1), 3),
                             ms_per_step=round(1e3 * cum / max(steps, 1), 3)))
    return rows


def profile_run(run, out: Path | None, name: str, batch: int, spec) -> dict:
    """run(): the timed generation. Returns a summary for the results row and
    appends the profile to the file `out`."""
    rounds0 = spec.stats.rounds if spec is not None else 0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        run()
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rounds = (spec.stats.rounds if spec is not None else 0) - rounds0
    # Steps = forwards launched (cProfile miscounts Engine.step under the generate loop).
    steps = sum(nc for (file, _l, fn), (_c, nc, *_r) in stats.stats.items()
                if fn == "execute" and file.replace("\\", "/").endswith("runner/model_runner.py"))
    split = _split(stats, rounds, steps)
    if out is not None:   # every profile of a run goes to one file (profiles.txt)
        buf = io.StringIO()
        buf.write(f"\n\n# {name}, batch {batch}: {wall:.3f} s under cProfile, {steps} engine steps, "
                  f"{rounds} verification rounds (request-rounds)\n\n")
        buf.write("## per-round split (cumulative time of each part / rounds; "
                  "ms per engine step beside)\n\n")
        for r in split:
            buf.write(f"{r['part']:<36} {r['ms_per_round']:>9.3f} ms/round "
                      f"{r['ms_per_step']:>9.3f} ms/step  ({r['calls']} calls)\n")
        buf.write("\n## top 40 by cumulative time\n\n")
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        buf.write("\n## top 40 by own time\n\n")
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(buf.getvalue())
    return dict(profile_seconds=round(wall, 3), profile_steps=steps, profile_rounds=rounds,
                split=split)


def count_syncs(llm, prompt, params, warmup_steps: int = 24, rounds: int = 6) -> dict:
    """One request through `llm.engine` step by step; after `warmup_steps`
    steps, the synchronizing CUDA calls of each of the next `rounds`
    speculation rounds (steps that verified drafts), with their places."""
    import torch
    engine = llm.engine
    spec = engine.runner.speculator
    if engine.config.device.type != "cuda" or spec is None:
        return dict(skipped="needs CUDA and a speculative method")
    rid = engine.add_request(prompt, params)
    per_round, places = [], {}
    error_mode = None
    try:
        for _ in range(warmup_steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        guard = 0
        while len(per_round) < rounds and engine.has_unfinished_requests() and guard < 200:
            guard += 1
            before = spec.stats.rounds
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            if spec.stats.rounds == before:
                continue        # not a speculation round (speculation paused this step)
            per_round.append(len(syncs))
            for w in syncs:
                key = f"{Path(w.filename).name}:{w.lineno}"
                places[key] = places.get(key, 0) + 1
        if engine.has_unfinished_requests():
            torch.cuda.set_sync_debug_mode("error")
            try:
                engine.step()
                error_mode = "passed"
            except RuntimeError as e:
                error_mode = f"raised: {str(e)[:200]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        try:            # leave the engine empty (a step that raised may have left it inconsistent)
            engine.abort_request(rid)
            for _ in range(8):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
        except Exception as e:  # noqa: BLE001 - the check's result is still reported
            error_mode = f"{error_mode}; cleanup: {type(e).__name__}: {str(e)[:100]}"
    return dict(syncs_per_round=per_round, sync_places=places, error_mode_round=error_mode)
