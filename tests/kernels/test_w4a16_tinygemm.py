"""torch's tinygemm int4 GEMM (aten._weight_int4pack_mm) as the batch-1 path of W4A16Linear:
the AWQ weight w = (q − z)·s carried into tinygemm's (q − 8)·s + m, checked on the CPU through
the op's CPU twin (`_for_cpu`, the same arithmetic) and on CUDA through the op itself."""

import pytest
import torch
from engines.kernels.w4a16 import TinyGemm, W4A16Linear, w4a16_reference
from engines.quant import pack_awq_gemm, quantize_groupwise

# the CPU twins came with torch 2.6; the project admits 2.5, where only the CUDA op exists
cpu_twin = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                              reason=f"torch {torch.__version__} has no CPU tinygemm (aten._weight_int4pack_mm_for_cpu)")


def parts(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s, z = quantize_groupwise(torch.randn(N, K, generator=g) / K**0.5, 4)
    return q, z, s


@cpu_twin
def test_tinygemm_scales_and_zeros_worked_by_hand():
    # one column, one group of 128: z = 3, s = 0.5 → m = (8 − 3) · 0.5 = 2.5, and every q gives
    # (q − 8) · 0.5 + 2.5 = (q − 3) · 0.5: q = 3 → 0, q = 15 → 6, q = 0 → −1.5
    q = torch.zeros(16, 128, dtype=torch.uint8)  # the CPU twin packs 16 columns at a time
    q[0, :3] = torch.tensor([3, 15, 0], dtype=torch.uint8)
    zero, scale = torch.full((16, 1), 3.0), torch.full((16, 1), 0.5)
    t = TinyGemm([(q, zero, scale)], "cpu")
    s, m = t.scales_and_zeros[0, 0].float().tolist()
    assert (s, m) == (0.5, 2.5)
    x = torch.zeros(1, 128)
    x[0, :3] = torch.tensor([1.0, 1.0, 2.0])
    # column 0: 1·0 + 1·6 + 2·(−1.5) = 3; column 1 (every q 0, weight −1.5): (1 + 1 + 2)·(−1.5) = −6
    assert t(x)[0, :2].tolist() == [3.0, -6.0]


@cpu_twin
@pytest.mark.parametrize("M", [1, 3])
def test_tinygemm_cpu_twin_matches_the_awq_reference(M):
    p = parts(64, 256)
    t = TinyGemm([p], "cpu")
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(1))
    got, want = t(x), w4a16_reference(x, *pack_awq_gemm(*p))
    # bf16 activations and output: 8 mantissa bits, so within 2⁻⁷ of the largest output
    assert (got - want).abs().max() <= want.abs().max() * 2**-7


def test_int4_gemv_choice_on_a_host_without_cuda():
    p = parts(64, 256)
    layer = W4A16Linear.from_parts([p], None, "cpu", "auto")
    assert layer.batch1 == "triton"  # tinygemm's kernel is CUDA's: auto falls back to the own GEMV
    with pytest.raises(ValueError, match=r"engine_options.int4_gemv: 'tinygemm' cannot run here: .*CUDA"):
        W4A16Linear.from_parts([p], None, "cpu", "tinygemm")
    with pytest.raises(ValueError, match=r"engine_options\.int4_gemv: 'fast' is not one of auto, tinygemm, triton"):
        W4A16Linear.from_parts([p], None, "cpu", "fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm's CUDA kernel needs CUDA")
def test_auto_takes_tinygemm_for_one_row_on_cuda():
    p = parts(4096 // 8, 4096)  # 512 × 4096: a shape tinygemm packs
    layer = W4A16Linear.from_parts([p], None, "cuda", "auto")
    assert layer.batch1 == "tinygemm"
    qweight, qzeros, scales = (t.cuda() for t in pack_awq_gemm(*p))
    for M in (1, 4):  # one row through tinygemm, four through the Triton GEMV
        x = torch.randn(M, 4096, generator=torch.Generator().manual_seed(M)).to("cuda", torch.float16)
        got, want = layer(x).float(), w4a16_reference(x, qweight, qzeros, scales).float()
        assert (got - want).abs().max() <= want.abs().max() * 2**-6
