"""Document signal: the suite's domain terms (perplexity.terms; term_nll_ratio): Σ −log p over the
tokens that overlap a term, and their count (vocabulary/terms.py)."""

from __future__ import annotations

from typing import Any

from engines.protocol import RollingRequest, RollingResult
from vocabulary.terms import compile_terms, term_nll
from workers.producers.base import Work
from workers.producers.documents import DocumentSignal, register_signal


@register_signal
class Terms(DocumentSignal):
    def __init__(self, work: Work):
        super().__init__(work)
        self.pattern = compile_terms(work.job.suite.perplexity.terms)

    def fields(self, first: int, requests: list[RollingRequest], results: list[RollingResult],
               texts: list[str]) -> list[dict[str, Any]]:
        if not self.pattern:
            return []
        out = []
        for doc, text in zip(results, texts, strict=True):
            term_nll_, term_tokens = term_nll(text, doc.logprobs, doc.char_spans, self.pattern) or (None, None)
            out.append({"term_nll": term_nll_, "term_tokens": term_tokens})
        return out
