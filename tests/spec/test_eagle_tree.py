"""EAGLE's tree expansion over a padded past (what a CUDA graph replays)
equals the expansion over the real pairs alone."""
import pytest
import torch

from slipstream.spec.eagle import EagleHead, EagleShape
from slipstream.spec.eagle_tree import EagleTreeExpander


def test_padded_past_expands_the_same_tree(tiny_target):
    c = tiny_target.config
    torch.manual_seed(0)
    head = EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.head_dim, 64, c.rope_theta, c.max_position_embeddings)).eval()
    ex = EagleTreeExpander(head, tiny_target.model.embed_tokens, tiny_target.compute_logits,
                           lambda cols: cols, depth=4, topk=3, beam=2)
    ctx, pad = 7, 9
    root = torch.randn(c.hidden_size)
    k = torch.randn(ctx, c.num_key_value_heads, c.head_dim)
    v = torch.randn(ctx, c.num_key_value_heads, c.head_dim)
    with torch.inference_mode():
        plain = ex.expand(root, k, v, base=11)
        # Junk (large, finite) in the rows past the real pairs must not matter.
        kp = torch.cat([k, 50 * torch.randn(pad, *k.shape[1:])])
        vp = torch.cat([v, 50 * torch.randn(pad, *v.shape[1:])])
        valid = torch.arange(ctx + pad) < ctx
        padded = ex.levels(root, kp, vp, valid, torch.tensor(11))
        shifted = ex.expand(root, k, v, base=12)
    assert plain.shape == (4, 3 + 3 * 2 * 3)
    assert torch.equal(plain[[0, 2, 3]], padded[[0, 2, 3]])
    assert torch.allclose(plain[1], padded[1], atol=1e-5)
    assert not torch.allclose(plain[1], shifted[1])     # positions reach the head


@pytest.mark.parametrize("n", [16384, 10000, 4097, 300])
@pytest.mark.parametrize("k", [1, 8, 10, 64])
def test_two_stage_row_topk_equals_topk(n, k):
    """The GPU's two-stage top-k (pieces of ~sqrt(n), padded) gives torch.topk's values in
    order and indices that point at them, for one row and for several."""
    from slipstream.spec.eagle_tree import row_topk
    gen = torch.Generator().manual_seed(n + k)
    for x in (torch.randn(n, generator=gen), torch.randn(3, n, generator=gen)):
        want = x.topk(k)
        for sort_max in (0, 128, 2048):
            got = row_topk(x, k, stages=2, sort_max=sort_max)
            assert torch.equal(got.values, want.values)
            assert torch.equal(x.gather(-1, got.indices), got.values)
        if n <= 2048:                   # one stage by a sort
            got = row_topk(x, k, stages=1, sort_max=2048)
            assert torch.equal(got.values, want.values) and torch.equal(x.gather(-1, got.indices), got.values)
        assert torch.equal(row_topk(x, k).indices, want.indices)     # on the CPU: torch.topk


@pytest.mark.parametrize("kernel", ["", "triton"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_head_attention_shaped_for_the_fused_kernel_equals_the_gqa_call(heads, kv_heads, kernel,
                                                                         monkeypatch):
    """The GPU's forms of the head's attention (SDPA's: 4-D, K/V heads repeated; or the
    Triton kernel) compute what the enable_gqa call computes, mask included."""
    from slipstream.spec import eagle_head
    from slipstream.spec.eagle_head import attention
    monkeypatch.setattr(eagle_head, "gpu_sdpa", kernel)
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(8, heads, 16, generator=gen)
    k, v = (torch.randn(40, kv_heads, 16, generator=gen) for _ in range(2))
    mask = torch.rand(8, 40, generator=gen) < 0.6
    mask[:, 0] = True
    torch.testing.assert_close(attention(q, k, v, mask, True), attention(q, k, v, mask, False),
                               atol=1e-5, rtol=1e-5)
