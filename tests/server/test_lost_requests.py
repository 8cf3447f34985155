"""An engine step that raises an error naming the requests it lost (a prefill/decode
pair whose prefill instance died) fails exactly those requests; the others go on."""
import asyncio
from types import SimpleNamespace

import pytest

from slipstream.sampling_params import SamplingParams
from slipstream.server.async_engine import AsyncEngine, StepError


class LostError(RuntimeError):
    def __init__(self, ids):
        super().__init__("the other instance died")
        self.request_ids = ids


class FakeEngine:
    """Request "a" decodes for three steps; "b" is lost by the second step."""

    def __init__(self):
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8))
        self.kv = SimpleNamespace(pool=SimpleNamespace(num_free_blocks=8, num_blocks=8))
        self._parents, self.steps = {}, 0

    def add_request(self, prompt, params, rid):
        self._parents[rid] = 0

    def abort_request(self, rid):
        self._parents.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self._parents)

    def step(self):
        self.steps += 1
        if self.steps == 2 and "b" in self._parents:
            del self._parents["b"]
            raise LostError(["b"])
        self._parents["a"] += 1
        done = self._parents["a"] == 3
        if done:
            del self._parents["a"]
        return [SimpleNamespace(request_id="a", finished=done, outputs=[])]


def test_only_the_lost_request_fails():
    async def main():
        engine = FakeEngine()
        ae = AsyncEngine(engine)
        ae.start()
        try:
            sub_b = ae.submit([("p", SamplingParams(), "b")])
            sub_a = ae.submit([("p", SamplingParams(), "a")])
            with pytest.raises(StepError, match="lost this request"):
                async for _ in sub_b:
                    pass
            while engine.has_unfinished_requests():     # "a" goes on to its end
                await asyncio.sleep(0.01)
            del sub_a
            return ae.stats.step_errors, engine.steps
        finally:
            await ae.stop()

    errors, steps = asyncio.run(asyncio.wait_for(main(), 20))
    assert errors == 1 and steps == 4     # 1 ok, 2 lost "b", 3 and 4 finish "a"
