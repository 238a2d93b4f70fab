"""Every torch reference and packer keeps the tensors it makes on its inputs' device.

A GPU host is not needed to catch the bug that broke 38 kernel tests on CUDA: on `meta` tensors
an index made without `device=` (e.g. `torch.arange(n)`) lands on the CPU, and the op that mixes
it with a meta tensor raises. Each function below runs on meta inputs and must return meta
tensors of the documented shapes."""

import pytest
import torch
from engines.kernels import decode, fp8_kv, kivi_kv, turbo_kv
from engines.kernels.w4a16 import w4a16_reference
from engines.quant import awq_gemm, dequantize_groupwise, fake_quantize, quantize_groupwise
from engines.reference import awq

META = torch.device("meta")


def m(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


def ints(*shape, dtype=torch.int32):
    return torch.empty(*shape, dtype=dtype, device=META)


B, H, HKV, S, D = 1, 4, 2, 64, 64

CASES = {
    # KIVI
    "kivi.pack_codes": (lambda: kivi_kv.pack_codes(ints(S, D, dtype=torch.int64), 2), (S, D * 2 // 32)),
    "kivi.unpack_codes": (lambda: kivi_kv.unpack_codes(ints(S, D * 2 // 32), 2), (S, D)),
    "kivi.quantize_keys_reference": (lambda: kivi_kv.quantize_keys_reference(m(S, D), 2)[0], (S, D * 2 // 32)),
    "kivi.quantize_values_reference": (lambda: kivi_kv.quantize_values_reference(m(S, D), 4)[0], (S, D * 4 // 32)),
    "kivi.dequantize_keys": (lambda: kivi_kv.dequantize_keys(ints(S, D // 16), m(S // 32, D), m(S // 32, D), 2), (S, D)),
    "kivi.decode_attention_reference": (
        lambda: kivi_kv.decode_attention_reference(
            m(B, H, D), m(B, HKV, S, D), m(B, HKV, S, D), ints(B, HKV, S, D // 16), m(B, HKV, S // 32, D),
            m(B, HKV, S // 32, D), ints(B, HKV, S, D // 16), m(B, HKV, S, D // 32), m(B, HKV, S, D // 32),
            ints(B, dtype=torch.int64), ints(B, dtype=torch.int64), ints(B, dtype=torch.int64), 2),
        (B, H, D)),
    # TurboQuant
    "turbo.pack_codes": (lambda: turbo_kv.pack_codes(ints(S, D, dtype=torch.int64), 3), (S, D // 8)),
    "turbo.unpack_codes": (lambda: turbo_kv.unpack_codes(ints(S, D // 8), 3), (S, D)),
    "turbo.quantize_reference": (lambda: turbo_kv.quantize_reference(m(S, D), 3)[0], (S, D // 8)),
    "turbo.dequantize_rotated": (lambda: turbo_kv.dequantize_rotated(ints(S, D // 8), m(S), 3), (S, D)),
    "turbo.decode_attention_reference": (
        lambda: turbo_kv.decode_attention_reference(m(B, H, D), ints(B, HKV, S, D // 8), m(B, HKV, S),
                                                    ints(B, HKV, S, D // 8), m(B, HKV, S), ints(B, dtype=torch.int64), 3),
        (B, H, D)),
    "decode.merge_split_k": (lambda: decode.merge_split_k(m(H, 4), m(H, 4), m(H, 4, D)), (H, D)),
    # fp8
    "fp8.quantize_reference": (lambda: fp8_kv.quantize_reference(m(S, D)), (S, D)),
    "fp8.decode_attention_reference": (
        lambda: fp8_kv.decode_attention_reference(m(B, H, D), m(B, HKV, S, D, dtype=fp8_kv.FP8),
                                                  m(B, HKV, S, D, dtype=fp8_kv.FP8), ints(B, dtype=torch.int64)),
        (B, H, D)),
    # weights: RTN, the AutoAWQ layout, W4A16, AWQ's clip search
    "quant.quantize_groupwise": (lambda: quantize_groupwise(m(32, 256), 4)[0], (32, 256)),
    "quant.dequantize_groupwise": (lambda: dequantize_groupwise(ints(32, 256, dtype=torch.uint8), m(32, 2), m(32, 2)), (32, 256)),
    "quant.fake_quantize": (lambda: fake_quantize(m(32, 256), 4), (32, 256)),
    "awq_gemm._pack_cols": (lambda: awq_gemm._pack_cols(ints(256, 32, dtype=torch.uint8)), (256, 4)),
    "awq_gemm._unpack_cols": (lambda: awq_gemm._unpack_cols(ints(256, 4)), (256, 32)),
    "awq_gemm.pack_awq_gemm": (lambda: awq_gemm.pack_awq_gemm(ints(32, 256, dtype=torch.uint8), m(32, 2), m(32, 2))[0], (256, 4)),
    "awq_gemm.dequantize_awq_gemm": (lambda: awq_gemm.dequantize_awq_gemm(ints(256, 4), ints(2, 4), m(2, 32, dtype=torch.float16)), (32, 256)),
    "awq.search_clip": (lambda: awq.search_clip(m(32, 256), m(16, 256)), (32, 2, 1)),
    "w4a16_reference": (lambda: w4a16_reference(m(3, 256, dtype=torch.float16), ints(256, 4), ints(2, 4),
                                                m(2, 32, dtype=torch.float16)), (3, 32)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_keeps_its_inputs_device(name):
    fn, shape = CASES[name]
    out = fn()
    assert out.device == META, f"{name} returned a tensor on {out.device}"
    assert tuple(out.shape) == shape
