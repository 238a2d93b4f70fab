"""Sanity bounds: a figure that cannot be right is a measurement error, not a verdict.

A broken endpoint can produce numbers that look like a great result: prompt log-probs that are
all 0 give a perplexity ratio of 0.01, and a shared server's spec-decode counters can move by
other clients' traffic. Each check here names what it found; the aggregation turns a finding into
the `measurement_error` verdict for the comparison it would have corrupted, which makes the run
`incomplete` (never a pass) and keeps the alert state as it was (no data, like `inconclusive`).

    check                  where                     a measurement error when
    logprobs               each config's documents   a document's Σ log p is NaN/inf, or above 0 (a
                                                     probability over 1), or every document's is 0
    bounds                 every comparison          its estimate is outside the metric's valid range
                                                     (vocabulary/metrics.py `valid`): e.g. a perplexity
                                                     ratio below 0.9 (a candidate far better than its
                                                     own baseline), an acceptance outside [0, 1]
    spec_counters          spec-decode counters      a counter is negative (a server restarted), more
                                                     tokens were accepted than drafted, or more were
                                                     accepted, or more drafts run, than the requests
                                                     sent generated tokens (other traffic on the server)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from evals.records import DocRecord, GenerationRecord
from vocabulary.comparison import Comparison
from vocabulary.metrics import get_metric

MEASUREMENT_ERROR = "measurement_error"


def logprob_problem(docs: Sequence[DocRecord], whose: str = "the") -> str | None:
    """Why these documents' log-probs cannot come from a language model, or None. `whose` names
    the side in the message ("the candidate's")."""
    scored = [d for d in docs if d.n_tokens > 0]
    if not scored:
        return None
    not_finite = [d.sample_key for d in scored if not math.isfinite(d.nll)]
    if not_finite:
        return (f"logprobs: {whose} log-probs are NaN or infinite on {len(not_finite)} of {len(scored)} documents "
                f"(e.g. '{not_finite[0]}')")
    above_zero = [d.sample_key for d in scored if d.nll < 0]
    if above_zero:
        return (f"logprobs: {whose} log-probs sum above 0 (a probability over 1) on {len(above_zero)} of "
                f"{len(scored)} documents (e.g. '{above_zero[0]}')")
    if all(d.nll == 0 for d in scored):
        return (f"logprobs: {whose} log-probs are all 0 (probability 1) on all {len(scored)} documents: "
                f"the engine is not returning real log-probs")
    return None


def spec_counter_problem(generations: Sequence[GenerationRecord]) -> str | None:
    """Why the spec-decode counters over these generations cannot be ours, or None."""
    stats = [g.spec for g in generations if g.spec is not None]
    if not stats:
        return None
    drafts = sum(s.num_drafts for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    generated = sum(g.n_tokens for g in generations)
    if min(min(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) for s in stats) < 0:
        return "spec_counters: a spec-decode counter went down during the run (the server restarted?)"
    if accepted > drafted:
        return f"spec_counters: {accepted} tokens accepted of {drafted} drafted (an acceptance above 1)"
    if accepted > generated or drafts > generated:
        return (f"spec_counters: the server counted {drafts} drafts and {accepted} accepted tokens while the run's "
                f"requests generated {generated} tokens: other traffic on the server moved its counters")
    return None


def out_of_bounds(comparison: Comparison) -> str | None:
    """Why this comparison's estimate is outside what its metric can measure, or None."""
    low, high = get_metric(comparison.metric).valid
    x = comparison.estimate
    if x is None or math.isnan(x):
        return None
    if (low is not None and x < low) or (high is not None and x > high):
        span = f"{'(-∞' if low is None else f'[{low:g}'}, {'∞)' if high is None else f'{high:g}]'}"
        return f"bounds: {comparison.metric} {x:.4g} is outside {span}, the range a correct measurement falls in"
    return None


def as_measurement_error(comparison: Comparison, problem: str) -> Comparison:
    """The comparison, its figures kept for the record, with the verdict that says they are not a result."""
    return replace(comparison, verdict=MEASUREMENT_ERROR, rule=f"measurement error: {problem}",  # type: ignore[arg-type]
                   details={**(comparison.details or {}), "measurement_error": problem.split(":", 1)[0]})


def checked(comparison: Comparison, *problems: str | None) -> Comparison:
    """The comparison as it is, or as a measurement error for the first problem found (its own bounds last)."""
    for problem in (*problems, out_of_bounds(comparison)):
        if problem:
            return as_measurement_error(comparison, problem)
    return comparison
