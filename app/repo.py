"""Repository functions: the one write path to the database. Routes, the CLI and tasks call
these; none of them writes rows itself. Functions take a Session and do not commit unless
their docstring says so — the caller owns the transaction (enqueue only after it commits)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Result, and_, delete, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from app.corpus import SampleIn
from app.models import (
    AlertRule,
    Channel,
    Comparison,
    ConfigRun,
    Model,
    OptimizationConfig,
    Project,
    Run,
    SampleResult,
    Schedule,
    Suite,
    SuiteSample,
    utcnow,
)

TERMINAL = ("succeeded", "failed")


class NotFound(LookupError):
    """An object that does not exist in this project (the API answers 404)."""


class Conflict(ValueError):
    """A request that contradicts stored state (the API answers 409)."""


class QueueFull(ValueError):
    """A project has as many config-runs queued as it may (the API answers 429)."""


def queued_config_runs(session: Session, project_id: int) -> int:
    """How many config-runs of the project wait for a GPU worker."""
    return session.scalar(select(func.count()).select_from(ConfigRun).join(Run, Run.id == ConfigRun.run_id)
                          .where(Run.project_id == project_id, ConfigRun.status == "queued")) or 0


def _insert(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert


def _rowcount(result: Result[Any]) -> int:
    """The rows an UPDATE matched: session.execute types its result as a Result, but a DML
    statement's is a CursorResult, which carries the count."""
    return cast(CursorResult[Any], result).rowcount


# -- projects, models, configs, suites ----------------------------------------------------------
def get_or_create_project(session: Session, name: str) -> Project:
    """The project named `name`, created if missing; a name outside NAME_PATTERN is a ValueError."""
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        from app.config_file import name_problem

        if problem := name_problem(name):
            raise ValueError(f"project {problem}")
        project = Project(name=name)
        session.add(project)
        session.flush()
    return project


def get_project(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise NotFound(f"project '{name}' not found")
    return project


def upsert_model(session: Session, project: Project, name: str, path: str) -> Model:
    model = session.scalar(select(Model).where(Model.project_id == project.id, Model.name == name))
    if model is None:
        model = Model(project_id=project.id, name=name, path=path)
        session.add(model)
    else:
        model.path = path
    session.flush()
    return model


def project_name(session: Session, project_id: int) -> str:
    project = session.get(Project, project_id)
    assert project is not None, f"project {project_id} not found"  # a foreign key: the row exists
    return project.name


def get_model(session: Session, project: Project, name: str) -> Model:
    model = session.scalar(select(Model).where(Model.project_id == project.id, Model.name == name))
    if model is None:
        raise NotFound(f"model '{name}' not found in project '{project.name}'")
    return model


def upsert_config(
    session: Session, project: Project, model: Model, name: str, spec: dict[str, Any], is_baseline: bool,
    field: str = "engine_options",
) -> OptimizationConfig:
    """The engine's URLs must pass the outbound URL policy and its api_key_env name an allowed
    secret now (and again when a worker uses them)."""
    from app.ssrf import check_engine_options

    check_engine_options(spec.get("engine_options"), field, project.name)
    config = session.scalar(
        select(OptimizationConfig).where(OptimizationConfig.project_id == project.id, OptimizationConfig.name == name)
    )
    if config is None:
        config = OptimizationConfig(project_id=project.id, model_id=model.id, name=name, spec=spec,
                                    is_baseline=is_baseline)
        session.add(config)
    else:
        if config.model_id != model.id:
            raise Conflict(f"name: config '{name}' already belongs to another model; choose another name")
        config.spec, config.is_baseline = spec, is_baseline
    session.flush()
    if is_baseline:  # one baseline per model
        session.execute(
            update(OptimizationConfig)
            .where(OptimizationConfig.model_id == model.id, OptimizationConfig.id != config.id)
            .values(is_baseline=False)
        )
    return config


def list_configs(session: Session, project: Project) -> list[OptimizationConfig]:
    """The project's configs, without the ablations the service derives from stacked ones."""
    return list(session.scalars(select(OptimizationConfig).where(OptimizationConfig.project_id == project.id,
                                                                 OptimizationConfig.ablation_of_id.is_(None))
                                .order_by(OptimizationConfig.id)))


def upsert_ablation(session: Session, stacked: OptimizationConfig, axis: str,
                    spec: dict[str, Any]) -> OptimizationConfig:
    """The single-optimization ablation of a stacked config on one axis (workers/step_back.py),
    named `<stacked>~<axis>-only` (a '~' no user config name holds); its spec follows the stacked
    config's current one."""
    cfg = session.scalar(select(OptimizationConfig).where(OptimizationConfig.ablation_of_id == stacked.id,
                                                          OptimizationConfig.ablation_axis == axis))
    if cfg is None:
        cfg = OptimizationConfig(project_id=stacked.project_id, model_id=stacked.model_id,
                                 name=f"{stacked.name}~{axis}-only", spec=spec, is_baseline=False,
                                 ablation_of_id=stacked.id, ablation_axis=axis)
        session.add(cfg)
    else:
        cfg.spec = spec
    session.flush()
    return cfg


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
               keep_metrics: Sequence[str] = ()) -> list[int]:
    """Append `new_keys` to the run's samples and queue the named configs again on all of them
    (workers/top_up.py), each in its own row: queued, its pass beginning at its current attempt
    (attempt_base), so the attempt number keeps fencing off any earlier attempt while the attempt
    budget is the new pass's own. Rows already written stay; the new pass overwrites them. Rows of
    any other metric than `keep_metrics` (what scorers added: a judge's, faithfulness) are deleted
    from the whole run when given, so the next aggregation scores the outputs as they now are. The
    run goes back to 'running'. Returns the config-runs' ids."""
    ids = [cr.id for cr in run.config_runs if cr.config_id in set(config_ids)]
    if keep_metrics:
        session.execute(delete(SampleResult).where(SampleResult.run_id == run.id,
                                                   SampleResult.metric.not_in(list(keep_metrics))))
    session.execute(
        update(ConfigRun).where(ConfigRun.id.in_(ids), ConfigRun.status.in_(TERMINAL))
        .values(status="queued", attempt_base=ConfigRun.attempt, enqueued_at=utcnow(), started_at=None,
                finished_at=None, lease_expires_at=None, worker=None, error=None, figures=None, progress_done=0,
                progress_total=0))
    session.execute(update(Run).where(Run.id == run.id)
                    .values(status="running", sample_keys=[*run.sample_keys, *new_keys]))
    session.flush()
    session.expire_all()  # the bulk updates are not in the loaded objects
    return ids


def get_config(session: Session, project: Project, name: str) -> OptimizationConfig:
    config = session.scalar(select(OptimizationConfig).where(OptimizationConfig.project_id == project.id,
                                                             OptimizationConfig.name == name))
    if config is None:
        names = ", ".join(other.name for other in list_configs(session, project)) or "none yet"
        raise NotFound(f"config '{name}' not found in project '{project.name}' (configs: {names})")
    return config


def content_hash(samples: Sequence[SampleIn]) -> str:
    """sha256 over the samples in order: the suite version."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.key, s.text, s.kind, s.reference, s.contexts, s.cluster]).encode())
    return h.hexdigest()


def upsert_suite(session: Session, project: Project, name: str, spec: dict[str, Any], samples: Sequence[SampleIn],
                 field: str = "judge") -> Suite:
    """Create or update a suite. Samples are immutable per content version: a changed corpus
    adds a version (earlier runs keep the text they drew); the same corpus writes nothing. The
    judge's URL and key name pass the outbound policy first."""
    from app.ssrf import check_judge

    check_judge(spec.get("judge"), field, project.name)
    version = content_hash(samples)
    suite = session.scalar(select(Suite).where(Suite.project_id == project.id, Suite.name == name))
    if suite is None:
        suite = Suite(project_id=project.id, name=name, spec=spec, version=version, n_documents=len(samples))
        session.add(suite)
        session.flush()
    else:
        suite.spec, suite.version, suite.n_documents = spec, version, len(samples)
        session.flush()
    exists = session.scalar(select(func.count()).select_from(SuiteSample).where(
        SuiteSample.suite_id == suite.id, SuiteSample.version == version))
    if not exists:
        session.add_all(
            SuiteSample(suite_id=suite.id, version=version, key=s.key, position=i, kind=s.kind, text=s.text,
                        reference=s.reference, contexts=s.contexts, cluster=s.cluster)
            for i, s in enumerate(samples)
        )
        session.flush()
    return suite


def list_suites(session: Session, project: Project) -> list[Suite]:
    return list(session.scalars(select(Suite).where(Suite.project_id == project.id).order_by(Suite.id)))


def get_suite(session: Session, project: Project, name: str) -> Suite:
    suite = session.scalar(select(Suite).where(Suite.project_id == project.id, Suite.name == name))
    if suite is None:
        names = ", ".join(s.name for s in list_suites(session, project)) or "none yet"
        raise NotFound(f"suite '{name}' not found in project '{project.name}' (suites: {names})")
    return suite


def suite_samples(session: Session, suite_id: int, version: str,
                  keys: Iterable[str] | None = None) -> list[SuiteSample]:
    q = (select(SuiteSample).where(SuiteSample.suite_id == suite_id, SuiteSample.version == version)
         .order_by(SuiteSample.position))
    if keys is not None:
        q = q.where(SuiteSample.key.in_(list(keys)))
    return list(session.scalars(q))


def set_thresholds(session: Session, project: Project, thresholds: dict[str, dict[str, Any]],
                   directions: Mapping[str, str]) -> None:
    """Project-wide rules from the config file (scope: all models and configs)."""
    for metric, t in thresholds.items():
        rule = session.scalar(
            select(AlertRule).where(AlertRule.project_id == project.id, AlertRule.metric == metric,
                                    AlertRule.model_id.is_(None), AlertRule.config_id.is_(None))
        )
        if rule is None:
            rule = AlertRule(project_id=project.id, metric=metric, direction=directions[metric], warn=t["warn"])
            session.add(rule)
        rule.warn, rule.critical, rule.direction = t["warn"], t.get("critical"), directions[metric]
        rule.min_n = t.get("min_n", 10)
        rule.for_runs = t.get("for_runs", 1)
    session.flush()


def alert_rules(session: Session, project_id: int, model_id: int) -> list[AlertRule]:
    """The enabled rules that can apply to a model's configs (project-wide, the model's, its configs')."""
    return list(session.scalars(
        select(AlertRule).where(AlertRule.project_id == project_id, AlertRule.enabled.is_(True),
                                or_(AlertRule.model_id.is_(None), AlertRule.model_id == model_id))
        .order_by(AlertRule.id)
    ))


def most_specific_rule(rules: Sequence[AlertRule], metric: str, config_id: int) -> AlertRule | None:
    """Of a model's rules, the most specific one for a config's metric: config over model over project."""
    mine = [r for r in rules if r.metric == metric and r.config_id in (None, config_id)]
    mine.sort(key=lambda r: (r.config_id is not None, r.model_id is not None), reverse=True)
    return mine[0] if mine else None


def threshold_for(session: Session, project_id: int, metric: str, model_id: int, config_id: int) -> AlertRule | None:
    """The most specific enabled rule: config over model over project."""
    return most_specific_rule(alert_rules(session, project_id, model_id), metric, config_id)


def upsert_channel(session: Session, project: Project, name: str, kind: str, url: str, settings: dict[str, Any],
                   field: str = "url") -> Channel:
    """``url`` may be a ${ENV_VAR} template, expanded only at send time (the secret stays out of
    the DB); a literal URL must pass the outbound URL policy now, and again at every send. A
    ${ENV_VAR} (the url, the signing secret) must name a secret of this project."""
    from app.ssrf import ENV_REF, check_secret_ref, check_url

    if not ENV_REF.fullmatch(url):
        check_url(url, field)
    check_secret_ref(url, field, project.name)
    signing = field.removesuffix("url") + "signing_secret" if field.endswith("url") else "signing_secret"
    check_secret_ref(settings.get("signing_secret"), signing, project.name)
    ch = session.scalar(select(Channel).where(Channel.project_id == project.id, Channel.name == name))
    if ch is None:
        ch = Channel(project_id=project.id, name=name, kind=kind, url=url, settings=settings)
        session.add(ch)
    else:
        ch.kind, ch.url, ch.settings = kind, url, settings
    session.flush()
    return ch


def upsert_schedule(session: Session, project: Project, name: str, cron: str, suite: Suite,
                    config_names: list[str], samples: int | None) -> Schedule:
    schedule = session.scalar(select(Schedule).where(Schedule.project_id == project.id, Schedule.name == name))
    if schedule is None:
        schedule = Schedule(project_id=project.id, name=name, cron=cron, suite_id=suite.id, config_names=config_names,
                            samples=samples)
        session.add(schedule)
    else:
        schedule.cron, schedule.suite_id = cron, suite.id
        schedule.config_names, schedule.samples = config_names, samples
    session.flush()
    return schedule


# -- runs -----------------------------------------------------------------------------------------
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
    when the run has ended or is being aggregated (its verdict is seconds away)."""
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
    from app.gates import decide

    decide(session, run.id)  # a gate waiting on the run decides error now
    return run


def list_runs(session: Session, project: Project, limit: int = 50, offset: int = 0) -> list[Run]:
    return list(session.scalars(
        select(Run).where(Run.project_id == project.id).order_by(Run.id.desc()).limit(limit).offset(offset)
    ))


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


def _unfinished(run_id):
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


def sample_rows(session: Session, run_id: int) -> list[tuple[int, str, str, float | None, dict | None]]:
    """Every sample result of a run as (config_id, metric, sample_key, value, extra), in storage order."""
    return [tuple(row) for row in session.execute(
        select(SampleResult.config_id, SampleResult.metric, SampleResult.sample_key, SampleResult.value,
               SampleResult.extra).where(SampleResult.run_id == run_id).order_by(SampleResult.id))]


def write_comparisons(session: Session, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        return
    insert = _insert(session)
    now = utcnow()
    stmt = insert(Comparison).values([{"run_id": run_id, "created_at": now, **r} for r in rows])
    cols = ("estimate", "ci_low", "ci_high", "n", "verdict", "rule", "baseline_value", "candidate_value", "details")
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "config_id", "metric"], set_={c: getattr(stmt.excluded, c) for c in cols}
    )
    session.execute(stmt)


def comparisons(session: Session, run_id: int) -> list[Comparison]:
    return list(session.scalars(select(Comparison).where(Comparison.run_id == run_id)
                                .order_by(Comparison.config_id, Comparison.metric)))


AGGREGATION_LOCK = 0x63616E61  # advisory-lock namespace of run aggregations


def aggregation_lock(run_id: int):
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


def mark_enqueued(session: Session, config_run_ids: Sequence[int]) -> None:
    if config_run_ids:
        session.execute(update(ConfigRun).where(ConfigRun.id.in_(list(config_run_ids))).values(enqueued_at=utcnow()))
