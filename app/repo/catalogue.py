"""The catalogue: projects, models, optimization configs, suites and their samples, thresholds,
channels and schedules."""


from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from app.corpus import SampleIn
from app.models import (
    AlertRule,
    Channel,
    Model,
    Notification,
    OptimizationConfig,
    Project,
    Schedule,
    Suite,
    SuiteSample,
)
from app.repo.base import Conflict, NotFound


def get_or_create_project(session: Session, name: str) -> Project:
    """The project named `name`, created if missing; a name outside NAME_PATTERN is a ValueError."""
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        from app.config_base import name_problem

        if problem := name_problem(name):
            raise ValueError(f"project {problem}")
        from app.secret_names import project_secret_prefix, secret_slug

        slug = secret_slug(name)  # one owner per secret name (app/ssrf.py project_secret_prefix)
        for other in session.scalars(select(Project.name)):
            if secret_slug(other) == slug:
                raise ValueError(f"name: project '{name}' would own the same secret variables as project '{other}' "
                                 f"({project_secret_prefix(name)}…): project names must differ in their letters or "
                                 "digits, not only in case or punctuation; choose another name")
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
    n_documents = sum(1 for s in samples if s.kind != "item")  # labelled items are not drawn as documents
    suite = session.scalar(select(Suite).where(Suite.project_id == project.id, Suite.name == name))
    if suite is None:
        suite = Suite(project_id=project.id, name=name, spec=spec, version=version, n_documents=n_documents)
        session.add(suite)
        session.flush()
    else:
        suite.spec, suite.version, suite.n_documents = spec, version, n_documents
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
                  keys: Iterable[str] | None = None, items: bool = False) -> list[SuiteSample]:
    """A suite version's documents in order; with `items`, its labelled items instead (kind "item")."""
    kind = SuiteSample.kind == "item" if items else SuiteSample.kind != "item"
    q = (select(SuiteSample).where(SuiteSample.suite_id == suite_id, SuiteSample.version == version, kind)
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
    from app.secret_names import ENV_REF, check_secret_ref
    from app.ssrf import check_url

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
        if (ch.kind, ch.url) != (kind, url):  # another receiver: its breaker starts closed, its rows due now
            ch.breaker_strikes, ch.breaker_until = 0, None
            session.execute(update(Notification).where(Notification.channel_id == ch.id,
                                                       Notification.status == "pending").values(next_attempt_at=None))
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
