"""Task accuracy with flips, paired: a candidate against its baseline on the same labelled items.

Accuracy alone hides flips: a quantized model can turn many answers right→wrong and as many
wrong→right at nearly equal accuracy (Dutta et al. 2024, "Accuracy is Not All You Need",
arXiv 2407.09141), and the flips track how far its distribution moved. So each side's accuracy is
reported with its Wilson interval, beside the recovery (candidate ÷ baseline, what llm-compressor
gates at 0.95), the two flip counts apart, and McNemar's exact test on them: with the items
paired, only the discordant ones carry evidence of a difference. An unpaired two-sample z-test on
the two accuracies (lm-eval's scripts/model_comparator.py) is computed too, for contrast: it
ignores the pairing, so it is both weaker and mis-calibrated here.

The labelled scorer (vocabulary/labelled.py) feeds it: `task_recovery` and `task_flips` are its two
metric rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from evals.health import NEAR_TIE_NATS
from evals.records import ItemRecord
from evals.stats import Thresholds, decide, paired_bootstrap_ci, wilson_interval
from vocabulary.comparison import Comparison


def mcnemar_exact_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """Two-sided exact McNemar p-value: under no difference each discordant item is a fair coin,
    so p = min(1, 2·P(X ≤ min(b, c))) with X ~ Binomial(b + c, ½); 1 when nothing flipped."""
    b, c = right_to_wrong, wrong_to_right
    if b < 0 or c < 0:
        raise ValueError(f"flip counts must be ≥ 0, got {b} and {c}")
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, k) for k in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2 * tail)


def unpaired_z_p(acc_a: float, acc_b: float, n_a: int, n_b: int) -> float:
    """lm-eval's model_comparator test: z = (a − b) / √(se_a² + se_b²), each se the sample standard
    error of a 0/1 mean, √(p(1 − p)/(n − 1)); two-sided normal p-value."""
    se = math.sqrt(acc_a * (1 - acc_a) / (n_a - 1) + acc_b * (1 - acc_b) / (n_b - 1))
    if se == 0:
        return 1.0 if acc_a == acc_b else 0.0
    z = (acc_a - acc_b) / se
    return 2 * (1 - NormalDist().cdf(abs(z)))


@dataclass(frozen=True)
class PairedAccuracy:
    n: int
    baseline_correct: int
    candidate_correct: int
    right_to_wrong: int  # the baseline right, the candidate wrong
    wrong_to_right: int
    baseline_ci: tuple[float, float]  # Wilson
    candidate_ci: tuple[float, float]
    recovery: float | None  # candidate accuracy ÷ baseline accuracy; None when the baseline got nothing right
    mcnemar_p: float
    unpaired_z_p: float

    @property
    def baseline_accuracy(self) -> float:
        return self.baseline_correct / self.n

    @property
    def candidate_accuracy(self) -> float:
        return self.candidate_correct / self.n

    @property
    def flips(self) -> int:
        return self.right_to_wrong + self.wrong_to_right


def paired_accuracy(baseline: Sequence[bool], candidate: Sequence[bool]) -> PairedAccuracy:
    """Per-item correctness of both sides, in the same item order."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(f"paired accuracy needs equally long, non-empty item lists; got {len(baseline)} and "
                         f"{len(candidate)}")
    n = len(baseline)
    base, cand = sum(map(bool, baseline)), sum(map(bool, candidate))
    b = sum(1 for x, y in zip(baseline, candidate, strict=True) if x and not y)
    c = sum(1 for x, y in zip(baseline, candidate, strict=True) if y and not x)
    return PairedAccuracy(n, base, cand, b, c, wilson_interval(base, n), wilson_interval(cand, n),
                          cand / base if base else None, mcnemar_exact_p(b, c), unpaired_z_p(base / n, cand / n, n, n))


def _pairs(candidate: Mapping[str, ItemRecord], baseline: Mapping[str, ItemRecord]) -> tuple[list[bool], list[bool]]:
    keys = [k for k in baseline if k in candidate]
    return [baseline[k].correct for k in keys], [candidate[k].correct for k in keys]


def _details(r: PairedAccuracy) -> dict:
    return {"items": r.n, "baseline_accuracy": r.baseline_accuracy, "candidate_accuracy": r.candidate_accuracy,
            "baseline_ci": list(r.baseline_ci), "candidate_ci": list(r.candidate_ci),
            "right_to_wrong": r.right_to_wrong, "wrong_to_right": r.wrong_to_right, "mcnemar_p": r.mcnemar_p,
            "unpaired_z_p": r.unpaired_z_p}


def recovery_comparison(candidate: Mapping[str, ItemRecord], baseline: Mapping[str, ItemRecord], t: Thresholds,
                        seed: int = 0) -> Comparison | None:
    """task_recovery: the candidate's right answers ÷ the baseline's on the same items, with a
    paired bootstrap CI over items; the accuracies, flips and McNemar's p in its details."""
    base, cand = _pairs(candidate, baseline)
    if not base:
        return None
    r = paired_accuracy(base, cand)
    if r.baseline_correct == 0:
        return Comparison("task_recovery", math.nan, math.nan, math.nan, r.n, "inconclusive",
                          "the baseline answered no item right: recovery is undefined; use items the baseline can do",
                          details=_details(r))
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    lo, hi = paired_bootstrap_ci(lambda w: (w @ c) / np.maximum(w @ b, 1e-12), r.n, seed=seed)
    est = r.candidate_correct / r.baseline_correct
    verdict, rule = decide(est, lo, hi, r.n, t)
    return Comparison("task_recovery", est, lo, hi, r.n, verdict, f"accuracy recovery: {rule}",
                      baseline_value=r.baseline_accuracy, candidate_value=r.candidate_accuracy, details=_details(r))


def margin(record: ItemRecord) -> float | None:
    """How far a multiple-choice answer's choice led the runner-up, in nats (Σ log p); None for a
    generated answer."""
    if len(record.scores) < 2:
        return None
    top, second = sorted(record.scores, reverse=True)[:2]
    return top - second


def near_tie_flips(candidate: Mapping[str, ItemRecord], baseline: Mapping[str, ItemRecord], tau: float) -> int:
    """Flipped multiple-choice items where either side's chosen answer led by at most `tau` nats:
    flips a server's nondeterminism alone can cause (the suite's near_tie_nats, as for greedy
    outputs)."""
    count = 0
    for key, b in baseline.items():
        c = candidate.get(key)
        if c is not None and b.correct != c.correct:
            margins = [m for m in (margin(b), margin(c)) if m is not None]
            count += bool(margins) and min(margins) <= tau
    return count


def flips_comparison(candidate: Mapping[str, ItemRecord], baseline: Mapping[str, ItemRecord],
                     t: Thresholds, tau: float = NEAR_TIE_NATS) -> Comparison | None:
    """task_flips: the share of items the candidate answers differently right-or-wrong from the
    baseline (either way), with its Wilson interval: flips at equal accuracy count here. Its details
    also count the flips at a near-tie (near_tie_flips), reported, not subtracted."""
    base, cand = _pairs(candidate, baseline)
    if not base:
        return None
    r = paired_accuracy(base, cand)
    lo, hi = wilson_interval(r.flips, r.n)
    est = r.flips / r.n
    verdict, rule = decide(est, lo, hi, r.n, t)
    why = (f"{r.right_to_wrong} right→wrong, {r.wrong_to_right} wrong→right of {r.n} "
           f"(McNemar p {r.mcnemar_p:.3g}): {rule}")
    return Comparison("task_flips", est, lo, hi, r.n, verdict, why, baseline_value=0.0, candidate_value=est,
                      details=_details(r) | {"near_tie_flips": near_tie_flips(candidate, baseline, tau),
                                             "near_tie_nats": tau})
