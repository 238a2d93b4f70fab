"""The vLLM adapter's config mapping (vLLM itself cannot be installed here: the adapter is kept
small and checked against the documented LLM(...) arguments, docs/reference.md §7)."""

from __future__ import annotations

import pytest
from engines.spec import ConfigNotAvailable, OptimizationSpec
from engines.vllm import spec_counters, vllm_args


def spec(**kw) -> OptimizationSpec:
    return OptimizationSpec(engine="vllm", **kw)


def test_weights_kv_and_speculative_map_to_llm_arguments():
    a = vllm_args("/models/llama-awq", spec(weights="awq-int4", kv_cache="turbo-3",
                                             speculative={"method": "draft", "draft_model": "/models/draft", "k": 5},
                                             engine_options={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8}))
    assert a == {"model": "/models/llama-awq", "dtype": "float16", "kv_cache_dtype": "turboquant_3bit_nc", "disable_log_stats": False,
                 "seed": 0, "quantization": "awq_marlin", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8,
                 "speculative_config": {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 5}}
    assert vllm_args("m", spec(kv_cache="fp8"))["kv_cache_dtype"] == "fp8"
    assert vllm_args("m", spec(kv_cache="turbo-3.5"))["kv_cache_dtype"] == "turboquant_k3v4_nc"
    assert vllm_args("m", spec(weights="bf16"))["dtype"] == "bfloat16"
    ng = vllm_args("m", spec(speculative={"method": "ngram", "k": 3, "prompt_lookup_max": 4}))["speculative_config"]
    assert ng == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    ea = vllm_args("m", spec(speculative={"method": "eagle", "draft_model": "e3", "k": 2}))["speculative_config"]
    assert ea["method"] == "eagle3" and ea["model"] == "e3"


@pytest.mark.parametrize("kw,field", [({"kv_cache": "kivi-2"}, "kv_cache"), ({"weights": "rtn-int2"}, "weights")])
def test_what_vllm_does_not_run_is_refused_naming_the_axis(kw, field):
    with pytest.raises(ConfigNotAvailable, match=f"{field}: '.*' is not available in engine 'vllm'"):
        vllm_args("m", spec(**kw))


def test_spec_counters_sum_across_labels():
    class M:
        def __init__(self, name, value):
            self.name, self.value = name, value

    got = spec_counters([M("vllm:spec_decode_num_draft_tokens_total", 40), M("vllm:spec_decode_num_draft_tokens", 8),
                         M("vllm:spec_decode_num_accepted_tokens", 30), M("vllm:num_requests_running", 1)])
    assert got == {"vllm:spec_decode_num_draft_tokens": 48.0, "vllm:spec_decode_num_accepted_tokens": 30.0}
