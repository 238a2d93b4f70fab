"""The fused decode-step kernels (engines/kernels/fused.py) give what the unfused model computes:
each against its torch reference, on the interpreter here and on the GPU where there is one."""

import pytest
import torch
from engines.kernels import fused
from engines.kernels.fp8_kv import FP8

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def ulps(dtype):
    return {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [96, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_the_residual_add_then_rmsnorm(device, dtype, dim, with_residual):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 2, dim, generator=g).to(dtype).to(device)
    res = torch.randn(3, 2, dim, generator=g).to(dtype).to(device) if with_residual else None
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(device)
    res_before = None if res is None else res.clone()
    out, h = fused.add_rms_norm(x, res, w, 1e-5)
    want_out, want_h = fused.add_rms_norm_reference(x, res, w, 1e-5)
    assert out.dtype == want_out.dtype and h.shape == x.shape
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # one rounding of the same sum
    torch.testing.assert_close(out, want_out, rtol=ulps(dtype), atol=ulps(dtype))
    if res is not None:
        assert torch.equal(res, res_before)  # the residual stream comes back new; its input is kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_is_swiglu_over_the_fused_gate_up_output(device, dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (3 * torch.randn(2, 1, 2 * 1500, generator=g)).to(dtype).to(device)  # not a multiple of the block
    got = fused.silu_mul(gate_up)
    torch.testing.assert_close(got, fused.silu_mul_reference(gate_up), rtol=ulps(dtype), atol=ulps(dtype))


def rope_inputs(device, dtype, B=2, T=1, H=4, HKV=2, D=64, S=10):
    from engines.reference.model import rope_cos_sin

    g = torch.Generator().manual_seed(B * 10 + T)
    qkv = torch.randn(B, T, H + 2 * HKV, D, generator=g).to(dtype).to(device)
    pos = torch.tensor([[5 + t for t in range(T)], [300 + t for t in range(T)]][:B], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cos, sin = rope_cos_sin(inv.to(device), pos, dtype)
    return qkv, cos, sin


def rope_expected(qkv, cos, sin, H, HKV):
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:]
    t = lambda x: x.transpose(1, 2)  # noqa: E731 — [B, heads, T, D], as the model rotates them
    return t(fused.rope_reference(t(q), cos, sin)), t(fused.rope_reference(t(k), cos, sin)), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 3])
def test_rope_store_rotates_queries_and_keys_as_apply_rope(device, dtype, T):
    H, HKV = 4, 2
    qkv, cos, sin = rope_inputs(device, dtype, T=T, H=H, HKV=HKV)
    want_q, want_k, want_v = rope_expected(qkv.clone(), cos, sin, H, HKV)
    q = fused.rope_store(qkv, cos, sin, H, HKV, torch.arange(T, device=device))
    tol = dict(rtol=ulps(dtype), atol=ulps(dtype))
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(qkv[:, :, H:H + HKV], want_k, **tol)  # keys rotated in place
    assert torch.equal(qkv[:, :, H + HKV:], want_v)  # values untouched


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32, FP8])
def test_rope_store_writes_the_rotated_keys_and_the_values_at_their_slots(device, cache_dtype):
    if cache_dtype is FP8 and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9")
    B, T, H, HKV, D, S = 2, 2, 4, 2, 64, 10
    qkv, cos, sin = rope_inputs(device, torch.float16, B=B, T=T, H=H, HKV=HKV, D=D)
    # away from e4m3's subnormals, which the interpreter flushes where GPUs round them (fp8_kv.py)
    qkv = torch.where(qkv.abs() < 0.05, torch.full_like(qkv, 0.5), qkv)
    if cache_dtype is FP8:
        # values exact in e4m3 (the interpreter rounds e4m3 ties away from zero where GPUs and torch
        # round them to even), and one past e4m3's range, which the store saturates to 448
        qkv[:, :, H + HKV:] = qkv[:, :, H + HKV:].to(FP8).to(qkv.dtype)
        qkv[0, 0, H + HKV, 0] = 1000.0
    _, want_k, want_v = rope_expected(qkv.clone(), cos, sin, H, HKV)
    k_cache = torch.zeros(B, HKV, S, D, dtype=cache_dtype, device=device)
    v_cache = torch.zeros(B, HKV, S, D, dtype=cache_dtype, device=device)
    slots = torch.tensor([7, 3], device=device)
    fused.rope_store(qkv, cos, sin, H, HKV, slots, (k_cache, v_cache))

    def stored(x):  # as the unfused store holds x: the cast (fp8: saturated first)
        return (x.float().clamp(-448, 448) if cache_dtype is FP8 else x).to(cache_dtype).float()

    for t, slot in enumerate(slots.tolist()):
        if cache_dtype is FP8 and device == "cpu":
            continue  # the interpreter's e4m3 cast drops a rounding carry (0.487 → 0.25): keys on the GPU only
        # a rotated key may fall on an e4m3 tie: one e4m3 step (1/8 relative) apart there
        tol = 0.125 if cache_dtype is FP8 else 1e-3
        torch.testing.assert_close(k_cache[:, :, slot].float(), stored(want_k[:, t]), rtol=tol, atol=1e-3)
        assert torch.equal(v_cache[:, :, slot].float(), stored(want_v[:, t]))
    if cache_dtype is FP8:
        assert v_cache[0, 0, 7, 0].float() == 448.0  # saturated, not NaN
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert not k_cache[:, :, untouched].float().any() and not v_cache[:, :, untouched].float().any()


def test_rope_store_names_a_wrong_layout(device):
    qkv, cos, sin = rope_inputs(device, torch.float16)
    with pytest.raises(ValueError, match="qkv"):
        fused.rope_store(qkv, cos, sin, 3, 2, torch.arange(1, device=device))  # 3 + 2·2 ≠ 8 heads
    with pytest.raises(ValueError, match="caches"):
        bad = torch.zeros(2, 2, 10, 32, dtype=torch.float16, device=device)  # head_dim 32, not 64
        fused.rope_store(qkv, cos, sin, 4, 2, torch.arange(1, device=device), (bad, bad))


def test_rope_store_writes_nothing_past_the_caches_slots(device):
    qkv, cos, sin = rope_inputs(device, torch.float16)
    big = torch.zeros(2, 3, 10, 64, dtype=torch.float16, device=device)  # 3 heads: head 2 follows head 1's slots
    fused.rope_store(qkv, cos, sin, 4, 2, torch.tensor([10], device=device), (big[:, :2], big[:, :2]))
    assert not big.any()  # slot 10 of a 10-slot cache would have landed on the next head's slot 0
