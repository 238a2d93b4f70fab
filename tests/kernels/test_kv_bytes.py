"""What a KV cache holds where the kernels run, sized on the meta device (nothing is allocated): a
compressed format stores its codes and nothing else, so its bytes are the format's bits, not two
fp16 copies beside them. The shapes are Llama-3-8B's (32 layers, 8 KV heads, head_dim 128) at
batch 16 × 32K, the shape where compression pays off most; each figure is worked out by hand."""

import pytest
import torch
from engines.reference.cache import KVCache
from engines.reference.kv import kv_format

L, B, HKV, S, D = 32, 16, 8, 32768, 128
SLOTS = L * B * HKV * S  # (layer, row, head, slot) vectors in each of keys and values
FP16 = 2 * SLOTS * D * 2  # keys and values, 2 bytes per element: 68.7 GB


@pytest.fixture
def kernel_path(monkeypatch):
    """The stores a CUDA cache makes (CANARY_KERNELS=triton: the kernel path on any device)."""
    monkeypatch.setenv("CANARY_KERNELS", "triton")


def cache(kv: str, batch: int = B, slots: int = S) -> KVCache:
    return KVCache(L, batch, slots, HKV, D, torch.float16, torch.device("meta"), kv_format(kv, torch.float16))


def test_fp16_is_one_raw_copy(kernel_path):
    c = cache("fp16")
    assert c.keeps_raw and c.nbytes() == FP16 == 68_719_476_736


def test_turbo3_holds_its_codes_and_norms_only(kernel_path):
    c = cache("turbo-3")
    # per vector: a nibble per channel, D/8 = 16 int32 words (64 B; 3-bit codes in 4 bits, so the GPU
    # decodes them by byte permutes) + one fp32 norm (4 B) = 68 B, against fp16's 256 B
    assert not c.keeps_raw and c.store.buffers() == [c.store.codes, c.store.norms]
    assert c.nbytes() == 2 * SLOTS * ((D // 8) * 4 + 4) == 18_253_611_008
    assert c.nbytes() / FP16 == pytest.approx(68 / 256)
    assert c.nbytes() <= 0.35 * FP16  # the bound


def test_fp8_holds_its_codes_only(kernel_path):
    c = cache("fp8")
    assert not c.keeps_raw and c.nbytes() == FP16 // 2


def test_kivi2_keeps_the_raw_window_source_and_its_codes_no_dequantized_copy(kernel_path):
    c = cache("kivi-2")
    # raw fp16 (the window is read from it, groups coded from it) + 2-bit codes (D·2/32 int32 words
    # per vector) + fp32 scale and zero: keys per (32-token group, channel), values per (slot, 32-channel group)
    codes = 2 * SLOTS * (D * 2 // 32) * 4
    key_meta = 2 * L * B * HKV * (S // 32) * D * 4
    value_meta = 2 * SLOTS * (D // 32) * 4
    assert c.keeps_raw and c.nbytes() == FP16 + codes + key_meta + value_meta
    assert c.nbytes() / FP16 == pytest.approx(1.25)


def test_torch_path_lossy_formats_hold_one_dequantized_copy(monkeypatch):
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    for kv in ("int4", "turbo-3", "turbo-2.5", "fp8"):
        c = cache(kv, batch=1, slots=1024)
        assert not c.keeps_raw and c.nbytes() == FP16 // (B * 32), kv  # one [L, 1, Hkv, 1024, D] fp16 pair


def test_capacity_at_32k_in_a_fixed_budget(kernel_path):
    # sequences of 32K that fit 100 GB beside the 8B model's ~15 GB of fp16 weights: fp16 19, turbo-3 74
    # (84.99 GB over 4.295 GB and over 1.141 GB a sequence)
    budget, weights = 100 * 10**9, 15_010_000_000
    seqs = {kv: (budget - weights) // cache(kv, batch=1).nbytes() for kv in ("fp16", "fp8", "turbo-3")}
    assert seqs == {"fp16": 19, "fp8": 39, "turbo-3": 74}
    assert seqs["turbo-3"] >= 3.5 * seqs["fp16"]


@pytest.mark.parametrize("kv", ["turbo-3", "fp8"])
def test_a_pass_that_rereads_the_cache_makes_the_shadow_once_and_writes_keep_it(kernel_path, kv):
    # on the Triton interpreter here (tests/kernels/conftest.py), on the GPU there: codes only until a
    # masked pass (left-padded decode, speculative verify, masked prefill chunk) reads the whole cache;
    # then the dequantized shadow is made from the codes once, and later writes fill both
    from engines.reference.attention import Causal

    g = torch.Generator().manual_seed(0)
    c = KVCache(1, 2, 32, 2, 32, torch.float32, torch.device("cpu"), kv_format(kv, torch.float32))
    codes_only = c.nbytes()
    k, v = torch.randn(2, 2, 8, 32, generator=g), torch.randn(2, 2, 8, 32, generator=g)
    q = torch.randn(2, 4, 8, 32, generator=g)
    c.attend(0, q, k, v, torch.arange(8), Causal(8))  # an unpadded first pass keeps nothing
    assert not c.store.has_shadow and c.nbytes() == codes_only
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    c.seq_start = torch.tensor([0, 1])  # a left-padded step: the torch path over the whole cache
    k1, v1 = torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
    c.attend(0, q[:, :, :1], k1, v1, torch.tensor([8]), mask)
    assert c.store.has_shadow and c.nbytes() == codes_only + 2 * 1 * 2 * 2 * 32 * 32 * 4  # + one fp32 [L,B,Hkv,S,D] pair
    kq, vq = c.store.dequantized(0, 9)
    assert torch.equal(c.store.kq[0, :, :, :9], kq) and torch.equal(c.store.vq[0, :, :, :9], vq)
    c.write(0, k1 * 2, v1 * 2, torch.tensor([9]))  # a later write fills the shadow beside the codes
    kq, vq = c.store.dequantized(0, 10)
    assert torch.equal(c.store.kq[0, :, :, 9], kq[:, :, 9]) and torch.equal(c.store.vq[0, :, :, 9], vq[:, :, 9])
