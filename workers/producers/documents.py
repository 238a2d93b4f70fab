"""The documents producer (scorer `perplexity`): each document's rolling log-likelihood, DOC_BATCH
documents per engine call, one DocRecord per document with what the document signals read beside
it (workers/producers/terms.py, positions.py, decode.py, distributions.py: each fills its own
fields of the record). Its figures: the documents' token perplexity and counts, over every pass."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from engines.protocol import RollingRequest, RollingResult
from evals.records import DocRecord
from workers.producers.base import Batch, Producer, Work, register_producer

DOC_BATCH = 8  # documents per engine call; progress and a commit after each (the lease: LeaseKeeper)


class DocumentSignal:
    """Something read beside the documents' log-likelihoods and stored on their rows: made per
    attempt, then asked once per batch for each document's fields of its DocRecord."""

    def __init__(self, work: Work):
        self.work = work

    def fields(self, first: int, requests: list[RollingRequest], results: list[RollingResult],
               texts: list[str]) -> list[dict[str, Any]]:
        """Per document of the batch (its first document is the run's `first`-th), the DocRecord
        fields this signal fills; a shorter list leaves the rest untouched."""
        raise NotImplementedError


SIGNALS: list[type[DocumentSignal]] = []  # in the order they read (their engine calls' order)


def register_signal(cls: type[DocumentSignal]) -> type[DocumentSignal]:
    if cls not in SIGNALS:
        SIGNALS.append(cls)
    return cls


@register_producer
class Documents(Producer):
    scorer = "perplexity"
    records = (DocRecord,)

    def __init__(self, work: Work):
        super().__init__(work)
        self.nll_sum, self.n_tokens = 0.0, 0
        samples = work.job.samples
        # a top-up pass scores only the documents it appended (the config holds the rest)
        self.start = work.job.first_unscored(DocRecord.KIND, [key for key, _, _ in samples])

    def total(self) -> int:
        return len(self.work.job.samples) - self.start

    def batches(self) -> Iterator[Batch]:
        work, samples = self.work, self.work.job.samples
        signals = [cls(work) for cls in SIGNALS]
        for i in range(self.start, len(samples), DOC_BATCH):
            documents = samples[i : i + DOC_BATCH]
            requests = [RollingRequest(key, text, work.window) for key, text, _ in documents]
            results = work.engine.loglikelihood_rolling(requests)
            records = [DocRecord.from_result(doc, cluster, work.keep_ids)
                       for doc, (_, _, cluster) in zip(results, documents, strict=True)]
            texts = [text for _, text, _ in documents]
            for signal in signals:
                for j, fields in enumerate(signal.fields(i, requests, results, texts)):
                    records[j] = replace(records[j], **fields)
            for doc in results:
                self.nll_sum += doc.nll
                self.n_tokens += len(doc.token_ids)
            yield Batch([record.to_row() for record in records], len(documents))

    def figures(self) -> dict[str, Any]:
        nll_sum, n_tokens = self.nll_sum, self.n_tokens
        if self.start:  # a top-up pass: the documents the config held count too, read from their rows
            nll_sum += self.work.job.recorded_nll[0]
            n_tokens += self.work.job.recorded_nll[1]
        return {"token_ppl": math.exp(nll_sum / n_tokens) if n_tokens else None,
                "n_documents": len(self.work.job.samples), "n_tokens": n_tokens}


# the document signals, in the order they read (their engine calls follow the documents' in this order)
from workers.producers import decode, distributions, positions, terms  # noqa: E402,F401 - each registers itself
