"""W4A16 over the AutoAWQ GEMM layout against its torch reference (interpreter on CPU, GPU when
present). Tolerances: fp32 inputs with IEEE dots 1e-4 relative; fp16 inputs 2e-2 absolute on
outputs of magnitude ~1 (fp16 rounding of x and W before the dot); bf16 (GPU only) 6e-2."""

import engines.kernels.w4a16 as w4a16_mod
import pytest
import torch
from engines.kernels import use_triton
from engines.kernels.w4a16 import DEQUANT_MIN_M, GEMV_MAX_M, w4a16, w4a16_dequantize, w4a16_reference, w4a16_triton
from engines.quant import dequantize_awq_gemm, pack_awq_gemm, quantize_groupwise


def make(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K**0.5
    q, s, z = quantize_groupwise(w, 4)
    return pack_awq_gemm(q, z, s)


@pytest.mark.parametrize(("M", "gemv"), [(1, "simt"), (3, "simt"), (16, "simt"), (1, "mma"), (3, "mma"), (16, "mma"),
                                         (33, "auto")])  # batch-1 GEMV, GEMV up to 16 rows (either kernel), GEMM above
@pytest.mark.parametrize("N,K", [(64, 128), (96, 384)])
# bf16 dots are wrong under the Triton interpreter (REFERENCE §11): bf16 is checked on CUDA only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_kernel_matches_reference(device, M, gemv, N, K, dtype):
    qweight, qzeros, scales = (t.to(device) for t in make(N, K))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    got = w4a16_triton(x, qweight, qzeros, scales, gemv=gemv).float()
    want = w4a16_reference(x, qweight, qzeros, scales).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    elif dtype == torch.float16:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    else:  # bf16 keeps 8 mantissa bits
        torch.testing.assert_close(got, want, rtol=0, atol=6e-2)


@pytest.mark.parametrize("N,K", [(64, 128), (96, 384)])  # 96: a partial tile of packed words
def test_dequantize_writes_the_awq_weight_in_column_order(device, N, K):
    """The prefill's one pass over the packed words gives exactly the torch unpacking's
    (q − z)·s, transposed to [K, N], in fp32; rounded to fp16 in fp16."""
    qweight, qzeros, scales = (t.to(device) for t in make(N, K))
    want = dequantize_awq_gemm(qweight, qzeros, scales.float()).T
    torch.testing.assert_close(w4a16_dequantize(qweight, qzeros, scales, torch.float32), want, rtol=0, atol=0)
    torch.testing.assert_close(w4a16_dequantize(qweight, qzeros, scales, torch.float16), want.half(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_prefill_dequantizes_once_then_matmul(device, dtype, monkeypatch):
    """From DEQUANT_MIN_M rows (every input past the GEMV's 16) 'auto' takes the dequantize-then-
    matmul path (one dequantization per call); 'tiled' still runs the tiled GEMM; each equals the
    reference, and a bad path is named."""
    qweight, qzeros, scales = (t.to(device) for t in make(96, 384))
    calls = []
    real = w4a16_mod.w4a16_dequantize
    monkeypatch.setattr(w4a16_mod, "w4a16_dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert DEQUANT_MIN_M == GEMV_MAX_M + 1
    for M, paths, path in ((DEQUANT_MIN_M, 1, "auto"), (GEMV_MAX_M, 0, "auto"), (33, 1, "dequant"),
                           (DEQUANT_MIN_M, 0, "tiled"), (33, 0, "tiled")):
        x = torch.randn(M, 384, generator=torch.Generator().manual_seed(M)).to(device=device, dtype=dtype)
        calls.clear()
        got = w4a16_triton(x, qweight, qzeros, scales, prefill=path).float()
        assert len(calls) == paths, (M, path)
        want = w4a16_reference(x, qweight, qzeros, scales).float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    with pytest.raises(ValueError, match="prefill: 'cublas' is not one of auto, tiled, dequant"):
        w4a16_triton(x, qweight, qzeros, scales, prefill="cublas")


def test_dispatch(monkeypatch):
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    assert not use_triton("cpu") and not use_triton("cuda:0")
    monkeypatch.setenv("CANARY_KERNELS", "auto")
    assert not use_triton("cpu") and use_triton("cuda:0")
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    assert use_triton("cuda:0")
    # forcing Triton onto CPU tensors needs the interpreter: on a CPU-only host this folder's
    # conftest turns it on; on a CUDA host it is off and the dispatcher says how to turn it on
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("cpu")
    monkeypatch.setenv("CANARY_KERNELS", "fast")
    with pytest.raises(ValueError, match="CANARY_KERNELS: 'fast'"):
        use_triton("cpu")


def test_dispatcher_takes_the_forced_path(monkeypatch):
    qweight, qzeros, scales = make(32, 128)
    x = torch.randn(2, 128)
    calls = []
    import engines.kernels.w4a16 as mod

    monkeypatch.setattr(mod, "w4a16_triton", lambda *a, **k: calls.append("triton") or w4a16_reference(*a))
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # forced onto CPU tensors: on a CUDA host it is not set
    w4a16(x, qweight, qzeros, scales)
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    w4a16(x, qweight, qzeros, scales)
    assert calls == ["triton"]


def test_auto_dispatch_follows_this_host(monkeypatch):
    """The default device an engine picks takes the kernels exactly when this host has CUDA."""
    pytest.importorskip("pydantic", reason="engines.spec needs pydantic (absent on the stock GPU image)")
    from engines.device import resolve_device
    from engines.spec import OptimizationSpec

    monkeypatch.setenv("CANARY_KERNELS", "auto")
    device = resolve_device(OptimizationSpec(engine="reference"))
    assert use_triton(device) == torch.cuda.is_available() == (device.type == "cuda")


def test_the_pairwise_dequantization_gives_every_column_its_own_code():
    # on CUDA the decode GEMV makes an AWQ word's codes fp16 two a LOP3 (inline PTX the interpreter
    # cannot run): its PTX text run here gives output j 2^10 + the code of column j (natural order)
    import numpy as np
    from engines.kernels import _w4a16_triton
    from engines.quant import AWQ_ORDER

    from tests.kernels import ptx_emulation

    asm = ptx_emulation.asm_of(_w4a16_triton, "_awq_pairs")
    g = torch.Generator().manual_seed(2)
    for codes in [torch.arange(8), torch.arange(8).flip(0) + 8, torch.full((8,), 15), *torch.randint(0, 16, (20, 8), generator=g)]:
        word = sum(int(codes[AWQ_ORDER[i]]) << 4 * i for i in range(8))  # nibble i holds column AWQ_ORDER[i]
        reg = ptx_emulation.run(asm, {"$8": word})
        got = np.array([reg[f"${j}"] for j in range(8)], np.uint16).view(np.float16)
        assert got.tolist() == (codes + 1024).tolist(), hex(word)

