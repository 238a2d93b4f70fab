"""Constraints the write paths rely on: SampleResult's unique key (idempotent upserts) and
ON DELETE CASCADE from a project."""

from __future__ import annotations

import pytest
from app.models import ConfigRun, Model, OptimizationConfig, Project, Run, SampleResult, Suite
from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import IntegrityError


def _key(graph) -> dict:
    return {"run_id": graph.run.id, "config_id": graph.baseline.id, "sample_key": "doc-0", "metric": "ppl"}


def test_sample_result_key_is_unique(db_session, make_graph):
    graph = make_graph(db_session)
    db_session.add(SampleResult(**_key(graph), value=1.0))
    db_session.flush()
    db_session.add(SampleResult(**_key(graph), value=2.0))
    with pytest.raises(IntegrityError, match="uq_sample_result"):
        db_session.flush()


def test_sample_result_upsert_keeps_latest_value(db_session, make_graph):
    graph = make_graph(db_session)
    for value in (1.0, 2.0, 3.0):  # a redelivered task writes the same key again
        stmt = insert(SampleResult).values(**_key(graph), value=value, extra={"try": value})
        stmt = stmt.on_conflict_do_update(
            constraint="uq_sample_result", set_={"value": stmt.excluded.value, "extra": stmt.excluded.extra}
        )
        db_session.execute(stmt)
    rows = db_session.execute(select(SampleResult.value, SampleResult.extra)).all()
    assert [tuple(r) for r in rows] == [(3.0, {"try": 3.0})]


def _count(session, table) -> int:
    return session.scalar(select(func.count()).select_from(table))


def test_deleting_project_cascades_to_models_configs_suites(db_session, make_graph):
    doomed = make_graph(db_session, name="doomed", with_run=False)
    make_graph(db_session, name="kept", with_run=False)

    # Core DELETE: the database must cascade, not the ORM (Project declares no relationships).
    db_session.execute(delete(Project).where(Project.id == doomed.project.id))

    for table in (Project, Model, OptimizationConfig, Suite):
        assert _count(db_session, table) == 1, table.__tablename__


def test_deleting_project_with_runs_cascades(db_session, make_graph):
    doomed = make_graph(db_session, name="doomed")
    make_graph(db_session, name="kept")
    db_session.add(SampleResult(**_key(doomed), value=1.0))
    db_session.flush()

    db_session.execute(delete(Project).where(Project.id == doomed.project.id))
    # The test's transaction is rolled back, never committed: check deferred keys now.
    db_session.execute(text("SET CONSTRAINTS ALL IMMEDIATE"))

    for table in (Project, Model, OptimizationConfig, Suite, Run, ConfigRun):
        assert _count(db_session, table) == 1, table.__tablename__
    assert _count(db_session, SampleResult) == 0


def test_a_gate_baseline_takes_the_rows_of_the_config_run_with_the_same_inputs(db_session, make_graph):
    """repo.reusable_config_run + copy_sample_results on Postgres: the newest succeeded config-run
    of the config, as its run's baseline, with the same inputs key on the same samples; the
    metrics asked for copied into the new run, replacing what an interrupted attempt left there,
    and nothing else (a judge's row stays behind)."""
    from app import repo

    graph = make_graph(db_session)
    graph.config_run.status = "succeeded"
    graph.config_run.figures = {"inputs_key": "k1"}
    key = {"run_id": graph.run.id, "config_id": graph.baseline.id, "sample_key": "doc-0"}
    db_session.add_all([SampleResult(**key, metric="nll", value=2.5, extra={"tokens": 4}),
                        SampleResult(**key, metric="generation", value=None, extra={"text": "x"}),
                        SampleResult(**key, metric="judge_score", value=4.0)])
    later = Run(project_id=graph.project.id, suite_id=graph.suite.id, suite_version="v1", model_id=graph.model.id,
                baseline_config_id=graph.baseline.id, trigger="gate", n_samples=1, sample_keys=["doc-0"])
    db_session.add(later)
    db_session.flush()
    db_session.add(SampleResult(run_id=later.id, config_id=graph.baseline.id, sample_key="doc-0", metric="nll",
                                value=9.0))  # a row of an interrupted attempt
    db_session.flush()
    assert repo.reusable_config_run(db_session, later, graph.baseline.id, "other") is None
    source = repo.reusable_config_run(db_session, later, graph.baseline.id, "k1")
    assert source is not None and source.id == graph.config_run.id
    repo.copy_sample_results(db_session, graph.run.id, later.id, graph.baseline.id, ["nll", "generation"])
    rows = db_session.execute(select(SampleResult.metric, SampleResult.value, SampleResult.extra)
                              .where(SampleResult.run_id == later.id).order_by(SampleResult.metric)).all()
    assert [tuple(r) for r in rows] == [("generation", None, {"text": "x"}), ("nll", 2.5, {"tokens": 4})]
    later.sample_keys = ["doc-1"]  # other samples: nothing to take
    db_session.flush()
    assert repo.reusable_config_run(db_session, later, graph.baseline.id, "k1") is None
    later.sample_keys = ["doc-0"]
    # the config was not that run's baseline (the baseline moved since): its rows hold another's scoring
    other = OptimizationConfig(project_id=graph.project.id, model_id=graph.model.id, name="old-base", spec={})
    db_session.add(other)
    db_session.flush()
    graph.run.baseline_config_id = other.id
    db_session.flush()
    assert repo.reusable_config_run(db_session, later, graph.baseline.id, "k1") is None
