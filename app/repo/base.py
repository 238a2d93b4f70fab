"""What every repository module shares: the errors the API maps to status codes, and the
dialect-portable insert."""


from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import CursorResult, Result, func, select
from sqlalchemy.orm import Session

from app.models import (
    ConfigRun,
    Run,
)

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PostgresInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert

TERMINAL = ("succeeded", "failed")


class NotFound(LookupError):
    """An object that does not exist in this project (the API answers 404)."""


class Conflict(ValueError):
    """A request that contradicts stored state (the API answers 409)."""


class QueueFull(ValueError):
    """A project has as many config-runs queued as it may (the API answers 429)."""


def queued_config_runs(session: Session, project_id: int) -> int:
    """How many config-runs of the project wait for a GPU worker."""
    return session.scalar(select(func.count()).select_from(ConfigRun).join(Run, Run.id == ConfigRun.run_id)
                          .where(Run.project_id == project_id, ConfigRun.status == "queued")) or 0


def _insert(session: Session) -> Callable[[type], PostgresInsert | SqliteInsert]:
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert


def _rowcount(result: Result[Any]) -> int:
    """The rows an UPDATE matched: session.execute types its result as a Result, but a DML
    statement's is a CursorResult, which carries the count."""
    return cast(CursorResult[Any], result).rowcount
