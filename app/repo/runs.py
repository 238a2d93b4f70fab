"""Runs: creation (with the drawn samples), reading, cancelling, the aggregation's start, lock and
finish, the comparisons, and what the reconciler looks for."""


from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import datetime

from sqlalchemy import Exists, delete, func, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.models import (
    ComparisonRow,
    ConfigRun,
    OptimizationConfig,
    Project,
    Run,
    SampleResult,
    Suite,
    utcnow,
)
from app.repo.base import TERMINAL, Conflict, NotFound, _insert, _rowcount
from app.repo.catalogue import suite_samples
from vocabulary.comparison import STORED
from vocabulary.comparison import Comparison as Measured  # app.models.ComparisonRow is its stored row


def draw_samples(keys: Sequence[str], n: int, seed: int) -> list[str]:
    """n keys drawn without replacement by seed, kept in suite order (reproducible per seed)."""
    picked = set(random.Random(seed).sample(range(len(keys)), n))
    return [k for i, k in enumerate(keys) if i in picked]


def create_run(
    session: Session,
    project: Project,
    suite: Suite,
    configs: Sequence[OptimizationConfig],
    *,
    n_samples: int | None = None,
    seed: int | None = None,
    trigger: str = "manual",
    idempotency_key: str | None = None,
) -> tuple[Run, bool]:
    """Write a Run and one queued ConfigRun per config (the model's baseline always included).
    Returns (run, created); a known idempotency key returns the earlier run unchanged, provided
    the request is the same one."""
    if not configs:
        raise ValueError("configs: name at least one config to run")
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"configs: {', '.join(dupes)} named more than once; name each config once")
    model_ids = {c.model_id for c in configs}
    if len(model_ids) != 1:
        raise ValueError("configs: every config of a run must belong to the same model")
    model_id = model_ids.pop()
    baseline = session.scalar(
        select(OptimizationConfig).where(OptimizationConfig.model_id == model_id,
                                         OptimizationConfig.is_baseline.is_(True))
    )
    if baseline is None:
        raise ValueError("configs: the model has no baseline config; mark one config as baseline")
    ordered = [baseline] + [c for c in configs if c.id != baseline.id]
    n = n_samples or suite.settings.samples
    seed = suite.settings.seed if seed is None else seed
    if idempotency_key:
        existing = session.scalar(select(Run).where(Run.project_id == project.id,
                                                    Run.idempotency_key == idempotency_key))
        if existing is not None:
            same = (existing.suite_id == suite.id and existing.n_samples == n and existing.seed == seed
                    and sorted(cr.config_id for cr in existing.config_runs if cr.config.ablation_of_id is None)
                    == sorted(c.id for c in ordered))  # ablations the run added later are not the request
            if not same:
                raise Conflict(f"Idempotency-Key '{idempotency_key}' was used for a different run request (run "
                               f"{existing.id}); use a new key")
            return existing, False
    if n > suite.n_documents:
        raise ValueError(
            f"samples: {n} > {suite.n_documents} documents in suite '{suite.name}'; lower samples or add documents"
        )
    keys = [s.key for s in suite_samples(session, suite.id, suite.version)]
    run = Run(
        project_id=project.id, suite_id=suite.id, suite_version=suite.version, model_id=model_id,
        baseline_config_id=baseline.id, trigger=trigger, n_samples=n, seed=seed,
        sample_keys=draw_samples(keys, n, seed), idempotency_key=idempotency_key,
    )
    session.add(run)
    session.flush()
    now = utcnow()
    session.add_all(ConfigRun(run_id=run.id, config_id=c.id, enqueued_at=now) for c in ordered)
    session.flush()
    return run, True


def get_run(session: Session, project: Project, run_id: int) -> Run:
    run = session.scalar(select(Run).where(Run.id == run_id, Run.project_id == project.id))
    if run is None:
        raise NotFound(f"run {run_id} not found in project '{project.name}'")
    return run


def cancel_run(session: Session, project: Project, run_id: int, who: str) -> Run:
    """Stop a queued or running run: it ends `cancelled` (verdict error, so a gate on it decides
    and CI stops waiting), its unfinished config-runs end `cancelled` — a worker still on one
    loses its lease at its next write (every write is fenced by a running attempt) — and what
    they had written so far is deleted, so no half-measured config is left to read. Conflict
    when the run has ended or is being aggregated (its verdict is seconds away). A gate on it is
    decided by the caller (app/services.cancel_run)."""
    run = get_run(session, project, run_id)
    now = utcnow()
    reason = f"cancelled by {who} at {now:%Y-%m-%d %H:%M:%S} UTC"
    # conditional: an aggregation that has begun (status aggregating) or ended keeps its run
    won = session.execute(update(Run).where(Run.id == run.id, Run.status.in_(("queued", "running")))
                          .values(status="cancelled", verdict="error", verdict_reason=reason, finished_at=now))
    if _rowcount(won) == 0:
        session.refresh(run)
        raise Conflict(f"run {run_id} is {run.status}: only a queued or running run can be cancelled")
    unfinished = list(session.scalars(select(ConfigRun.id).where(ConfigRun.run_id == run.id,
                                                                 ConfigRun.status.not_in(TERMINAL))))
    if unfinished:
        session.execute(update(ConfigRun).where(ConfigRun.id.in_(unfinished))
                        .values(status="cancelled", error=reason, finished_at=now, lease_expires_at=None))
        session.execute(delete(SampleResult).where(SampleResult.run_id == run.id,
                                                   SampleResult.config_id.in_(
                                                       select(ConfigRun.config_id).where(ConfigRun.id.in_(unfinished)))))
    session.flush()
    session.refresh(run)
    return run


def list_runs(session: Session, project: Project, limit: int = 50, offset: int = 0) -> list[Run]:
    return list(session.scalars(
        select(Run).where(Run.project_id == project.id).order_by(Run.id.desc()).limit(limit).offset(offset)
    ))


def _unfinished(run_id: int | InstrumentedAttribute[int]) -> Exists:
    """EXISTS a config-run of the run (an id or the Run.id column) that is not yet terminal."""
    return select(ConfigRun.id).where(ConfigRun.run_id == run_id, ConfigRun.status.not_in(TERMINAL)).exists()


def try_start_aggregation(session: Session, run_id: int) -> bool:
    """Exactly one caller wins once every config-run is terminal (a conditional UPDATE)."""
    res = session.execute(
        update(Run).where(Run.id == run_id, Run.status.in_(("queued", "running")), ~_unfinished(run_id))
        .values(status="aggregating")
    )
    return _rowcount(res) == 1


def run_trigger(session: Session, run_id: int) -> str | None:
    """How the run was started (manual | schedule | gate | alert): its tasks' queue priority."""
    return session.scalar(select(Run.trigger).where(Run.id == run_id))


def sample_results(session: Session, run_id: int, config_id: int | None = None, metric: str | None = None,
                   limit: int | None = None, offset: int = 0) -> list[SampleResult]:
    q = select(SampleResult).where(SampleResult.run_id == run_id)
    if config_id is not None:
        q = q.where(SampleResult.config_id == config_id)
    if metric is not None:
        q = q.where(SampleResult.metric == metric)
    q = q.order_by(SampleResult.id).offset(offset)
    if limit is not None:
        q = q.limit(limit)
    return list(session.scalars(q))


def recorded_keys(session: Session, run_id: int, config_id: int) -> frozenset[tuple[str, str]]:
    """(record kind, sample key) of every row a config holds in a run: what a top-up pass of it need
    not score again (workers/job.py)."""
    return frozenset((metric, key) for metric, key in session.execute(
        select(SampleResult.metric, SampleResult.sample_key)
        .where(SampleResult.run_id == run_id, SampleResult.config_id == config_id)))


def recorded_nll(session: Session, run_id: int, config_id: int) -> tuple[float, int]:
    """Σ NLL and Σ tokens of the documents (nll rows) a config holds in a run."""
    total, tokens = 0.0, 0
    for value, extra in session.execute(select(SampleResult.value, SampleResult.extra).where(
            SampleResult.run_id == run_id, SampleResult.config_id == config_id, SampleResult.metric == "nll")):
        if value is not None:
            total += value
            tokens += int((extra or {}).get("n_tokens") or 0)
    return total, tokens


def sample_rows(session: Session, run_id: int) -> list[tuple[int, str, str, float | None, dict | None]]:
    """Every sample result of a run as (config_id, metric, sample_key, value, extra), in storage order."""
    return [tuple(row) for row in session.execute(
        select(SampleResult.config_id, SampleResult.metric, SampleResult.sample_key, SampleResult.value,
               SampleResult.extra).where(SampleResult.run_id == run_id).order_by(SampleResult.id))]


def write_comparisons(session: Session, run_id: int, rows: Sequence[Measured]) -> None:
    """The run's comparisons (each with its config_id), a row each; one already stored for the
    same (config, metric) is replaced."""
    if not rows:
        return
    if any(c.config_id is None for c in rows):
        raise ValueError("write_comparisons: every comparison needs its config_id")
    insert = _insert(session)
    now = utcnow()
    stmt = insert(ComparisonRow).values([{"run_id": run_id, "created_at": now, **c.to_row()} for c in rows])
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "config_id", "metric"],
        set_={c: getattr(stmt.excluded, c) for c in STORED if c not in ("config_id", "metric")},
    )
    session.execute(stmt)


def comparisons(session: Session, run_id: int) -> list[ComparisonRow]:
    return list(session.scalars(select(ComparisonRow).where(ComparisonRow.run_id == run_id)
                                .order_by(ComparisonRow.config_id, ComparisonRow.metric)))


AGGREGATION_LOCK = 0x63616E61  # advisory-lock namespace of run aggregations


def aggregation_lock(run_id: int) -> AbstractContextManager[bool]:
    """Held by the one aggregation pass of a run (app.db.advisory_lock)."""
    from app.db import advisory_lock

    return advisory_lock(AGGREGATION_LOCK, run_id)


def finish_run(session: Session, run_id: int, status: str, verdict: str, reason: str | None,
               only_if: Sequence[str] | None = None) -> bool:
    """Record the run's outcome; with only_if, only while the run is in one of those states (an
    error path must not overwrite a verdict that another pass already wrote)."""
    q = update(Run).where(Run.id == run_id)
    if only_if is not None:
        q = q.where(Run.status.in_(list(only_if)))
    finished = q.values(status=status, verdict=verdict, verdict_reason=reason, finished_at=utcnow())
    if _rowcount(session.execute(finished)) == 0:
        return False
    session.flush()  # the caller decides a gate on this run in the same transaction (app.gates.decide)
    return True


def stalled_runs(session: Session, older_than: datetime) -> list[int]:
    """Runs whose every config-run finished before older_than but whose aggregation never
    completed: the trigger message was lost, or the process died between the two commits."""
    last_finish = select(func.max(ConfigRun.finished_at)).where(ConfigRun.run_id == Run.id).scalar_subquery()
    return list(session.scalars(
        select(Run.id).where(Run.status.in_(("queued", "running", "aggregating")), ~_unfinished(Run.id),
                             last_finish < older_than)
    ))


def reopen_aggregation(session: Session, run_id: int) -> None:
    """Put a stalled run into 'aggregating' (idempotent) so the aggregate task will take it, only
    while every config-run is still finished: a top-up or a step back that queued config-runs again
    since the run was found stalled keeps it 'running'."""
    session.execute(update(Run).where(Run.id == run_id, Run.status.in_(("queued", "running")), ~_unfinished(run_id))
                    .values(status="aggregating"))
