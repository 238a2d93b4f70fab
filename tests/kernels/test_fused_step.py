"""A decode step on the fused operators (model._forward_fused: add+RMSNorm, RoPE with the KV store,
SiLU·mul) gives the logits and the cache the unfused step gives, over the same attention kernels:
each format whose store the RoPE kernel writes (a lossless raw cache, KIVI's raw window) and each
that encodes its own way (TurboQuant, fp8 under the interpreter, fp16 rounding of an fp32 model)."""

import pytest
import torch
from engines.reference.decode import Decoder
from engines.reference.kv import kv_format
from engines.reference.model import ModelArgs, Transformer

pytestmark = pytest.mark.integration  # 12 decodes through the Triton interpreter: about 30 s

ARGS = ModelArgs(model_type="llama", vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 intermediate_size=160, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=512, tie_embeddings=False,
                 attention_bias=False, rope_scaling={"rope_type": "default"})


def tiny_model(dtype):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
    return model.to(dtype).eval().fuse()


def decode(model, kv, dtype, steps=4, prompt=20):
    # the unpadded causal prefill a CUDA decoder takes: a lossy store then keeps no dequantized shadow,
    # so TurboQuant's decode steps take RoPE in its own kernels, as on a GPU
    dec = Decoder(model, kv_format(kv, dtype, dtype), 2, prompt + steps + 1, "cpu", dtype, graphs=False,
                  causal_prefill=True)
    dec.prepare()
    ids = torch.randint(0, ARGS.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = [dec.prefill(ids)]
        for _ in range(steps):
            logits.append(dec.step(logits[-1].argmax(-1)).clone())
    return torch.stack(logits), dec.cache


@pytest.mark.parametrize("dtype,kv", [(torch.float32, "fp32"), (torch.float32, "fp16"), (torch.float32, "kivi-2"),
                                      (torch.float32, "turbo-3"), (torch.float32, "fp8"), (torch.float16, "fp16")])
def test_the_fused_step_gives_the_unfused_steps_logits_and_cache(monkeypatch, dtype, kv):
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    model = tiny_model(dtype)
    calls = []
    real = Transformer._forward_fused
    monkeypatch.setattr(Transformer, "_forward_fused", lambda self, *a: calls.append(1) or real(self, *a))
    import engines.kernels.turbo_kv as turbo_kv

    ropes = []
    real_write = turbo_kv.write_slots
    monkeypatch.setattr(turbo_kv, "write_slots", lambda *a, **k: ropes.append(k.get("rope")) or real_write(*a, **k))
    fused_logits, fused_cache = decode(model, kv, dtype)
    assert len(calls) == 4  # every decode step took it; the prefill did not
    if kv == "turbo-3":  # RoPE in TurboQuant's own kernels: each decode step's writes took cos and sin
        assert sum(r is not None for r in ropes) == 4 * ARGS.n_layers
    monkeypatch.setattr(Transformer, "fused_step", lambda self, h: False)
    plain_logits, plain_cache = decode(model, kv, dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused_logits, plain_logits, rtol=tol, atol=tol)
    assert torch.equal(fused_logits.argmax(-1), plain_logits.argmax(-1))
    for a, b in zip([fused_cache.k, fused_cache.v, *fused_cache.store.buffers()],
                    [plain_cache.k, plain_cache.v, *plain_cache.store.buffers()], strict=True):
        # a value the two steps round differently by a hair may land on the other side of a
        # rounding step of the stored type (fp16, e4m3, a code): at most one in a thousand do
        off = (a != b) if a.dtype == torch.int32 else ~torch.isclose(a.float(), b.float(), rtol=tol, atol=tol)
        assert off.float().mean() < 1e-3


def row_cache_decode(model, steps=3):
    from engines.reference.rows import RowCache

    cache = RowCache(ARGS.n_layers, 2, ARGS.n_kv_heads, ARGS.head_dim, ARGS.max_seq_len, torch.float32,
                     torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        firsts = [cache.prefill(model, row, torch.randint(0, ARGS.vocab_size, (1, n), generator=g), n + steps + 1)
                  for row, n in ((0, 7), (1, 11))]  # rows of two lengths: each token has its own slot
        tokens = torch.cat(firsts).argmax(-1)[:, None]
        out = []
        for _ in range(steps):
            out.append(cache.decode(model, tokens, [0, 1]))
            tokens = out[-1].argmax(-1)[:, None]
    return torch.stack(out)


def test_a_row_cache_step_of_two_rows_takes_the_fused_operators(monkeypatch):
    # engine-serve's rows pass each row's own position as its slot ([B] for one token a row): the RoPE
    # kernel rotates them and leaves the storing to the row cache, which has no rope_destination
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    model = tiny_model(torch.float32)
    calls = []
    real = Transformer._forward_fused
    monkeypatch.setattr(Transformer, "_forward_fused", lambda self, *a: calls.append(1) or real(self, *a))
    fused_logits = row_cache_decode(model)
    assert len(calls) == 3
    monkeypatch.setattr(Transformer, "fused_step", lambda self, h: False)
    torch.testing.assert_close(fused_logits, row_cache_decode(model), rtol=1e-4, atol=1e-4)
