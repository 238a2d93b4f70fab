"""The grouped split-K scheme every decode-attention kernel shares (engines/kernels/decode.py):
the merge kernel by hand, the chunk count, and the layouts a caller may pass."""

import pytest
import torch
from engines.kernels import decode, fp8_kv


def test_merge_kernel_by_hand(device):
    # one row, two chunks: m = (1, 0) in log2 units, l = (1, 2), accumulators 2 and 4 in every
    # channel: weights 2^(1−1) = 1 and 2^(0−1) = ½, so out = (1·2 + ½·4) / (1·1 + ½·2) = 2;
    # a third, empty chunk (m = −inf) adds nothing
    from engines.kernels._decode_triton import merge_kernel

    D = 16
    m = torch.tensor([[1.0, 0.0, float("-inf")]], device=device)
    l = torch.tensor([[1.0, 2.0, 0.0]], device=device)
    acc = torch.stack([torch.full((D,), 2.0), torch.full((D,), 4.0), torch.zeros(D)])[None].to(device)
    out = torch.empty(1, D, dtype=torch.float16, device=device)
    merge_kernel[(1,)](m, l, acc, m, out, 3, D=D, NCP=4, ROTATE=False)
    assert out.float().cpu().tolist() == [[2.0] * D]
    assert decode.merge_split_k(m, l, acc).cpu().tolist() == [[2.0] * D]
    # ROTATE multiplies by Π: with Π a permutation (channel i → i + 1 mod D) the output moves over
    rot = torch.roll(torch.eye(D), 1, dims=1).to(device)
    acc[0, 0, 3] = 6.0  # channel 3 of the merged output: (6 + ½·4) / 2 = 4
    merge_kernel[(1,)](m, l, acc, rot, out, 3, D=D, NCP=4, ROTATE=True)
    assert out.float().cpu()[0, 4] == 4.0 and out.float().cpu()[0, 3] == 2.0


@pytest.mark.parametrize("S,rows,sms,want", [(32768, 8, 132, 33), (131072, 8, 132, 33), (8192, 8, 132, 33),
                                             (32768, 128, 132, 3), (100, 8, 132, 2), (1000, 2, 4, 4)])
def test_split_k_fills_the_sms_without_tiny_chunks(monkeypatch, S, rows, sms, want):
    # ≈ 2 programs per SM (an H100 or H200 has 132; Llama-3-8B at batch 1 has 8 KV heads → 33 chunks),
    # never more chunks than 64-slot tiles
    class Props:
        multi_processor_count = sms

    monkeypatch.setattr(decode.torch.cuda, "get_device_properties", lambda d: Props)
    decode._sm_count.cache_clear()
    try:
        assert decode.split_k_chunks(S, rows, "cuda", 64) == want
    finally:
        decode._sm_count.cache_clear()


def test_a_slice_of_a_wider_cache_is_read_in_place(device):
    # the engine passes k8[layer, :, :, :S] of a cache S_max wide: same answer as a compact copy
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, S_max, S, D = 2, 4, 2, 80, 48, 32
    k8 = fp8_kv.quantize_reference(torch.randn(B, Hkv, S_max, D, generator=g)).to(device)
    v8 = fp8_kv.quantize_reference(torch.randn(B, Hkv, S_max, D, generator=g)).to(device)
    q = torch.randn(B, H, D, generator=g).to(device)
    lengths = torch.tensor([48, 20], device=device)
    got = fp8_kv.decode_attention(q, k8[:, :, :S], v8[:, :, :S], lengths, block_s=16)
    want = fp8_kv.decode_attention_reference(q, k8[:, :, :S].contiguous(), v8[:, :, :S].contiguous(), lengths)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_half_precision_queries_come_back_in_their_dtype(device):
    # an fp16 model: fp16 products with fp32 accumulation, the output in fp16 and near the fp32 answer
    g = torch.Generator().manual_seed(6)
    B, H, Hkv, S, D = 1, 8, 2, 64, 32
    k8 = fp8_kv.quantize_reference(torch.randn(B, Hkv, S, D, generator=g)).to(device)
    v8 = fp8_kv.quantize_reference(torch.randn(B, Hkv, S, D, generator=g)).to(device)
    q = torch.randn(B, H, D, generator=g).to(device)
    got = fp8_kv.decode_attention(q.half(), k8, v8, torch.tensor([S], device=device), block_s=16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), fp8_kv.decode_attention_reference(q, k8, v8, torch.tensor([S], device=device)),
                               rtol=2e-2, atol=5e-3)


def test_bad_grouping_is_refused():
    q = torch.zeros(1, 6, 32)
    k8 = fp8_kv.quantize_reference(torch.zeros(1, 4, 16, 32))
    with pytest.raises(ValueError, match="6 query heads do not share 4 KV heads"):
        fp8_kv.decode_attention(q, k8, k8, torch.tensor([16]))
