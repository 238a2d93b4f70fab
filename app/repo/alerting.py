"""Alerting's rows: alert episodes, alert rules, silences, the notification outbox, and the rows
that say who may call (API keys) and what a gate decided. Every write of them goes through here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Alert, AlertRule, ApiKey, Gate, Notification, Silence


def queue_notification(session: Session, channel_id: int, idempotency_key: str, payload: Any,
                       alert_id: int | None = None) -> Notification:
    """A pending row of the outbox (app/notify.py delivers it), flushed: its id is set."""
    notification = Notification(channel_id=channel_id, alert_id=alert_id, idempotency_key=idempotency_key,
                                payload=payload, status="pending")
    session.add(notification)
    session.flush()
    return notification


def open_alert(session: Session, project_id: int, rule_id: int, fingerprint: str, labels: dict[str, str], state: str,
               severity: str, started_at: datetime | None) -> Alert:
    """A new alert episode (app/alert_evaluation.py moves it through its states)."""
    row = Alert(project_id=project_id, rule_id=rule_id, fingerprint=fingerprint, labels=labels, state=state,
                severity=severity, started_at=started_at)
    session.add(row)
    return row


def upsert_alert_rule(session: Session, project_id: int, metric: str, direction: str, model_id: int | None,
                      config_id: int | None, **settings: Any) -> AlertRule:
    """The project's rule for the metric at that scope (model and config, each or neither), created
    if missing, with `settings` (warn, critical, min_n, for_runs, enabled) set."""
    rule = session.scalar(select(AlertRule).where(
        AlertRule.project_id == project_id, AlertRule.metric == metric,
        AlertRule.model_id.is_(None) if model_id is None else AlertRule.model_id == model_id,
        AlertRule.config_id.is_(None) if config_id is None else AlertRule.config_id == config_id))
    if rule is None:
        rule = AlertRule(project_id=project_id, metric=metric, direction=direction, warn=settings["warn"],
                         model_id=model_id, config_id=config_id)
        session.add(rule)
    for name, value in settings.items():
        setattr(rule, name, value)
    session.flush()
    return rule


def add_silence(session: Session, project_id: int, matchers: list[dict[str, str]], starts_at: datetime,
                ends_at: datetime, author: str, comment: str) -> Silence:
    silence = Silence(project_id=project_id, matchers=matchers, starts_at=starts_at, ends_at=ends_at, author=author,
                      comment=comment)
    session.add(silence)
    session.flush()
    return silence


def add_api_key(session: Session, project_id: int, name: str, key_hash: str, scope: str) -> ApiKey:
    row = ApiKey(project_id=project_id, name=name, key_hash=key_hash, scope=scope)
    session.add(row)
    session.flush()
    return row


def record_gate(session: Session, project_id: int, run_id: int, candidate: str, baseline: str,
                policy: dict | None, idempotency_key: str | None) -> Gate:
    gate = Gate(project_id=project_id, run_id=run_id, idempotency_key=idempotency_key, candidate=candidate,
                baseline=baseline, policy=policy or None)
    session.add(gate)
    session.flush()
    return gate
