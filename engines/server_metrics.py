"""A serving process's figures as vLLM names them: its Prometheus /metrics text parsed, the
speculative-decoding counters' deltas between two scrapes, and one request's own figures from
a response that carries vLLM's `metrics.speculative_decoding` (engines/openai.py reads them)."""

from __future__ import annotations

from engines.protocol import ServerTiming, SpeculativeStats

SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"



Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metric_of(line: str) -> str:
    """The metric a line of Prometheus text is about: a sample's name, or a # HELP / # TYPE line's."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 else ""
    return line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""


def parse_metrics(text: str, only: tuple[str, ...] | None = None) -> Samples:
    """Prometheus text → {(sample name, sorted labels): value}. only: the metrics wanted (a gauge's
    name is its sample's); the other lines are dropped before parsing. A vLLM /metrics page runs
    to thousands of lines, and parsing it whole in the client's event loop while requests stream
    delays reading their chunks (benchmarks/production_path.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    if only is not None:
        text = "".join(line + "\n" for line in text.splitlines() if _metric_of(line) in only)
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_sum(samples: dict, name: str, **match: str) -> float | None:
    vals = [v for (n, labels), v in samples.items()
            if n == name and all(dict(labels).get(k) == x for k, x in match.items())]
    return sum(vals) if vals else None


def spec_from_response(chunk: dict) -> SpeculativeStats | None:
    """One request's speculative-decoding figures from a response (or stream chunk) that carries
    vLLM's `metrics.speculative_decoding` object (vLLM PR #48915): num_spec_steps (verification
    steps with a draft), num_draft_tokens, num_accepted_draft_tokens and acceptance_histogram,
    where entry j counts the steps that accepted exactly j draft tokens. Drafts are accepted
    from the front, so position i (0-based) was accepted by every step that accepted more than
    i: Σ_{j>i} histogram[j]. None when the response has no such object or it is not numbers."""
    metrics = chunk.get("metrics")
    figures = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(figures, dict):
        return None
    try:
        histogram = [int(x) for x in figures.get("acceptance_histogram") or []]
        return SpeculativeStats(int(figures["num_spec_steps"]), int(figures["num_draft_tokens"]),
                         int(figures["num_accepted_draft_tokens"]),
                         tuple(sum(histogram[i + 1:]) for i in range(len(histogram) - 1)))
    except (KeyError, TypeError, ValueError):
        return None


def timing_from_response(chunk: dict) -> ServerTiming | None:
    """A request's own timings from a response (or its stream's final usage chunk) carrying vLLM's
    per-request `metrics` (time_to_first_token_ms, queue_time_ms, mean_itl_ms); None without them."""
    metrics = chunk.get("metrics")
    if not isinstance(metrics, dict):
        return None
    found = {}
    for field, key in (("ttft_ms", "time_to_first_token_ms"), ("queue_ms", "queue_time_ms"),
                       ("mean_itl_ms", "mean_itl_ms")):
        value = metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[field] = float(value)
    return ServerTiming(**found) if found else None


def spec_delta(before: dict, after: dict) -> SpeculativeStats | None:
    """Counter deltas between two scrapes (vLLM: acceptance rate = Δaccepted / Δdraft_tokens)."""
    d = {}
    for field, name in SPEC_COUNTERS.items():
        a, b = metric_sum(after, name), metric_sum(before, name)
        if a is None:
            return None
        d[field] = int(round(a - (b or 0.0)))
    positions = sorted({int(dict(lab)["position"]) for (n, lab) in after if n == PER_POS and "position" in dict(lab)})
    per = tuple(int(round((metric_sum(after, PER_POS, position=str(p)) or 0)
                          - (metric_sum(before, PER_POS, position=str(p)) or 0)))
                for p in positions)
    return SpeculativeStats(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"], per)
