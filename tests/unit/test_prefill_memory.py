"""Long-context prefill holds O(chunk × S), never O(P²): a 32K prefill of an 8B-shaped layer (32
query heads over 8 KV heads, head_dim 128) runs on `meta` tensors while a TorchDispatchMode
records every tensor an op allocates, and the largest stays under 4 GiB for every KV format
(KIVI's unchunked prefill held 64 GiB of fp16 scores, then 128 GiB in fp32: an OOM on any card).
On small real CPU shapes the chunked prefill gives the logits and tokens of a single pass."""

import pytest
import torch
import torch.nn.functional as F
from engines.reference import attention
from engines.reference.attention import query_chunk, two_tier_attention, windowed_causal_attention
from engines.reference.decode import Decoder
from engines.reference.kv import kv_format
from engines.reference.model import ModelArgs, Transformer, rope_inv_freq
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GiB = 1 << 30
FORMATS = ["fp16", "fp8", "turbo-3", "kivi-2"]


class LargestAllocation(TorchDispatchMode):
    """Records the bytes of every tensor an op returns that is not a view or an in-place result.
    On meta a host read (`int(t)`, `bool(t.any())`) has no value: it reads 0 (no left padding)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            return 0
        if func is torch.ops.aten.is_nonzero.default:
            return False
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        for t, new in zip(tree_flatten(out)[0], fresh + [True] * 8, strict=False):
            if isinstance(t, torch.Tensor) and new and t.untyped_storage().nbytes() > self.largest:
                self.largest, self.op = t.untyped_storage().nbytes(), f"{func} {tuple(t.shape)} {t.dtype}"
        return out


def gpu_like_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as flash / memory-efficient attention allocate it on a GPU: the output, plus a bool
    mask turned into an additive bias of the mask's shape (no [T, S] scores). On meta the math
    fallback's scores would be recorded instead, which no CUDA prefill allocates."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def llama8b_layer(max_seq_len: int) -> Transformer:
    a = ModelArgs(model_type="llama", vocab_size=1024, dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, head_dim=128,
                  intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=max_seq_len,
                  tie_embeddings=False, attention_bias=False, rope_scaling={"rope_type": "default"})
    with torch.device("meta"):
        model = Transformer(a).half()
    model.fuse()
    model.inv_freq = rope_inv_freq(a).to("meta")
    return model.eval()


def largest_prefill_allocation(monkeypatch, fmt_name: str, P: int, chunk: int | None,
                               causal: bool | None = None) -> tuple[int, str]:
    monkeypatch.setattr(F, "scaled_dot_product_attention", gpu_like_sdpa)
    model = llama8b_layer(P + 8)
    ids = torch.zeros(1, P, dtype=torch.long, device="meta")
    with torch.inference_mode(), LargestAllocation() as rec:  # the cache and the format's buffers counted too
        d = Decoder(model, kv_format(fmt_name, torch.float16), 1, P + 8, "meta", torch.float16, prefill_chunk=chunk,
                    causal_prefill=causal)
        d.prefill(ids)
    return rec.largest, rec.op


@pytest.mark.parametrize("fmt", [*FORMATS, "int4", "kivi-4", "turbo-ip-3"])
@pytest.mark.integration  # slow for the quick tier's budget: the whole suite runs it
def test_a_32k_prefill_of_an_8b_layer_allocates_under_4_gib(monkeypatch, fmt):
    largest, op = largest_prefill_allocation(monkeypatch, fmt, 32768, None)
    assert largest < 4 * GiB, f"{fmt}: {largest / GiB:.1f} GiB in {op}"


@pytest.mark.parametrize("fmt", ["fp8", "turbo-3", "int4", "turbo-ip-3", "kivi-2"])
def test_the_cuda_prefill_of_a_lossy_format_builds_no_mask(monkeypatch, fmt):
    """As the decoder runs it on CUDA: one causal pass over what the cache holds (attention.Causal),
    no [P, P] mask; KIVI's window in blocks beside a causal pass. The largest tensor is the MLP's,
    as in an fp16 prefill: [P, 2 × 14336] fp16 at 32K, 1.75 GiB."""
    largest, op = largest_prefill_allocation(monkeypatch, fmt, 32768, None, causal=True)
    assert largest == 32768 * 2 * 14336 * 2, f"{fmt}: {largest / GiB:.2f} GiB in {op}"


@pytest.mark.parametrize("fmt,at_least", [("fp8", 8), ("kivi-2", 64)])
def test_the_check_sees_an_unchunked_prefill(monkeypatch, fmt, at_least):
    # the same run in one chunk of the whole prompt (as before chunking): the [P, P] mask comes
    # back, as an fp16 bias over the 4 folded query heads (8 GiB), and KIVI's scores (64 GiB)
    monkeypatch.setattr(attention, "SCORE_BYTES", 1 << 60)
    largest, op = largest_prefill_allocation(monkeypatch, fmt, 32768, 32768)
    assert largest >= at_least * GiB, op


def test_query_chunk_bounds_the_fp32_scores():
    assert query_chunk(32, 32768) == 256 and query_chunk(32, 131072) == 64
    assert query_chunk(32, 10**9) == 16  # never below 16
    for rows, S in ((32, 32768), (64, 8192), (8, 1000)):
        assert 4 * rows * S * query_chunk(rows, S) <= GiB or query_chunk(rows, S) == 16


def two_tier_reference(q, k, v, kq, vq, mask, ck, cv):
    """The earlier implementation: K and V copied to every query head, all [B, H, T, S] scores at once."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v, kq, vq = (x.repeat_interleave(g, dim=1) for x in (k, v, kq, vq))
    scale = 1.0 / D**0.5
    s_raw = (q @ k.transpose(-1, -2)) * scale
    s_cmp = (q @ kq.transpose(-1, -2)) * scale
    scores = torch.where(ck, s_cmp, s_raw).float().masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    return (p * cv) @ vq + (p * ~cv) @ v


@pytest.mark.parametrize("chunk", [None, 1, 7, 16])
def test_two_tier_attention_in_chunks_equals_the_single_pass(chunk):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 8, 2, 40, 48, 32
    q = torch.randn(B, H, T, D, generator=g)
    k, v, kq, vq = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(4))
    t, j = torch.arange(T)[:, None] + (S - T), torch.arange(S)[None, :]
    mask = (j <= t)[None, None].expand(B, 1, T, S)
    ck, cv = (j < (t // 16) * 16)[None, None].expand(B, 1, T, S), (j < t - 8)[None, None].expand(B, 1, T, S)
    got = two_tier_attention(q, k, v, kq, vq, mask, ck, cv, chunk=chunk)
    want = two_tier_reference(q, k, v, kq, vq, mask, ck, cv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,R", [(5, 8), (8, 8), (9, 8), (10, 8), (40, 8), (41, 16), (100, 16)])
def test_windowed_causal_attention_equals_two_tier_attention_under_kivis_masks(T, R):
    # KIVI's boundaries for query t (sequence length n = t + 1): keys compressed below R⌊t/R⌋,
    # values below t − R; T ≤ R + 1 leaves no far part, T = 9, R = 8 exactly one far slot
    g = torch.Generator().manual_seed(T)
    B, H, Hkv, D = 2, 8, 2, 16
    q = torch.randn(B, H, T, D, generator=g)
    k, v, kq, vq = (torch.randn(B, Hkv, T, D, generator=g) for _ in range(4))
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    fmt = kv_format("kivi-2", torch.float32)
    fmt.residual = R
    n = t + 1
    ck, cv = j < fmt.boundary_k(n), j < fmt.boundary_v(n)
    assert ck.equal(j < (t // R) * R) and cv.equal(j < t - R)
    masks = [(m)[None, None].expand(B, 1, T, T) for m in (j <= t, ck, cv)]
    want = two_tier_reference(q, k, v, kq, vq, *masks)
    torch.testing.assert_close(windowed_causal_attention(q, k, v, kq, vq, R), want, rtol=1e-5, atol=1e-5)


def test_windowed_causal_attention_holds_no_scores_over_the_prompt(monkeypatch):
    # half a block of fp32 scores per query at most ([B, H, chunk of blocks, R, 2R]), not [T, T]
    monkeypatch.setattr(attention, "SCORE_BYTES", 1 << 20)
    B, H, Hkv, T, D, R = 1, 4, 2, 1000, 8, 16
    with LargestAllocation() as rec:
        q = torch.zeros(B, H, T, D, device="meta")
        k = torch.zeros(B, Hkv, T, D, device="meta")
        windowed_causal_attention(q, k, k, k, k, R)
    assert rec.largest <= max(B * H * T * D * 4, 1 << 20), rec.op


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("pydantic")
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from engines.zoo import resolve_model_path

    target = str(resolve_model_path("builtin:pydoc-target"))
    spec = OptimizationSpec(engine="reference", weights="fp32", engine_options={"device": "cpu"})
    return ReferenceEngine(target, spec)


PROMPT = ("os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed. "
          "If any component is an absolute path, all previous path components will be discarded. ") * 3


@pytest.mark.parametrize("fmt", FORMATS)
@torch.inference_mode()
def test_chunked_prefill_equals_one_pass_on_the_tiny_model(engine, fmt):
    # > 128 tokens: KIVI's first key flush and its value window both fall inside the prompt
    ids = torch.tensor([[engine.start_id] + engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    P = ids.shape[1]
    assert P > 140  # boundary_k = 128 keys compressed, boundary_v = P − 129 values
    runs = {}
    for chunk in (P, 16, 33):
        d = Decoder(engine.model, kv_format(fmt, torch.float32), 1, P + 6, "cpu", torch.float32, prefill_chunk=chunk)
        d.prepare(torch.tensor([5]) if fmt == "fp16" else None)  # fp16 (lossless) takes the masked path padded only
        logits = d.prefill(ids if fmt != "fp16" else F.pad(ids[:, 5:], (5, 0)))
        toks = [int(logits.argmax())]
        for _ in range(5):
            toks.append(int(d.step(torch.tensor([toks[-1]])).argmax()))
        runs[chunk] = (logits, toks)
    for chunk in (16, 33):
        torch.testing.assert_close(runs[chunk][0], runs[P][0], rtol=1e-4, atol=1e-4)
        assert runs[chunk][1] == runs[P][1]
    if fmt == "fp16":
        return
    # the CUDA default for a lossy format: one causal pass, no mask (KIVI: windowed_causal_attention)
    d = Decoder(engine.model, kv_format(fmt, torch.float32), 1, P + 6, "cpu", torch.float32, causal_prefill=True)
    assert d.causal_prefill
    d.prepare()
    logits = d.prefill(ids)
    toks = [int(logits.argmax())]
    for _ in range(5):
        toks.append(int(d.step(torch.tensor([toks[-1]])).argmax()))
    torch.testing.assert_close(logits, runs[P][0], rtol=1e-4, atol=1e-4)
    assert toks == runs[P][1]
