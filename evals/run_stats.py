"""What a config-run's generate calls add up to, batch by batch: the serving figures of its
`RunFigures` (time to first token, time between tokens, tokens per second, speculative-decoding
counters, and a serving process's own gauges and counters with how many batches someone else's
traffic moved them)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.protocol import GenerationResult, ServerStats, ServerTiming, SpeculativeStats
from vocabulary.figures import ServerFigures, SpeculativeFigures


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean_of(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def peak(values: Sequence[float | None]) -> float | None:
    """The highest known value; None when no source knew it."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


@dataclass
class RunStats:
    """The running totals of one config-run's generations. dedicated: the config says its server
    serves only the canary, so the server's own counters over a batch stand for that batch."""

    dedicated: bool = False
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tps: list[float] = field(default_factory=list)
    generated_tokens: int = 0
    # requests' own counters plus a dedicated server's per batch
    spec: SpeculativeStats = field(default_factory=SpeculativeStats)
    servers: list[ServerStats] = field(default_factory=list)  # one per batch, from an engine that runs in a server
    server_spec: SpeculativeStats = field(default_factory=SpeculativeStats)  # a server's spec-decode counter deltas
    own_spec: SpeculativeStats = field(default_factory=SpeculativeStats)  # the responses' own spec-decode figures
    foreign: int = 0  # batches whose server counters someone else's requests moved
    foreign_excess: int = 0  # the server's counters beyond own_spec so far
    server_timings: list[ServerTiming] = field(default_factory=list)  # the server's own clock, per request

    def add(self, generation: GenerationResult) -> None:
        if generation.server_timing is not None:
            self.server_timings.append(generation.server_timing)
        self.ttft.append(generation.ttft_ms)
        self.itl.extend(generation.itl_ms)
        self.tps.append(generation.tokens_per_second)
        self.generated_tokens += generation.n_tokens
        if generation.spec is not None:
            self.spec += generation.spec

    def add_server(self, server: ServerStats | None,
                   generations: Sequence[GenerationResult]) -> SpeculativeStats | None:
        """A serving process's own figures over one batch (None: the engine runs in-process). Returns
        the server's counters when they stand for the batch (a dedicated server, and no request
        carried its own figures): the batch's first row carries them."""
        if server is None:
            return None
        self.servers.append(server)
        per_request = [generation.spec for generation in generations if generation.spec is not None]
        self.own_spec = sum(per_request, self.own_spec)
        if server.spec is None or not server.spec.num_draft_tokens:
            return None
        self.server_spec += server.spec
        if per_request:
            # the server reported each request's own: what its counters moved beyond them, summed
            # over the run so far, is someone else's; a batch is flagged when that excess grows (a
            # scrape that lags one batch moves counts between batches, never adds any)
            excess = max(0, self.server_spec.num_drafts - self.own_spec.num_drafts,
                         self.server_spec.num_draft_tokens - self.own_spec.num_draft_tokens)
            self.foreign += int(excess > self.foreign_excess)
            self.foreign_excess = max(self.foreign_excess, excess)
        else:  # more drafts or accepted tokens than the batch generated: someone else's requests
            ours = sum(generation.n_tokens for generation in generations)
            self.foreign += int(server.spec.num_drafts > ours or server.spec.num_accepted_tokens > ours)
        # a dedicated server's counters stand for the batch (GenerationRecord.spec_scope), unless
        # each request carried its own figures, which are already in the rows
        if self.dedicated and not per_request:
            self.spec += server.spec
            return server.spec
        return None

    def server_figures(self) -> ServerFigures | None:
        """A serving process's own gauges, each at its peak over the run's generate calls, and its
        spec-decode counter deltas summed over them."""
        if not self.servers:
            return None
        return ServerFigures(
            metrics_url=self.servers[-1].metrics_url,
            max_kv_cache_usage=peak([batch.max_kv_cache_usage for batch in self.servers]),
            max_num_requests_waiting=peak([batch.max_num_requests_waiting for batch in self.servers]),
            max_num_requests_running=peak([batch.max_num_requests_running for batch in self.servers]),
            spec=SpeculativeFigures.from_stats(self.server_spec) if self.server_spec.num_drafts else None,
            dedicated=self.dedicated, foreign_traffic_batches=self.foreign,
            request_ttft_ms_p50=percentile([t.ttft_ms for t in self.server_timings if t.ttft_ms is not None], 50),
            request_queue_ms_p50=percentile([t.queue_ms for t in self.server_timings if t.queue_ms is not None], 50),
            request_itl_ms_mean=mean_of([t.mean_itl_ms for t in self.server_timings if t.mean_itl_ms is not None]))

    def figures(self, engine_kv_cache_usage: float | None) -> dict[str, Any]:
        """The serving fields of RunFigures. The KV cache usage is the peak over the run: the
        engine's own (engine_kv_cache_usage), or the highest a server reported while it ran."""
        return {
            "ttft_ms_p50": percentile(self.ttft, 50), "ttft_ms_p99": percentile(self.ttft, 99),
            "tbt_ms_mean": statistics.fmean(self.itl) if self.itl else None,
            "tbt_ms_p50": percentile(self.itl, 50), "tbt_ms_p99": percentile(self.itl, 99),
            "tokens_per_second": statistics.fmean(self.tps) if self.tps else None,
            "generated_tokens": self.generated_tokens,
            "kv_cache_usage": peak([engine_kv_cache_usage, *(batch.max_kv_cache_usage for batch in self.servers)]),
            "server": self.server_figures(),
            "spec": SpeculativeFigures.from_stats(self.spec) if self.spec.num_drafts else None,
        }
