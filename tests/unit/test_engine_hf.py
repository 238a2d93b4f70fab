"""The transformers backend on the real tiny model: forward passes, not stubs."""


import pytest
import torch
from engines.hf import EngineLoadError, TransformersEngine
from engines.protocol import Engine, GenerationRequest, RollingRequest, WindowSpec
from engines.registry import load_engine
from engines.spec import ConfigNotAvailable, OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))
DOC = "json.dumps()\n\nSerialize obj to a JSON formatted str using this conversion table."


@pytest.fixture(scope="module")
def fp32():
    return TransformersEngine(TARGET, OptimizationSpec(weights="fp32"))


def test_protocol_and_registry(fp32):
    assert isinstance(fp32, Engine)
    assert isinstance(load_engine(TARGET, OptimizationSpec(weights="fp16")), TransformersEngine)
    with pytest.raises(ConfigNotAvailable, match="kv_cache: 'fp8' is not available in engine 'transformers'"):
        load_engine(TARGET, OptimizationSpec(kv_cache="fp8"))


def test_rolling_logprobs_equal_one_full_forward(fp32):
    # A document shorter than the window: the engine's per-token log-probs must equal a single
    # forward pass over [start] + tokens, read off by hand.
    [r] = fp32.loglikelihood_rolling([RollingRequest("d", DOC, WindowSpec(256, 256))])
    ids = fp32.tokenizer(DOC, add_special_tokens=False)["input_ids"]
    x = torch.tensor([[fp32.start_id] + ids])
    with torch.no_grad():
        lsm = torch.log_softmax(fp32.model(input_ids=x).logits.float(), -1)[0]
    expected = [lsm[i, ids[i]].item() for i in range(len(ids))]
    assert r.token_ids == tuple(ids)
    assert r.logprobs == pytest.approx(expected, abs=1e-4)
    assert r.greedy_ids == tuple(lsm[: len(ids)].argmax(-1).tolist())
    assert r.n_bytes == len(DOC.encode()) and r.n_words == len(DOC.split())


def test_windows_cover_every_token_and_context_helps(fp32):
    text = DOC * 6
    [short] = fp32.loglikelihood_rolling([RollingRequest("d", text, WindowSpec(16, 16))])
    [strided] = fp32.loglikelihood_rolling([RollingRequest("d", text, WindowSpec(16, 4))])
    [full] = fp32.loglikelihood_rolling([RollingRequest("d", text, WindowSpec(512, 512))])
    assert len(short.logprobs) == len(strided.logprobs) == len(full.logprobs) == len(full.token_ids)
    # The first window is identical; later tokens see more context with a smaller stride.
    assert short.logprobs[:16] == pytest.approx(full.logprobs[:16], abs=1e-4)
    assert full.nll < strided.nll < short.nll


def test_batched_equals_unbatched(fp32):
    reqs = [RollingRequest(str(i), DOC[: 20 + 7 * i]) for i in range(5)]
    batched = fp32.loglikelihood_rolling(reqs)
    single = [fp32.loglikelihood_rolling([r])[0] for r in reqs]
    for b, s in zip(batched, single, strict=False):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_quantized_weights_change_logprobs_and_memory():
    base = TransformersEngine(TARGET, OptimizationSpec(weights="fp16"))
    int4 = TransformersEngine(TARGET, OptimizationSpec(weights="rtn-int4"))
    int2 = TransformersEngine(TARGET, OptimizationSpec(weights="rtn-int2"))
    reqs = [RollingRequest("d", DOC * 3)]
    nll = {name: e.loglikelihood_rolling(reqs)[0].nll for name, e in (("fp16", base), ("int4", int4), ("int2", int2))}
    assert nll["fp16"] != nll["int4"]
    assert abs(nll["int2"] - nll["fp16"]) > abs(nll["int4"] - nll["fp16"])
    d16, d4 = base.describe(), int4.describe()
    assert d16.weight_bytes == 2 * d16.parameters
    # Decoder linears: 6 layers × (q 256·256 + k 256·64 + v 256·64 + o 256·256 + 3 · 256·768)
    linear = 6 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 768)
    assert int4.quantized_params == linear
    # int4 codes (½ byte) + an fp16 scale and zero per 128 weights, the rest in fp16
    assert d4.weight_bytes == (d4.parameters - linear) * 2 + linear // 2 + (linear // 128) * 4
    # KV per token: 2 (k, v) × 6 layers × 2 kv heads × 32 dims × 2 bytes
    assert d16.kv_bytes_per_token == 2 * 6 * 2 * 32 * 2


def test_generate_greedy_is_deterministic_and_timed(fp32):
    req = GenerationRequest("g", "json.dumps()\n\nSerialize", max_new_tokens=12)
    a, b = fp32.generate([req]), fp32.generate([req])
    assert a[0].text == b[0].text and a[0].token_ids == b[0].token_ids
    g = a[0]
    assert 1 <= len(g.token_ids) <= 12
    assert g.ttft_ms > 0 and len(g.itl_ms) == len(g.token_ids) - 1
    assert g.total_ms >= g.ttft_ms + sum(g.itl_ms) - 1e-6
    assert g.tokens_per_second == pytest.approx(len(g.token_ids) / (g.total_ms / 1000))
    sampled = fp32.generate([GenerationRequest("s", "json", max_new_tokens=8, temperature=1.0, seed=3)] * 2)
    assert sampled[0].token_ids == sampled[1].token_ids  # seeded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_config_on_cpu_worker_is_refused():
    with pytest.raises(EngineLoadError, match=r"engine_options.device: 'cuda'"):
        TransformersEngine(TARGET, OptimizationSpec(engine_options={"device": "cuda"}))


def test_missing_model_dir_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineLoadError, match="cannot load model"):
        TransformersEngine(str(tmp_path), OptimizationSpec())
