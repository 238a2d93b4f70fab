"""API keys (docs/reference.md §10): 256 random bits, shown once, stored only as a SHA-256 hash,
scoped to one project, read-only, read-write or metrics-only, revocable. A key of project A asking for
project B's objects gets the same 404 as a project that does not exist."""

from __future__ import annotations

import hashlib
import secrets
from typing import Literal, overload

from sqlalchemy import select
from sqlalchemy.orm import Session

from app import repo
from app.models import ApiKey, utcnow

PREFIX = "cnry_"
# read: GET on its project; write: everything on its project; metrics: GET /metrics with its
# project's figures only; metrics-all: GET /metrics with every project's figures (an operator's
# Prometheus). Metrics keys open no /api route.
SCOPES = ("read", "write", "metrics", "metrics-all")
METRICS_SCOPES = ("metrics", "metrics-all")


class Unauthorized(Exception):
    pass


class Forbidden(Exception):
    pass


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, project_name: str, name: str, scope: str = "write") -> tuple[ApiKey, str]:
    if scope not in SCOPES:
        raise ValueError(f"scope: one of {', '.join(SCOPES)}")
    project = repo.get_or_create_project(session, project_name)
    key = PREFIX + secrets.token_urlsafe(32)  # 256 bits
    return repo.add_api_key(session, project.id, name, hash_key(key), scope), key


def revoke_key(session: Session, key_id: int) -> ApiKey:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise repo.NotFound(f"API key {key_id} not found")
    row.revoked_at = row.revoked_at or utcnow()
    return row


@overload
def authenticate(session: Session, authorization: str | None, required: Literal[True]) -> ApiKey: ...
@overload
def authenticate(session: Session, authorization: str | None, required: bool) -> ApiKey | None: ...


def authenticate(session: Session, authorization: str | None, required: bool) -> ApiKey | None:
    """The key the header names; None only when no header was sent and none is required."""
    if not authorization:
        if required:
            raise Unauthorized("send 'Authorization: Bearer <API key>'; an operator creates one with "
                               "`canary keys create --project NAME`")
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer <API key>'")
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(token.strip())))
    if row is None or row.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key")
    return row
