"""The engine server's Prometheus metrics, under vLLM V1's names, types, label names and buckets
(vllm/v1/metrics/loggers.py, PrometheusStatLogger), so that a client or a dashboard reads them as
it reads a vLLM server's. Counters are exposed with the _total suffix. Every series carries
`model_name` and `engine` (this server is one engine core: "0").

What the reference engine has no counterpart for stays at its neutral value: preemptions (0),
prefix-cache queries and hits (not exported: there is no prefix cache)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from engines.protocol import SpeculativeStats
    from workers.engine_server.jobs import ServeRequest

ENGINE = "0"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # seconds
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")


def one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, … up to max_value: vLLM's buckets for token counts."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class ServeMetrics:
    """One registry per server. Each attribute is the series of this server's model and engine."""

    def __init__(self, model_name: str, max_model_len: int = 1024, cache_dtype: str = "auto"):
        self.registry = registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        mine = (model_name, ENGINE)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*mine)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*mine)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(*mine)

        tokens = one_two_five(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # token positions the batch's rows hold / what max_num_seqs rows of a full context reserve
        # (engine_thread.py; one-at-a-time engines: the running request's / the context)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=registry)
        self.request_success = {reason: success.labels(*mine, reason) for reason in FINISH_REASONS}
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TPOT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TPOT_BUCKETS)
        self.prefill_per_token = histogram("vllm:time_per_prefill_token_request_seconds",
                                           "Time spent per token during prefill phase in seconds",
                                           PREFILL_TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels + ["position"], registry=registry)
        # an info metric as vLLM writes it: a gauge held at 1 whose labels describe the KV cache
        info = {"engine": ENGINE, "cache_dtype": cache_dtype, "block_size": "1",
                "num_gpu_blocks": str(max_model_len), "enable_prefix_caching": "False"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=registry).labels(**info).set(1)
        self.model = model_name
        for series in (self.running, self.waiting, self.kv_usage):
            series.set(0)

    def accepted_at(self, position: int) -> Counter:
        return self._accepted_pos.labels(self.model, ENGINE, str(position))

    def tokens_delivered(self, job: ServeRequest, now: float, n_new: int, prefill_tokens: int | None) -> None:
        """A request's new tokens in the metrics: TTFT at its first (with its prefill step's tokens,
        unless None: a step shared with other rows, which the caller counts once), the gap since its
        last delivery after."""
        if not job.stamps:
            self.ttft.observe(now - job.arrived)
            if prefill_tokens is not None:
                self.iteration_tokens.observe(prefill_tokens + n_new)  # the prefill step
        else:
            self.itl.observe(now - job.stamps[-1])
            self.tpot.observe((now - job.stamps[-1]) / max(1, n_new))
        job.stamps.append(now)
        self.generation_tokens.inc(n_new)

    def speculative_step(self, step: SpeculativeStats) -> None:
        """A speculative step's drafts and accepted tokens in vLLM's spec_decode counters."""
        self.drafts.inc(step.num_drafts)
        self.draft_tokens.inc(step.num_draft_tokens)
        self.accepted.inc(step.num_accepted_tokens)
        for pos, accepted in enumerate(step.accepted_per_position):
            self.accepted_at(pos).inc(accepted)

    def request_finished(self, job: ServeRequest, started: float, started_decode: float, n_prompt: int,
                         n_generated: int, reason: str) -> None:
        """A request's phases as vLLM splits them: queued (arrival → the engine takes it), prefill
        (→ first token), decode (→ done), inference (prefill + decode), end to end."""
        now = time.perf_counter()
        self.request_success[reason].inc()
        self.request_prompt_tokens.observe(n_prompt)
        self.request_generation_tokens.observe(n_generated)
        self.prefill_time.observe(started_decode - started)
        self.prefill_per_token.observe((started_decode - started) / max(1, n_prompt))
        self.decode_time.observe(now - started_decode)
        self.inference_time.observe(now - started)
        self.e2e.observe(now - job.arrived)
