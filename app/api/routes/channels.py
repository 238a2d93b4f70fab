"""Alert channels. A channel's URL is a secret (it carries the webhook token): responses show
it masked, and `${ENV_VAR}` references keep it out of the database altogether."""

from __future__ import annotations

from fastapi import APIRouter, status
from pydantic import BaseModel, Field
from sqlalchemy import select

from app import repo
from app.api.deps import ProjectDep, SessionDep
from app.config_file import ChannelEntry
from app.models import Channel, aware, utcnow
from app.schemas import error_responses
from app.services import check_project_room
from app.ssrf import mask_url

router = APIRouter(tags=["channels"], responses=error_responses(404))


class ChannelIn(ChannelEntry):
    enabled: bool = True


class ChannelOut(BaseModel):
    id: int
    name: str
    kind: str
    url: str = Field(description="masked: the token part is never shown")
    send_resolved: bool
    signing_secret_set: bool
    enabled: bool
    resting_until: str | None = Field(
        default=None, description="its receiver failed or answered slowly: nothing is posted to it before "
        "this time (the circuit breaker, app/notify.py); null when it is closed")
    failed_in_a_row: int = Field(default=0, description="failed or slow answers in a row; 0 after a quick success")


def out(channel: Channel) -> dict:
    settings = channel.settings or {}
    return {"id": channel.id, "name": channel.name, "kind": channel.kind, "url": mask_url(channel.url),
            "send_resolved": settings.get("send_resolved", True),
            "signing_secret_set": bool(settings.get("signing_secret")), "enabled": channel.enabled,
            "resting_until": resting_until(channel), "failed_in_a_row": channel.breaker_strikes}


def resting_until(channel: Channel) -> str | None:
    """When its breaker closes (ISO 8601, as every time the API gives), when that is ahead."""
    until = aware(channel.breaker_until)
    return until.isoformat() if until is not None and until > utcnow() else None


@router.put("/projects/{project}/channels", status_code=status.HTTP_200_OK, response_model=ChannelOut,
            responses=error_responses(400, 403, 409))
def put_channel(body: ChannelIn, project: ProjectDep, session: SessionDep) -> dict:
    settings: dict[str, bool | str] = {"send_resolved": body.send_resolved}
    if body.signing_secret:
        settings["signing_secret"] = body.signing_secret
    check_project_room(session, project, "channels", [body.name], "name")
    channel = repo.upsert_channel(session, project, body.name, body.kind, body.url, settings)
    channel.enabled = body.enabled
    return out(channel)


@router.get("/projects/{project}/channels", response_model=list[ChannelOut])
def list_channels(project: ProjectDep, session: SessionDep) -> list[dict]:
    channels = session.scalars(select(Channel).where(Channel.project_id == project.id).order_by(Channel.id))
    return [out(channel) for channel in channels]
