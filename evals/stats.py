"""Statistics for baseline-vs-candidate comparisons (docs/reference.md §6).

A verdict uses the confidence interval, not the point estimate alone:
  n < min_n                                        → inconclusive ("too few samples"; the rule says
                                                     what the CI already shows, e.g. beyond warn),
    except a CI wholly beyond critical on at least half of min_n samples → critical: a clear
    failure is not let through (and a gate not passed) because the sample was small
  metric 'above' (higher is worse), thresholds W ≤ C:
    ci_low ≥ C                                     → critical  (surely past critical)
    ci_low ≥ W                                     → warn      (surely past warn)
    ci_high < W                                    → ok        (surely inside warn)
    otherwise (the CI straddles W)                 → inconclusive
  metric 'below' (lower is worse) mirrors it: ci_high ≤ C → critical, ci_high ≤ W → warn,
  ci_low > W → ok, otherwise inconclusive.
"ok" therefore means the data rule out a regression as large as the warn threshold; a point
estimate near the threshold with a wide CI is "inconclusive", and the answer is more samples:
the rule says about how many would decide it at the current effect (samples_to_decide).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

from vocabulary.comparison import Verdict

TOO_FEW = "too few samples to decide"  # the rule of an inconclusive comparison below min_n (run reasons group them)


@dataclass(frozen=True)
class Thresholds:
    warn: float
    critical: float | None = None
    direction: Literal["above", "below"] = "above"  # which side of the threshold is bad
    min_n: int = 10

    @classmethod
    def seed(cls, metric: str) -> Thresholds:
        """The metric table's seed thresholds for `metric` (vocabulary/metrics.py)."""
        from vocabulary.metrics import METRICS

        m = METRICS[metric]
        return cls(m.warn if m.warn is not None else math.nan, m.critical, m.direction, m.min_n)

    def __post_init__(self) -> None:
        if self.critical is not None:
            bad = self.critical < self.warn if self.direction == "above" else self.critical > self.warn
            if bad:
                raise ValueError(
                    f"critical={self.critical} must be {'≥' if self.direction == 'above' else '≤'} warn={self.warn} "
                    f"for a metric that is bad {self.direction} its threshold"
                )


def samples_to_decide(estimate: float, ci_low: float, ci_high: float, n: int, bound: float) -> int | None:
    """About how many paired samples would decide a CI that straddles `bound`, if the effect stays
    where it is: the CI's half facing the bound narrows as 1/√n, so it clears the bound at
    n·(half / |estimate − bound|)². None where that cannot be said (no spread, or the estimate on
    the bound)."""
    half = (estimate - ci_low) if bound < estimate else (ci_high - estimate)
    gap = abs(estimate - bound)
    if not all(math.isfinite(x) for x in (half, gap)) or half <= 0 or gap <= 0:
        return None
    return max(n + 1, math.ceil(n * (half / gap) ** 2))


def clear_failure_n(min_n: int) -> int:
    """The fewest paired samples on which a CI wholly beyond critical is judged critical although
    n < min_n: half of min_n (at least 2). Fewer, and a bootstrap CI is too unsure of its own width."""
    return max(2, math.ceil(min_n / 2))


def decide(estimate: float, ci_low: float, ci_high: float, n: int, t: Thresholds) -> tuple[Verdict, str]:
    """Verdict and the rule that produced it (module docstring). An inconclusive rule says what
    would decide it: below min_n, what the CI already shows (beyond critical, say); a CI across
    the warn threshold, about how many samples would clear it at the current effect."""
    if n < t.min_n:
        rule = f"n={n} < min_n={t.min_n}: {TOO_FEW}"
        if not (math.isfinite(ci_low) and math.isfinite(ci_high)):
            return "inconclusive", rule
        shown, why = decide(estimate, ci_low, ci_high, n, Thresholds(t.warn, t.critical, t.direction, min_n=0))
        if shown == "inconclusive":
            return "inconclusive", f"{rule}; {why}"
        if shown == "critical" and n >= clear_failure_n(t.min_n):
            # a clear failure is not let through because the sample was small (module docstring)
            return "critical", f"{why}, though n={n} < min_n={t.min_n}: the whole CI lies beyond critical"
        return "inconclusive", f"{rule}, though the CI already shows {shown}: {why} ({t.min_n} samples decide it)"
    if t.direction == "above":
        if t.critical is not None and ci_low >= t.critical:
            return "critical", f"CI low {ci_low:.4g} ≥ critical {t.critical:g}"
        if ci_low >= t.warn:
            return "warn", f"CI low {ci_low:.4g} ≥ warn {t.warn:g}"
        if ci_high < t.warn:
            return "ok", f"CI high {ci_high:.4g} < warn {t.warn:g}"
        return "inconclusive", _straddles(estimate, ci_low, ci_high, n, t)
    if t.critical is not None and ci_high <= t.critical:
        return "critical", f"CI high {ci_high:.4g} ≤ critical {t.critical:g}"
    if ci_high <= t.warn:
        return "warn", f"CI high {ci_high:.4g} ≤ warn {t.warn:g}"
    if ci_low > t.warn:
        return "ok", f"CI low {ci_low:.4g} > warn {t.warn:g}"
    return "inconclusive", _straddles(estimate, ci_low, ci_high, n, t)


def _straddles(estimate: float, ci_low: float, ci_high: float, n: int, t: Thresholds) -> str:
    rule = f"CI [{ci_low:.4g}, {ci_high:.4g}] straddles warn {t.warn:g}: more samples needed"
    need = samples_to_decide(estimate, ci_low, ci_high, n, t.warn)
    return rule + (f" (about {need} at this effect)" if need is not None else "")


def bootstrap_counts(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """[n_resamples, n] multiplicities of each sample in each resample (with replacement)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    counts = np.zeros((n_resamples, n), dtype=np.float64)
    np.add.at(counts, (np.arange(n_resamples)[:, None], idx), 1.0)
    return counts


def paired_bootstrap_ci(
    statistic: Callable[[np.ndarray], np.ndarray],
    n: int,
    *,
    clusters: Sequence[Hashable] | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile CI of ``statistic(weights)`` over resampled samples.

    ``statistic`` receives a [R, n] weight matrix (how often each paired sample appears in each
    resample) and returns R values; pairing holds because a sample's baseline and candidate
    values are always resampled together. With ``clusters`` (one label per sample), whole
    clusters are resampled — samples cut from one source document rise and fall together, and
    the CI reflects the number of independent sources, not of chunks (docs/reference.md §6).
    """
    if n == 0:
        return float("nan"), float("nan")
    if clusters is None:
        weights = bootstrap_counts(n, n_resamples, seed)
    else:
        if len(clusters) != n:
            raise ValueError(f"clusters has {len(clusters)} labels for {n} samples")
        labels = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
        index = np.array([labels[c] for c in clusters])
        weights = bootstrap_counts(len(labels), n_resamples, seed)[:, index]
    values = statistic(weights)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(values, [alpha, 1 - alpha])
    return float(lo), float(hi)


def required_n(sd_delta: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Paired samples needed to detect a mean difference ``effect`` with a two-sided test:
    n = ((z_{1−α/2} + z_power) · σ_Δ / δ)² (docs/reference.md §6)."""
    if effect <= 0 or sd_delta < 0:
        raise ValueError("effect must be > 0 and sd_delta ≥ 0")
    z = NormalDist().inv_cdf
    return max(1, math.ceil(((z(1 - alpha / 2) + z(power)) * sd_delta / effect) ** 2))


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a rate (docs/reference.md §6)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return float(centre - half), float(centre + half)


def minimum_detectable_effect(sd_delta: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest mean difference n paired samples detect: δ = (z_{1−α/2} + z_power)·σ_Δ/√n
    (required_n solved for δ)."""
    if n < 1:
        raise ValueError("n must be ≥ 1")
    z = NormalDist().inv_cdf
    return (z(1 - alpha / 2) + z(power)) * sd_delta / math.sqrt(n)


def paired_mean_difference(
    baseline: Sequence[float], candidate: Sequence[float], *, clusters: Sequence[Hashable] | None = None,
    n_resamples: int = 2000, seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of (candidate − baseline) over paired samples and its (clustered) bootstrap CI."""
    if len(baseline) != len(candidate):
        raise ValueError(f"paired samples: {len(baseline)} baseline values vs {len(candidate)} candidate values")
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = paired_bootstrap_ci(lambda w: (w @ d) / w.sum(1), d.size, clusters=clusters, n_resamples=n_resamples,
                                 seed=seed)
    return float(d.mean()), lo, hi


def cohen_kappa(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """Agreement of two raters beyond chance: κ = (p_o − p_e) / (1 − p_e), p_e from each rater's
    label frequencies. 1 = perfect, 0 = chance. NaN when p_e = 1 (one label only)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"cohen_kappa needs two equally long, non-empty label lists; got {len(a)} and {len(b)}")
    n = len(a)
    p_o = sum(x == y for x, y in zip(a, b, strict=True)) / n
    labels = set(a) | set(b)
    p_e = sum((list(a).count(lab) / n) * (list(b).count(lab) / n) for lab in labels)
    return float("nan") if p_e == 1 else (p_o - p_e) / (1 - p_e)
