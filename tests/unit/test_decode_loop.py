"""The static decode loop (engines/reference/decode.py) against a full recompute, on the tiny
built-in model: a step reads the whole preallocated cache under a device-side mask, and must
pick exactly the tokens that a fresh causal pass over the whole sequence picks."""

import pytest
import torch
from engines.protocol import GenerationRequest
from engines.reference.cache import NoCache
from engines.reference.decode import Decoder
from engines.reference.engine import ReferenceEngine
from engines.reference.kv import kv_format
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options={"device": "cpu"}))


def recompute_greedy(model, ids: list[int], n: int) -> list[int]:
    """No cache at all: one causal pass over the whole sequence per new token."""
    seq = list(ids)
    for _ in range(n):
        x = torch.tensor([seq])
        pos = torch.arange(len(seq))
        seq.append(int(model(x, pos[None], pos, NoCache(), None, last_only=True)[0, -1].argmax()))
    return seq[len(ids):]


@torch.inference_mode()
def test_static_steps_pick_what_a_full_recompute_picks(engine):
    prompt = [engine.start_id] + engine.tokenizer("os.path.join(a, *p)\n\nJoin", add_special_tokens=False)["input_ids"]
    n = 12
    d = Decoder(engine.model, engine.kv, 1, len(prompt) + n, "cpu", torch.float32)
    logits = d.prefill(torch.tensor([prompt]))
    got = []
    for _ in range(n):
        tok = logits.argmax(-1)
        got.append(int(tok))
        if len(got) < n:
            logits = d.step(tok)
    assert got == recompute_greedy(engine.model, prompt, n)
    assert d.next_slot == len(prompt) + n - 1 and int(d.slot) == d.next_slot
    assert not d.graphs_active and d.graphs_reason == "off"  # CPU: eager


@torch.inference_mode()
def test_left_padded_rows_decode_as_they_would_alone(engine):
    texts = ["json.dumps()\n\nSerialize", "Return the absolute value of the argument."]
    alone = [engine.generate([GenerationRequest(f"r{i}", t, max_new_tokens=8)])[0].token_ids for i, t in enumerate(texts)]
    engine.concurrency = 2
    try:
        together = [r.token_ids for r in engine.generate([GenerationRequest(f"r{i}", t, max_new_tokens=8) for i, t in enumerate(texts)])]
    finally:
        engine.concurrency = 1
    assert together == alone


def test_a_full_cache_is_refused(engine):
    d = Decoder(engine.model, engine.kv, 1, 4, "cpu", torch.float32)
    d.prefill(torch.tensor([[engine.start_id] * 4]))
    with pytest.raises(ValueError, match="4 slots are full"):
        d.step(torch.tensor([0]))


@pytest.mark.parametrize("name,capturable", [("fp16", True), ("fp8", True), ("int8", True), ("turbo-3", True),
                                             ("kivi-2", False), ("turbo-2.5", False), ("turbo-ip-3", False)])
def test_which_formats_replay_as_a_cuda_graph(name, capturable):
    # the format's own answer, wherever it runs; KIVI's store lifts it where its kernels run
    # (tests/kernels/test_kivi_steps.py)
    assert (kv_format(name, torch.float16).graph_blocker is None) == capturable


def test_graphs_asked_for_on_cpu_say_why_not(engine):
    d = Decoder(engine.model, engine.kv, 1, 8, "cpu", torch.float32, graphs=True)
    assert not d.graphs_wanted and d.graphs_reason == "CUDA graphs need a CUDA device"


def test_cuda_graphs_option_takes_a_bool_only():
    from engines.spec import ConfigNotAvailable

    OptimizationSpec(engine="reference", engine_options={"cuda_graphs": False}).check_available()
    with pytest.raises(ConfigNotAvailable, match=r"engine_options.cuda_graphs: expected bool"):
        OptimizationSpec(engine="reference", engine_options={"cuda_graphs": "yes"}).check_available()
    with pytest.raises(ConfigNotAvailable, match=r"engine_options.batch_size: expected int"):
        OptimizationSpec(engine="reference", engine_options={"batch_size": True}).check_available()


def test_folded_gqa_attention_equals_sdpa_with_gqa():
    # the G query heads of a kv head folded into the query length: the same attention
    from engines.reference.attention import masked_gqa_attention

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 8, 2, 3, 11, 16
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(masked_gqa_attention(q, k, v, mask), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masked_gqa_attention(q, k, v, mask[:1]), torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:1], enable_gqa=True), rtol=1e-5, atol=1e-6)  # a mask broadcast over the batch


@torch.inference_mode()
def test_prepare_fixes_the_padding_that_prefill_uses(engine):
    d = Decoder(engine.model, engine.kv, 2, 12, "cpu", torch.float32)
    d.prepare(torch.tensor([2, 0]))
    assert d.cache.left_padded and d.pad.tolist() == [2, 0]
    ids = torch.tensor([[engine.start_id] * 2 + [5, 6, 7], [engine.start_id, 5, 6, 7, 8]])
    d.prefill(ids)  # no pad given: the prepared one
    assert d.pad.tolist() == [2, 0] and d.next_slot == 5
    fresh = Decoder(engine.model, engine.kv, 1, 8, "cpu", torch.float32)
    fresh.prepare()
    assert fresh.pad.tolist() == [0] and not fresh.cache.left_padded


def test_a_lossy_cache_on_the_torch_path_holds_one_copy_not_raw_beside_it(engine):
    # turbo-3 without kernels: each slot's dequantized value is what attention reads, so the cache
    # keeps no raw keys and values beside it: one [L, B, Hkv, S, D] pair, as a lossless cache's
    a = engine.model.args
    d = Decoder(engine.model, kv_format("turbo-3", torch.float32), 1, 64, "cpu", torch.float32)
    one_pair = 2 * a.n_layers * 1 * a.n_kv_heads * 64 * a.head_dim * 4
    assert not d.cache.keeps_raw and d.cache.nbytes() == one_pair
    lossless = Decoder(engine.model, kv_format("fp32", torch.float32), 1, 64, "cpu", torch.float32)
    assert lossless.cache.keeps_raw and lossless.cache.nbytes() == one_pair


def test_every_kv_cache_name_builds_a_format_of_that_name():
    # engines/spec.KV_CACHE is the one list of KV names; the reference engine builds each one
    from engines.spec import AVAILABLE, KV_CACHE

    assert AVAILABLE["reference"]["kv_cache"] == frozenset(KV_CACHE)
    assert [kv_format(name, torch.float32).name for name in KV_CACHE if name != "auto"] == list(KV_CACHE[1:])
