"""Alert channels. A channel's URL is a secret (it carries the webhook token): responses show
it masked, and `${ENV_VAR}` references keep it out of the database altogether."""

from __future__ import annotations

import re
from typing import Literal

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select

from app import repo
from app.api.deps import ProjectDep, SessionDep
from app.config_file import NAME_PATTERN
from app.models import Channel

router = APIRouter(tags=["channels"])
ENV_REF = r"\$\{[A-Za-z_][A-Za-z0-9_]*\}"


class ChannelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    kind: Literal["slack", "teams", "discord", "webhook", "alertmanager"]
    url: str = Field(max_length=2048, description="http(s) webhook URL, or ${ENV_VAR} read by the workers at send time")
    send_resolved: bool = True
    signing_secret: str | None = Field(None, description="webhook: ${ENV_VAR} holding the HMAC-SHA256 secret")
    enabled: bool = True

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if re.fullmatch(ENV_REF, v) or re.match(r"^https?://[^\s/]+", v):
            return v
        raise ValueError(f"'{mask(v)}' is not an http(s) URL or an ${{ENV_VAR}} reference")

    @field_validator("signing_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(ENV_REF, v):
            raise ValueError("give the signing secret as an ${ENV_VAR} reference, never the secret itself")
        return v


def mask(url: str) -> str:
    """Only scheme and host stay readable: path, query and user info (where webhook tokens and
    passwords live) never leave the server."""
    if re.fullmatch(ENV_REF, url):
        return url
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "***"
    return f"{u.scheme}://{host}{port}/***" if u.scheme and host else "***"


def out(c: Channel) -> dict:
    settings = c.settings or {}
    return {"id": c.id, "name": c.name, "kind": c.kind, "url": mask(c.url), "send_resolved": settings.get("send_resolved", True),
            "signing_secret_set": bool(settings.get("signing_secret")), "enabled": c.enabled}


@router.put("/projects/{project}/channels", status_code=status.HTTP_200_OK)
def put_channel(body: ChannelIn, project: ProjectDep, session: SessionDep) -> dict:
    from app.ssrf import check_url

    if not re.fullmatch(ENV_REF, body.url):
        check_url(body.url, "url")  # again at every send: DNS may change
    settings = {"send_resolved": body.send_resolved}
    if body.signing_secret:
        settings["signing_secret"] = body.signing_secret
    c = repo.upsert_channel(session, project, body.name, body.kind, body.url, settings)
    c.enabled = body.enabled
    return out(c)


@router.get("/projects/{project}/channels")
def list_channels(project: ProjectDep, session: SessionDep) -> list[dict]:
    return [out(c) for c in session.scalars(select(Channel).where(Channel.project_id == project.id).order_by(Channel.id))]
