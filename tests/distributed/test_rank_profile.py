"""A profile window opened by rank 0 covers the same steps on every rank (CPU, gloo)."""
import json

from slipstream import SamplingParams
from slipstream.distributed.rank_profile import ProfileCommand, is_collective
from tests.distributed.test_tensor_parallel import _save
from tests.engine.conftest import make_llm
from tests.loader.checkpoints import hf_config


def test_every_rank_writes_its_table_and_trace(tmp_path):
    folder = _save(tmp_path / "model", hf_config("llama"))
    llm = make_llm(folder, tensor_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        engine.add_request({"prompt_token_ids": [3, 5, 7, 11, 13]}, params)
        for _ in range(3):
            engine.step()
        out = tmp_path / "prof"
        engine.runner.profile(ProfileCommand("start", cpu=True))
        for _ in range(4):
            engine.step()
        summary = engine.runner.profile(ProfileCommand("stop", out_dir=str(out), tag="t",
                                                       steps=4, trace=True))
        assert summary["rank"] == 0 and summary["steps"] == 4
        for rank in (0, 1):
            table = json.loads((out / f"t_rank{rank}_kernels.json").read_text())
            assert table["rank"] == rank and table["wall_ms_per_step"] > 0
            # each rank's row-parallel layers all-reduce in every step of the window
            rows = [r for r in table["kernels"] if is_collective(r["name"])]
            assert rows and table["collective_ms_per_step"] > 0
            assert (out / f"t_rank{rank}_kernels.md").read_text().startswith("# t, rank")
            assert "traceEvents" in (out / f"t_rank{rank}_trace.json").read_text()[:2000]
        while engine.has_unfinished_requests():   # the workers still serve steps after
            engine.step()
    finally:
        engine.shutdown()
