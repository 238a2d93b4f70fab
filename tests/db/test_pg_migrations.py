"""Migrations on PostgreSQL: a full round trip, and no drift between app.models and the revisions."""

from __future__ import annotations

from app.db import downgrade, upgrade
from sqlalchemy import create_engine, inspect, pool, text


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


def test_a_downgrade_the_database_refuses_is_named_as_a_failed_migration(make_database):
    """Security round 4, N6: the CLI called any refused downgrade an unreachable database. A row the
    old schema cannot hold (a verdict longer than 0003's old width of 16, written behind the
    service's back) makes 0003's downgrade fail: the CLI says which step failed and why, in one
    line, and the database stays at head with its rows (the step runs in one transaction)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    url = make_database()
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            run = lambda q, **kw: conn.execute(text(q), kw).scalar()  # noqa: E731
            project = run("INSERT INTO projects (name, created_at) VALUES ('p', now()) RETURNING id")
            model = run("INSERT INTO models (project_id, name, path, created_at) VALUES (:p, 'm', 'x', now()) "
                        "RETURNING id", p=project)
            config = run("INSERT INTO optimization_configs (project_id, model_id, name, spec, is_baseline, created_at) "
                         "VALUES (:p, :m, 'c', '{}', true, now()) RETURNING id", p=project, m=model)
            suite = run("INSERT INTO suites (project_id, name, spec, version, n_documents, created_at) "
                        "VALUES (:p, 's', '{}', 'v1', 1, now()) RETURNING id", p=project)
            run_id = run("INSERT INTO runs (project_id, suite_id, suite_version, model_id, baseline_config_id, trigger, "
                         "status, n_samples, seed, sample_keys, created_at) VALUES (:p, :s, 'v1', :m, :c, 'manual', "
                         "'done', 1, 0, '[\"d0\"]', now()) RETURNING id", p=project, s=suite, m=model, c=config)
            for metric, verdict in (("ppl_ratio", "measurement_error"), ("ttft_ms", "a-verdict-of-21-chars")):
                conn.execute(text("INSERT INTO comparisons (run_id, config_id, metric, estimate, ci_low, ci_high, n, "
                                  "verdict, rule, created_at) VALUES (:r, :c, :m, 1.2, 1.1, 1.3, 12, :v, 'x', now())"),
                             {"r": run_id, "c": config, "m": metric, "v": verdict})
        env = {**os.environ, "CANARY_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-m", "app.cli", "db", "downgrade", "0002"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
        [line] = [x for x in r.stdout.splitlines() + r.stderr.splitlines() if x.strip()]
        assert line.startswith("error: the downgrade to revision 0002 failed in a migration: ") and "unreachable" not in line
        assert "value too long" in line, line
        with engine.connect() as conn:
            # the head: nothing of the downgrade stayed
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0008"
            assert conn.execute(text("SELECT count(*) FROM comparisons")).scalar() == 2
            assert conn.execute(text("SELECT verdict FROM comparisons WHERE metric = 'ppl_ratio'")).scalar() == \
                "measurement_error"  # the step's UPDATE rolled back with it
    finally:
        engine.dispose()


REVISIONS = ["0007", "0006", "0005", "0004", "0003", "0002", "0001"]  # each downgrade target below head


def test_every_downgrade_keeps_rows_of_every_kind_on_a_round_trip(make_database, table_names, model_tables,
                                                                  schema_diff):
    """Security round 4, N6: a row in every table, the columns later revisions added away from their
    defaults (a measurement_error verdict, an ablation, a pass's attempt base, a priority, an
    informational comparison). Down to each earlier revision and back to head, every row and value
    is as it was, and the stash that kept them is gone (app/migration_stash.py). Before, a round
    trip read measurement_error as inconclusive and reset the ablations, attempt bases and priorities."""
    from tests.db.every_kind import dump, seed_every_table

    url = make_database()
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            counts = seed_every_table(conn)
        assert set(counts) == model_tables
        with engine.connect() as conn:
            before = dump(conn)
        for revision in REVISIONS:
            downgrade(url, revision)
            upgrade(url, "head")
            with engine.connect() as conn:
                assert dump(conn) == before, revision
        assert table_names(engine) == model_tables | {"alembic_version"}
        assert schema_diff(engine) == []
    finally:
        engine.dispose()
