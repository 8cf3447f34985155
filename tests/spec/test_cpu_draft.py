"""EAGLE's draft head on GGUF blocks (spec/cpu_draft.py) against its fp32 form."""
import pytest
import torch
from torch import nn

from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix
from slipstream.spec import cpu_draft

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="no C compiler for the CPU kernels")


def test_q8_0_blocks_round_trip():
    """The blocks dequantize (by the kernels' own reader) to within half a step of
    the weights, scale amax / 127 per 32 values."""
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 96)
    w[3, :32] = 0                                        # an all-zero block
    blocks = cpu_draft.q8_0_blocks(w)
    assert blocks.shape == (32, 3 * 34) and blocks.dtype == torch.uint8
    back = QuantMatrix([(cpu_draft.Q8_0, blocks)], 96).dequantize()
    step = (w.reshape(32, 3, 32).abs().amax(-1, keepdim=True) / 127).expand(-1, -1, 32).reshape(32, 96)
    assert ((back - w).abs() <= step * 0.5 + 1e-6).all()
    assert (back[3, :32] == 0).all()
    with pytest.raises(ValueError, match="32 columns"):
        cpu_draft.q8_0_blocks(torch.zeros(16, 40))


def test_q4_1_blocks_round_trip():
    """Codes in [0, 15] over [min, max] of each 32 values: back within half a step
    (plus the fp16 rounding of the offset); an all-zero block and a constant one
    come back exactly."""
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 3, 96)
    w[3, :32] = 0
    w[4, 32:64] = 0.75
    blocks = cpu_draft.q4_1_blocks(w)
    assert blocks.shape == (32, 3 * 20) and blocks.dtype == torch.uint8
    back = QuantMatrix([(cpu_draft.Q4_1, blocks)], 96).dequantize()
    b = w.reshape(32, 3, 32)
    step = ((b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / 15).expand(-1, -1, 32).reshape(32, 96)
    assert ((back - w).abs() <= step * 0.5 + w.abs().amax() * 2 ** -11 + 1e-6).all()
    assert (back[3, :32] == 0).all() and (back[4, 32:64] == 0.75).all()
    with pytest.raises(ValueError, match="32 columns"):
        cpu_draft.q4_1_blocks(torch.zeros(16, 40))


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_tracks_its_blocks(bits):
    """The product of the blocks it holds (within the int8 rounding of x), and near
    the linear itself: within a step of the weights' rounding at 8 bits."""
    lin = nn.Linear(64, 48, bias=False)
    q = cpu_draft.QuantLinear(lin, bits)
    assert q.qm.segments[0][0] == (cpu_draft.Q4_1 if bits == 4 else cpu_draft.Q8_0)
    x = torch.randn(2, 5, 64)
    got = q(x)
    assert got.shape == (2, 5, 48)
    want = torch.nn.functional.linear(x, q.qm.dequantize())
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    if bits == 8:
        ref = lin(x)
        assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_draft_lm_head_reads_the_targets_rows():
    """The draft vocabulary's columns of the target's quantized head, from its own blocks."""
    from tests.spec.conftest import draft_lm_head_over
    w = torch.randn(80, 64, generator=torch.Generator().manual_seed(1))
    table = QuantMatrix([(cpu_draft.Q8_0, cpu_draft.q8_0_blocks(w))], 64)
    base = draft_lm_head_over(table, torch.arange(3, 80, 5)[:16])
    head = cpu_draft.QuantDraftLMHead(base, table, bits=8)
    x = torch.randn(3, 64)
    torch.testing.assert_close(head(x), table.matmul(x)[:, base.vocab])
    assert torch.equal(head.token_ids(torch.tensor([0, 15])), base.vocab[[0, 15]])


def test_draft_lm_head_at_4_bits_re_rounds_the_rows():
    """bits=4: the rows of the draft vocabulary, dequantized from the target's Q8_0
    blocks, re-rounded to Q4_1."""
    from tests.spec.conftest import draft_lm_head_over
    w = torch.randn(80, 64, generator=torch.Generator().manual_seed(4))
    table = QuantMatrix([(cpu_draft.Q8_0, cpu_draft.q8_0_blocks(w))], 64)
    vocab = torch.arange(3, 80, 5)[:16]
    head = cpu_draft.QuantDraftLMHead(draft_lm_head_over(table, vocab), table, bits=4)
    assert head.rows.segments[0][0] == cpu_draft.Q4_1
    rows = table.dequantize()[vocab]
    assert torch.equal(head.rows.dequantize(),
                       QuantMatrix([(cpu_draft.Q4_1, cpu_draft.q4_1_blocks(rows))], 64).dequantize())


def test_quantize_lm_head_takes_the_blocks_only_with_a_draft_vocabulary():
    """With a draft vocabulary over a target whose head is one quantized table, the
    draft LM head reads its rows in the target's blocks; without one it stays as it is."""
    from tests.spec.conftest import draft_lm_head_over
    w = torch.randn(80, 64, generator=torch.Generator().manual_seed(2))
    table = QuantMatrix([(cpu_draft.Q8_0, cpu_draft.q8_0_blocks(w))], 64)
    with_vocab = draft_lm_head_over(table, torch.arange(0, 80, 3))
    assert isinstance(cpu_draft.quantize_lm_head(with_vocab), cpu_draft.QuantDraftLMHead)
    without = draft_lm_head_over(table, None)
    assert cpu_draft.quantize_lm_head(without) is without


def test_medusa_drafts_from_the_quantized_rows_on_a_cpu(tiny_target, tmp_path, monkeypatch):
    """The Medusa proposer of a head file with a draft vocabulary asks for the target's
    quantized rows on a CPU (as EAGLE's does), not a dense fp32 copy (with the copy,
    the default model's Medusa ran at 0.48x plain against 0.60x without a vocabulary)."""
    from slipstream.config import SpecConfig
    from slipstream.spec import medusa
    heads = medusa.MedusaHeads(tiny_target.config.hidden_size, 2)
    path = tmp_path / "medusa.safetensors"
    heads.save(path, torch.arange(0, tiny_target.config.vocab_size, 2))
    seen = []
    monkeypatch.setattr(cpu_draft, "quantize_lm_head", lambda h: seen.append(h) or h)
    spec = SpecConfig(method="medusa", model=str(path), num_speculative_tokens=2,
                      medusa_topk=(2, 1))
    proposer = medusa._make(spec, "cpu", torch.float32, target=tiny_target)
    assert len(seen) == 1 and seen[0].vocab is not None and proposer.lm_head is seen[0]
