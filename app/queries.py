"""Reads that the API's routes and the CLI's read commands share: each takes a session and the
project and returns what the API serves, so `canary alerts list` and GET .../alerts (or `canary
gates show` and GET .../gates/{id}) cannot drift apart."""

from __future__ import annotations

from typing import cast

from sqlalchemy import and_, select
from sqlalchemy.orm import Session, aliased

from app import repo
from app.alert_evaluation import ACTIVE
from app.gates import summary_markdown
from app.models import Alert, Gate, Project, Run, SampleResult, Suite
from app.runbooks import alert_runbook
from app.services import run_summary
from app.settings import get_settings


def alert_out(alert: Alert, inhibited_by: int | None = None) -> dict:
    iso = lambda t: t.isoformat() if t else None  # noqa: E731
    return {"id": alert.id, "fingerprint": alert.fingerprint, "labels": alert.labels,
            "annotations": {**(alert.annotations or {}),
                            "runbook_url": alert_runbook(alert.labels or {}, get_settings().runbook_url)},
            "state": alert.state, "severity": alert.severity, "value": alert.value,
            "consecutive": alert.consecutive, "run_id": alert.run_id, "started_at": iso(alert.started_at),
            "fired_at": iso(alert.fired_at), "resolved_at": iso(alert.resolved_at),
            "last_notified_at": iso(alert.last_notified_at), "escalation_run_id": alert.escalation_run_id,
            "inhibited_by": inhibited_by}


def _without_severity(labels: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "severity"))


def alerts(session: Session, project: Project, state: str | None = None, limit: int = 100,
           inhibited: bool = True) -> list[dict]:
    """The project's alerts, newest first; with inhibited=False, an active warn alert that a firing
    critical alert with the same labels inhibits is left out (one alert per regression)."""
    firing_critical = select(Alert).where(Alert.project_id == project.id, Alert.state == "firing",
                                          Alert.severity == "critical")
    critical = {_without_severity(alert.labels): alert.id for alert in session.scalars(firing_critical)}
    query = select(Alert).where(Alert.project_id == project.id)
    if state:
        query = query.where(Alert.state == state)
    query = query.order_by(Alert.id.desc())
    query = query.limit(limit) if inhibited else query.execution_options(yield_per=500)
    out = []
    for alert in session.scalars(query):
        active_warn = alert.severity == "warn" and alert.state in ACTIVE
        by = critical.get(_without_severity(alert.labels)) if active_warn else None
        if by is not None and not inhibited:
            continue
        out.append(alert_out(alert, by))
        if len(out) == limit:
            break
    return out


def gate_out(session: Session, project: Project, gate: Gate) -> dict:
    summary = run_summary(session, repo.get_run(session, project, gate.run_id))
    return {"gate_id": gate.id, "candidate": gate.candidate, "baseline": gate.baseline, "verdict": gate.verdict,
            "decided_at": gate.decided_at.isoformat() if gate.decided_at else None, "run_id": gate.run_id,
            "run_status": summary.status, "run_verdict": summary.verdict, "reason": summary.verdict_reason,
            "idempotency_key": gate.idempotency_key,
            "created_at": gate.created_at.isoformat() if gate.created_at else None,
            "summary_markdown": summary_markdown(gate, summary, get_settings().dashboard_url,
                                                 cast(Suite, session.get(Suite, summary.suite_id)).name),  # an FK
            "comparisons": [c for c in summary.comparisons if c.config == gate.candidate],
            "summary": summary.summary.lines}


def gate(session: Session, project: Project, gate_id: int) -> dict:
    found = session.get(Gate, gate_id)
    if found is None or found.project_id != project.id:
        raise repo.NotFound(f"gate {gate_id} not found in project '{project.name}'")
    return gate_out(session, project, found)


def gates(session: Session, project: Project, limit: int = 50) -> list[dict]:
    """The project's newest gates."""
    rows = session.scalars(select(Gate).where(Gate.project_id == project.id).order_by(Gate.id.desc()).limit(limit))
    return [{"gate_id": gate.id, "candidate": gate.candidate, "baseline": gate.baseline, "verdict": gate.verdict,
             "run_id": gate.run_id, "created_at": gate.created_at.isoformat() if gate.created_at else None,
             "decided_at": gate.decided_at.isoformat() if gate.decided_at else None} for gate in rows]


def worst_samples(session: Session, run: Run, cand_id: int, metric: str, limit: int) -> list[dict]:
    """The candidate's samples that regressed most against the baseline on one metric (higher
    NLL / lower score is worse), with both sides' raw values and extras: the API's WorstSample
    items, which the report shows too."""
    if metric == "judge_pairwise":  # judged against the baseline already: 0 = baseline won, ½ tie, 1 candidate won
        rows = session.scalars(select(SampleResult)
                               .where(SampleResult.run_id == run.id, SampleResult.config_id == cand_id,
                                      SampleResult.metric == metric, SampleResult.value.is_not(None))
                               .order_by(SampleResult.value, SampleResult.sample_key).limit(limit)).all()
        return [{"sample_key": r.sample_key, "delta": 0.5 - cast(float, r.value),  # the query's value IS NOT NULL
                 "baseline_value": 0.5, "candidate_value": r.value, "baseline_extra": None, "candidate_extra": r.extra,
                 "outputs": _outputs(session, run, cand_id, [r.sample_key]).get(r.sample_key, {})} for r in rows]
    b, c = aliased(SampleResult), aliased(SampleResult)
    lower_is_worse = metric in ("faithfulness", "judge_score", "judge_pairwise")
    delta = (b.value - c.value) if lower_is_worse else (c.value - b.value)
    pairs = session.execute(
        select(c, b, delta.label("delta"))
        .join(b, and_(b.run_id == c.run_id, b.sample_key == c.sample_key, b.metric == c.metric,
                      b.config_id == run.baseline_config_id))
        .where(c.run_id == run.id, c.config_id == cand_id, c.metric == metric, c.value.is_not(None),
               b.value.is_not(None))
        .order_by(delta.desc()).limit(limit)).all()
    gens = _outputs(session, run, cand_id, [row[0].sample_key for row in pairs])
    return [{"sample_key": cr.sample_key, "delta": d, "baseline_value": br.value, "candidate_value": cr.value,
             "baseline_extra": br.extra, "candidate_extra": cr.extra, "outputs": gens.get(cr.sample_key, {})}
            for cr, br, d in pairs]


def _outputs(session: Session, run: Run, cand_id: int, keys: list[str]) -> dict:
    """Generations, judge verdicts and faithfulness statements of both sides, by sample."""
    gens: dict = {}
    if keys:
        for r in session.scalars(select(SampleResult).where(SampleResult.run_id == run.id, SampleResult.metric.in_(
                ("generation", "judge_pairwise", "faithfulness")), SampleResult.sample_key.in_(keys),
                SampleResult.config_id.in_((cand_id, run.baseline_config_id)))):
            side = "candidate" if r.config_id == cand_id else "baseline"
            gens.setdefault(r.sample_key, {}).setdefault(side, {})[r.metric] = r.extra
    return gens
