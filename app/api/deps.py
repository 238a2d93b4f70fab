from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends
from sqlalchemy.orm import Session

from app import repo
from app.db import get_sessionmaker
from app.models import Project


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


def get_project(project: str, session: SessionDep) -> Project:
    return repo.get_project(session, project)


ProjectDep = Annotated[Project, Depends(get_project)]
