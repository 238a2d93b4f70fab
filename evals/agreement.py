"""Output agreement with the baseline (docs/design.md §Scorers): greedy exact-match rate and the
first position where outputs diverge; top-1 agreement and KL divergence against the baseline's
next-token distributions from the perplexity pass (llama.cpp --kl-divergence). Speculative
decoding at temperature 0 must score exact-match 1.0: it is lossless."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from evals.stats import wilson_interval


def first_divergence(baseline: Sequence, candidate: Sequence) -> int | None:
    """Index of the first differing token (or the shorter length when one is a prefix of the
    other); None when identical."""
    for i, (a, b) in enumerate(zip(baseline, candidate, strict=False)):
        if a != b:
            return i
    return None if len(baseline) == len(candidate) else min(len(baseline), len(candidate))


@dataclass(frozen=True)
class ExactMatch:
    n: int
    matches: int
    rate: float | None
    ci: tuple[float, float]  # Wilson
    mean_first_divergence: float | None  # over the samples that diverge


def exact_match(baseline: Sequence[Sequence], candidate: Sequence[Sequence]) -> ExactMatch:
    """Paired outputs (token ids, or texts where ids are unknown)."""
    if len(baseline) != len(candidate):
        raise ValueError(f"paired outputs: {len(baseline)} baseline vs {len(candidate)} candidate")
    div = [first_divergence(a, b) for a, b in zip(baseline, candidate, strict=True)]
    m = sum(d is None for d in div)
    diverged = [d for d in div if d is not None]
    n = len(div)
    return ExactMatch(n, m, m / n if n else None, wilson_interval(m, n),
                      float(np.mean(diverged)) if diverged else None)


def top1_agreement(baseline_greedy: Sequence[int], candidate_greedy: Sequence[int]) -> float:
    """Share of positions where both configs' argmax next tokens agree (same scored tokens)."""
    if len(baseline_greedy) != len(candidate_greedy) or not baseline_greedy:
        raise ValueError(f"top-1 agreement needs equally long, non-empty greedy sequences; "
                         f"got {len(baseline_greedy)} and {len(candidate_greedy)}")
    return float(np.mean(np.asarray(baseline_greedy) == np.asarray(candidate_greedy)))


def kl_divergence(baseline_logprobs: np.ndarray, candidate_logprobs: np.ndarray) -> np.ndarray:
    """KL(P_baseline ‖ P_candidate) per position, in nats: Σ_v p(v)·(log p(v) − log q(v)) over
    log-prob rows [T, V] (normalised log-softmax outputs)."""
    p_log = np.asarray(baseline_logprobs, dtype=np.float64)
    q_log = np.asarray(candidate_logprobs, dtype=np.float64)
    if p_log.shape != q_log.shape:
        raise ValueError(f"log-prob shapes differ: {p_log.shape} vs {q_log.shape}")
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)
