"""Migrations on SQLite (the embedded default): round trip, drift, and auto-assigned ids.
Needs no PostgreSQL server."""

from __future__ import annotations

import pytest
from app.db import downgrade, upgrade
from sqlalchemy import create_engine, pool, text


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'canary.db'}"


@pytest.fixture
def sqlite_engine(sqlite_url):
    engine = create_engine(sqlite_url, poolclass=pool.NullPool)
    yield engine
    engine.dispose()


def test_sqlite_upgrade_downgrade_upgrade(sqlite_url, sqlite_engine, table_names, model_tables):
    upgrade(sqlite_url, "head")
    assert table_names(sqlite_engine) == model_tables | {"alembic_version"}

    downgrade(sqlite_url, "base")
    assert table_names(sqlite_engine) <= {"alembic_version"}

    upgrade(sqlite_url, "head")
    assert table_names(sqlite_engine) == model_tables | {"alembic_version"}


def test_sqlite_models_match_migrations(sqlite_url, sqlite_engine, schema_diff):
    upgrade(sqlite_url, "head")
    assert schema_diff(sqlite_engine) == []


def test_sqlite_big_ids_are_assigned(sqlite_url, sqlite_engine):
    # BigId must render as INTEGER on SQLite: a BIGINT key is no rowid alias and stays NULL.
    upgrade(sqlite_url, "head")
    with sqlite_engine.begin() as conn:  # foreign keys are off on this bare engine
        for metric in ("ppl", "judge"):
            conn.execute(
                text(
                    "INSERT INTO sample_results (run_id, config_id, sample_key, metric, created_at) "
                    "VALUES (1, 1, 'doc-0', :metric, CURRENT_TIMESTAMP)"
                ),
                {"metric": metric},
            )
        ids = conn.scalars(text("SELECT id FROM sample_results ORDER BY id")).all()
    assert ids == [1, 2]


def test_sqlite_every_downgrade_keeps_rows_of_every_kind_on_a_round_trip(sqlite_url, sqlite_engine, table_names,
                                                                         model_tables):
    """As tests/db/test_pg_migrations.py's round trip, on the embedded default (batch mode: SQLite
    rebuilds a table to drop a column)."""
    from tests.db.every_kind import dump, seed_every_table

    upgrade(sqlite_url, "head")
    with sqlite_engine.begin() as conn:
        assert set(seed_every_table(conn)) == model_tables
    with sqlite_engine.connect() as conn:
        before = dump(conn)
    for revision in ["0007", "0006", "0005", "0004", "0003", "0002", "0001"]:
        downgrade(sqlite_url, revision)
        upgrade(sqlite_url, "head")
        with sqlite_engine.connect() as conn:
            assert dump(conn) == before, revision
    assert table_names(sqlite_engine) == model_tables | {"alembic_version"}


def test_sqlite_a_row_added_while_downgraded_takes_no_stashed_value(sqlite_url, sqlite_engine):
    """SQLite gives a deleted row's id to the next row. An ablation deleted while the database was
    at 0003 and a new config inserted in its place (same id): the upgrade leaves the new config an
    ordinary one, as the stash matches the natural key (project, name), not the id alone."""
    from tests.db.every_kind import seed_every_table

    upgrade(sqlite_url, "head")
    with sqlite_engine.begin() as conn:
        seed_every_table(conn)
    downgrade(sqlite_url, "0003")
    with sqlite_engine.begin() as conn:
        old = conn.execute(text("SELECT id FROM optimization_configs WHERE name = 'stacked-kv'")).scalar()
        conn.execute(text("DELETE FROM optimization_configs WHERE name = 'stacked-kv'"))
        conn.execute(text("INSERT INTO optimization_configs (project_id, model_id, name, spec, is_baseline, created_at) "
                          "SELECT project_id, model_id, 'new-config', spec, 0, created_at FROM optimization_configs "
                          "WHERE name = 'stacked'"))
        assert conn.execute(text("SELECT id FROM optimization_configs WHERE name = 'new-config'")).scalar() == old
    upgrade(sqlite_url, "head")
    with sqlite_engine.connect() as conn:
        row = conn.execute(text("SELECT ablation_of_id, ablation_axis FROM optimization_configs "
                                "WHERE name = 'new-config'")).one()
        assert tuple(row) == (None, None)
        assert "migration_stash" not in {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master"))}
