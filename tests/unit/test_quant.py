"""Group-wise asymmetric INT-b quantization (docs/reference.md §1), checked against hand arithmetic."""

import torch
from engines.quant import dequantize_groupwise, fake_quantize, quantize_groupwise, quantized_bytes


def test_int4_group_by_hand():
    # One group of 128: min −1.0, max 2.0 → s = 3/15 = 0.2, z = clamp(−round(−1/0.2)) = 5.
    w = torch.zeros(1, 128)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = -1.0, 2.0, 0.53, -0.33
    q, s, z = quantize_groupwise(w, bits=4)
    assert torch.allclose(s, torch.tensor([[0.2]]))
    assert z.item() == 5
    # 0.53/0.2 = 2.65 → 3, +5 = 8 → ŵ = 0.6;  −0.33/0.2 = −1.65 → −2, +5 = 3 → ŵ = −0.4;  0 → 5 → 0
    assert q[0, :4].tolist() == [0, 15, 8, 3]
    assert q[0, 4].item() == 5
    deq = dequantize_groupwise(q, s, z)
    assert torch.allclose(deq[0, :4], torch.tensor([-1.0, 2.0, 0.6, -0.4]), atol=1e-6)


def test_error_bounded_by_half_step_and_int8_finer():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    for bits in (4, 8):
        q, s, z = quantize_groupwise(w, bits)
        err = (dequantize_groupwise(q, s, z) - w).abs().reshape(64, 2, 128)
        assert (err <= s[..., None] / 2 + 1e-6).all()
        assert q.max() <= 2**bits - 1
    e4 = (fake_quantize(w, 4) - w).pow(2).mean()
    e8 = (fake_quantize(w, 8) - w).pow(2).mean()
    assert e8 < e4 / 100  # 16× finer steps → ~256× lower MSE


def test_packed_size_by_hand():
    # 256×128 int4: 256·128/2 = 16384 bytes of codes + 256 groups × (fp16 scale + fp16 zero) = 1024
    assert quantized_bytes(256, 128, 4) == 17408
    assert quantized_bytes(256, 128, 8) == 32768 + 1024


def test_rejects_ragged_groups():
    import pytest

    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_groupwise(torch.zeros(4, 100), 4)
