"""TurboQuant KV kernels against their torch references (interpreter on CPU, GPU when present).
Codes must match exactly (ties aside) and norms to 1e-5; attention outputs to 1e-4 (fp32)."""

import pytest
import torch
from engines.kernels import _turbo_kv_triton
from engines.kernels.turbo_kv import (
    codebook_polynomial,
    decode_attention,
    decode_attention_reference,
    dequantize_rotated,
    field_bits,
    lookup_bytes,
    pack_codes,
    quantize_on_write,
    quantize_reference,
    unpack_codes,
    write_slots,
)
from engines.quant import turbo_mse_rotated

from tests.kernels import ptx_emulation


def test_code_packing_by_hand():
    # channel j holds code j % 8 at 3 bits, a nibble each: word w holds channels 8w … 8w + 7, the
    # first lowest, so every word reads 0x76543210
    idx = (torch.arange(32) % 8)[None]
    codes = pack_codes(idx, 3)
    assert codes.shape == (1, 4) and codes[0].tolist() == [0x76543210] * 4
    assert torch.equal(unpack_codes(codes, 3), idx)
    # 2 bits: 2-bit fields, 16 to a word; channel j holds j % 4, so a word reads 0b11100100 repeated
    idx = (torch.arange(32) % 4)[None]
    assert pack_codes(idx, 2)[0].tolist() == [int("11100100" * 4, 2) - 2**32] * 2
    assert torch.equal(unpack_codes(pack_codes(idx, 2), 2), idx)
    # 4 bits: code 15 in the top nibble sets the sign bit of the int32 word
    idx = torch.tensor([[15, 0, 0, 0, 0, 0, 0, 15]])
    assert pack_codes(idx, 4)[0].tolist() == [0xF000000F - 2**32]
    assert torch.equal(unpack_codes(pack_codes(idx, 4), 4), idx)
    assert [field_bits(b) for b in (2, 3, 4)] == [2, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_byte_permute_lookup_gives_each_channel_its_own_codebook_value(dtype):
    # on a GPU the 3-bit decode reads codebook values by PRMT (inline PTX the interpreter cannot run):
    # its PTX text run here on every code in every position of a word gives the codebook in dtype
    from engines.quant import codebook_on

    book = codebook_on(128, 3, "cpu").to(dtype)
    want = book.view(torch.int16).to(torch.int64) & 0xFFFF
    la, lb, ha, hb = lookup_bytes(128, 3, dtype)
    asm = ptx_emulation.asm_of(_turbo_kv_triton, "_lookup8")
    g = torch.Generator().manual_seed(0)
    words = [0x76543210, 0x01234567, 0] + [int(w) for w in torch.randint(0, 2**31, (20,), generator=g)]
    for word in words:
        idx = [(word >> 4 * j) & 7 for j in range(8)]
        word = sum(i << 4 * j for j, i in enumerate(idx))  # codes < 8: every nibble's top bit clear
        reg = ptx_emulation.run(asm, {"$8": word, "$9": la, "$10": lb, "$11": ha, "$12": hb})
        assert [reg[f"${i}"] for i in range(8)] == [int(want[i]) for i in idx], hex(word)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("D", [32, 64])
def test_quantize_on_write_matches_reference(device, bits, D):
    x = torch.randn(19, D, generator=torch.Generator().manual_seed(bits)).to(device)
    codes, norms = quantize_on_write(x, bits)
    ref_codes, ref_norms = quantize_reference(x, bits)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-5)
    agree = (unpack_codes(codes.cpu(), bits) == unpack_codes(ref_codes.cpu(), bits)).float().mean()
    assert agree > 0.999  # a coordinate exactly between two centroids may round either way
    # and the layout decodes to what the CPU engine's cache holds
    torch.testing.assert_close(dequantize_rotated(ref_codes, ref_norms, bits), turbo_mse_rotated(x, bits, 0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3])
def test_write_slots_fills_codes_norms_and_values_at_the_slots_only(device, bits):
    # new keys and values as the model hands them (transposed views: [B, Hkv, T, D] with T not
    # innermost, each its own strides) written in one launch at slots 5 and 2 of a 9-slot cache:
    # those slots hold the reference's codes, norms and rotated-domain values c[idx]·‖x‖ (in the
    # cache's fp16), keys at index 0 and values at index 1; every other slot keeps its sentinel
    g = torch.Generator().manual_seed(bits)
    B, Hkv, T, S, D = 2, 3, 2, 9, 64
    k = torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2).to(device)
    v = torch.randn(T, B, Hkv, D, generator=g).permute(1, 2, 0, 3).to(device)
    slots = torch.tensor([5, 2], device=device)
    codes = torch.full((2, B, Hkv, S, D * field_bits(bits) // 32), 7, dtype=torch.int32, device=device)
    norms = torch.full((2, B, Hkv, S), -1.0, device=device)
    values = [torch.full((B, Hkv, S, D), -3.0, dtype=torch.float16, device=device) for _ in range(2)]
    write_slots([k, v], slots, codes, norms, values, bits)
    untouched = [s for s in range(S) if s not in (5, 2)]
    assert codes.cpu()[:, :, :, [5, 2]].ne(7).any()  # written at all
    for i, x in enumerate((k, v)):
        ref_codes, ref_norms = quantize_reference(x.cpu(), bits)
        got_codes = codes[i].cpu()[:, :, [5, 2]]
        differ = (unpack_codes(got_codes, bits) != unpack_codes(ref_codes, bits)).sum()
        assert differ <= 2  # of 768: a coordinate (almost) between two centroids may round either way
        torch.testing.assert_close(norms[i].cpu()[:, :, [5, 2]], ref_norms, rtol=1e-5, atol=1e-5)
        want = turbo_mse_rotated(x.cpu(), bits, 0).half()
        far = (values[i].cpu()[:, :, [5, 2]].float() - want.float()).abs() > 1e-3 * want.float().abs() + 1e-3
        assert far.sum() <= 2  # those coordinates' codes only
        assert (codes[i].cpu()[:, :, untouched] == 7).all() and (norms[i].cpu()[:, :, untouched] == -1).all()
        assert (values[i].cpu()[:, :, untouched] == -3).all()


@pytest.mark.parametrize("bits", [2, 3])
# a 16-bit query takes the byte-permute lookup on CUDA at 3 bits (the polynomial here); bf16 is
# checked on CUDA only (the Triton interpreter computes bf16 wrongly)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_decode_attention_matches_reference(device, bits, dtype):
    g = torch.Generator().manual_seed(7)
    B, H, Hkv, S, D = 2, 4, 2, 70, 32
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    kc, kn = quantize_reference(k, bits)
    vc, vn = quantize_reference(v, bits)
    q = torch.randn(B, H, D, generator=g)
    lengths = torch.tensor([70, 33])  # the second sequence is shorter: its tail slots are ignored
    args = [t.to(device) for t in (q, kc, kn, vc, vn, lengths)]
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the Triton interpreter computes bf16 wrongly")
    got = decode_attention(args[0].to(dtype), *args[1:], bits=bits, chunks=2, block_s=16)
    want = decode_attention_reference(*args, bits=bits)  # fp32
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_default_split_matches_reference(device):
    """The launcher's own split (decode.split_k_chunks) with a length far below the cache's width, as
    in a CUDA-graph decode step over the whole static cache."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, S, D = 1, 4, 2, 200, 32
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    (kc, kn), (vc, vn) = quantize_reference(k, 3), quantize_reference(v, 3)
    args = [t.to(device) for t in (torch.randn(B, H, D, generator=g), kc, kn, vc, vn, torch.tensor([37]))]
    torch.testing.assert_close(decode_attention(*args, bits=3), decode_attention_reference(*args, bits=3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,tol", [(1, 0.0), (2, 0.0), (3, 0.0), (4, 1e-7)])
def test_codebook_polynomial_gives_the_codebook(bits, tol):
    # the kernel's arithmetic lookup, in fp32 as the kernel runs it: x·(a₁ + x²·(a₃ + …))
    from engines.quant import codebook_on

    a = codebook_polynomial(128, bits, "cpu")
    x = torch.arange(2**bits, dtype=torch.float32) - (2**bits - 1) / 2
    acc = torch.full_like(x, a[-1].item())
    for coef in a.flip(0)[1:]:
        acc = acc * x * x + coef
    assert (x * acc - codebook_on(128, bits, "cpu")).abs().max().item() <= tol


def test_write_slots_refuses_buffers_that_do_not_fit(device):
    x = torch.randn(1, 2, 3, 32).to(device)
    codes = torch.zeros(1, 1, 2, 8, 4, dtype=torch.int32, device=device)
    norms = torch.zeros(1, 1, 2, 8, device=device)
    with pytest.raises(ValueError, match="slots"):
        write_slots([x], torch.tensor([0, 1], device=device), codes, norms, None, 3)
    with pytest.raises(ValueError, match="int32 codes"):
        write_slots([x], torch.tensor([0, 1, 2], device=device), codes[..., :3], norms, None, 3)
    with pytest.raises(ValueError, match="dequantized"):
        write_slots([x], torch.tensor([0, 1, 2], device=device), codes, norms, [torch.zeros(1, 2, 9, 32, device=device)], 3)


def rope_of(B, T, D, dtype, device):
    from engines.reference.model import rope_cos_sin

    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    pos = torch.tensor([[40 + t for t in range(T)], [7 + t for t in range(T)]][:B])
    return tuple(x.to(device) for x in rope_cos_sin(inv, pos, dtype))  # [B, 1, T, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [32, 64])  # at 32 one 32-channel chunk holds both halves RoPE pairs
def test_write_slots_with_rope_stores_what_the_keys_after_rope_would(device, dtype, D):
    # the fused decode step hands the write kernel its keys before RoPE (a view of the fused q/k/v
    # output): the codes and norms are those of the keys rotated first, as model.apply_rope rotates them
    from engines.kernels.fused import rope_reference

    g = torch.Generator().manual_seed(11)
    B, Hkv, T, S, bits = 2, 3, 1, 9, 3
    qkv = torch.randn(B, T, 4 + 2 * Hkv, D, generator=g).to(dtype).to(device)
    k, v = qkv[:, :, 4:4 + Hkv].transpose(1, 2), qkv[:, :, 4 + Hkv:].transpose(1, 2)
    cos, sin = rope_of(B, T, D, dtype, device)
    slots = torch.tensor([6], device=device)
    W = D * field_bits(bits) // 32
    fused_codes, plain_codes = (torch.zeros(2, B, Hkv, S, W, dtype=torch.int32, device=device) for _ in range(2))
    fused_norms, plain_norms = (torch.zeros(2, B, Hkv, S, device=device) for _ in range(2))
    write_slots([k, v], slots, fused_codes, fused_norms, None, bits, rope=(cos, sin))
    write_slots([rope_reference(k, cos, sin), v], slots, plain_codes, plain_norms, None, bits)
    assert fused_codes[:, :, :, 6].ne(0).any()
    assert torch.equal(fused_codes, plain_codes)  # the same rounded keys, the same codes
    torch.testing.assert_close(fused_norms, plain_norms, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused_codes[1], plain_codes[1])  # values are not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_with_rope_reads_a_strided_query_and_rotates_it_first(device, dtype):
    from engines.kernels.fused import rope_reference

    g = torch.Generator().manual_seed(12)
    B, H, Hkv, S, D, bits = 2, 4, 2, 40, 32, 3
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    (kc, kn), (vc, vn) = quantize_reference(k, bits), quantize_reference(v, bits)
    qkv = torch.randn(B, 1, H + 2 * Hkv, D, generator=g).to(dtype).to(device)
    q = qkv[:, :, :H].transpose(1, 2)[:, :, 0]  # [B, H, D], batch stride (H + 2·Hkv)·D: not contiguous
    assert not q.is_contiguous()
    cos, sin = rope_of(B, 1, D, dtype, device)
    caches = [t.to(device) for t in (kc, kn, vc, vn, torch.tensor([40, 23]))]
    got = decode_attention(q, *caches, bits=bits, chunks=2, block_s=16, rope=(cos, sin))
    rotated = rope_reference(q[:, :, None], cos, sin)[:, :, 0]  # [B, H, D]
    want = decode_attention(rotated.contiguous(), *caches, bits=bits, chunks=2, block_s=16)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
