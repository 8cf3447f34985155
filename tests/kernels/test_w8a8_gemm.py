"""The W8A8 path's kernels against their PyTorch twins: the GEMM (kernels/w8a8_gemm.py vs
reference.w8a8_linear, int8 and fp8), and the quantizing variants of the fused RMSNorm
and SiLU * up (reference.rms_norm_quant, reference.silu_and_mul_quant: the plain op, then
per-token quantization). fp16/fp32 under the interpreter; fp8 and bf16 on a GPU.

W8A8 int8 accumulates exactly in int32 in kernel and twin: only the final scaling rounds
(rtol 1e-3 fp16, 1e-5 fp32). Fused producers: the codes of a row may differ by one step
where the twin's value lies within an fp32 rounding of a rounding boundary (the norm's
fp32 reduction order differs), so codes are compared exactly on all but a tiny share."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.rms_norm import rms_norm
from slipstream.kernels.silu_mul import silu_and_mul_quant
from slipstream.kernels.w8a8_gemm import _cfg, w8a8_candidates, w8a8_gemm
from slipstream.quant.primitives import quantize_int8_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (17, 40, 96), (70, 64, 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w8a8_gemm_matches_reference(m, n, k, dtype):
    xq, xs = quantize_int8_rows(torch.randn(m, k))
    wq, ws = quantize_int8_rows(torch.randn(n, k))
    ws = ws.flatten()
    y = w8a8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), dtype)
    ref = reference.w8a8_linear(xq, xs, wq, ws, torch.float32)
    rtol = 1e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(y.float().cpu(), ref, atol=rtol, rtol=rtol)


@pytest.mark.parametrize("m", [3, 40, 300])
def test_every_w8a8_candidate_is_correct(m):
    """Every tile the tuner may pick (decode, small batch, prefill sets), with M and N
    not multiples of the tile (the clamped rows and columns must not be stored)."""
    xq, xs = quantize_int8_rows(torch.randn(m, 256))
    wq, ws = quantize_int8_rows(torch.randn(40, 256))
    ref = reference.w8a8_linear(xq, xs, wq, ws.flatten(), torch.float32)
    cands = w8a8_candidates(m)
    if m > 64 and DEVICE == "cpu":
        cands = cands[:2]              # the interpreter is slow on 256-wide tiles
    for cfg in cands:
        y = w8a8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.flatten().to(DEVICE),
                      torch.float32, cfg)
        torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-5, msg=str(cfg))


@pytest.mark.parametrize("kernel", ["tma", "tma-persistent"])
@pytest.mark.parametrize("m,n", [(3, 40), (70, 100)])
def test_w8a8_tma_kernels(kernel, m, n):
    """TMA tiles (zero-filled past the edges) and persistent programs that take several
    tiles each (two programs under the interpreter)."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA: Hopper and later")
    xq, xs = quantize_int8_rows(torch.randn(m, 256))
    wq, ws = quantize_int8_rows(torch.randn(n, 256))
    ref = reference.w8a8_linear(xq, xs, wq, ws.flatten(), torch.float32)
    cfg = _cfg(16, 32, 64, 4, 2, kernel) if DEVICE == "cpu" else _cfg(64, 64, 64, 4, 3, kernel)
    y = w8a8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.flatten().to(DEVICE),
                  torch.float32, cfg)
    torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_candidate_sets(monkeypatch):
    """Prefill: int8 tunes the base tiles, float8 the TMA kernels (the measured best);
    SLIPSTREAM_W8A8_TILES picks another set."""
    kinds = lambda cands: {c.get("KERNEL") for c in cands}  # noqa: E731
    assert kinds(w8a8_candidates(2048)) == {None}
    assert _cfg(128, 128, 128, 8, 3) in w8a8_candidates(2048)
    assert kinds(w8a8_candidates(2048, dtype=torch.float8_e4m3fn)) == {"tma", "tma-persistent"}
    assert kinds(w8a8_candidates(16, dtype=torch.float8_e4m3fn)) == {None}
    monkeypatch.setenv("SLIPSTREAM_W8A8_TILES", "all")
    assert kinds(w8a8_candidates(2048)) == {None, "tma", "tma-persistent"}
    monkeypatch.setenv("SLIPSTREAM_W8A8_TILES", "bogus")
    with pytest.raises(ValueError, match="SLIPSTREAM_W8A8_TILES"):
        w8a8_candidates(2048)


def test_fp8_mode_names_the_option(monkeypatch):
    from slipstream.kernels.w8a8_gemm import fp8_mode
    assert fp8_mode() == "auto"
    monkeypatch.setenv("SLIPSTREAM_FP8_GEMM", "cublas")
    with pytest.raises(ValueError, match="SLIPSTREAM_FP8_GEMM"):
        fp8_mode()


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 tensor cores: sm_89+")
@pytest.mark.parametrize("mode", ["auto", "scaled_mm", "triton"])
def test_fp8_gemm_modes(monkeypatch, mode):
    """Each fp8 path (tuned choice, torch._scaled_mm, Triton) gives the twin's product."""
    from slipstream.kernels import quant_tuning
    from slipstream.quant.primitives import quantize_fp8_rows
    monkeypatch.setenv("SLIPSTREAM_FP8_GEMM", mode)
    monkeypatch.setattr(quant_tuning, "_BEST", {})
    xq, xs = quantize_fp8_rows(torch.randn(130, 512, device=DEVICE))
    wq, ws = quantize_fp8_rows(torch.randn(256, 512, device=DEVICE))
    y = w8a8_gemm(xq, xs, wq, ws.flatten(), torch.bfloat16)
    ref = reference.w8a8_linear(xq, xs, wq, ws.flatten(), torch.float32)
    _fp8_product_close(y, ref)


def _fp8_product_close(y, ref):
    """float8 tensor cores (sm_89/sm_90) add their products with fewer bits than fp32:
    an element may be off by ~1e-3 of the output's scale (measured on an H200: 0.03 at
    outputs of scale 30), beyond bf16 rounding."""
    torch.testing.assert_close(y.float(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-2)


def test_w8a8_gemm_rejects_mixed_operands():
    xq = torch.zeros(2, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        w8a8_gemm(xq, torch.ones(2, 1), torch.zeros(4, 32, dtype=torch.float8_e4m3fn),
                  torch.ones(4), torch.float32)


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 tensor-core dot: sm_89+ (the interpreter rounds fp8 wrongly)")
def test_w8a8_gemm_fp8_matches_reference():
    from slipstream.quant.primitives import quantize_fp8_rows
    xq, xs = quantize_fp8_rows(torch.randn(300, 512, device=DEVICE))
    wq, ws = quantize_fp8_rows(torch.randn(200, 512, device=DEVICE))
    y = w8a8_gemm(xq, xs, wq, ws.flatten(), torch.bfloat16)
    ref = reference.w8a8_linear(xq, xs, wq, ws.flatten(), torch.float32)
    _fp8_product_close(y, ref)


def _codes_agree(q, qr, share=0.002):
    """Equal codes, except a share of one-step differences (rounding-boundary ties)."""
    d = (q.float() - qr.float()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() <= share, (d.max(), (d > 0).float().mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_int8_codes(dtype, with_residual):
    x = (torch.randn(9, 200, device=DEVICE) * 3).to(dtype)
    w = (torch.rand(200, device=DEVICE) + 0.5).to(dtype)
    res = torch.randn(9, 200, device=DEVICE).to(dtype) if with_residual else None
    got = rms_norm(x, w, 1e-5, res, quant="int8")
    want = reference.rms_norm_quant(x, w, 1e-5, res, "int8")
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
        got, want = got[0], want[0]
    (q, s), (qr, sr) = got, (t.cpu() for t in want)
    assert q.dtype == torch.int8 and s.shape == (9, 1)
    torch.testing.assert_close(s.cpu(), sr, atol=0, rtol=2e-3)
    _codes_agree(q.cpu(), qr, share=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,d", [(1, 48), (5, 1500), (3, 2500)])
@pytest.mark.parametrize("one_pass", [False, True])
def test_silu_and_mul_int8_codes(dtype, num_tokens, d, one_pass):
    """Two passes over the row (d > the 2048-wide block: the maximum spans two steps of
    the loop) or the whole row at once."""
    x = (torch.randn(num_tokens, 2 * d, device=DEVICE) * 2).to(dtype)
    q, s = silu_and_mul_quant(x, "int8", one_pass=one_pass)
    qr, sr = (t.cpu() for t in reference.silu_and_mul_quant(x, "int8"))
    assert q.shape == (num_tokens, d) and s.shape == (num_tokens, 1)
    torch.testing.assert_close(s.cpu(), sr, atol=0, rtol=2e-3)
    _codes_agree(q.cpu(), qr, share=0.01)
    with pytest.raises(ValueError, match="kind"):
        silu_and_mul_quant(x, "int4")


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's interpreter rounds float8 wrongly")
def test_fused_producers_fp8_codes():
    x = torch.randn(64, 4096, device=DEVICE, dtype=torch.bfloat16) * 3
    w = (torch.rand(4096, device=DEVICE) + 0.5).to(torch.bfloat16)
    q, s = rms_norm(x, w, 1e-5, quant="fp8")
    qr, sr = reference.rms_norm_quant(x, w, 1e-5, None, "fp8")
    torch.testing.assert_close(s, sr, atol=0, rtol=2e-3)
    _within_one_e4m3_step(q, qr)
    q, s = silu_and_mul_quant(x, "fp8")
    qr, sr = reference.silu_and_mul_quant(x, "fp8")
    torch.testing.assert_close(s, sr, atol=0, rtol=2e-3)
    _within_one_e4m3_step(q, qr)


def _within_one_e4m3_step(q, qr, share=0.002):
    """Codes one e4m3 step apart at most (where the scales' last bits differ, values on a
    rounding boundary go either way): 2^-3 of the binade, 2^-9 among subnormals."""
    a, b = q.float(), qr.float()
    big = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -6)
    step = torch.exp2(torch.floor(torch.log2(big)) - 3)
    d = (a - b).abs()
    assert (d <= step).all() and (d > 0).float().mean() <= share
