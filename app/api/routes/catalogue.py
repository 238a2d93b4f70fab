"""The metric catalogue: the rows of vocabulary/metrics.py as the API serves them. The dashboard reads
its columns, labels, formats and directions from here, so a new metric shows up without a
dashboard change."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from vocabulary.metrics import METRICS, VERDICTS

router = APIRouter(tags=["catalogue"])


class MetricOut(BaseModel):
    name: str
    label: str = Field(description="short column heading")
    unit: str
    direction: Literal["above", "below"] = Field(description="the side of the threshold that is bad")
    higher_is_better: bool
    comparison: str = Field(description="paired_ratio, paired_difference, rate, mean, percentile or peak")
    producer: str = Field(description="the suite scorer that measures it")
    definition: str
    gated: bool = Field(description="false: reported with its CI, no threshold, no say in the verdict")
    warn: float | None = Field(description="seed warn threshold (a project's own rules may differ)")
    critical: float | None
    min_n: int
    fmt: str = Field(description="Python format spec for the estimate, e.g. .4f")


class CatalogueOut(BaseModel):
    metrics: list[MetricOut]
    verdicts: list[str] = Field(description="from best to worst; a run's verdict is its worst gated comparison's")


@router.get("/metrics", response_model=CatalogueOut)
def catalogue() -> CatalogueOut:
    """Every comparison metric the canary computes, in display order."""
    return CatalogueOut(metrics=[MetricOut(**{k: v for k, v in m.as_dict().items() if k in MetricOut.model_fields})
                                 for m in METRICS.values()], verdicts=list(VERDICTS))
