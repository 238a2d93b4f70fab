"""The canary watches itself: a schedule whose runs stop succeeding (a dead beat, workers that
never come back, a run stuck queued) leaves the last verdicts looking current. Each enabled
schedule has a heartbeat, its last successful run; the schedule is stale once the run due after
that heartbeat is overdue by more than one period:

    heartbeat   the finish of the schedule's last run that ended `done` (the schedule's creation
                when it has none)
    due         the first cron slot after the heartbeat: the run that should have succeeded next
    stale       now > due + period (period: the cron's interval around the latest slot)

Three places read it: `/metrics` (canary_schedule_stale, computed by the API on each scrape, so
Prometheus' CanaryStale rule fires even while the beat is dead), the reconciler (beat or the
embedded server: a CanaryStale notification to the project's channels once per episode, and its
resolution when a run succeeds again) and the dashboard's banner.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from croniter import croniter
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import repo
from app.models import Channel, Notification, Project, Run, Schedule, aware, utcnow

if TYPE_CHECKING:
    from app.channels import AlertMessage

METRIC = "canary_stale"


@dataclass(frozen=True)
class ScheduleHealth:
    project: str
    project_id: int
    schedule: str
    schedule_id: int
    cron: str
    period: timedelta
    heartbeat: datetime  # the last successful run's finish, or the schedule's creation
    last_success_run_id: int | None
    due: datetime  # the slot whose run should have succeeded next
    stale: bool

    def reason(self) -> str:
        since = (f"its last successful run (run {self.last_success_run_id}) ended {self.heartbeat:%Y-%m-%d %H:%M} UTC"
                 if self.last_success_run_id else f"it has had no successful run since it was created "
                 f"{self.heartbeat:%Y-%m-%d %H:%M} UTC")
        hours = self.period.total_seconds() / 3600
        period = f"{hours:g} h" if hours >= 1 else f"{hours * 60:g} min"
        return (f"schedule '{self.schedule}' ({self.cron}) of project '{self.project}': {since}, and the run due "
                f"{self.due:%Y-%m-%d %H:%M} UTC has not succeeded within one period ({period}); are the beat and "
                f"the workers up? (docs/runbooks.md, CanaryStale)")


def _period(cron: str, now: datetime) -> timedelta:
    it = croniter(cron, now)
    prev = it.get_prev(datetime)
    return croniter(cron, prev).get_next(datetime) - prev


def schedule_health(session: Session, now: datetime | None = None,
                    project_id: int | None = None) -> list[ScheduleHealth]:
    """Every enabled schedule's heartbeat and whether it is stale, at `now`."""
    now = aware(now or utcnow())
    query = select(Schedule, Project.name).join(Project, Project.id == Schedule.project_id).where(
        Schedule.enabled.is_(True))
    if project_id is not None:
        query = query.where(Schedule.project_id == project_id)
    out = []
    for schedule, project in session.execute(query.order_by(Schedule.id)).all():
        successes = _successes(session, schedule)
        heartbeat, run_id = successes[0] if successes else (aware(schedule.created_at), None)
        period = _period(schedule.cron, now)
        due = _due(schedule.cron, heartbeat)
        out.append(ScheduleHealth(project, schedule.project_id, schedule.name, schedule.id, schedule.cron, period,
                                  heartbeat, run_id, due, now > due + period))
    return out


def _successes(session: Session, schedule: Schedule, limit: int = 2) -> list[tuple[datetime, int]]:
    """(finish, run id) of the schedule's latest runs that ended done, newest first. Its runs carry
    the idempotency key schedule:<id>:<slot> (app/schedules.py)."""
    rows = session.execute(
        select(Run.id, func.coalesce(Run.finished_at, Run.created_at)).where(
            Run.project_id == schedule.project_id, Run.status == "done",
            Run.idempotency_key.like(f"schedule:{schedule.id}:%"))
        .order_by(func.coalesce(Run.finished_at, Run.created_at).desc()).limit(limit)).all()
    return [(aware(finished), run_id) for run_id, finished in rows]


def _due(cron: str, heartbeat: datetime) -> datetime:
    return aware(croniter(cron, heartbeat).get_next(datetime))


def _key(channel_id: int, schedule_id: int, heartbeat: datetime, kind: str) -> str:
    """One notification per (channel, schedule, missed heartbeat, kind): a state change, sent once."""
    raw = f"{channel_id}|stale|{schedule_id}|{heartbeat.isoformat()}|{kind}"
    return hashlib.sha256(raw.encode()).hexdigest()[:40]


def _message(health: ScheduleHealth, kind: str, now: datetime, dashboard_url: str) -> AlertMessage:
    from app.channels import AlertMessage
    from app.runbooks import alert_runbook
    from app.settings import get_settings

    labels = {"project": health.project, "model": "", "config": health.schedule, "metric": METRIC,
              "severity": "critical", "alertname": "CanaryStale"}
    text = health.reason() if kind == "firing" else (
        f"schedule '{health.schedule}' of project '{health.project}' has a successful run again "
        f"(run {health.last_success_run_id})")
    return AlertMessage(status=kind, labels=labels, fingerprint=hashlib.sha256(
        f"stale|{health.schedule_id}".encode()).hexdigest()[:16], estimate=None, ci_low=None, ci_high=None, n=0,
        baseline="", baseline_value=None, candidate_value=None, rule=text, run_id=health.last_success_run_id or 0,
        dashboard_url=dashboard_url, starts_at=health.due + health.period,
        annotations={"description": text, "runbook_url": alert_runbook(labels, get_settings().runbook_url)},
        ends_at=now if kind == "resolved" else None)


def notify_stale(session: Session, now: datetime | None = None) -> list[int]:
    """Queue CanaryStale notifications on state changes only: a firing one per channel when a
    schedule turns stale (once per missed heartbeat), and a resolved one when a schedule whose
    staleness was announced has a successful run again. Returns the notification ids queued."""
    from app.channels import build
    from app.settings import get_settings

    now = aware(now or utcnow())
    url = get_settings().dashboard_url
    queued = []
    for health in schedule_health(session, now):
        schedule = session.get_one(Schedule, health.schedule_id)
        previous = _successes(session, schedule)[1:2]
        # the episode the latest success ended: stale from the heartbeat before it
        before = previous[0][0] if previous else aware(schedule.created_at)
        for channel in session.scalars(select(Channel).where(Channel.project_id == health.project_id,
                                                             Channel.enabled.is_(True))):
            wanted = []
            if health.stale:
                wanted.append(("firing", health.heartbeat))
            elif health.last_success_run_id is not None:
                announced = _key(channel.id, health.schedule_id, before, "firing")
                if session.scalar(select(Notification.id).where(Notification.idempotency_key == announced)):
                    wanted.append(("resolved", before))
            for kind, heartbeat in wanted:
                key = _key(channel.id, health.schedule_id, heartbeat, kind)
                if session.scalar(select(Notification.id).where(Notification.idempotency_key == key)) is not None:
                    continue
                if kind == "resolved" and not (channel.settings or {}).get("send_resolved", True):
                    continue
                payload = build(channel.kind, _message(health, kind, now, url))
                queued.append(repo.queue_notification(session, channel.id, key, payload).id)
    session.commit()
    return queued
