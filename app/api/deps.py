from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from app import repo
from app.auth import Forbidden, authenticate
from app.config_file import DB_INT_MAX
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
    return authenticate(session, request.headers.get("authorization"), get_settings().auth_required)


KeyDep = Annotated[ApiKey | None, Depends(get_key)]
# a run, gate or silence id in a path: bounded like the INTEGER column it is looked up in (422, not a DB overflow)
RowId = Annotated[int, Path(ge=1, le=DB_INT_MAX)]
READ_METHODS = ("GET", "HEAD", "OPTIONS")


def get_project(project: str, request: Request, session: SessionDep, key: KeyDep) -> Project:
    if key is not None:
        owned = session.get(Project, key.project_id)
        if owned is None or owned.name != project:
            raise repo.NotFound(f"project '{project}' not found")  # the same answer as for a project that does not exist
        if request.method not in READ_METHODS and key.scope != "write":
            raise Forbidden(f"this API key is read-only; {request.method} needs a read-write key of project '{project}'")
    return repo.get_project(session, project)


ProjectDep = Annotated[Project, Depends(get_project)]
