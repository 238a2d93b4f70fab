"""Known-answer tests for every KV-cache quantizer, on small tensors worked out by hand."""

import math

import pytest
import torch
from engines.quant import lloyd_max_gaussian, minmax_quant, qjl_residual, random_rotation, turbo_mse
from engines.reference.kv import Fp8KV, IntPerTokenKV, KiviKV, TurboKV, kv_format


def test_lloyd_max_codebooks_match_the_paper():
    # b = 1: ±√(2/π); b = 2: ±0.453, ±1.51 (for N(0, 1); TurboQuant scales them by 1/√d)
    assert lloyd_max_gaussian(1) == pytest.approx((-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)), abs=1e-9)
    assert lloyd_max_gaussian(2) == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-4)
    assert len(lloyd_max_gaussian(3)) == 8 and lloyd_max_gaussian(3)[4] > 0


def test_sphere_codebook_is_lloyd_max_for_the_exact_coordinate_law():
    from engines.quant import lloyd_max_sphere

    # b = 1 on the exact law (1 − x²)^((d−3)/2): the centroid is E|x| = Γ(d/2) / (√π Γ((d+1)/2))
    d = 32
    exact = math.gamma(d / 2) / (math.sqrt(math.pi) * math.gamma((d + 1) / 2))
    assert lloyd_max_sphere(d, 1)[1] == pytest.approx(exact, rel=1e-3)
    assert lloyd_max_sphere(d, 1)[0] == pytest.approx(-exact, rel=1e-3)
    # large d tends to the Gaussian codebook / √d (TurboQuant's ±√(2/π)/√d, ±0.453/√d, ±1.51/√d)
    big = 1024
    assert [c * math.sqrt(big) for c in lloyd_max_sphere(big, 2)] == pytest.approx(lloyd_max_gaussian(2), rel=1e-2)


def test_turbo_mse_distortion_matches_the_paper():
    # Unit vectors in d = 128: MSE ≈ 0.36, 0.117, 0.03, 0.009 for b = 1…4 (TurboQuant Thm. 1)
    x = torch.randn(2000, 128, generator=torch.Generator().manual_seed(0))
    x = x / x.norm(dim=-1, keepdim=True)
    mse = [((turbo_mse(x, b, 0) - x) ** 2).sum(-1).mean().item() for b in (1, 2, 3, 4)]
    assert mse == pytest.approx([0.36, 0.117, 0.034, 0.0093], rel=0.08)


def test_turbo_one_bit_by_hand():
    # d = 4, one bit: the exact-law centroid is E|x| = Γ(2) / (√π Γ(2.5)) = 4 / (3π) = 0.42441.
    # x rotated = (3, −4, 0.5, −0.5), ‖x‖ = 5.0498 → signs (+, −, +, −) → x̂ = 5.0498 · 0.42441 · signs
    rot = random_rotation(4, 0)
    xr = torch.tensor([[3.0, -4.0, 0.5, -0.5]])
    c = 4 / (3 * math.pi) * xr.norm().item()
    got = turbo_mse(xr @ rot, 1, 0) @ rot.T  # back in the rotated frame
    assert got == pytest.approx(torch.tensor([[c, -c, c, -c]]), abs=2e-3)


def test_rotation_is_orthogonal():
    r = random_rotation(32, 7)
    assert torch.allclose(r @ r.T, torch.eye(32), atol=1e-5)


def test_qjl_residual_is_unbiased_for_inner_products():
    g = torch.Generator().manual_seed(1)
    q, r = torch.randn(64, generator=g), torch.randn(64, generator=g)
    est = torch.stack([q @ qjl_residual(r[None], seed)[0] for seed in range(400)])
    se = est.std() / 20
    assert abs(est.mean() - q @ r) < 4 * se  # unbiased: the mean of 400 sketches sits on ⟨q, r⟩


def test_minmax_by_hand():
    # one slice [0, 1, 2, 3.3] at 2 bits: scale 1.1, levels 0, 1.1, 2.2, 3.3 → 0, 1.1, 2.2, 3.3
    x = torch.tensor([[0.0, 1.0, 2.0, 3.3]])
    assert minmax_quant(x, 2, -1) == pytest.approx(torch.tensor([[0.0, 1.1, 2.2, 3.3]]), abs=1e-6)


def test_fp8_by_hand():
    # e4m3 near 0.3: neighbours 0.28125 and 0.3125 → 0.3125; 448 is the largest finite value
    k = torch.tensor([[[[0.3, 1000.0]]]])
    kq, _ = Fp8KV().encode(k, k, torch.zeros(1, dtype=torch.long))
    assert kq.flatten().tolist() == [0.3125, 448.0]


def test_int8_per_token_error_bound():
    k = torch.randn(1, 2, 5, 32)
    kq, _ = IntPerTokenKV(8).encode(k, k, torch.zeros(1, dtype=torch.long))
    step = (k.amax(-1, keepdim=True) - k.amin(-1, keepdim=True)) / 255
    assert ((kq - k).abs() <= step / 2 + 1e-6).all()


def test_kivi_windows_by_hand():
    f = KiviKV(bits=2, group=4, residual=8)
    # keys wait in a residual of up to 8 and are flushed 8 at a time: floor((n − 1) / 8) · 8
    assert f.boundary_k(torch.tensor([5, 8, 9, 16, 17])).tolist() == [0, 0, 8, 8, 16]
    # values leave an 8-token window one at a time: max(0, n − 1 − 8)
    assert f.boundary_v(torch.tensor([5, 9, 10, 17])).tolist() == [0, 0, 1, 8]


def test_kivi_keys_per_channel_values_per_token_by_hand():
    f = KiviKV(bits=2, group=4, residual=8)
    # k[t, c] = t · 10^c over 4 tokens: each channel holds 4 evenly spaced levels, so per-channel
    # 2-bit groups are exact — per-token groups would not be (token 1 = [1, 10, 100, 1000]).
    t = torch.arange(4.0)[:, None]
    k = (t * 10.0 ** torch.arange(4.0)[None, :])[None, None]  # [1, 1, 4 tokens, 4 channels]
    v = torch.zeros(1, 1, 4, 4)
    v[0, 0, 1] = torch.tensor([0.0, 1.0, 2.0, 30.0])  # one token: its 4 channels form one group
    kq, vq = f.encode(k, v, torch.zeros(1, dtype=torch.long))
    assert torch.allclose(kq, k)
    # per-token value group at 2 bits: scale 10 → 0, 1, 2, 30 become 0, 0, 0, 30
    assert vq[0, 0, 1].tolist() == pytest.approx([0.0, 0.0, 0.0, 30.0])
    # a left-padded row groups from its own first token
    k2 = torch.randn(1, 1, 9, 4)
    kq2, _ = f.encode(k2, k2, torch.tensor([1]))
    assert torch.equal(kq2[0, 0, 0], k2[0, 0, 0])  # the pad slot is not part of any group


def test_fractional_turbo_outliers_are_fixed_per_layer_and_order_free():
    from engines.reference.model import load_model
    from engines.zoo import resolve_model_path

    model = load_model(resolve_model_path("builtin:pydoc-target"))
    f = TurboKV(2.5)
    f.calibrate(model)
    assert len(f.outliers) == 2 * model.args.n_layers
    idx = f.outliers[(0, "k")]  # [Hkv, D/4], RoPE pairs (i, i + D/2) kept together
    assert idx.shape == (2, 8) and set((idx[0] % 16).tolist()) == set((idx[0] % 16).tolist()[:4])
    a, b = torch.randn(1, 2, 6, 32), torch.randn(1, 2, 6, 32)
    z = torch.zeros(1, dtype=torch.long)
    first = f.encode(a, a, z, layer=3)[0]
    f.encode(b, b, z, layer=3)
    assert torch.equal(f.encode(a, a, z, layer=3)[0], first)  # another request in between changes nothing


@pytest.mark.parametrize(
    "name,head_dim,bits",
    [("fp16", 32, (16, 16)), ("fp8", 32, (8, 8)), ("int8", 32, (9, 9)), ("int2", 32, (3, 3)), ("kivi-4", 32, (5, 5)),
     ("kivi-2", 128, (3, 3)), ("turbo-3", 128, (3.125, 3.125)), ("turbo-2.5", 128, (2.5, 2.5)),
     ("turbo-3.5", 128, (3.5, 3.5)), ("turbo-2.5", 32, (3.25, 3.25)), ("turbo-ip-3", 128, (3.25, 3.125))],
)
def test_exact_bits_per_element(name, head_dim, bits):
    # e.g. int8 per token, d = 32: 8 + (16-bit scale + 16-bit zero)/32 = 9;
    # turbo-2.5, d = 128: 32·3 + 96·2 = 288 code bits + 2 norms · 16 = 320 bits / 128 = 2.5
    assert kv_format(name, torch.float32).bits_per_element(head_dim) == pytest.approx(bits)


def test_unknown_format():
    with pytest.raises(ValueError, match="kv_cache: 'zip-1'"):
        kv_format("zip-1", torch.float32)
    assert TurboKV(2.5).fractional


def test_rotated_domain_attention_equals_attention_over_reconstructions():
    # ⟨q, Πᵀĉ‖k‖⟩ = ⟨Πq, ĉ‖k‖⟩ and Σ p·Πᵀĉ‖v‖ = Πᵀ Σ p·ĉ‖v‖: same output, no per-slot rotation.
    import torch.nn.functional as F
    from engines.reference.attention import rotated_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 32, generator=g), torch.randn(1, 2, 9, 32, generator=g), torch.randn(1, 2, 9, 32, generator=g)
    mask = torch.ones(1, 1, 5, 9, dtype=torch.bool)
    fmt = TurboKV(3)
    assert fmt.rotated and not TurboKV(2.5).rotated and not TurboKV(3, inner_product=True).rotated
    expected = F.scaled_dot_product_attention(q, turbo_mse(k, 3, 0), turbo_mse(v, 3, 0), attn_mask=mask, enable_gqa=True)
    kr, vr = fmt.encode(k, v, torch.zeros(1, dtype=torch.long))  # stored: rotated codes × norms
    assert torch.allclose(rotated_attention(q, kr, vr, fmt.rotation(32, "cpu"), mask), expected, atol=1e-5)
