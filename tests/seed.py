"""Rows written straight into a database for tests that judge what reads them: a project, its
model, its configs (the first one the baseline) and a suite, as app/config_file.py would store
them. The tests add the runs and comparisons they are about."""

from __future__ import annotations

from typing import Any


def catalogue(session, project: str, model: str, configs: list[str], *, spec: dict[str, Any] | None = None,
              suite: str = "daily", suite_spec: dict[str, Any] | None = None, n_documents: int = 100):
    """(project, model, {name: config}, suite), flushed so that each has its id."""
    from app.models import Model, OptimizationConfig, Project, Suite

    row = Project(name=project)
    session.add(row)
    session.flush()
    mod = Model(project_id=row.id, name=model, path="builtin:pydoc-target")
    session.add(mod)
    session.flush()
    made = {name: OptimizationConfig(project_id=row.id, model_id=mod.id, name=name, is_baseline=i == 0,
                                     spec=dict(spec or {}))
            for i, name in enumerate(configs)}
    session.add_all(made.values())
    found = Suite(project_id=row.id, name=suite, version="v1", spec=suite_spec or {}, n_documents=n_documents)
    session.add(found)
    session.flush()
    return row, mod, made, found
