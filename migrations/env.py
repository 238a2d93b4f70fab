"""Alembic environment. The URL comes from the Config (app.db.alembic_config sets it), else
from settings; the target is app.db.Base.metadata with every model registered."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, make_url, pool

import app.models  # noqa: F401  (registers every table on Base.metadata)
from app.db import Base
from app.settings import get_settings

config = context.config


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def _options(dialect: str) -> dict:
    return {
        "target_metadata": Base.metadata,
        "compare_type": True,
        # SQLite can't ALTER most things; batch mode rebuilds the table instead.
        "render_as_batch": dialect == "sqlite",
    }


def run_migrations_offline() -> None:
    url = _url()
    options = _options(make_url(url).get_backend_name())
    context.configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"}, **options)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # A one-shot engine, not app.db.get_engine: that one turns on SQLite's foreign_keys, and
    # then a batch-mode table rebuild (DROP TABLE) would cascade-delete the child rows.
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **_options(connection.dialect.name))
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
