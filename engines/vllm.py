"""In-process vLLM (optional extra `vllm`): a config mapped onto `vllm.LLM(...)` arguments.

Mapping (docs/reference.md §7; vLLM V1):
  weights      fp16/bf16/fp32 → dtype; awq-int4 → quantization="awq_marlin" (the model path
               must hold an AWQ checkpoint)
  kv_cache     auto/fp16/bf16 → "auto"; fp8 → "fp8"; turbo-4 → "turboquant_4bit_nc";
               turbo-3.5 → "turboquant_k3v4_nc" (3-bit keys, 4-bit values); turbo-3 → "turboquant_3bit_nc"
  speculative  draft → {"method": "draft_model", "model", "num_speculative_tokens"};
               ngram → {"method": "ngram", "num_speculative_tokens", "prompt_lookup_max/min"};
               eagle → {"method": "eagle3", "model", "num_speculative_tokens"}
Figures: per-request TTFT from RequestOutput.metrics (log stats on), spec-decode counters from
llm.get_metrics() before and after a batch (counter deltas, as over HTTP).

vLLM cannot be installed on the CI machines of this project: vllm_args() is unit-tested; the
adapter below follows the documented API and is exercised only where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from engines.protocol import (
    EngineDescription,
    GenerationRequest,
    GenerationResult,
    RollingRequest,
    RollingResult,
    ServerStats,
    SpeculativeStats,
    count_words,
    strided_windows,
    tokenize_with_spans,
)
from engines.spec import OptimizationSpec

DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "awq-int4": "float16"}
KV_DTYPE = {"auto": "auto", "fp16": "auto", "bf16": "auto", "fp8": "fp8", "turbo-4": "turboquant_4bit_nc",
            "turbo-3.5": "turboquant_k3v4_nc", "turbo-3": "turboquant_3bit_nc"}


def vllm_args(model: str, spec: OptimizationSpec) -> dict:
    """The keyword arguments of vllm.LLM for this config."""
    spec.check_available()
    opts = spec.engine_options
    args: dict = {"model": model, "dtype": DTYPE[spec.weights], "kv_cache_dtype": KV_DTYPE[spec.kv_cache],
                  "disable_log_stats": False, "seed": 0}
    if spec.weights == "awq-int4":
        args["quantization"] = "awq_marlin"
    sp = spec.speculative
    if sp.method == "draft":
        args["speculative_config"] = {"method": "draft_model", "model": sp.draft_model, "num_speculative_tokens": sp.k}
    elif sp.method == "ngram":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": sp.k,
                                      "prompt_lookup_max": sp.prompt_lookup_max,
                                      "prompt_lookup_min": sp.prompt_lookup_min}
    elif sp.method == "eagle":
        args["speculative_config"] = {"method": "eagle3", "model": sp.draft_model, "num_speculative_tokens": sp.k}
    for key in ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len"):
        if key in opts:
            args[key] = opts[key]
    return args


def spec_counters(metrics: Iterable[Any]) -> dict[str, float]:
    """Sum vLLM's spec-decode counters from llm.get_metrics() (objects with .name, .value)."""
    out: dict[str, float] = {}
    for metric in metrics:
        name = metric.name.removesuffix("_total")
        if name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            out[name] = out.get(name, 0.0) + float(metric.value)
    return out


class VLLMEngine:
    def __init__(self, model_path: str, spec: OptimizationSpec):
        try:
            from vllm import LLM
        except ImportError as e:
            from engines.device import EngineLoadError

            raise EngineLoadError("engine: 'vllm' needs vLLM on this worker: "
                                  "pip install 'inference-canary[vllm]' on a GPU node") from e
        self.spec = spec
        self.model_path = model_path
        self.llm = LLM(**vllm_args(model_path, spec))
        self.tokenizer = self.llm.get_tokenizer()
        self._server_stats: ServerStats | None = None  # over the last generate call

    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0)
        out = []
        for req in requests:
            ids, spans = tokenize_with_spans(self.tokenizer, req.text)
            seq = [self.tokenizer.bos_token_id or self.tokenizer.eos_token_id] + ids
            logprobs: list[float] = []
            for begin, end, n in strided_windows(len(ids), req.window):
                res = self.llm.generate([TokensPrompt(prompt_token_ids=seq[begin:end])], params, use_tqdm=False)[0]
                lps = [None] + [d[t].logprob
                                for d, t in zip(res.prompt_logprobs[1:], seq[begin + 1 : end], strict=True)]
                logprobs += lps[len(lps) - n :]
            out.append(RollingResult(req.doc_id, tuple(ids), tuple(logprobs), (),
                                     len(req.text.encode()), count_words(req.text), spans))
        return out

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        from vllm import SamplingParams

        before = spec_counters(self.llm.get_metrics())
        params = [SamplingParams(max_tokens=request.max_new_tokens, temperature=request.temperature, seed=request.seed,
                                 top_p=request.top_p, top_k=request.top_k or -1,
                                 presence_penalty=request.presence_penalty,
                                 frequency_penalty=request.frequency_penalty,
                                 logit_bias=dict(request.logit_bias) or None)
                  for request in requests]
        # a TokensPrompt where the request gives ids (used as given, as vLLM's server takes them)
        prompts = [{"prompt_token_ids": list(request.prompt_ids)} if request.prompt_ids is not None else request.prompt
                   for request in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        after = spec_counters(self.llm.get_metrics())
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        spec = (SpeculativeStats(int(delta.get("vllm:spec_decode_num_drafts", 0)),
                          int(delta.get("vllm:spec_decode_num_draft_tokens", 0)),
                          int(delta.get("vllm:spec_decode_num_accepted_tokens", 0)))
                if delta.get("vllm:spec_decode_num_draft_tokens") else None)
        self._server_stats = ServerStats(spec=spec)
        results = []
        for request, output in zip(requests, outputs, strict=True):
            metrics, completion = output.metrics, output.outputs[0]
            ttft = ((metrics.first_token_latency or 0.0) * 1000
                    if metrics is not None and hasattr(metrics, "first_token_latency") else 0.0)
            results.append(GenerationResult(request.request_id, completion.text, tuple(completion.token_ids),
                                            len(output.prompt_token_ids),
                                            ttft, (), ttft, finish_reason=completion.finish_reason))
        return results

    def server_stats(self) -> ServerStats | None:
        """The in-process engine's spec-decode counter deltas over the last generate call."""
        return self._server_stats

    def reset_peaks(self) -> None:
        """Nothing to reset: vLLM's figures are read per generate call."""

    def describe(self) -> EngineDescription:
        import vllm

        spec = self.spec
        return EngineDescription(engine="vllm", model=self.model_path, weights=spec.weights, kv_cache=spec.kv_cache,
                                 speculative=spec.speculative.method, device="cuda", compute_dtype=DTYPE[spec.weights],
                                 parameters=0, weight_bytes=0, kv_bytes_per_token=0,
                                 versions={"vllm": vllm.__version__})
