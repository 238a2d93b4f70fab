"""Engine and session factory. SQLite (embedded default) and Postgres (production)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import MetaData, create_engine, event, exc, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from app.settings import get_settings

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine.interfaces import DBAPIConnection
    from sqlalchemy.pool import ConnectionPoolEntry


class Base(DeclarativeBase):
    # Named constraints: identical on SQLite and Postgres, and droppable by later migrations.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


def get_engine(url: str | None = None) -> Engine:
    return _engine(url or get_settings().database_url)


@lru_cache
def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")  # API reads while the worker thread writes
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # hide_parameters: an error's text (logged, or stored as a run's reason) never carries values
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10, hide_parameters=True)


def get_sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    return _sessionmaker(url or get_settings().database_url)


@lru_cache
def _sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


T = TypeVar("T")
log = logging.getLogger(__name__)


# SQLSTATEs worth a retry: connection exceptions (class 08), the server shutting down or
# restarting (57P01-57P03), serialization failures and deadlocks (40001, 40P01)
_TRANSIENT_SQLSTATES = {"57P01", "57P02", "57P03", "40001", "40P01"}


def is_transient(e: BaseException) -> bool:
    """The database could not be reached or dropped the connection (a restart, a failover, a
    network blip), or a lock conflict aborted the transaction: the same transaction may succeed
    when tried again. Constraint violations, a missing table, a statement timeout and
    programming errors are not transient."""
    if getattr(e, "connection_invalidated", False) or isinstance(e, exc.DisconnectionError):
        return True
    if not isinstance(e, (exc.OperationalError, exc.InterfaceError)):
        return False
    orig = getattr(e, "orig", None)
    state = getattr(orig, "sqlstate", None)
    if state:
        return state.startswith("08") or state in _TRANSIENT_SQLSTATES
    if type(orig).__module__.startswith("sqlite3"):
        return "locked" in str(orig) or "busy" in str(orig)
    return True  # no SQLSTATE: the client could not connect or lost the connection


def retry_transient(fn: Callable[[], T], what: str, deadline_s: float | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """Call fn, which runs one whole transaction of its own (a session_scope), again while the
    database is unreachable, with backoff from 0.5 s to 5 s, for up to deadline_s seconds
    (settings.db_retry_seconds); then re-raise. A failed transaction rolled back entirely, so
    running it again is safe."""
    deadline = time.monotonic() + (get_settings().db_retry_seconds if deadline_s is None else deadline_s)
    delay = 0.5
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1f s", what, type(e).__name__, delay)
            sleep(delay)
            delay = min(delay * 2, 5.0)


@contextmanager
def advisory_lock(namespace: int, key: int, url: str | None = None) -> Iterator[bool]:
    """Try to take a Postgres session-level advisory lock on (namespace, key) for the duration of
    the block; yields whether it is held. It lives on its own connection, so it spans the many
    short transactions of a long task, and dies with the process (the server releases it when
    the connection closes). SQLite (the embedded default, one process): always held."""
    engine = get_engine(url)
    if engine.dialect.name != "postgresql":
        yield True
        return
    with engine.connect() as conn:
        held = bool(conn.execute(text("SELECT pg_try_advisory_lock(:n, :k)"), {"n": namespace, "k": key}).scalar())
        conn.commit()
        try:
            yield held
        finally:
            if held:
                try:
                    conn.execute(text("SELECT pg_advisory_unlock(:n, :k)"), {"n": namespace, "k": key})
                    conn.commit()
                except Exception:  # noqa: BLE001 - a dead connection: never pool it, the lock went with it
                    conn.invalidate()


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on error."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Run Alembic migrations (`canary db upgrade`)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def alembic_config(url: str | None = None) -> Config:
    import pathlib

    from alembic.config import Config

    root = pathlib.Path(__file__).resolve().parent.parent
    alembic_config = Config()
    alembic_config.set_main_option("script_location", str(root / "migrations"))
    alembic_config.set_main_option("sqlalchemy.url", (url or get_settings().database_url).replace("%", "%%"))
    return alembic_config
