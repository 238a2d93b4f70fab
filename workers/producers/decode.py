"""Document signal: the decode pass (perplexity.decode_samples; decode_nll_ratio). The suite's
first documents again, one token per decode step through the KV cache, each token read back from
its compressed cache: Σ −log p and its position buckets. An engine that cannot (ScoresDecode,
engines/protocol.py) scores none."""

from __future__ import annotations

from typing import Any

from engines.protocol import RollingRequest, RollingResult, scores_decode
from evals.positions import position_nll
from workers.producers.base import Work
from workers.producers.documents import DocumentSignal, register_signal


@register_signal
class DecodePass(DocumentSignal):
    def __init__(self, work: Work):
        super().__init__(work)
        self.n = work.job.suite.perplexity.decode_samples if scores_decode(work.engine) else 0

    def fields(self, first: int, requests: list[RollingRequest], results: list[RollingResult],
               texts: list[str]) -> list[dict[str, Any]]:
        if self.n <= first:
            return []
        decoded = self.work.engine.loglikelihood_decode(requests[: self.n - first])
        return [{"decode_nll": d.nll, "decode_positions": tuple(position_nll(d.logprobs, self.work.window))}
                for d in decoded]
