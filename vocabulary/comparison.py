"""The one typed comparison: candidate vs baseline on one metric, from paired samples. evals'
producers make it (evals/compare.py, evals/field.py), the worker's aggregation gives it its
config and hands the list to top-up, step-back and storage (workers/aggregate.py,
app/repo/runs.py write_comparisons); the stored row (app/models.py) has the same fields and the
API's ComparisonOut (app/schemas.py) serves them. numpy- and torch-free, so app/ may import it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Verdict = Literal["ok", "warn", "critical", "inconclusive", "measurement_error"]


@dataclass(frozen=True)
class Comparison:
    """Candidate vs baseline for one metric, from paired samples."""

    metric: str
    estimate: float
    ci_low: float
    ci_high: float
    n: int
    verdict: Verdict
    rule: str
    baseline_value: float | None = None
    candidate_value: float | None = None
    details: dict = field(default_factory=dict)
    # False: reported with its CI, no say in any verdict, although the metric's row is gated (its
    # producer decided: an offline faithfulness approximation, a lossless check over a noisy floor)
    gated: bool = True
    config_id: int | None = None  # the config it judges, once a run holds it (workers/aggregate.py)

    def to_row(self) -> dict[str, Any]:
        """Its stored columns (app/models.py Comparison): a NaN figure (nothing to estimate) as
        None, empty details as None."""
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("estimate", "ci_low", "ci_high", "baseline_value", "candidate_value"):
            x = row[name]
            row[name] = None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
        row["details"] = self.details or None
        return row


STORED = tuple(f.name for f in fields(Comparison))  # the stored row's columns beside run_id


def bucket_interval(bucket: dict[str, Any]) -> tuple[float, float, float]:
    """(estimate, CI low, CI high) of one position bucket in a comparison's details["by_position"]
    (evals.compare.ppl_ratio_by_position and gen_nll_ratio_by_position write them)."""
    return bucket["estimate"], bucket["ci_low"], bucket["ci_high"]
