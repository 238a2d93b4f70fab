"""The engine server's Prometheus metrics, under vLLM V1's names (counters are exposed with the
_total suffix), so that a client reads them as it reads a vLLM server's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)  # seconds


class ServeMetrics:
    """One registry per server; every series is labelled with the served model's name."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", label,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", label,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine", label, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", label, registry=registry)
        # tokens held by the running request / the model's context (engine_thread.py)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1", label, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens", label, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", label, registry=registry)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Draft proposals", label, registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens", label, registry=registry)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", label,
                                registry=registry)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted at position",
                                    label + ["position"], registry=registry)
        self.model = model_name
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(model_name).set(0)
