"""Migrations on PostgreSQL: a full round trip, and no drift between app.models and the revisions."""

from __future__ import annotations

from app.db import downgrade, upgrade
from sqlalchemy import create_engine, inspect, pool


def test_pg_upgrade_downgrade_upgrade(make_database, table_names, model_tables, schema_diff):
    url = make_database(migrate=False)
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        upgrade(url, "head")
        assert table_names(engine) == model_tables | {"alembic_version"}

        downgrade(url, "base")
        assert table_names(engine) <= {"alembic_version"}
        assert inspect(engine).get_sequence_names() == []  # SERIAL sequences went with their tables

        upgrade(url, "head")
        assert table_names(engine) == model_tables | {"alembic_version"}
        assert schema_diff(engine) == []
    finally:
        engine.dispose()


def test_pg_models_match_migrations(pg_engine, schema_diff):
    # A non-empty diff means app/models.py changed without a new revision (or the reverse): write
    # one with alembic.command.revision(app.db.alembic_config(url), autogenerate=True, message=…)
    # against a database at head, then review it.
    assert schema_diff(pg_engine) == []
