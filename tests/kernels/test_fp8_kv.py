"""fp8 KV kernels against their torch references (interpreter on CPU, GPU when present)."""

import torch
from engines.kernels.fp8_kv import decode_attention, decode_attention_reference, quantize_on_write, quantize_reference


def test_quantize_on_write_is_the_saturating_e4m3_cast(device):
    x = torch.tensor([0.3, 1000.0, -2.7, 0.0, -5000.0, 1e-3]).to(device)
    got = quantize_on_write(x).float().cpu()
    want = quantize_reference(x).float().cpu()
    assert got[:5].tolist() == want[:5].tolist() == [0.3125, 448.0, -2.75, 0.0, -448.0]
    # 1e-3 is an e4m3 subnormal (< 2^-6): the interpreter flushes it to 0, torch and GPUs round it
    # to 2^-9; either is within one subnormal step
    assert abs(got[5] - want[5]) <= 2**-9


def test_decode_attention_matches_reference(device):
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, S, D = 2, 4, 2, 50, 32
    k8 = quantize_reference(torch.randn(B, Hkv, S, D, generator=g))
    v8 = quantize_reference(torch.randn(B, Hkv, S, D, generator=g))
    q = torch.randn(B, H, D, generator=g)
    lengths = torch.tensor([50, 17])
    args = [t.to(device) for t in (q, k8, v8, lengths)]
    torch.testing.assert_close(decode_attention(*args, chunks=2, block_s=16), decode_attention_reference(*args), rtol=1e-4, atol=1e-4)
