"""Read views for the dashboard: the current status of every config, metric trends over runs,
and a run's worst samples. Each is a handful of indexed queries, not a scan of sample results."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import and_, func, select
from sqlalchemy.orm import aliased

from app import repo
from app.api.deps import ProjectDep, RowId, SessionDep
from app.models import Alert, AlertRule, Comparison, ConfigRun, Model, OptimizationConfig, Run, SampleResult, Schedule
from app.api.routes.schedules import ScheduleOut
from app.schemas import FiguresOut, Time, Verdict, error_responses
from app.ssrf import public_spec
from evals.metrics import METRICS

router = APIRouter(tags=["views"], responses=error_responses(404))
MetricName = Literal[tuple(METRICS)]  # type: ignore[valid-type]  # the catalogue's names: another is a 422 naming them


class ComparisonCell(BaseModel):
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    verdict: Verdict
    rule: str
    baseline_value: float | None
    candidate_value: float | None


class OverviewConfig(BaseModel):
    config: str
    baseline: bool
    spec: dict[str, Any]
    run_id: int | None = Field(description="the config's latest finished run; null: never measured")
    checked_at: Time | None
    comparisons: dict[str, ComparisonCell] = Field(description="by metric name")
    figures: FiguresOut  # type: ignore[valid-type]


class OverviewOut(BaseModel):
    project: str
    models: dict[str, list[OverviewConfig]] = Field(description="by model name")
    last_check_at: Time | None
    next_check_at: Time | None
    schedules: list[ScheduleOut]


class TrendPoint(BaseModel):
    config: str
    run_id: int
    at: Time
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    verdict: Verdict


class TrendThreshold(BaseModel):
    warn: float
    critical: float | None
    direction: str
    config_id: int | None
    model_id: int | None


class TrendAlert(BaseModel):
    config: str | None
    severity: str
    state: str
    fired_at: Time | None
    resolved_at: Time | None
    run_id: int | None


class TrendsOut(BaseModel):
    metric: str
    points: list[TrendPoint] = Field(description="oldest first")
    thresholds: list[TrendThreshold]
    alerts: list[TrendAlert]


class WorstSample(BaseModel):
    sample_key: str
    delta: float = Field(description="how much worse the candidate is on this sample (in the metric's unit)")
    baseline_value: float | None
    candidate_value: float | None
    baseline_extra: dict[str, Any] | None
    candidate_extra: dict[str, Any] | None
    outputs: dict[str, dict[str, Any]] = Field(description="per side (baseline, candidate): generation, judge and faithfulness extras")


class WorstOut(BaseModel):
    run_id: int
    config: str
    metric: str
    items: list[WorstSample]


def iso(t):
    return t.isoformat() if t else None


@router.get("/projects/{project}/overview", response_model=OverviewOut)
def overview(project: ProjectDep, session: SessionDep) -> dict:
    """Per model, each config's latest finished run: comparisons (estimate, CI, verdict) and
    serving figures; when the last check ran and when the next is scheduled."""
    latest = (select(ConfigRun.config_id, func.max(ConfigRun.run_id).label("run_id"))
              .join(Run, Run.id == ConfigRun.run_id)
              .where(Run.project_id == project.id, Run.status == "done", ConfigRun.status == "succeeded")
              .group_by(ConfigRun.config_id).subquery())
    rows = session.execute(select(OptimizationConfig, latest.c.run_id)
                           .join(Model, Model.id == OptimizationConfig.model_id)
                           .outerjoin(latest, latest.c.config_id == OptimizationConfig.id)
                           .where(Model.project_id == project.id).order_by(Model.name, OptimizationConfig.id)).all()
    run_ids = {r for _, r in rows if r is not None}
    comps: dict[tuple[int, int], dict] = {}
    figures: dict[tuple[int, int], dict] = {}
    runs = {}
    if run_ids:
        for c in session.scalars(select(Comparison).where(Comparison.run_id.in_(run_ids))):
            comps.setdefault((c.run_id, c.config_id), {})[c.metric] = {
                "estimate": c.estimate, "ci_low": c.ci_low, "ci_high": c.ci_high, "n": c.n, "verdict": c.verdict, "rule": c.rule,
                "baseline_value": c.baseline_value, "candidate_value": c.candidate_value}
        for cr in session.scalars(select(ConfigRun).where(ConfigRun.run_id.in_(run_ids))):
            figures[(cr.run_id, cr.config_id)] = cr.figures or {}
        runs = {r.id: r for r in session.scalars(select(Run).where(Run.id.in_(run_ids)))}
    models: dict[str, list] = {}
    for cfg, run_id in rows:
        run = runs.get(run_id)
        models.setdefault(cfg.model.name, []).append({
            "config": cfg.name, "baseline": cfg.is_baseline, "spec": public_spec(cfg.spec), "run_id": run_id,
            "checked_at": iso(run.finished_at) if run else None,
            "comparisons": comps.get((run_id, cfg.id), {}), "figures": figures.get((run_id, cfg.id), {})})
    from app.api.routes.schedules import out as schedule_out

    schedules = [schedule_out(s) for s in session.scalars(select(Schedule).where(Schedule.project_id == project.id, Schedule.enabled.is_(True)))]
    last = session.scalar(select(func.max(Run.finished_at)).where(Run.project_id == project.id, Run.status == "done"))
    return {"project": project.name, "models": models, "last_check_at": iso(last),
            "next_check_at": min((s["next_slot_at"] for s in schedules), default=None), "schedules": schedules}


@router.get("/projects/{project}/trends", response_model=TrendsOut)
def trends(project: ProjectDep, session: SessionDep,
           metric: MetricName = Query("ppl_ratio", description="a metric of the catalogue (GET /metrics)"),
           config: str | None = Query(None, max_length=128), limit: int = Query(200, ge=1, le=2000)) -> dict:
    """A metric over time per config (newest `limit` comparisons), with the thresholds that
    apply and the alerts that fired on it."""
    q = (select(Comparison, Run.created_at, OptimizationConfig.name).join(Run, Run.id == Comparison.run_id)
         .join(OptimizationConfig, OptimizationConfig.id == Comparison.config_id)
         .where(Run.project_id == project.id, Comparison.metric == metric))
    if config:
        q = q.where(Comparison.config_id == repo.get_config(session, project, config).id)
    points = [{"config": name, "run_id": c.run_id, "at": iso(at), "estimate": c.estimate, "ci_low": c.ci_low, "ci_high": c.ci_high,
               "n": c.n, "verdict": c.verdict}
              for c, at, name in session.execute(q.order_by(Comparison.run_id.desc()).limit(limit))]
    points.reverse()
    rules = [{"warn": r.warn, "critical": r.critical, "direction": r.direction, "config_id": r.config_id, "model_id": r.model_id}
             for r in session.scalars(select(AlertRule).where(AlertRule.project_id == project.id, AlertRule.metric == metric))]
    alerts = [{"config": a.labels.get("config"), "severity": a.severity, "state": a.state, "fired_at": iso(a.fired_at),
               "resolved_at": iso(a.resolved_at), "run_id": a.run_id}
              for a in session.scalars(select(Alert).where(Alert.project_id == project.id, Alert.fired_at.is_not(None))
                                       .order_by(Alert.id.desc()).limit(500)) if a.labels.get("metric") == metric]
    return {"metric": metric, "points": points, "thresholds": rules, "alerts": alerts}


@router.get("/projects/{project}/runs/{run_id}/worst", response_model=WorstOut)
def worst_samples(run_id: RowId, project: ProjectDep, session: SessionDep, config: str = Query(..., max_length=128),
                  metric: str = Query("nll", max_length=64), limit: int = Query(20, ge=1, le=200)) -> dict:
    """The candidate's samples that regressed most against the baseline on one metric (higher
    NLL / lower score is worse), with both sides' raw values and extras."""
    run = repo.get_run(session, project, run_id)
    cand_id = repo.get_config(session, project, config).id
    if metric == "judge_pairwise":  # judged against the baseline already: 0 = baseline won, ½ tie, 1 candidate won
        rows = session.scalars(select(SampleResult).where(SampleResult.run_id == run.id, SampleResult.config_id == cand_id,
                                                          SampleResult.metric == metric, SampleResult.value.is_not(None))
                               .order_by(SampleResult.value, SampleResult.sample_key).limit(limit)).all()
        return {"run_id": run.id, "config": config, "metric": metric, "items": [
            {"sample_key": r.sample_key, "delta": 0.5 - r.value, "baseline_value": 0.5, "candidate_value": r.value,
             "baseline_extra": None, "candidate_extra": r.extra, "outputs": _outputs(session, run, cand_id, [r.sample_key]).get(r.sample_key, {})}
            for r in rows]}
    b, c = aliased(SampleResult), aliased(SampleResult)
    lower_is_worse = metric in ("faithfulness", "judge_score", "judge_pairwise")
    delta = (b.value - c.value) if lower_is_worse else (c.value - b.value)
    rows = session.execute(
        select(c, b, delta.label("delta")).join(b, and_(b.run_id == c.run_id, b.sample_key == c.sample_key, b.metric == c.metric,
                                                        b.config_id == run.baseline_config_id))
        .where(c.run_id == run.id, c.config_id == cand_id, c.metric == metric, c.value.is_not(None), b.value.is_not(None))
        .order_by(delta.desc()).limit(limit)).all()
    gens = _outputs(session, run, cand_id, [row[0].sample_key for row in rows])
    return {"run_id": run.id, "config": config, "metric": metric, "items": [
        {"sample_key": cr.sample_key, "delta": d, "baseline_value": br.value, "candidate_value": cr.value,
         "baseline_extra": br.extra, "candidate_extra": cr.extra, "outputs": gens.get(cr.sample_key, {})} for cr, br, d in rows]}


def _outputs(session, run, cand_id: int, keys: list[str]) -> dict:
    """Generations, judge verdicts and faithfulness statements of both sides, by sample."""
    gens: dict = {}
    if keys:
        for r in session.scalars(select(SampleResult).where(SampleResult.run_id == run.id, SampleResult.metric.in_(
                ("generation", "judge_pairwise", "faithfulness")), SampleResult.sample_key.in_(keys),
                SampleResult.config_id.in_((cand_id, run.baseline_config_id)))):
            side = "candidate" if r.config_id == cand_id else "baseline"
            gens.setdefault(r.sample_key, {}).setdefault(side, {})[r.metric] = r.extra
    return gens
