"""A config-run's own figures (config_runs.figures), a `RunFigures`: what the engine says of itself,
the run's speed percentiles, and the spec-decode and server figures when there are any. The API's
figures response is built from its fields (app/schemas.py FiguresOut). Plain dataclasses with no
numpy or torch, so the API reads the same figures the workers write."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from engines.protocol import SpeculativeStats


@dataclass(frozen=True)
class SpeculativeFigures:
    """A run's spec-decode counters and what follows from them (SpeculativeStats: vLLM's definitions —
    acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts,
    per-position rate = accepted at position i / drafts)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_rate: list[float]

    @classmethod
    def from_stats(cls, spec: SpeculativeStats) -> SpeculativeFigures:
        return cls(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_position),
                   spec.acceptance_rate, spec.mean_acceptance_length, list(spec.per_position_rate))


@dataclass(frozen=True)
class ServerFigures:
    """A serving process's own gauges (vLLM's /metrics), each at its peak over the run."""

    metrics_url: str | None
    max_kv_cache_usage: float | None
    max_num_requests_waiting: float | None
    max_num_requests_running: float | None
    # spec-decode counter deltas over the run's generate calls, and how they were used: judged as the
    # run's acceptance only on a dedicated server (engine_options.dedicated_server)
    spec: SpeculativeFigures | None = None
    dedicated: bool = False
    # batches whose counters moved more than the canary's own requests could explain
    foreign_traffic_batches: int = 0
    # the server's own clock, where it reported each request's timings (vLLM --enable-per-request-metrics):
    # TTFT from scheduling to the first token, the queue wait, the mean inter-token latency. The
    # timing verdicts use the client's clock (ttft_ms_p50 above), the same on every engine
    request_ttft_ms_p50: float | None = None
    request_queue_ms_p50: float | None = None
    request_itl_ms_mean: float | None = None


@dataclass(frozen=True)
class RunFigures:
    """One config's figures over a run: the engine's description, perplexity and speed, peaks."""

    engine: str
    weights: str
    kv_cache: str
    speculative: str
    device: str
    compute_dtype: str
    parameters: int
    weight_bytes: int  # in the stored format, scales included
    kv_bytes_per_token: int  # all layers, keys + values
    versions: dict[str, str]
    resident_weight_bytes: int | None  # measured: what the engine holds
    peak_kv_cache_bytes: int | None
    peak_device_bytes: int | None
    notes: list[str]
    token_ppl: float | None  # exp(Σ NLL / Σ tokens) over the run's documents
    n_documents: int
    n_tokens: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tbt_ms_mean: float | None  # time between tokens (inter-token latency)
    tbt_ms_p50: float | None
    tbt_ms_p99: float | None
    tokens_per_second: float | None  # mean over generations
    generated_tokens: int
    concurrency: int
    kv_cache_usage: float | None  # peak 0–1: the engine's own, or the highest its server reported
    server: ServerFigures | None = None
    spec: SpeculativeFigures | None = None
    baseline_scoring_error: str | None = None  # why the baseline model could not score these outputs
    # sha256 of everything that decides this config-run's results (workers/baseline_reuse.py inputs_key);
    # None where they cannot be pinned (a served model)
    inputs_key: str | None = None
    # the run whose results (rows and figures) this config-run took instead of computing them again
    reused_from_run: int | None = None
    # sha256 of the model as this config loaded it (engines/fingerprint.weights_digest: weight files and
    # config.json, or a GGUF file); None for a served model, whose weights the canary cannot read
    model_digest: str | None = None
    # spec_digest of the config's spec as stored when this config-run loaded it: a config edited in
    # place since then has this run's figures and comparisons as evidence about its earlier
    # definition only ("mixed": a top-up pass after an edit, its passes of two definitions)
    config_digest: str | None = None
    # where this pass's time went, in wall seconds: "engine" (load, and the AWQ search where it ran)
    # and each producer by its scorer ("perplexity", "generation", ...); None before it was recorded
    seconds: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form: a JSON object without the sections a run did not have."""
        out = asdict(self)
        for section in ("server", "spec", "baseline_scoring_error", "inputs_key", "reused_from_run", "model_digest",
                        "config_digest", "seconds"):
            if out[section] is None:
                del out[section]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunFigures:
        """The stored form back; a field that an older version did not store reads as None."""
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        if values["server"] is not None:
            server = dict(values["server"])
            if server.get("spec") is not None:
                server["spec"] = SpeculativeFigures(**server["spec"])
            values["server"] = ServerFigures(**server)
        if values["spec"] is not None:
            values["spec"] = SpeculativeFigures(**values["spec"])
        return cls(**values)


MIXED = "mixed"  # RunFigures.config_digest of a config-run whose passes loaded two definitions


def spec_digest(spec: Mapping[str, Any]) -> str:
    """A short sha256 of a stored config spec (optimization_configs.spec), the same for the same
    JSON whatever its key order: what a config-run records of the definition it measured, and
    what a reader compares with the config as it is now. A digest, not the spec: a spec may carry
    an engine URL with credentials, and figures are shown to read-only keys."""
    raw = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]
