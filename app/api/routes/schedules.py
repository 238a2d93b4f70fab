from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select

from app import repo
from app.api.deps import ProjectDep, SessionDep
from app.config_base import DB_INT_MAX, NAME_PATTERN, NameRef
from app.config_file import check_cron
from app.models import Schedule
from app.schedules import latest_slot
from app.schemas import Time, error_responses
from app.services import check_project_room
from app.settings import get_settings

if TYPE_CHECKING:
    from app.staleness import ScheduleHealth

router = APIRouter(tags=["schedules"], responses=error_responses(404))


class ScheduleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    cron: str = Field(
        description="five-field cron expression in UTC, e.g. '0 6 * * *' (daily) or '0 3 * * 0' (weekly)")
    suite: NameRef
    configs: list[NameRef] = Field(default_factory=list, max_length=256,
                                   description="empty = every config of the project")
    samples: int | None = Field(None, ge=1, le=DB_INT_MAX,
                                description="documents drawn; at most the server's samples-per-run limit")
    enabled: bool = True

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        return check_cron(v)


class ScheduleOut(BaseModel):
    id: int
    name: str
    cron: str
    suite_id: int
    configs: list[str] = Field(description="empty: every config of the project")
    samples: int | None
    enabled: bool
    last_slot_at: Time | None
    next_slot_at: Time
    last_success_at: Time | None = Field(None, description="when its last successful run ended")
    stale: bool = Field(False, description="the run due after its last success is overdue by more than one "
                                           "period: the canary itself has stopped (app/staleness.py)")
    stale_reason: str | None = None


def out(schedule: Schedule, health: ScheduleHealth | None = None) -> dict:
    from croniter import croniter

    from app.models import utcnow

    next_slot = croniter(schedule.cron, latest_slot(schedule.cron, utcnow())).get_next(type(utcnow()))
    return {"id": schedule.id, "name": schedule.name, "cron": schedule.cron, "suite_id": schedule.suite_id,
            "configs": schedule.config_names, "samples": schedule.samples, "enabled": schedule.enabled,
            "last_slot_at": schedule.last_slot_at.isoformat() if schedule.last_slot_at else None,
            "next_slot_at": next_slot.isoformat(),
            "last_success_at": health.heartbeat.isoformat() if health and health.last_success_run_id else None,
            "stale": bool(health and health.stale),
            "stale_reason": health.reason() if health and health.stale else None}


@router.put("/projects/{project}/schedules", status_code=status.HTTP_200_OK, response_model=ScheduleOut,
            responses=error_responses(400, 403, 409))
def put_schedule(body: ScheduleIn, project: ProjectDep, session: SessionDep) -> dict:
    limit = get_settings().max_samples_per_run
    if body.samples is not None and body.samples > limit:  # refused now, not at every scheduled slot
        raise ValueError(f"samples: {body.samples} exceeds the limit of {limit} per run")
    suite = repo.get_suite(session, project, body.suite)
    for name in body.configs:
        repo.get_config(session, project, name)  # 404 naming an unknown config
    check_project_room(session, project, "schedules", [body.name], "name")
    schedule = repo.upsert_schedule(session, project, body.name, body.cron, suite, body.configs, body.samples)
    schedule.enabled = body.enabled
    return out(schedule)


@router.get("/projects/{project}/schedules", response_model=list[ScheduleOut])
def list_schedules(project: ProjectDep, session: SessionDep) -> list[dict]:
    from app.staleness import schedule_health

    schedules = session.scalars(select(Schedule).where(Schedule.project_id == project.id).order_by(Schedule.id))
    health = {h.schedule_id: h for h in schedule_health(session, project_id=project.id)}
    return [out(schedule, health.get(schedule.id)) for schedule in schedules]
