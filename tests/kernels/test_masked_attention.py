"""The masked-attention kernel (the EAGLE head's drafting attention) against SDPA on
the same inputs: GQA groups, rows that see a prefix of the past plus a tree, keys
past the real ones masked, row blocks and key tiles with ragged ends; as the op
torch.compile'd callers use."""
import pytest
import torch

from slipstream.kernels.masked_attention import (
    masked_attention, masked_attention_op, masked_attention_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def _case(t, heads, kv_heads, d, past, real, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = past + t
    q = torch.randn(t, heads, d, generator=gen).to(DTYPE).to(DEVICE)
    k = torch.randn(c, kv_heads, d, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(c, kv_heads, d, generator=gen).to(DTYPE).to(DEVICE)
    mask = torch.zeros(t, c, dtype=torch.bool)
    mask[:, :real] = True                                    # the real prefix of the past
    mask[:, past:] = torch.rand(t, t, generator=gen) < 0.3   # some tree keys
    mask[:, past:] |= torch.eye(t, dtype=torch.bool)         # every row sees itself
    return q, k, v, mask.to(DEVICE)


@pytest.mark.parametrize("t,heads,kv_heads,d,past,real", [
    (8, 9, 3, 64, 264, 150), (7, 9, 3, 64, 264, 0), (1, 4, 4, 32, 70, 70),
    (24, 8, 2, 64, 100, 37), (3, 2, 1, 128, 5, 5)])
def test_masked_attention_matches_sdpa(t, heads, kv_heads, d, past, real):
    q, k, v, mask = _case(t, heads, kv_heads, d, past, real)
    got = masked_attention(q, k, v, mask)
    want = masked_attention_reference(q, k, v, mask)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_strided_views_and_bad_shapes():
    q, k, v, mask = _case(8, 9, 3, 64, 40, 20)
    kv = torch.cat([k, v], 1)                                 # K and V as views of one tensor
    got = masked_attention(q, kv[:, :3], kv[:, 3:], mask)
    torch.testing.assert_close(got.float(), masked_attention_reference(q, k, v, mask).float(),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="masked_attention"):
        masked_attention(q, k, v, mask[:, 1:])
    with pytest.raises(ValueError, match="masked_attention"):
        masked_attention(q[..., :48], k[..., :48], v[..., :48], mask)


def test_the_op_under_torch_compile():
    q, k, v, mask = _case(8, 9, 3, 64, 64, 30)
    fn = torch.compile(lambda a, b, c, m: masked_attention_op(a * 1.0, b, c, m & m), dynamic=False)
    torch.testing.assert_close(fn(q, k, v, mask).float(),
                               masked_attention_reference(q, k, v, mask).float(), rtol=1e-2, atol=1e-2)


def test_the_eagle_heads_attention_takes_it_when_asked(monkeypatch):
    from slipstream.spec import eagle_head
    q, k, v, mask = _case(8, 9, 3, 64, 48, 20)
    monkeypatch.setattr(eagle_head, "gpu_sdpa", "triton")
    got = eagle_head.attention(q, k, v, mask, fused=True)
    want = eagle_head.attention(q.float(), k.float(), v.float(), mask, fused=False)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
