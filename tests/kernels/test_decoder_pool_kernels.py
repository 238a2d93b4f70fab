"""A generation decode loop reused per batch bucket (ReferenceEngine.pooled_decoder) over the
kernels' code buffers: KIVI's key groups and coded counts, TurboQuant's code words. A second,
shorter sequence in the same bucket decodes as a fresh loop would, over what the first one coded
and left. On CUDA the step is captured and replayed; here, on the Triton interpreter, eager."""

import pytest
import torch
from engines.protocol import GenerationRequest
from engines.zoo import resolve_model_path

pytest.importorskip("pydantic", reason="ReferenceEngine needs engines.spec (pydantic): docs/benchmarks.md 'GPU report'")
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec

TARGET = str(resolve_model_path("builtin:pydoc-target"))
NO_EOS = ((0, -100.0),)


# tens of seconds on the Triton interpreter: the full tier (tests/conftest.py)
@pytest.mark.integration
# on the interpreter only KIVI (its coded counts are the state a reuse could leave behind); on CUDA both
@pytest.mark.parametrize("kv", ["kivi-2", pytest.param("turbo-3", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="minutes on the Triton interpreter; the CPU test covers its torch path"))])
def test_a_reused_loop_over_the_kernels_codes_decodes_as_a_fresh_one(monkeypatch, device, kv):
    monkeypatch.setenv("CANARY_KERNELS", "triton")
    weights = "fp16" if device == "cuda" else "fp32"

    def engine(reuse: bool) -> ReferenceEngine:
        e = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights=weights, kv_cache=kv,
                                                     engine_options={"device": device}))
        e.reuse_decoders = reuse
        return e

    pooled, fresh = engine(True), engine(False)
    # both in the 256-slot bucket, past KIVI's full-precision window of 128 slots (long prompts,
    # few new tokens: the interpreter is slow); the second ends slots before the first did
    text = "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed. "
    # (147 + 5 and 132 + 4 slots: each passes the window in its prefill and codes more each step)
    reqs = [GenerationRequest("a", text * 5, max_new_tokens=5, logit_bias=NO_EOS),
            GenerationRequest("b", text * 4 + "json.dumps(obj) " * 2, max_new_tokens=4, logit_bias=NO_EOS)]
    with torch.inference_mode():
        for r in reqs:
            got, want = pooled.generate([r])[0], fresh.generate([r])[0]
            assert got.token_ids == want.token_ids, r.request_id
    assert (pooled.decoders_built, fresh.decoders_built) == (1, 2)
    assert [d.slots for d in pooled._decoders.values()] == [256]
    store = next(iter(pooled._decoders.values())).cache.store
    assert kv != "kivi-2" or store.packed_v[0] > 0  # the second sequence coded values leaving the window
