"""Config-runs: the claim, lease and fenced writes of an attempt, the sample results it writes, a
baseline's reuse, and the config-runs a top-up or a step back adds."""


from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, and_, delete, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from app.dispatch import stored_priority
from app.models import (
    ConfigRun,
    OptimizationConfig,
    Run,
    SampleResult,
    aware,
    utcnow,
)
from app.repo.base import TERMINAL, _insert, _rowcount


def add_config_runs(session: Session, run: Run, configs: Sequence[OptimizationConfig]) -> list[int]:
    """More config-runs of a run that has begun (its stacked configs' ablations), queued on the same
    samples and seed; the run goes back to 'running' until they finish. Returns their ids."""
    now = utcnow()
    rows = [ConfigRun(run_id=run.id, config_id=c.id, enqueued_at=now) for c in configs]
    session.add_all(rows)
    session.execute(update(Run).where(Run.id == run.id).values(status="running"))
    session.flush()
    return [row.id for row in rows]


def top_up_run(session: Session, run: Run, new_keys: Sequence[str], config_ids: Sequence[int],
               scorers: Sequence[str] | None = None) -> list[int]:
    """Append `new_keys` to the run's samples and queue the named configs again on them
    (workers/top_up.py), each in its own row: queued, its pass beginning at its current attempt
    (attempt_base), so the attempt number keeps fencing off any earlier attempt while the attempt
    budget is the new pass's own. Rows already written stay, a judge's and faithfulness scores
    too: the new pass scores only the samples appended (workers/job.py `recorded`), so the outputs
    they scored are still the config's, and the next aggregation scores only the new ones. Its
    figures start from the last pass's; `scorers` (None: all the suite's) go with them as
    `pass_scorers`, the producers the pass runs. The run goes back to 'running'. Returns the
    config-runs' ids."""
    ids = [cr.id for cr in run.config_runs if cr.config_id in set(config_ids)]
    for cr in run.config_runs:
        if cr.id in ids and cr.status in TERMINAL:
            cr.figures = {**(cr.figures or {}), "pass_scorers": list(scorers) if scorers is not None else None}
    session.flush()
    session.execute(
        update(ConfigRun).where(ConfigRun.id.in_(ids), ConfigRun.status.in_(TERMINAL))
        .values(status="queued", attempt_base=ConfigRun.attempt, enqueued_at=utcnow(), started_at=None,
                finished_at=None, lease_expires_at=None, worker=None, error=None, progress_done=0,
                progress_total=0))
    session.execute(update(Run).where(Run.id == run.id)
                    .values(status="running", sample_keys=[*run.sample_keys, *new_keys]))
    session.flush()
    session.expire_all()  # the bulk updates are not in the loaded objects
    return ids


def fair_pick(session: Session, config_run_id: int) -> int:
    """The config-run a worker that received config_run_id's message runs instead, for fairness
    between projects (security round 4, N5): a message is a turn on a GPU, and the turn goes to
    the most urgent work queued (the lowest priority number among the queued config-runs, whatever
    the message's own: a worker that prefetched a message held one step behind before a manual run
    arrived runs the manual run), then, within that priority, to the project that deserves it most:
    the one with the fewest config-runs running, then the one whose last config-run started longest
    ago, then the oldest queued (first come, first served). Within one project nothing changes:
    the message's own config-run runs when its project is that one and it is at that priority (or
    when its worker died: running with an expired lease, re-sent by the reconciler). A config-run passed
    over keeps its queued row; the message of the one taken instead is its turn later (the
    reconciler counts such messages, workers/tasks.py)."""
    own = session.get(ConfigRun, config_run_id)
    if own is None:
        return config_run_id
    own_run = session.get(Run, own.run_id)
    if own_run is None:
        return config_run_id
    expired = aware(own.lease_expires_at)
    if own.status == "running" and expired is not None and expired < utcnow():
        return config_run_id  # its worker died and the reconciler re-sent it: this message is its own
    queued = session.execute(
        select(ConfigRun.id, ConfigRun.priority, ConfigRun.enqueued_at, Run.trigger, Run.project_id)
        .join(Run, Run.id == ConfigRun.run_id).where(ConfigRun.status == "queued")).all()
    if not queued:
        return config_run_id
    level = min(stored_priority(row.priority, row.trigger) for row in queued)
    peers = [row for row in queued if stored_priority(row.priority, row.trigger) == level]
    projects = {row.project_id for row in peers}
    running = dict(session.execute(
        select(Run.project_id, func.count()).select_from(ConfigRun).join(Run, Run.id == ConfigRun.run_id)
        .where(ConfigRun.status == "running", Run.project_id.in_(projects)).group_by(Run.project_id)).all())
    last_start = dict(session.execute(
        select(Run.project_id, func.max(ConfigRun.started_at)).select_from(ConfigRun)
        .join(Run, Run.id == ConfigRun.run_id).where(Run.project_id.in_(projects)).group_by(Run.project_id)).all())
    never = datetime.min

    def turn(row: Row[int, int | None, datetime | None, str, int]) -> tuple:
        started = last_start.get(row.project_id)
        return (running.get(row.project_id, 0), started.replace(tzinfo=None) if started else never,
                row.enqueued_at.replace(tzinfo=None) if row.enqueued_at else never, row.id)

    best = min(peers, key=turn)
    if (own.status == "queued" and best.project_id == own_run.project_id
            and stored_priority(own.priority, own_run.trigger) == level):
        return config_run_id  # its own project's turn at its own priority: its own config-run, as sent
    return best.id


def claim_config_run(session: Session, config_run_id: int, worker: str, lease_seconds: int,
                     max_attempts: int) -> int | None:
    """Take a queued config-run, or one whose lease expired, and return the new attempt number
    (the fencing token for every later write), or None when it is not ours to run."""
    now = utcnow()
    row = session.execute(
        update(ConfigRun)
        .where(
            ConfigRun.id == config_run_id,
            ConfigRun.attempt - ConfigRun.attempt_base < max_attempts,
            or_(ConfigRun.status == "queued", and_(ConfigRun.status == "running", ConfigRun.lease_expires_at < now)),
        )
        .values(status="running", attempt=ConfigRun.attempt + 1, worker=worker, started_at=now,
                lease_expires_at=now + timedelta(seconds=lease_seconds), error=None)
        .returning(ConfigRun.attempt, ConfigRun.run_id)
    ).first()
    if row is None:
        return None
    session.execute(update(Run).where(Run.id == row.run_id, Run.status == "queued").values(status="running"))
    return row.attempt


def heartbeat(session: Session, config_run_id: int, attempt: int, lease_seconds: float,
              done: int | None = None, total: int | None = None) -> bool:
    """Renew the lease, and record progress when given; False when another attempt has taken
    over (or the config-run is no longer running)."""
    values: dict[str, Any] = {"lease_expires_at": utcnow() + timedelta(seconds=lease_seconds)}
    if done is not None:
        values.update(progress_done=done, progress_total=total)
    res = session.execute(
        update(ConfigRun)
        .where(ConfigRun.id == config_run_id, ConfigRun.attempt == attempt, ConfigRun.status == "running")
        .values(**values)
    )
    return _rowcount(res) == 1


def release_lease(session: Session, config_run_id: int, attempt: int, note: str) -> bool:
    """An attempt that stops working on a config-run while its process lives lets go of the
    lease at once and says why in `error` (the next claim clears it; a give-up quotes it)."""
    res = session.execute(
        update(ConfigRun)
        .where(ConfigRun.id == config_run_id, ConfigRun.attempt == attempt, ConfigRun.status == "running")
        .values(lease_expires_at=utcnow(), error=note)
    )
    return _rowcount(res) == 1


def write_sample_results(session: Session, run_id: int, config_id: int, rows: Sequence[dict[str, Any]]) -> None:
    """Idempotent: a redelivered task rewrites the same (run, config, sample, metric) rows."""
    if not rows:
        return
    insert = _insert(session)
    now = utcnow()
    stmt = insert(SampleResult).values(
        [{"run_id": run_id, "config_id": config_id, "created_at": now, **r} for r in rows]
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "config_id", "sample_key", "metric"],
        set_={"value": stmt.excluded.value, "extra": stmt.excluded.extra},
    )
    session.execute(stmt)


def reusable_config_run(session: Session, run: Run, config_id: int, inputs_key: str) -> ConfigRun | None:
    """The newest succeeded config-run of `config_id`, as its run's baseline (a candidate's rows hold
    what another baseline scored), on the same suite version and samples as `run`, whose figures
    carry the same inputs key (workers/baseline_reuse.py inputs_key), or None."""
    candidates = session.scalars(
        select(ConfigRun).join(Run, Run.id == ConfigRun.run_id)
        .where(ConfigRun.config_id == config_id, ConfigRun.status == "succeeded", Run.id != run.id,
               Run.baseline_config_id == config_id,
               Run.project_id == run.project_id, Run.suite_id == run.suite_id,
               Run.suite_version == run.suite_version, Run.n_samples == run.n_samples, Run.seed == run.seed)
        .order_by(ConfigRun.id.desc()).limit(20)
    )
    for config_run in candidates:
        if (config_run.figures or {}).get("inputs_key") == inputs_key and config_run.run.sample_keys == run.sample_keys:
            return config_run
    return None


def copy_sample_results(session: Session, from_run_id: int, to_run_id: int, config_id: int,
                        metrics: Sequence[str]) -> None:
    """Copy one config's rows of the given metrics from a run into another run (rows of those
    already there, from an interrupted attempt, are replaced)."""
    session.execute(delete(SampleResult).where(SampleResult.run_id == to_run_id, SampleResult.config_id == config_id,
                                               SampleResult.metric.in_(metrics)))
    columns = ("config_id", "sample_key", "metric", "value", "extra")
    source = (select(literal(to_run_id), *(getattr(SampleResult, c) for c in columns), literal(utcnow()))
              .where(SampleResult.run_id == from_run_id, SampleResult.config_id == config_id,
                     SampleResult.metric.in_(metrics)))
    session.execute(insert(SampleResult).from_select(["run_id", *columns, "created_at"], source))


def finish_config_run(
    session: Session, config_run_id: int, attempt: int, status: str, *, error: str | None = None,
    figures: dict[str, Any] | None = None,
) -> bool:
    """Fenced: only the attempt that holds the lease may finish it."""
    assert status in TERMINAL
    values: dict[str, Any] = {"status": status, "finished_at": utcnow(), "error": error, "lease_expires_at": None}
    if figures is not None:
        values["figures"] = figures
    res = session.execute(
        update(ConfigRun).where(ConfigRun.id == config_run_id, ConfigRun.attempt == attempt,
                                ConfigRun.status == "running").values(**values)
    )
    return _rowcount(res) == 1


def give_up_config_run(session: Session, config_run_id: int, max_attempts: int, error: str) -> bool:
    """Fail a config-run whose attempts are spent, unless an attempt still holds a live lease."""
    now = utcnow()
    res = session.execute(
        update(ConfigRun)
        .where(ConfigRun.id == config_run_id, ConfigRun.attempt - ConfigRun.attempt_base >= max_attempts,
               or_(ConfigRun.status == "queued", and_(ConfigRun.status == "running", ConfigRun.lease_expires_at < now)))
        .values(status="failed", error=error, finished_at=now, lease_expires_at=None)
    )
    return _rowcount(res) == 1


def stale_config_runs(session: Session, older_than: datetime) -> list[ConfigRun]:
    """Config-runs whose message may be lost (queued, last enqueued before older_than) or whose
    worker died (running with an expired lease, not re-sent since older_than)."""
    now = utcnow()
    return list(session.scalars(
        select(ConfigRun).where(
            ConfigRun.enqueued_at < older_than,
            or_(ConfigRun.status == "queued", and_(ConfigRun.status == "running", ConfigRun.lease_expires_at < now)),
        )
    ))


def config_runs_by_id(session: Session, ids: Sequence[int]) -> list[ConfigRun]:
    return list(session.scalars(select(ConfigRun).where(ConfigRun.id.in_(list(ids))))) if ids else []


def queued_ids(session: Session, ids: Iterable[int]) -> list[int]:
    """Those of `ids` whose config-run is queued."""
    ids = list(ids)
    return list(session.scalars(select(ConfigRun.id).where(ConfigRun.id.in_(ids), ConfigRun.status == "queued"))) \
        if ids else []


def mark_enqueued(session: Session, config_run_ids: Sequence[int]) -> None:
    if config_run_ids:
        session.execute(update(ConfigRun).where(ConfigRun.id.in_(list(config_run_ids))).values(enqueued_at=utcnow()))
