"""Task accuracy with flips, paired: a candidate against its baseline on the same labelled items.

Accuracy alone hides flips: a quantized model can turn many answers right→wrong and as many
wrong→right at nearly equal accuracy (Dutta et al. 2024, "Accuracy is Not All You Need",
arXiv 2407.09141), and the flips track how far its distribution moved. So each side's accuracy is
reported with its Wilson interval, beside the recovery (candidate ÷ baseline, what llm-compressor
gates at 0.95), the two flip counts apart, and McNemar's exact test on them: with the items
paired, only the discordant ones carry evidence of a difference. An unpaired two-sample z-test on
the two accuracies (lm-eval's scripts/model_comparator.py) is computed too, for contrast: it
ignores the pairing, so it is both weaker and mis-calibrated here.

The building block of issue 34's labelled tasks; no scorer feeds it yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from evals.stats import wilson_interval


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
