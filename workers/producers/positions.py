"""Document signal: quality by position in the window (evals/positions.py): Σ −log p and tokens per
position bucket of the suite's window."""

from __future__ import annotations

from typing import Any

from engines.protocol import RollingRequest, RollingResult
from evals.positions import position_nll
from workers.producers.documents import DocumentSignal, register_signal


@register_signal
class Positions(DocumentSignal):
    def fields(self, first: int, requests: list[RollingRequest], results: list[RollingResult],
               texts: list[str]) -> list[dict[str, Any]]:
        return [{"positions": tuple(position_nll(doc.logprobs, self.work.window))} for doc in results]
