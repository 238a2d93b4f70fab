"""The reference engine takes the Triton path for TurboQuant decode steps when kernels run
(forced here with CANARY_KERNELS=triton under the interpreter) and its torch path otherwise;
both give the same greedy tokens."""

import engines.kernels.turbo_kv as turbo_kv
from engines.protocol import GenerationRequest
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))


def generate(monkeypatch, mode):
    monkeypatch.setenv("CANARY_KERNELS", mode)
    calls = []
    real = turbo_kv.decode_attention
    monkeypatch.setattr(turbo_kv, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    e = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache="turbo-3"))
    out = e.generate([GenerationRequest("g", "json.dumps()\n\nSerialize", max_new_tokens=5)])[0].token_ids
    return out, len(calls)


def test_kernel_and_torch_paths_agree(monkeypatch):
    torch_tokens, torch_calls = generate(monkeypatch, "torch")
    triton_tokens, triton_calls = generate(monkeypatch, "triton")
    assert torch_calls == 0 and triton_calls == 6 * 4  # 6 layers × 4 decode steps after the prefill
    assert triton_tokens == torch_tokens
