"""The sampler on a CUDA device: no host sync inside forward (checked by torch's
sync debug mode), and seeded rows reproduce across batch compositions with a
generator on the device or, through the copy path, on the CPU."""
import pytest
import torch

from slipstream.layers.sampler import Sampler, SamplingBatch, make_generator
from slipstream.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 1000


def _params():
    return [SamplingParams(temperature=0.0, logprobs=2),
            SamplingParams(top_k=50, top_p=0.9, min_p=0.02, seed=3, logprobs=4),
            SamplingParams(temperature=0.7, seed=5),
            SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                           min_tokens=3, stop_token_ids=[0])]


def _generators(params, cpu_rows=(2,)):
    return [make_generator(p, "cpu" if i in cpu_rows else "cuda") for i, p in enumerate(params)]


def test_forward_never_syncs_with_the_host():
    params = _params()
    batch = SamplingBatch.build(params, [[1, 2, 3]] * 4, [[4, 4]] * 4, _generators(params),
                                VOCAB, "cuda", eos_token_ids=[7])
    logits = torch.randn(4, VOCAB, device="cuda")
    Sampler()(logits, batch)  # warm-up: first calls may initialise libraries
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.sampled_token_ids[0].item() == logits[0].argmax().item()
    assert out.logprobs.token_ids.shape == (4, 5)


@pytest.mark.parametrize("generator_device", ["cuda", "cpu"])
def test_seeded_rows_reproduce_across_batch_compositions(generator_device):
    steps = torch.randn(8, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(companions, position):
        gen = make_generator(target, generator_device)
        gens = [make_generator(p, "cuda") for p in companions]
        gens.insert(position, gen)
        params = list(companions)
        params.insert(position, target)
        tokens = []
        for step in steps:
            rest = torch.randn(len(companions), VOCAB, device="cuda")
            logits = torch.cat([rest[:position], step[None], rest[position:]])
            batch = SamplingBatch.build(params, [[1]] * len(params), [[2]] * len(params), gens,
                                        VOCAB, "cuda")
            tokens.append(Sampler()(logits, batch).sampled_token_ids[position].item())
        return tokens

    alone = run([], 0)
    assert run(_params(), 1) == alone
    assert run(_params()[:2], 2) == alone
