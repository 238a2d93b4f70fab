"""Document signal: next-token distributions on the suite's first perplexity.distribution_samples
documents (kld_mean). A candidate whose engine and the baseline's both give whole distributions
(GivesDistributions: in-process) is compared with the baseline engine here, token by token
(evals/distribution.py); otherwise the config-run stores its own top-k table (DocTopK), compared
with the baseline's stored one at aggregation. The baseline's table is always stored: every
candidate's aggregation reads it, and a reused baseline carries it."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np

from engines.openai import NoDistributions
from engines.protocol import GivesDistributions, GivesTopK, RollingRequest, RollingResult, gives_distributions
from evals.distribution import TOP_K, doc_distribution, topk_rows
from evals.positions import position_totals
from evals.records import DocDistribution, DocTopK, tokens_digest
from workers.producers.base import Work
from workers.producers.documents import DocumentSignal, register_signal

log = logging.getLogger(__name__)


# The baseline engine's distributions of a document, kept in the worker process: every candidate of a
# run compares with the same ones, and an in-process engine gives the same rows for the same request,
# so a process that runs several candidates (the demo's two run seven each) computes them once. Keyed
# by the engine object (an engine the cache lets go takes its rows with it), at most KEPT_BYTES in all.
KEPT_BYTES = 256 << 20
_kept: weakref.WeakKeyDictionary[Any, OrderedDict[RollingRequest, tuple[RollingResult, np.ndarray]]] = \
    weakref.WeakKeyDictionary()


def kept_distributions(engine: GivesDistributions, request: RollingRequest) -> tuple[RollingResult, np.ndarray]:
    """engine.next_token_logprobs([request])'s one answer, from what this process kept if it has it."""
    rows = _kept.setdefault(engine, OrderedDict())
    if request in rows:
        rows.move_to_end(request)
        return rows[request]
    [answer] = engine.next_token_logprobs([request])
    rows[request] = answer
    while sum(a.nbytes for _, a in rows.values()) > KEPT_BYTES and len(rows) > 1:
        rows.popitem(last=False)
    return answer


def compared_with_baseline(engine: GivesDistributions, baseline: GivesDistributions,
                           requests: list[RollingRequest]) -> list[DocDistribution | None]:
    """Per document, the candidate's whole next-token distributions against the baseline
    engine's (both in-process; the baseline's as this process kept them); None for a document
    the two tokenize differently."""
    out: list[DocDistribution | None] = []
    for request in requests:  # one document at a time: two [T, V] arrays live
        [(r, q)], (b, p) = engine.next_token_logprobs([request]), kept_distributions(baseline, request)
        d = doc_distribution(p, q, r.token_ids) if r.token_ids == b.token_ids else None
        # KLD by position in the window (evals/positions.py), as the perplexity ratio is kept
        out.append(replace(d, positions=position_totals(d.kld, request.window)) if d else None)
    return out


def own_topk(engine: GivesDistributions | GivesTopK, requests: list[RollingRequest],
             baseline: bool = False) -> list[DocTopK]:
    """Per document, the config's own top-k table: its whole distributions cut to their top k
    in-process (a baseline's kept for its candidates in this process), or what a server returns
    (at most 20)."""
    out = []
    for request in requests:
        if isinstance(engine, GivesDistributions):
            [(result, rows)] = [kept_distributions(engine, request)] if baseline else \
                engine.next_token_logprobs([request])
            ids, logprobs = topk_rows(rows, TOP_K)
        else:
            [(result, top_ids, top_logprobs)] = engine.next_token_topk([request], TOP_K)
            ids, logprobs = np.asarray(top_ids), np.asarray(top_logprobs, np.float64)
        out.append(DocTopK(int(ids.shape[1]), tuple(int(x) for x in ids.ravel()),
                           tuple(float(x) for x in logprobs.ravel()), tuple(result.logprobs),
                           (request.window.max_length, request.window.stride), tokens_digest(result.token_ids)))
    return out


@register_signal
class Distributions(DocumentSignal):
    def __init__(self, work: Work):
        super().__init__(work)
        n, job = work.job.suite.perplexity.distribution_samples, work.job
        # a candidate's whole distributions against the baseline engine's, where both give them
        self.baseline = None
        if n and not job.is_baseline and isinstance(work.engine, GivesDistributions):
            baseline = work.baseline().engine
            self.baseline = baseline if isinstance(baseline, GivesDistributions) else None
        self.n_compared = n if self.baseline is not None else 0
        # else (and always for the baseline) the config-run's own top-k table
        self.n_topk = n if n and gives_distributions(work.engine) and (self.baseline is None or job.is_baseline) else 0

    def fields(self, first: int, requests: list[RollingRequest], results: list[RollingResult],
               texts: list[str]) -> list[dict[str, Any]]:
        work = self.work
        compared = compared_with_baseline(work.engine, self.baseline, requests[: max(0, self.n_compared - first)]) \
            if self.baseline is not None else []
        try:
            tables = own_topk(work.engine, requests[: max(0, self.n_topk - first)], work.job.is_baseline)
        except NoDistributions as e:  # a server that cannot give them (llama-cpp-python: text prompts only);
            # a server error (5xx) fails the pass as the echo for perplexity would, rather than leave
            # every candidate of the run without kld_mean
            log.warning("config-run %s stores no next-token top-k: %s", work.config_run_id, e)
            work.notes.append(f"no next-token distributions (kld_mean): {e}")
            tables, self.n_topk = [], 0
        out: list[dict[str, Any]] = [{} for _ in requests]
        for j, d in enumerate(compared):
            out[j]["distribution"] = d
        for j, table in enumerate(tables):
            out[j]["topk"] = table
        return out
