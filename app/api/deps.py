from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from app import repo
from app.api import limits
from app.auth import Forbidden, Unauthorized, authenticate
from app.config_base import DB_INT_MAX
from app.db import get_sessionmaker
from app.models import ApiKey, Project
from app.settings import get_settings


def get_session() -> Iterator[Session]:
    session = get_sessionmaker()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# scope="function": commit before the response is sent, so a client that got 201 can read
# what it wrote on its next request (the default "request" scope commits after sending).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_key(request: Request, session: SessionDep) -> ApiKey | None:
    """The request's API key, checked, and one token from its rate-limit bucket: keyed on the
    key's id (whitespace or case variants of one key share it), or on the client address when
    no key is sent. The key is looked up first: a failed authentication takes from the address's
    failure bucket (429 instead of 401 once it is empty); a valid key is never limited by it."""
    address = limits.client_address(request)
    try:
        key = authenticate(session, request.headers.get("authorization"), get_settings().auth_required)
    except Unauthorized:
        limits.authentication_failed(address)
        raise
    limits.take_request(("key", key.id) if key is not None else ("address", address))
    if key is not None and key.scope not in ("read", "write"):
        raise Forbidden(f"this API key has the '{key.scope}' scope: it reads /metrics only; the API needs a read-only "
                        "or read-write key (`canary keys create --project P [--read-only]`)")
    return key


KeyDep = Annotated[ApiKey | None, Depends(get_key)]
# a run, gate or silence id in a path: bounded like the INTEGER column it is looked up in (422, not a DB overflow)
RowId = Annotated[int, Path(ge=1, le=DB_INT_MAX)]
READ_METHODS = ("GET", "HEAD", "OPTIONS")


def get_project(project: str, request: Request, session: SessionDep, key: KeyDep) -> Project:
    if key is not None:
        owned = session.get(Project, key.project_id)
        if owned is None or owned.name != project:
            # the same answer as for a project that does not exist
            raise repo.NotFound(f"project '{project}' not found")
        if request.method not in READ_METHODS and key.scope != "write":
            raise Forbidden(f"this API key is read-only; {request.method} needs a read-write key of project "
                            f"'{project}'")
    return repo.get_project(session, project)


ProjectDep = Annotated[Project, Depends(get_project)]
