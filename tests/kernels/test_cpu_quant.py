"""CPU kernels over GGUF blocks (kernels/cpu_quant.c) against their twins in
kernels/cpu_reference.py, which dequantize with the gguf package's numpy code.

Blocks are random bytes with finite, positive fp16 scales, so every bit pattern
of the quantized values is exercised.
"""
import pytest
import torch

from slipstream.kernels import cpu_library, cpu_reference
from slipstream.kernels.cpu_quant import BLOCKS, Q4X16, Q8X16, QUANTIZED, QuantMatrix

if cpu_library.load() is None:
    pytest.skip(f"CPU kernels unavailable: {cpu_library.error()}", allow_module_level=True)

# byte offsets of each format's fp16 scales inside a block
_HALVES = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
# The 32-block formats multiply int8-quantized activations (as llama.cpp does): each
# product is off by at most half an int8 step of each x block, summed over the row.
# Bound used: 2% of the largest |y| (measured: under 0.7%). K-quants dot in fp32: 1e-5.
INT8_TOL, FP32_TOL = 2e-2, 1e-5


def random_blocks(qtype: int, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    qk, nbytes = BLOCKS[qtype]
    data = torch.randint(0, 256, (rows, cols // qk, nbytes), dtype=torch.uint8, generator=gen)
    for off in _HALVES[qtype]:
        scale = (torch.rand(rows, cols // qk, generator=gen) * 0.02 + 1e-3).half()
        data[..., off:off + 2] = scale.view(torch.uint8).view(rows, cols // qk, 2)
    return data.reshape(rows, -1)


def _tol(qtype: int) -> float:
    return INT8_TOL if qtype in (2, 3, 8) else FP32_TOL


@pytest.mark.parametrize("qtype", sorted(QUANTIZED), ids=lambda q: QUANTIZED[q])
@pytest.mark.parametrize("m", [1, 3, 9, 17])
@pytest.mark.parametrize("rows", [40, 48])
def test_matmul_matches_dequantize_then_matmul(qtype, m, rows):
    """48 rows: Q4_0 / Q4_1 / Q8_0 run repacked for 16 rows at a time (cpu_q4x16.c,
    cpu_q8x16.c; on a CPU with AMX, Q8_0's 9 and 17 rows of x and Q4's 17 partly on
    tiles, cpu_amx.c);
    40 rows: as stored."""
    gen = torch.Generator().manual_seed(qtype * 10 + m + rows)
    cols = 512
    data = random_blocks(qtype, rows, cols, gen)
    x = torch.randn(m, cols, generator=gen)
    qm = QuantMatrix([(qtype, data)], cols)
    assert (qm.kernel_segments[0][0] in (Q4X16, Q8X16)) == (qtype in (2, 3, 8) and rows % 16 == 0)
    y = qm.matmul(x)
    ref = cpu_reference.quant_matmul([(qtype, data)], cols, x)
    assert y.shape == (m, rows)
    assert (y - ref).abs().max() <= _tol(qtype) * ref.abs().max()


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).sum())


@pytest.mark.parametrize("qtype", sorted(QUANTIZED), ids=lambda q: QUANTIZED[q])
@pytest.mark.parametrize("rows", [40, 48])
@pytest.mark.parametrize("blocks", ["odd", "even"])
def test_a_row_gives_the_same_bits_alone_and_among_others(qtype, rows, blocks):
    """Each row of x comes out bit for bit as it does alone, whatever the number of
    rows around it: a one-token step and a prompt's token among others in a step
    give the same logits. 48 rows: Q4_0 / Q4_1 / Q8_0 repacked for 16 rows at a
    time (on a CPU with AMX, batches from 8 / 16 rows partly on tiles); 40 rows: the
    file's blocks (rows of x four at a time, then a tail of fewer); an odd block
    count: the two-block AVX-512 steps leave one over."""
    cols = {"odd": 224, "even": 576} if BLOCKS[qtype][0] == 32 else {"odd": 768, "even": 512}
    cols = cols[blocks]
    gen = torch.Generator().manual_seed(qtype * 7 + rows + cols)
    qm = QuantMatrix([(qtype, random_blocks(qtype, rows, cols, gen))], cols)
    x = torch.randn(70, cols, generator=gen)
    alone = torch.cat([qm.matmul(x[i:i + 1]) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 7, 8, 9, 16, 21, 40, 70):
        assert _differing(qm.matmul(x[:m]), alone[:m]) == 0, f"{m} rows of x"
    assert _differing(qm.matmul(x[33:]), alone[33:]) == 0


def test_fused_segments_give_a_row_the_same_bits_alone_and_among_others():
    """The default model's products (Q4_1 q/k/v and gate/up fused from shards, Q8_0
    LM head rows, 576 columns) and a fused product whose shards do not repack."""
    gen = torch.Generator().manual_seed(11)
    for segs, cols in (([(3, random_blocks(3, r, 576, gen)) for r in (576, 192, 192)], 576),
                       ([(3, random_blocks(3, 1536, 576, gen)), (3, random_blocks(3, 1536, 576, gen))], 576),
                       ([(8, random_blocks(8, 320, 576, gen))], 576),
                       ([(3, random_blocks(3, 24, 256, gen)), (2, random_blocks(2, 13, 256, gen)),
                         (8, random_blocks(8, 5, 256, gen)), (12, random_blocks(12, 8, 256, gen))], 256)):
        qm = QuantMatrix(segs, cols)
        x = torch.randn(19, cols, generator=gen)
        alone = torch.cat([qm.matmul(x[i:i + 1]) for i in range(x.shape[0])])
        for m in (2, 5, 19):
            assert _differing(qm.matmul(x[:m]), alone[:m]) == 0, f"{len(segs)} segments, {m} rows of x"


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=lambda q: QUANTIZED[q])
def test_repacked_blocks_hold_the_same_weights(qtype):
    """The repacked layouts dequantized row by row equal the file's blocks dequantized
    (Q4_0's offset -8 d is exact in fp16)."""
    gen = torch.Generator().manual_seed(qtype + 50)
    data = random_blocks(qtype, 32, 256, gen)
    data.view(32, 8, -1)[::3, :, 1] |= 0x80     # some negative scales
    qm = QuantMatrix([(qtype, data)], 256)
    kind, packed = qm.kernel_segments[0]
    # Q4_0 gains an offset (20 bytes a block, as Q4_1); Q8_0 keeps its 34
    assert (kind, packed.shape) == ((Q8X16, (32, 272)) if qtype == 8 else (Q4X16, (32, 160)))
    out = torch.empty(32, 256)
    assert cpu_library.load().ss_dequant(kind, packed.data_ptr(), 32, 256, out.data_ptr()) == 0
    torch.testing.assert_close(out, cpu_reference.dequantize(qtype, data, 256), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=lambda q: QUANTIZED[q])
def test_odd_block_count(qtype):
    """Rows of 7 blocks: the two-block AVX-512 steps leave one block over."""
    gen = torch.Generator().manual_seed(qtype + 100)
    data = random_blocks(qtype, 9, 224, gen)
    for m in (1, 5):
        x = torch.randn(m, 224, generator=gen)
        ref = cpu_reference.quant_matmul([(qtype, data)], 224, x)
        y = QuantMatrix([(qtype, data)], 224).matmul(x)
        assert (y - ref).abs().max() <= INT8_TOL * ref.abs().max()


def test_fused_segments_of_different_formats():
    """q/k/v of a Q4_K_M file: shards in different formats, one call."""
    gen = torch.Generator().manual_seed(1)
    cols = 256
    segs = [(12, random_blocks(12, 24, cols, gen)), (14, random_blocks(14, 8, cols, gen)),
            (3, random_blocks(3, 8, cols, gen)), (8, random_blocks(8, 5, cols, gen))]
    x = torch.randn(2, cols, generator=gen)
    y = QuantMatrix(segs, cols).matmul(x)
    ref = cpu_reference.quant_matmul(segs, cols, x)
    assert y.shape == (2, 45)
    assert (y - ref).abs().max() <= INT8_TOL * ref.abs().max()


@pytest.mark.parametrize("qtype", sorted(QUANTIZED), ids=lambda q: QUANTIZED[q])
def test_dequantize_and_row_lookup(qtype):
    gen = torch.Generator().manual_seed(qtype)
    data = random_blocks(qtype, 12, 256, gen)
    qm = QuantMatrix([(qtype, data)], 256)
    ref = cpu_reference.dequantize(qtype, data, 256)
    # fp32 dequantization: equal up to the rounding of a fused multiply-add
    torch.testing.assert_close(qm.dequantize(), ref, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([11, 0, 5, 5])
    torch.testing.assert_close(qm.get_rows(ids), ref[ids], rtol=1e-6, atol=1e-7)


def test_rejects_a_wrong_layout():
    with pytest.raises(ValueError, match="expected uint8"):
        QuantMatrix([(3, torch.zeros(4, 19, dtype=torch.uint8))], 32)
    with pytest.raises(ValueError, match="whole number"):
        QuantMatrix([(12, torch.zeros(4, 144, dtype=torch.uint8))], 100)


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=lambda q: QUANTIZED[q])
@pytest.mark.parametrize("cols", [512, 544])
def test_amx_tiles_give_the_avx512_result(qtype, cols):
    """Where the build and the OS give AMX tiles: products of 8-40 rows of x on them
    (Q8_0 from 8 rows, Q4_0 / Q4_1 from 16; full tiles of 16, a tail of fewer rows, an
    even and an odd block count) equal the AVX-512 kernels' up to the order of fp32
    sums (the int32 block sums are exact)."""
    before = cpu_library.set_amx()
    if not before:
        pytest.skip("no AMX tiles here (build target or OS)")
    gen = torch.Generator().manual_seed(qtype + cols)
    data = random_blocks(qtype, 48, cols, gen)
    qm = QuantMatrix([(qtype, data)], cols)
    try:
        for m in (8, 12, 16, 21, 40):
            x = torch.randn(m, cols, generator=gen)
            assert cpu_library.set_amx(True)
            tiles = qm.matmul(x)
            assert not cpu_library.set_amx(False)
            vec = qm.matmul(x)
            assert (tiles - vec).abs().max() <= 1e-5 * vec.abs().max(), m
    finally:
        cpu_library.set_amx(before)


def test_threads_give_the_same_result():
    gen = torch.Generator().manual_seed(7)
    data = random_blocks(3, 300, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    qm = QuantMatrix([(3, data)], 256)
    before = cpu_library.set_threads(None)
    try:
        cpu_library.set_threads(1)
        one = qm.matmul(x)
        cpu_library.set_threads(3)
        three = qm.matmul(x)
    finally:
        cpu_library.set_threads(before)
    assert torch.equal(one, three)


_POOL_JOBS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_cpu_quant import random_blocks
from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix
gen = torch.Generator().manual_seed(8)
mats = [QuantMatrix([(8, random_blocks(8, r, 256, gen))], 256) for r in (64, 512)]
x = torch.randn(3, 256, generator=gen)
refs = [(qm.matmul(x), qm.dequantize()) for qm in mats]
cpu_library.set_threads(4)
cpu_library.load().ss_pool_test_delay(200)
bad = 0
for _ in range(150):
    for qm, (y, w) in zip(mats, refs):
        bad += not torch.equal(qm.matmul(x), y)
        bad += not torch.equal(qm.dequantize(), w)
print("bad", bad)
"""


def test_pool_jobs_never_mix_when_workers_wake_late():
    """Jobs of different sizes back to back, with workers that wake late after
    seeing a job and a caller that pauses between writing the next job and opening
    it (ss_pool_test_delay widens that window): a late worker must claim nothing of
    a job it did not see opened. Before the fix it could run a chunk of the next
    job early and count it, so the caller returned with chunks still running
    (crashes in the engine's test runs). This exercises that path; it does not
    reproduce the old race every time (with the old code it hung in one run of
    six, so it runs in a process of its own with a time limit)."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", _POOL_JOBS, str(Path(__file__).parent)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-2:] == ["bad", "0"], r.stdout + r.stderr[-2000:]


def test_row_argmax_in_c_is_torchs_argmax():
    """The C kernels' argmax (fp32 rows on the CPU): torch's answer for ties, NaN (the
    first NaN wins), rows of -inf, signed zeros and lengths off the vector width."""
    from slipstream.layers.argmax import row_argmax
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 16, 17, 49152, 32001):
        x = torch.randn(5, n, generator=g)
        x[1] = (x[1] * 2).round()                        # ties
        x[2, n // 2] = float("nan")
        x[2, -1] = float("nan")
        x[3] = float("-inf")
        x[4] = 0.0
        x[4, n // 3] = -0.0
        assert torch.equal(row_argmax(x), x.argmax(dim=-1)), n
        assert torch.equal(row_argmax(x[:, :n - 1 or 1].contiguous()), x[:, :n - 1 or 1].argmax(dim=-1))
    assert row_argmax(torch.zeros(0, 8)).shape == (0,)


def test_row_candidates_in_c():
    """`ss_row_candidates`: each row's log-sum-exp, and in column order every column
    within the widest of delta, delta / 1.5, delta / 2.4, delta / 4 of the row's largest
    value that keeps at most cap (their count above cap where none does); rows of -inf,
    lengths off the vector width."""
    lib = cpu_library.load()
    delta, cap = 12.0, 64
    fracs = (1.0, 1 / 1.5, 1 / 2.4, 0.25)
    g = torch.Generator().manual_seed(2)
    for n in (1, 7, 16, 17, 1000, 49152):
        x = torch.randn(4, n, generator=g) * 3
        x[1] = torch.randn(n, generator=g) * 0.1          # flat: too many within any distance
        x[2] = float("-inf")
        x[3, : n // 2] = float("-inf")
        ids = torch.zeros(4, cap, dtype=torch.int64)
        lse = torch.empty(4)
        count = torch.empty(4, dtype=torch.int64)
        assert lib.ss_row_candidates(x.data_ptr(), 4, n, delta, cap, ids.data_ptr(), lse.data_ptr(),
                                     count.data_ptr()) == 0
        for r in range(4):
            if r == 2:
                assert lse[r] == float("-inf") and count[r] == 0
                continue
            torch.testing.assert_close(lse[r], x[r].logsumexp(0), rtol=1e-5, atol=1e-5)
            m = x[r].max()
            want = None
            for f in fracs:
                want = (x[r] >= m - delta * f).nonzero()[:, 0]
                if len(want) <= cap:
                    break
            assert int(count[r]) == len(want), (n, r)
            k = min(len(want), cap)
            assert torch.equal(ids[r, :k], want[:k]), (n, r)


@pytest.mark.parametrize("arch", ["haswell", "x86-64", "skylake-avx512"])
def test_other_cpus(arch, tmp_path):
    """The kernels built for an AVX2-only CPU, for one without vector extensions and
    for AVX-512 without VNNI (paths this machine may not take) pass the same tests,
    the one-call decoder's (one-token and verification steps) and EAGLE head's included."""
    import os
    import platform
    import subprocess
    import sys
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    if arch == "skylake-avx512" and "avx512bw" not in cpu_library._cpu_flags().split():
        pytest.skip("this CPU runs no AVX-512")
    env = dict(os.environ, SLIPSTREAM_CPU_ARCH=arch, SLIPSTREAM_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not other_cpus and not default_model and not amx", "tests/kernels/test_cpu_attention.py",
                        "tests/loader/test_cpu_decoder.py", "tests/spec/test_cpu_eagle.py"],
                       env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


def test_torch_gets_its_threads_back_when_no_pool_owner_lives(monkeypatch):
    """A dense CPU model loaded after a GGUF one was dropped runs torch's ops on all
    threads again (take_threads had left torch one); not while the GGUF one lives."""
    import types
    import weakref
    from slipstream.quant.selector import quant_method_for
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_library, "_owners", weakref.WeakSet())
    monkeypatch.setattr(cpu_library, "took_threads", False)
    try:
        torch.set_num_threads(2)

        class Owner:
            pass
        owner = Owner()
        cpu_library.take_threads(owner)
        assert torch.get_num_threads() == 1 and cpu_library.took_threads
        dense = types.SimpleNamespace(quantization=None, device=torch.device("cpu"))
        assert quant_method_for(dense, object()) is None
        assert torch.get_num_threads() == 1          # the owner still lives
        del owner
        assert quant_method_for(dense, object()) is None
        assert torch.get_num_threads() == 2 and not cpu_library.took_threads
        assert not cpu_library.release_threads()     # nothing taken
    finally:
        torch.set_num_threads(before)
