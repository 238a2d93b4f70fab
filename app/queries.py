"""Reads that the API's routes and the CLI's read commands share: each takes a session and the
project and returns what the API serves, so `canary alerts list` and GET .../alerts (or `canary
gates show` and GET .../gates/{id}) cannot drift apart."""

from __future__ import annotations

from sqlalchemy import select

from app import repo
from app.alerts import ACTIVE
from app.gates import summary_markdown
from app.models import Alert, Gate, Project, Suite
from app.services import run_summary
from app.settings import get_settings


def alert_out(alert: Alert, inhibited_by: int | None = None) -> dict:
    iso = lambda t: t.isoformat() if t else None  # noqa: E731
    return {"id": alert.id, "fingerprint": alert.fingerprint, "labels": alert.labels,
            "annotations": alert.annotations, "state": alert.state, "severity": alert.severity, "value": alert.value,
            "consecutive": alert.consecutive, "run_id": alert.run_id, "started_at": iso(alert.started_at),
            "fired_at": iso(alert.fired_at), "resolved_at": iso(alert.resolved_at),
            "last_notified_at": iso(alert.last_notified_at), "escalation_run_id": alert.escalation_run_id,
            "inhibited_by": inhibited_by}


def _without_severity(labels: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "severity"))


def alerts(session, project: Project, state: str | None = None, limit: int = 100,
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


def gate_out(session, project, gate: Gate) -> dict:
    summary = run_summary(session, repo.get_run(session, project, gate.run_id))
    return {"gate_id": gate.id, "candidate": gate.candidate, "baseline": gate.baseline, "verdict": gate.verdict,
            "decided_at": gate.decided_at.isoformat() if gate.decided_at else None, "run_id": gate.run_id,
            "run_status": summary.status, "run_verdict": summary.verdict, "reason": summary.verdict_reason,
            "idempotency_key": gate.idempotency_key,
            "created_at": gate.created_at.isoformat() if gate.created_at else None,
            "summary_markdown": summary_markdown(gate, summary, get_settings().dashboard_url,
                                                 session.get(Suite, summary.suite_id).name),
            "comparisons": [c for c in summary.comparisons if c.config == gate.candidate]}


def gate(session, project: Project, gate_id: int) -> dict:
    found = session.get(Gate, gate_id)
    if found is None or found.project_id != project.id:
        raise repo.NotFound(f"gate {gate_id} not found in project '{project.name}'")
    return gate_out(session, project, found)


def gates(session, project: Project, limit: int = 50) -> list[dict]:
    """The project's newest gates."""
    rows = session.scalars(select(Gate).where(Gate.project_id == project.id).order_by(Gate.id.desc()).limit(limit))
    return [{"gate_id": gate.id, "candidate": gate.candidate, "baseline": gate.baseline, "verdict": gate.verdict,
             "run_id": gate.run_id, "created_at": gate.created_at.isoformat() if gate.created_at else None,
             "decided_at": gate.decided_at.isoformat() if gate.decided_at else None} for gate in rows]
