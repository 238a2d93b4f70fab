"""Read views for the dashboard: the current status of every config, metric trends over runs,
and a run's worst samples. Each is a handful of indexed queries, not a scan of sample results."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query
from pydantic import AliasChoices, BaseModel, Field
from sqlalchemy import ColumnElement, Row, and_, func, select
from sqlalchemy.orm import Session

from app import queries, repo
from app.api.deps import ProjectDep, RowId, SessionDep
from app.api.routes.schedules import ScheduleOut
from app.api.routes.schedules import out as schedule_out
from app.models import (
    Alert,
    AlertRule,
    ComparisonRow,
    ConfigRun,
    Model,
    OptimizationConfig,
    Project,
    Run,
    Schedule,
    Suite,
)
from app.schemas import ComparisonOut, FiguresOut, Time, Verdict, VerdictSummaryOut, error_responses
from app.services import decide_command, decide_settings_commands
from app.settings import get_settings
from app.ssrf import public_spec
from app.summary import Advice, verdict_summary
from vocabulary.figures import spec_digest
from vocabulary.metrics import METRICS, VERDICT_ORDER

if TYPE_CHECKING:
    from typing_extensions import Unpack

router = APIRouter(tags=["views"], responses=error_responses(404))
if TYPE_CHECKING:  # a Literal built at run time: to a type checker, a str
    MetricName = str
else:
    MetricName = Literal[tuple(METRICS)]  # the catalogue's names: another is a 422 naming them


class ComparisonCell(BaseModel):
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    verdict: Verdict
    rule: str
    baseline_value: float | None
    candidate_value: float | None
    judged: bool = Field(True, validation_alias=AliasChoices("judged", "gated"),  # the stored row's `gated`
                         description="false: reported but not judged against its threshold (e.g. faithfulness "
                                     "by the offline approximation); its verdict says nothing")
    advice: str | None = Field(None, description="a stacked config's step-back advice on this metric (the layer "
                                                 "to disable), else null")


class HistoryPoint(BaseModel):
    run_id: int
    estimate: float | None
    verdict: Verdict


class OverviewConfig(BaseModel):
    config: str
    baseline: bool
    spec: dict[str, Any]
    run_id: int | None = Field(description="the run that stands for the config: of the suite's last 10 done runs "
                                           "that measured it (and its baseline) as it is now, the one with the most "
                                           "samples, the newest among equals (else its latest run of the suite); "
                                           "null: never measured on it")
    checked_at: Time | None
    edited_since_checked: bool = Field(False, description=(
        "the config (or its run's baseline) was edited in place after run_id measured it, and no recent run has "
        "measured it since: its figures describe the earlier definition; run it again"))
    comparisons: dict[str, ComparisonCell] = Field(description="by metric name")
    figures: FiguresOut
    baseline_figures: FiguresOut | None = Field(None, description=(
        "the baseline's figures in the same run (run_id): what a tile compares this config with; null for the "
        "baseline itself, or where the run has no baseline config-run"))
    breaching_metric: str | None = Field(description="the worst metric of the latest run when it is warn or critical")
    breaching_since: Time | None = Field(
        description="start of the first run of the unbroken streak of warn/critical on breaching_metric (this suite)")
    ppl_history: list[HistoryPoint] = Field(description="ppl_ratio over the suite's recent runs, oldest first")


class OverviewOut(BaseModel):
    project: str
    suite: str | None = Field(description="the suite shown: the one asked for, else the enabled schedule's, "
                                          "else the last run's")
    suites: list[str] = Field(description="every suite of the project")
    models: dict[str, list[OverviewConfig]] = Field(description="by model name")
    summaries: dict[str, VerdictSummaryOut] = Field(default_factory=dict, description=(
        "by model name: the verdict for people over each config's strongest recent run (app/summary.py)"))
    last_check_at: Time | None = Field(description="the suite's last finished run")
    next_check_at: Time | None = Field(description="the next slot of a schedule of the suite")
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
    config: str | None = Field(description="the config the rule is scoped to; null: every config (of the model)")


class TrendAlert(BaseModel):
    config: str | None
    severity: str
    state: str
    fired_at: Time | None
    resolved_at: Time | None
    run_id: int | None = Field(description="the run it fired on (later runs that re-checked it are not marked)")


class TrendsOut(BaseModel):
    metric: str
    suite: str | None = Field(description="points come from this suite's runs only (default as on the overview)")
    suites: list[str]
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
    outputs: dict[str, dict[str, Any]] = Field(
        description="per side (baseline, candidate): generation, judge and faithfulness extras")


class WorstOut(BaseModel):
    run_id: int
    config: str
    metric: str
    items: list[WorstSample]


def iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


SuiteQuery = Query(None, max_length=128,
                   description="a suite name; default: the enabled schedule's suite, else the suite of the last "
                               "finished run. Other suites' runs are never mixed in")
HISTORY_RUNS = 100  # how far back "breaching since" and the sparkline look (runs of the suite)
EVIDENCE_RUNS = 10  # how far back the Overview looks for a config's strongest evidence (runs of the suite)


def _strongest_evidence(session: Session, done: ColumnElement[bool], rows: Sequence) -> list[tuple]:
    """Each (config, latest run id) with the run that stands for it instead, and whether that run
    measured the config as it is now: among the suite's last EVIDENCE_RUNS done runs at the newest
    run's suite version, the config's run with the most samples drawn, the newest among equals,
    that measured the config and its run's baseline as they are now (the digest of the spec each
    config-run loaded, in its figures: a config edited in place after a 100-sample nightly has the 12-sample
    run after the edit as its evidence, not the nightly). A smaller, later run never hides stronger
    evidence about the same definition. A config none of those runs measured as it is now keeps its
    latest run, marked edited when that run measured an earlier definition (a run stored before
    config-runs kept their spec counts as measuring the config as it is)."""
    recent = session.execute(select(Run.id, Run.suite_version, Run.sample_keys, Run.baseline_config_id).where(done)
                             .order_by(Run.id.desc()).limit(EVIDENCE_RUNS)).all()
    latest = [row[1] for row in rows if row[1] is not None]
    run_ids = {run_id for run_id, *_ in recent} | set(latest)
    measured: dict[tuple[int, int], str | None] = {}  # (run, config) → its config_digest (None: not kept)
    for run_id, config_id, figures in session.execute(
            select(ConfigRun.run_id, ConfigRun.config_id, ConfigRun.figures)
            .where(ConfigRun.run_id.in_(list(run_ids)), ConfigRun.status == "succeeded")):
        measured[(run_id, config_id)] = (figures or {}).get("config_digest")
    baseline_of = {run_id: base for run_id, _, _, base in recent}
    baseline_of |= dict(session.execute(select(Run.id, Run.baseline_config_id).where(Run.id.in_(latest))).all())
    spec_now = {config_id: spec_digest(spec) for config_id, spec in session.execute(  # config id → its digest now
        select(OptimizationConfig.id, OptimizationConfig.spec).where(OptimizationConfig.id.in_(
            list({base for base in baseline_of.values()} | {cfg.id for cfg, _ in rows}))))}

    def as_now(run_id: int, config_id: int) -> bool:
        """Whether the run measured the config, and its baseline, as they are now."""
        return all(measured.get((run_id, c)) in (None, spec_now.get(c)) for c in {config_id, baseline_of.get(run_id)}
                   if c is not None)

    size = {run_id: len(keys or ()) for run_id, version, keys, _ in recent if version == recent[0][1]} \
        if recent else {}
    best: dict[int, tuple[int, int]] = {}
    for run_id, config_id in measured:
        if run_id in size and as_now(run_id, config_id):
            best[config_id] = max(best.get(config_id, (-1, -1)), (size[run_id], run_id))
    out = []
    for cfg, run_id in rows:
        if cfg.id in best:
            out.append((cfg, best[cfg.id][1], False))
        else:
            out.append((cfg, run_id, run_id is not None and not as_now(run_id, cfg.id)))
    return out


BREACHING = ("warn", "critical")


def _suite(session: Session, project: Project, name: str | None) -> Suite | None:
    """The suite asked for (404 naming the project's suites), else the daily schedule's, else the last run's."""
    if name:
        return repo.get_suite(session, project, name)
    suite_id = session.scalar(select(Schedule.suite_id)
                              .where(Schedule.project_id == project.id, Schedule.enabled.is_(True))
                              .order_by(Schedule.id).limit(1))
    if suite_id is None:
        suite_id = session.scalar(select(Run.suite_id).where(Run.project_id == project.id, Run.status == "done")
                                  .order_by(Run.id.desc()).limit(1))
    return session.get(Suite, suite_id) if suite_id is not None else None


def _suite_names(session: Session, project: Project) -> list[str]:
    return list(session.scalars(select(Suite.name).where(Suite.project_id == project.id).order_by(Suite.id)))


CELL_COLUMNS = tuple(getattr(ComparisonRow, name) for name in (
    "run_id", "config_id", "metric", "estimate", "ci_low", "ci_high", "n", "verdict", "rule", "baseline_value",
    "candidate_value", "details", "gated"))


def _cell(c: ComparisonRow | Row[Unpack[tuple[Any, ...]]]) -> dict:
    """A comparison (a ComparisonRow or a row of CELL_COLUMNS) as the overview's cell."""
    cell = ComparisonCell.model_validate(c, from_attributes=True).model_dump()
    found = (c.details or {}).get("step_back")
    cell["advice"] = found.get("advice") if isinstance(found, dict) else None
    return cell


def _worst_metric(cells: dict[str, dict]) -> str | None:
    """The metric with the worst verdict (ppl_ratio wins a tie), when that verdict breaches."""
    if not cells:
        return None
    name = max(cells, key=lambda m: (VERDICT_ORDER.get(cells[m]["verdict"], 0), m == "ppl_ratio"))
    return name if cells[name]["verdict"] in BREACHING else None


def _model_summary(configs: list[dict], project: str, suite: str, runs: dict[int, tuple], documents: int | None,
                   limit: int) -> VerdictSummaryOut:
    """The verdict for people over a model's configs' latest comparisons (app/summary.py), naming
    the engine and device of a speed finding; the command that decides the undecided ones only
    where every config's latest run is the same run (else no one command reruns them as they ran)."""
    comparisons = [ComparisonOut.model_validate({**cell, "config": c["config"], "metric": metric, "details": {},
                                                 "gated": cell["judged"]})
                   for c in configs if not c["baseline"] for metric, cell in c["comparisons"].items()]
    run_ids = {c["run_id"] for c in configs if c["run_id"] is not None}
    one = runs[run_ids.pop()] if len(run_ids) == 1 else None  # its samples drawn: a command never asks for fewer
    decide = decide_command(project, suite, one[2]) if one is not None else None
    # a stacked config's advice, the first by metric name as the run's own summary takes it (app/services.py)
    step_back = [Advice(c["config"], c["comparisons"][metric]["advice"])
                 for c in configs for metric in sorted(c["comparisons"]) if c["comparisons"][metric].get("advice")]
    return verdict_summary(comparisons, step_back, figures={c["config"]: c["figures"] for c in configs},
                           decide_with=decide, decide_settings_with=decide_settings_commands(project),
                           decide_cap=min(documents or limit, limit), drawn=one[3] if one is not None else None,
                           edited={c["config"]: c["run_id"] for c in configs if c.get("edited_since_checked")})


@router.get("/projects/{project}/overview", response_model=OverviewOut)
def overview(project: ProjectDep, session: SessionDep, suite: str | None = SuiteQuery) -> dict:
    """Per model, each config's strongest recent evidence on one suite (of the suite's last 10 done
    runs, the config's run with the most samples: a smaller, later run never hides a larger one):
    comparisons (estimate, CI, n, verdict), serving figures, since when it breaches and its
    ppl_ratio history; when the suite was last checked and when its schedule checks next."""
    chosen = _suite(session, project, suite)
    suite_id = chosen.id if chosen else -1
    done = and_(Run.project_id == project.id, Run.status == "done", Run.suite_id == suite_id)
    # one statement each below, whatever the history's length: the recent runs as a subquery, not a
    # list of ids bound one parameter each (a new statement for the driver at every length)
    recent_q = select(Run.id).where(done).order_by(Run.id.desc()).limit(HISTORY_RUNS)
    recent = set(session.scalars(recent_q))
    latest = (select(ConfigRun.config_id, func.max(ConfigRun.run_id).label("run_id"))
              .join(Run, Run.id == ConfigRun.run_id).where(done, ConfigRun.status == "succeeded")
              .group_by(ConfigRun.config_id).subquery())
    newest = session.execute(select(OptimizationConfig, latest.c.run_id)
                             .join(Model, Model.id == OptimizationConfig.model_id)
                             .outerjoin(latest, latest.c.config_id == OptimizationConfig.id)
                             .where(Model.project_id == project.id, OptimizationConfig.ablation_of_id.is_(None))
                             .order_by(Model.name, OptimizationConfig.id)).all()
    evidence = _strongest_evidence(session, done, newest)
    edited = {cfg.id for cfg, _, was_edited in evidence if was_edited}
    rows = [(cfg, run_id) for cfg, run_id, _ in evidence]
    latest_ids = {r for _, r in rows if r is not None}
    older_ids = set(recent) - latest_ids
    # by (config, metric): run id → cell; whole cells for each config's latest run, and only the
    # estimate and verdict over the suite's recent history (the sparkline, "breaching since")
    history: dict[tuple[int, str], dict[int, dict]] = {}
    figures: dict[tuple[int, int], dict] = {}
    runs: dict[int, tuple] = {}  # run id → (created_at, finished_at, trigger, samples drawn)
    if latest_ids:
        # columns, not ComparisonRow objects: no eager join of each row's config, no identity map
        for c in session.execute(select(*CELL_COLUMNS).where(ComparisonRow.run_id.in_(latest_ids))):
            history.setdefault((c.config_id, c.metric), {})[c.run_id] = _cell(c)
        for run_id, config_id, figs in session.execute(select(ConfigRun.run_id, ConfigRun.config_id, ConfigRun.figures)
                                                       .where(ConfigRun.run_id.in_(latest_ids))):
            figures[(run_id, config_id)] = figs or {}
    if older_ids:
        recent_sq = recent_q.subquery()
        for run_id, config_id, metric, estimate, verdict in session.execute(
                select(ComparisonRow.run_id, ComparisonRow.config_id, ComparisonRow.metric, ComparisonRow.estimate,
                       ComparisonRow.verdict).join(recent_sq, recent_sq.c.id == ComparisonRow.run_id)):
            if run_id in older_ids:
                history.setdefault((config_id, metric), {})[run_id] = {"estimate": estimate, "verdict": verdict}
    baseline_of: dict[int, int] = {}  # run id → its baseline config (what a tile compares a config with)
    if latest_ids or older_ids:
        for run_id, created, finished, trigger, base, keys in session.execute(
                select(Run.id, Run.created_at, Run.finished_at, Run.trigger, Run.baseline_config_id, Run.sample_keys)
                .where(Run.id.in_(latest_ids | older_ids))):
            runs[run_id], baseline_of[run_id] = (created, finished, trigger, len(keys or [])), base
    models: dict[str, list] = {}
    for cfg, run_id in rows:
        run = runs.get(run_id)
        cells = {m: by_run[run_id] for (cid, m), by_run in history.items() if cid == cfg.id and run_id in by_run}
        worst = _worst_metric(cells)
        since = None
        if worst:  # walk back from the latest run while the metric keeps breaching
            by_run = history[(cfg.id, worst)]
            for rid in sorted((r for r in by_run if r <= run_id), reverse=True):
                if by_run[rid]["verdict"] not in BREACHING:
                    break
                since = runs[rid][0]
        ppl = history.get((cfg.id, "ppl_ratio"), {})
        models.setdefault(cfg.model.name, []).append({
            "config": cfg.name, "baseline": cfg.is_baseline, "spec": public_spec(cfg.spec), "run_id": run_id,
            "checked_at": iso(run[1]) if run else None, "edited_since_checked": cfg.id in edited, "comparisons": cells,
            "figures": figures.get((run_id, cfg.id), {}),
            "baseline_figures": None if cfg.is_baseline or run_id not in baseline_of
            else figures.get((run_id, baseline_of[run_id])),
            "breaching_metric": worst, "breaching_since": iso(since),
            "ppl_history": [{"run_id": rid, "estimate": ppl[rid]["estimate"], "verdict": ppl[rid]["verdict"]}
                            for rid in sorted(ppl) if rid in recent or rid == run_id]})
    summaries = {model: _model_summary(configs, project.name, chosen.name if chosen else "", runs,
                                       chosen.n_documents if chosen else None, get_settings().max_samples_per_run)
                 for model, configs in models.items()}
    schedules = [schedule_out(s) for s in session.scalars(select(Schedule).where(Schedule.project_id == project.id,
                                                                                 Schedule.enabled.is_(True)))]
    last = session.scalar(select(func.max(Run.finished_at)).where(done))
    return {"project": project.name, "suite": chosen.name if chosen else None, "suites": _suite_names(session, project),
            "models": models, "summaries": summaries, "last_check_at": iso(last),
            "next_check_at": min((s["next_slot_at"] for s in schedules if s["suite_id"] == suite_id), default=None),
            "schedules": schedules}


@router.get("/projects/{project}/trends", response_model=TrendsOut)
def trends(project: ProjectDep, session: SessionDep,
           metric: MetricName = Query("ppl_ratio", description="a metric of the catalogue (GET /metrics)"),  # noqa: B008
           config: str | None = Query(None, max_length=128), suite: str | None = SuiteQuery,
           limit: int = Query(200, ge=1, le=2000)) -> dict:
    """A metric over time per config on one suite (newest `limit` comparisons), with the
    thresholds that apply (per config where a rule is scoped to one) and the alerts that fired on
    it from that suite's runs."""
    chosen = _suite(session, project, suite)
    suite_id = chosen.id if chosen else -1
    q = (select(ComparisonRow.run_id, ComparisonRow.estimate, ComparisonRow.ci_low, ComparisonRow.ci_high,
                ComparisonRow.n, ComparisonRow.verdict, Run.created_at, OptimizationConfig.name)
         .join(Run, Run.id == ComparisonRow.run_id)
         .join(OptimizationConfig, OptimizationConfig.id == ComparisonRow.config_id)
         .where(Run.project_id == project.id, Run.suite_id == suite_id, ComparisonRow.metric == metric,
                OptimizationConfig.ablation_of_id.is_(None)))  # a stacked config's layers: on its run's page
    if config:
        q = q.where(ComparisonRow.config_id == repo.get_config(session, project, config).id)
    points = [TrendPoint.model_validate({**c._mapping, "config": c.name, "at": iso(c.created_at)})
              for c in session.execute(q.order_by(ComparisonRow.run_id.desc()).limit(limit))]
    points.reverse()
    names = dict(session.execute(select(OptimizationConfig.id, OptimizationConfig.name)
                                 .join(Model, Model.id == OptimizationConfig.model_id)
                                 .where(Model.project_id == project.id)).all())
    rules = [{"warn": r.warn, "critical": r.critical, "direction": r.direction, "config_id": r.config_id,
              "model_id": r.model_id, "config": names.get(r.config_id) if r.config_id is not None else None}
             for r in session.scalars(select(AlertRule).where(AlertRule.project_id == project.id,
                                                              AlertRule.metric == metric))]
    suite_runs = select(Run.id).where(Run.project_id == project.id, Run.suite_id == suite_id)
    alerts = [{"config": a.labels.get("config"), "severity": a.severity, "state": a.state, "fired_at": iso(a.fired_at),
               "resolved_at": iso(a.resolved_at),
               "run_id": int((a.annotations or {}).get("fired_run") or a.run_id or 0) or None}
              for a in session.scalars(select(Alert).where(Alert.project_id == project.id, Alert.fired_at.is_not(None),
                                                           Alert.run_id.in_(suite_runs))
                                       .order_by(Alert.id.desc()).limit(500)) if a.labels.get("metric") == metric]
    return {"metric": metric, "suite": chosen.name if chosen else None, "suites": _suite_names(session, project),
            "points": points, "thresholds": rules, "alerts": alerts}


@router.get("/projects/{project}/runs/{run_id}/worst", response_model=WorstOut)
def worst_samples(run_id: RowId, project: ProjectDep, session: SessionDep, config: str = Query(..., max_length=128),
                  metric: str = Query("nll", max_length=64), limit: int = Query(20, ge=1, le=200)) -> dict:
    """The candidate's samples that regressed most against the baseline on one metric (higher
    NLL / lower score is worse), with both sides' raw values and extras."""
    run = repo.get_run(session, project, run_id)
    cand_id = repo.get_config(session, project, config).id
    return {"run_id": run.id, "config": config, "metric": metric,
            "items": queries.worst_samples(session, run, cand_id, metric, limit)}


