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


SessionDep = Annotated[Session, Depends(get_session)]


def get_project(project: str, session: SessionDep) -> Project:
    return repo.get_project(session, project)


ProjectDep = Annotated[Project, Depends(get_project)]
