"""KIVI decode steps that a CUDA graph can capture: decode.Decoder calls before_step, which writes
the codes of the slots leaving the full-precision window on the host's schedule (a whole key
group every R steps, a value every step), so the step itself reads nothing from the host. Here on
the Triton interpreter (the kernel path) against the torch path, on a small random model whose
decode crosses a key flush (on the GPU when there is one)."""

import pytest
import torch
from engines.reference.decode import Decoder
from engines.reference.kv import kv_format
from engines.reference.model import ModelArgs, Transformer, rope_inv_freq
from torch.utils._python_dispatch import TorchDispatchMode

P, STEPS = 120, 12  # slots 120…131: the first key flush (slots 0…127) comes at slot 128


def small_model(device="cpu") -> Transformer:
    a = ModelArgs(model_type="llama", vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                  intermediate_size=96, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=False,
                  attention_bias=False, rope_scaling={"rope_type": "default"})
    torch.manual_seed(0)
    model = Transformer(a)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.fuse()
    model.inv_freq = rope_inv_freq(a)
    return model.to(device).eval()


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (a sync on a GPU; refused in a capture)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                    torch.ops.aten.is_nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def decode(monkeypatch, mode: str, device: str):
    monkeypatch.setenv("CANARY_KERNELS", mode)
    model = small_model(device)
    d = Decoder(model, kv_format("kivi-2", torch.float32), 1, P + STEPS, device, torch.float32, graphs=False)
    ids = torch.randint(0, 64, (1, P), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        logits = d.prefill(ids)
        out, reads = [], []
        store, attend = d.cache.store, d.cache.store.attend

        def watched(*args, **kw):  # the store's part of a step, which a capture records (the
            with HostReads() as rec:  # CPU-only RoPE table reads the host; CUDA does not use it)
                result = attend(*args, **kw)
            reads.extend(rec.reads)
            return result

        store.attend = watched
        for _ in range(STEPS):
            out.append(logits.clone())
            logits = d.step(logits.argmax(-1))
    return d, torch.stack(out), reads


@pytest.mark.integration  # slow for the quick tier's budget: the whole suite runs it
def test_kivi_kernel_steps_read_nothing_from_the_host_and_match_the_torch_path(monkeypatch, device):
    d, kernel_logits, reads = decode(monkeypatch, "triton", device)
    assert reads == []
    assert d.cache.store.packed_k == [128, 128]  # the key flush ran in before_step, every layer
    assert d.cache.store.graph_blocker(False) is None  # capturable where its kernels run
    assert d.cache.store.graph_blocker(True) is not None  # left padding: the torch path re-encodes
    _, torch_logits, _ = decode(monkeypatch, "torch", device)
    torch.testing.assert_close(kernel_logits, torch_logits, rtol=2e-3, atol=2e-3)


def test_the_torch_path_still_says_why_it_cannot_be_captured(monkeypatch):
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    d = Decoder(small_model(), kv_format("kivi-2", torch.float32), 1, 8, "cpu", torch.float32)
    assert "re-encoded on the host's schedule" in d.cache.store.graph_blocker(False)


@pytest.mark.parametrize("slot,keys,values", [(127, 0, 0), (128, 128, 0), (129, 128, 1), (300, 256, 172)])
def test_before_step_writes_the_boundaries_kivi_reads_at_that_length(monkeypatch, device, slot, keys, values):
    # keys compressed below R⌊t/R⌋, values below t − R, for the query at slot t (R = 128)
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    fmt = kv_format("kivi-2", torch.float32)
    n = torch.tensor([slot + 1])
    assert (int(fmt.boundary_k(n)), int(fmt.boundary_v(n))) == (keys, values)
    from engines.reference.cache import KVCache

    cache = KVCache(1, 1, 320, 2, 32, torch.float32, torch.device(device), fmt)
    cache.store.before_step(slot)
    assert (cache.store.packed_k[0], cache.store.packed_v[0]) == (keys, values)


@pytest.mark.integration  # tens of seconds on the Triton interpreter: the full tier (tests/conftest.py)
def test_a_one_token_prefill_chunk_codes_what_it_reads(monkeypatch, device):
    # a chunked prefill one query at a time (each chunk reads like a decode step) past the first
    # key group: outside a decode step nothing is prepared, so the store codes inline. The chunked
    # pass is asked for by name: on CUDA a KIVI prefill defaults to the windowed causal pass,
    # which codes nothing until the first decode step's before_step (h200-run10 caught this)
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    ids = torch.randint(0, 64, (1, 136), generator=torch.Generator().manual_seed(2)).to(device)
    logits = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv("CANARY_KERNELS", mode)
        d = Decoder(small_model(device), kv_format("kivi-2", torch.float32), 1, 140, device, torch.float32,
                    graphs=False, prefill_chunk=1, causal_prefill=False)
        with torch.inference_mode():
            logits[mode] = d.prefill(ids)
        if mode == "triton":
            assert d.cache.store.packed_k == [128, 128]
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=2e-3, atol=2e-3)


@pytest.mark.integration  # tens of seconds on the Triton interpreter: the full tier (tests/conftest.py)
def test_a_second_prefill_starts_the_codes_afresh(monkeypatch, device):
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    d = Decoder(small_model(device), kv_format("kivi-2", torch.float32), 1, P + STEPS, device, torch.float32,
                graphs=False)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(2):  # two sequences through one decoder: the second's codes are its own
            ids = torch.randint(0, 64, (1, P), generator=gen).to(device)
            logits = d.prefill(ids)
            for _ in range(STEPS):
                logits = d.step(logits.argmax(-1))
            assert d.cache.store.packed_k == [128, 128]
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    fresh = Decoder(small_model(device), kv_format("kivi-2", torch.float32), 1, P + STEPS, device, torch.float32,
                    graphs=False)
    with torch.inference_mode():
        want = fresh.prefill(ids)
        for _ in range(STEPS):
            want = fresh.step(want.argmax(-1))
    torch.testing.assert_close(logits, want, rtol=2e-3, atol=2e-3)
