"""The reference engine takes the Triton path for TurboQuant decode steps when kernels run
(forced here with CANARY_KERNELS=triton under the interpreter) and its torch path otherwise;
both give the same greedy tokens."""

import engines.kernels.fp8_kv as fp8_kv
import engines.kernels.turbo_kv as turbo_kv
import pytest
from engines.protocol import GenerationRequest
from engines.zoo import resolve_model_path

# ReferenceEngine takes an OptimizationSpec (pydantic); the GPU image has no pydantic unless its
# wheels are carried (docs/benchmarks.md "GPU report"): skip this module there instead of failing collection
pytest.importorskip("pydantic", reason="ReferenceEngine needs engines.spec (pydantic): docs/benchmarks.md 'GPU report'")
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec

pytestmark = pytest.mark.integration  # the tiny model through the Triton interpreter: tens of seconds

TARGET = str(resolve_model_path("builtin:pydoc-target"))


LONG_PROMPT = ("os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed. "
               "If any component is an absolute path, all previous path components will be discarded. "
               "An empty last part will result in a path that ends with a separator.\n\n") * 3


def generate(monkeypatch, mode, kv_cache, module, prompt="json.dumps()\n\nSerialize", attr="decode_attention"):
    monkeypatch.setenv("CANARY_KERNELS", mode)
    calls = []
    real = getattr(module, attr)
    monkeypatch.setattr(module, attr, lambda *a, **k: calls.append(1) or real(*a, **k))
    # graphs off: on CUDA a captured decode step is replayed without re-entering Python, so counting
    # Python-level decode_attention calls would see only the warm-up and capture calls (2 + 1 per layer)
    e = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv_cache,
                                                 engine_options={"cuda_graphs": False}))
    out = e.generate([GenerationRequest("g", prompt, max_new_tokens=5)])[0].token_ids
    return out, len(calls)


@pytest.mark.parametrize("kv_cache,module", [("turbo-3", turbo_kv), ("fp8", fp8_kv)])
def test_kernel_and_torch_paths_agree(monkeypatch, kv_cache, module):
    torch_tokens, torch_calls = generate(monkeypatch, "torch", kv_cache, module)
    triton_tokens, triton_calls = generate(monkeypatch, "triton", kv_cache, module)
    assert torch_calls == 0 and triton_calls == 6 * 4  # 6 layers × 4 decode steps after the prefill
    assert triton_tokens == torch_tokens


def test_kivi_decode_steps_take_the_two_tier_kernel(monkeypatch):
    # KIVI keeps the last 128 tokens in full precision: a prompt past 130 tokens puts keys
    # (one flush of 128) and values (token by token) in the compressed tier during decode
    import engines.kernels.kivi_kv as kivi_kv

    n_prompt = len(ReferenceEngine(TARGET, OptimizationSpec(engine="reference")).tokenizer(LONG_PROMPT)["input_ids"])
    assert n_prompt > 130
    torch_tokens, torch_calls = generate(monkeypatch, "torch", "kivi-2", kivi_kv, LONG_PROMPT)
    triton_tokens, triton_calls = generate(monkeypatch, "triton", "kivi-2", kivi_kv, LONG_PROMPT)
    assert torch_calls == 0 and triton_calls == 6 * 4
    assert triton_tokens == torch_tokens


def test_int4_linears_take_the_w4a16_kernel_when_forced(monkeypatch):
    import engines.kernels.w4a16 as w4a16_mod
    from engines.protocol import RollingRequest, WindowSpec

    doc = [RollingRequest("d", "os.path.join(a, *p)\n\nJoin two or more pathname components.", WindowSpec(64, 64))]
    monkeypatch.setenv("CANARY_KERNELS", "torch")
    dense = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="rtn-int4")).loglikelihood_rolling(doc)[0]
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    calls = []
    real = w4a16_mod.w4a16_triton
    monkeypatch.setattr(w4a16_mod, "w4a16_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    e = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="rtn-int4"))
    assert type(e.model.model.layers[0].mlp.down_proj).__name__ == "W4A16Linear"
    packed = e.loglikelihood_rolling(doc)[0]
    assert len(calls) == 6 * 4  # qkv, o, gate_up, down in each of 6 layers
    # same math; the packed path carries fp16 scales (the AutoAWQ layout), the dense one fp32
    assert max(abs(a - b) for a, b in zip(packed.logprobs, dense.logprobs, strict=False)) < 2e-2


@pytest.mark.parametrize("kv_cache", ["fp32", "int8"])
def test_float_and_dequantized_caches_decode_with_the_grouped_kernel(monkeypatch, kv_cache):
    # a lossless cache (fp32 for fp32 weights: the raw keys and values) and a dequantized one
    # (int8: each slot's dequantized value) take decode.float_decode_attention on decode steps
    import engines.kernels.decode as decode

    torch_tokens, torch_calls = generate(monkeypatch, "torch", kv_cache, decode, attr="float_decode_attention")
    triton_tokens, triton_calls = generate(monkeypatch, "triton", kv_cache, decode, attr="float_decode_attention")
    assert torch_calls == 0 and triton_calls == 6 * 4
    assert triton_tokens == torch_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="tinygemm's int4 kernel is CUDA's")
def test_int4_single_rows_take_tinygemm_on_cuda_and_describe_says_so():
    # every fused linear of the tiny model has K a multiple of 128 and N of 8: 'auto' puts each
    # decode step's single row through tinygemm; 'triton' keeps the own GEMV. Prefill (many rows)
    # is the Triton GEMM in both, so the two differ only in decode steps, by bf16 activations.
    req = GenerationRequest("g", "json.dumps()\n\nSerialize", max_new_tokens=6, logprobs=1)
    out = {}
    for choice in ("auto", "triton"):
        e = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="rtn-int4",
                                                     engine_options={"int4_gemv": choice}))
        notes = " ".join(e.describe().notes)
        assert ("tinygemm" in notes) == (choice == "auto") and "int4 batch-1 GEMV" in notes
        out[choice] = e.generate([req])[0]
    a, t = out["auto"], out["triton"]
    assert len(a.token_ids) == len(t.token_ids) == 6
    same = next((i for i, (x, y) in enumerate(zip(a.token_ids, t.token_ids, strict=True)) if x != y), 6)
    assert same >= 1  # the first token comes from the prefill, the same kernel in both
    for i in range(same):
        assert abs(a.token_logprobs[i][0] - t.token_logprobs[i][0]) < 5e-2
