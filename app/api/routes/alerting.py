"""Alert rules (thresholds per project, model or config), alerts and silences."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import select

from app import repo
from app.api.deps import ProjectDep, RowId, SessionDep
from app.config_base import DB_INT_MAX, NameRef
from app.config_file import METRIC_DIRECTIONS
from app.models import AlertRule, Silence, aware, utcnow
from app.queries import alerts as read_alerts
from app.schemas import Time, error_responses

router = APIRouter(tags=["alerts"], responses=error_responses(404))


class RuleIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN / Infinity are never a threshold
    metric: str = Field(description=f"one of: {', '.join(METRIC_DIRECTIONS)}")
    warn: float
    critical: float | None = None
    min_n: int = Field(10, ge=1, le=DB_INT_MAX)
    for_runs: int = Field(1, ge=1, le=100, description="consecutive breaching runs before firing")
    model: NameRef | None = Field(None, description="narrow the rule to one model")
    config: NameRef | None = Field(None, description="narrow the rule to one config")
    enabled: bool = True

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRIC_DIRECTIONS:
            raise ValueError(f"unknown metric '{v}'; thresholds exist for: {', '.join(METRIC_DIRECTIONS)}")
        return v

    @model_validator(mode="after")
    def _order(self) -> RuleIn:
        direction = METRIC_DIRECTIONS[self.metric]
        critical, warn = self.critical, self.warn
        if critical is not None and ((direction == "above" and critical < warn)
                                     or (direction == "below" and critical > warn)):
            side = "≥" if direction == "above" else "≤"
            raise ValueError(f"critical {critical} must be {side} warn {warn}: {self.metric} is bad {direction}")
        return self


class RuleOut(BaseModel):
    id: int
    metric: str
    warn: float
    critical: float | None
    direction: str = Field(description="above | below: the side of the threshold that is bad")
    min_n: int
    for_runs: int
    model_id: int | None = Field(description="null: every model")
    config_id: int | None = Field(description="null: every config")
    enabled: bool


def rule_out(rule: AlertRule) -> dict:
    return {"id": rule.id, "metric": rule.metric, "warn": rule.warn, "critical": rule.critical,
            "direction": rule.direction, "min_n": rule.min_n, "for_runs": rule.for_runs, "model_id": rule.model_id,
            "config_id": rule.config_id, "enabled": rule.enabled}


@router.put("/projects/{project}/alert-rules", status_code=status.HTTP_200_OK, response_model=RuleOut,
            responses=error_responses(400, 403, 409))
def put_rule(body: RuleIn, project: ProjectDep, session: SessionDep) -> dict:
    """Create or replace the rule for (metric, model, config); config beats model beats project."""
    model_id = repo.get_model(session, project, body.model).id if body.model else None
    config_id = repo.get_config(session, project, body.config).id if body.config else None
    rule = repo.upsert_alert_rule(session, project.id, body.metric, METRIC_DIRECTIONS[body.metric], model_id,
                                  config_id, warn=body.warn, critical=body.critical, min_n=body.min_n,
                                  for_runs=body.for_runs, enabled=body.enabled)
    return rule_out(rule)


@router.get("/projects/{project}/alert-rules", response_model=list[RuleOut])
def list_rules(project: ProjectDep, session: SessionDep) -> list[dict]:
    rules = session.scalars(select(AlertRule).where(AlertRule.project_id == project.id).order_by(AlertRule.id))
    return [rule_out(rule) for rule in rules]


class AlertOut(BaseModel):
    id: int
    fingerprint: str
    labels: dict[str, str] = Field(description="alertname, project, model, config, metric, severity")
    annotations: dict[str, str] | None = Field(description="summary, description, runbook_url, dashboard_url")
    state: Literal["pending", "firing", "resolved", "inactive"]
    severity: str
    value: float | None
    consecutive: int = Field(description="breaching runs in a row")
    run_id: int | None
    started_at: Time | None
    fired_at: Time | None
    resolved_at: Time | None
    last_notified_at: Time | None
    escalation_run_id: int | None
    inhibited_by: int | None = Field(None, description="the firing critical alert, same labels but severity, that "
                                                       "mutes this active warn alert (one regression, one alert)")


@router.get("/projects/{project}/alerts", response_model=list[AlertOut])
def list_alerts(project: ProjectDep, session: SessionDep,
                state: str | None = Query(None, pattern="^(pending|firing|resolved|inactive)$"),
                limit: int = Query(100, ge=1, le=1000),
                inhibited: bool = Query(True, description="include active warn alerts that a firing critical alert "
                                                          "inhibits (as Alertmanager's API); false lists one alert "
                                                          "per regression")) -> list[dict]:
    """Newest first. An active warn alert inhibited by a firing critical one names it in inhibited_by."""
    return read_alerts(session, project, state=state, limit=limit, inhibited=inhibited)


class Matcher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    value: str = Field(max_length=256)
    isRegex: bool = False  # Alertmanager's field name, camelCase as its API spells it


class SilenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    matchers: list[Matcher] = Field(min_length=1, max_length=16)
    starts_at: datetime | None = None
    ends_at: datetime | None = None
    duration_minutes: int | None = Field(None, ge=1, le=60 * 24 * 90)
    author: str = Field(min_length=1, max_length=128)
    comment: str = Field(min_length=1, max_length=2000)

    @model_validator(mode="after")
    def _window(self) -> SilenceIn:
        if (self.ends_at is None) == (self.duration_minutes is None):
            raise ValueError("give either ends_at or duration_minutes")
        return self


class SilenceOut(BaseModel):
    id: int
    matchers: list[dict[str, str]] = Field(description="name, value, isRegex ('true' | 'false'): Alertmanager's shape")
    starts_at: Time
    ends_at: Time
    author: str
    comment: str


def silence_out(silence: Silence) -> dict:
    return {"id": silence.id, "matchers": silence.matchers, "starts_at": aware(silence.starts_at).isoformat(),
            "ends_at": aware(silence.ends_at).isoformat(), "author": silence.author, "comment": silence.comment}


@router.post("/projects/{project}/silences", status_code=status.HTTP_201_CREATED, response_model=SilenceOut,
             responses=error_responses(400, 403, 409))
def create_silence(body: SilenceIn, project: ProjectDep, session: SessionDep) -> dict:
    import re

    for matcher in body.matchers:
        if matcher.isRegex:
            try:
                re.compile(matcher.value)
            except re.error as e:
                raise ValueError(f"matchers: '{matcher.value}' is not a valid regular expression ({e})") from None
    start = aware(body.starts_at) or utcnow()  # a time without a zone is UTC, as every stored time
    try:
        # SilenceIn holds exactly one of ends_at and duration_minutes
        end = aware(body.ends_at) or start + timedelta(minutes=body.duration_minutes or 0)
    except OverflowError:
        raise ValueError("duration_minutes: starts_at + duration_minutes is past the year 9999; give an earlier "
                         "starts_at") from None
    if end <= start:
        raise ValueError("ends_at must be after starts_at")
    matchers = [{"name": matcher.name, "value": matcher.value, "isRegex": str(matcher.isRegex).lower()}
                for matcher in body.matchers]
    silence = repo.add_silence(session, project.id, matchers, start, end, body.author, body.comment)
    return silence_out(silence)


@router.get("/projects/{project}/silences", response_model=list[SilenceOut])
def list_silences(project: ProjectDep, session: SessionDep) -> list[dict]:
    silences = session.scalars(select(Silence).where(Silence.project_id == project.id).order_by(Silence.id.desc()))
    return [silence_out(silence) for silence in silences]


@router.delete("/projects/{project}/silences/{silence_id}", response_model=SilenceOut, responses=error_responses(403))
def expire_silence(silence_id: RowId, project: ProjectDep, session: SessionDep) -> dict:
    """Expire a silence now (its history stays)."""
    silence = session.get(Silence, silence_id)
    if silence is None or silence.project_id != project.id:
        raise repo.NotFound(f"silence {silence_id} not found in project '{project.name}'")
    silence.ends_at = min(aware(silence.ends_at), utcnow())
    return silence_out(silence)
