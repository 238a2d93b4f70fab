"""Fixtures for tests against a real PostgreSQL server.

Each test session works in its own throwaway databases (canary_test_<hex>), so concurrent
sessions on one server don't collide. Tests that need committed rows (locks seen from two
connections) take a fresh database of their own; the rest share one migrated database and
run inside a transaction that is rolled back (`db_session`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import app.models as m
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from app.db import Base, upgrade
from sqlalchemy import create_engine, inspect, pool, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _server_url() -> URL:
    url = make_url(os.environ.get("CANARY_TEST_DATABASE_URL") or DEFAULT_URL)
    return url.set(drivername="postgresql+psycopg")


def _table_names(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _schema_diff(engine: Engine) -> list:
    """Alembic autogenerate's differences between the live schema and app.models ([] = none)."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


# Helpers as fixtures: two conftest.py files share one module name, so tests can't import them.
@pytest.fixture(scope="session")
def table_names() -> Callable[[Engine], set[str]]:
    return _table_names


@pytest.fixture(scope="session")
def schema_diff() -> Callable[[Engine], list]:
    return _schema_diff


@pytest.fixture(scope="session")
def model_tables() -> set[str]:
    return set(Base.metadata.tables)


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Engine]:
    """AUTOCOMMIT engine on the server's "postgres" database, for CREATE/DROP DATABASE."""
    admin_url = _server_url().set(database="postgres")
    engine = create_engine(
        admin_url, isolation_level="AUTOCOMMIT", poolclass=pool.NullPool, connect_args={"connect_timeout": 3}
    )
    try:
        with engine.connect():
            pass
    except Exception as exc:  # noqa: BLE001 — any connect failure means "no server"
        where = admin_url.render_as_string(hide_password=True)
        cause = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        message = (
            f"PostgreSQL unreachable at {where} ({cause}). "
            "Start it, or point CANARY_TEST_DATABASE_URL at a server where this user may CREATE DATABASE."
        )
        if os.environ.get("CI"):
            pytest.fail("CI is set, so a missing PostgreSQL is a failure: " + message, pytrace=False)
        pytest.skip("SKIPPING ALL POSTGRES TESTS: " + message)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def make_database(pg_admin: Engine) -> Iterator[Callable[..., str]]:
    """Factory: the URL of a new database, migrated to head unless migrate=False; all dropped at exit."""
    created: list[str] = []

    def create(migrate: bool = True) -> str:
        name = f"canary_test_{uuid.uuid4().hex[:12]}"
        with pg_admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        url = _server_url().set(database=name).render_as_string(hide_password=False)
        if migrate:
            upgrade(url, "head")
        return url

    def drop(name: str) -> None:
        with pg_admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    yield create
    # Each DROP DATABASE waits for a checkpoint (~1 s); concurrent drops share one.
    with ThreadPoolExecutor() as executor:
        list(executor.map(drop, created))


@pytest.fixture(scope="session")
def pg_engine(make_database: Callable[..., str]) -> Iterator[Engine]:
    """The session's shared database, migrated once."""
    engine = create_engine(make_database())
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(pg_engine: Engine) -> Iterator[Session]:
    """A Session whose commits are savepoints inside an outer transaction rolled back after the test."""
    with pg_engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
        try:
            yield session
        finally:
            session.close()
            outer.rollback()


def _make_graph(session: Session, name: str = "acme", with_run: bool = True) -> SimpleNamespace:
    """The smallest valid Project → Model → baseline config + Suite (→ Run → ConfigRun) graph."""
    project = m.Project(name=name)
    session.add(project)
    session.flush()
    model = m.Model(project_id=project.id, name="tiny", path="builtin:tiny")
    suite = m.Suite(project_id=project.id, name="daily", spec={"samples": 1}, version="v1")
    session.add_all([model, suite])
    session.flush()
    baseline = m.OptimizationConfig(
        project_id=project.id, model_id=model.id, name="fp16", spec={"weights": "fp16"}, is_baseline=True
    )
    session.add(baseline)
    session.flush()
    graph = SimpleNamespace(project=project, model=model, suite=suite, baseline=baseline)
    if not with_run:
        return graph
    graph.run = m.Run(
        project_id=project.id,
        suite_id=suite.id,
        suite_version="v1",
        model_id=model.id,
        baseline_config_id=baseline.id,
        trigger="manual",
        n_samples=1,
        sample_keys=["doc-0"],
    )
    session.add(graph.run)
    session.flush()
    graph.config_run = m.ConfigRun(run_id=graph.run.id, config_id=baseline.id)
    session.add(graph.config_run)
    session.flush()
    return graph


@pytest.fixture(scope="session")
def make_graph() -> Callable[..., SimpleNamespace]:
    return _make_graph
