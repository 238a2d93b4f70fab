"""Domain operations shared by the API and the CLI: apply a config file, start a run
(commit, then enqueue), and summarise a run in the shape `--json` and the API return."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app import repo
from app.config_file import METRIC_DIRECTIONS, CanaryFile
from app.corpus import load_corpus, load_items, long_documents
from app.db import session_scope
from app.dispatch import EXECUTE_CONFIG_RUN, Dispatcher, fair_priorities
from app.model_paths import is_endpoint, model_dir, unusable
from app.models import Project, Run, Suite
from app.schemas import ComparisonOut, FiguresOut, ProgressOut, RunConfigOut, RunOut, StepBackOut
from app.settings import get_settings
from app.ssrf import check_url, public_spec
from app.summary import trade_off_points, verdict_summary
from engines.zoo import (
    ModelPathError,
    check_checkpoint,
    check_draft_tokenizer,
    check_group_divisible,
    check_reference_family,
)
from vocabulary.suite import SuiteSpec

log = logging.getLogger(__name__)


def check_model_path(path: str, field: str = "model.path", project: str | None = None) -> None:
    """A model's path: builtin:NAME, a Hugging Face directory the project may read
    (app/model_paths.py), or a served model's URL (engine openai; refused for other engines when a
    config names the model) that passes the outbound policy."""
    if is_endpoint(path):
        check_url(path, field)  # never fetched, but no internal address either
        return
    model_dir(path, field, project)


def check_config_fits_model(spec: dict, model_path: str, field: str, project: str | None = None) -> None:
    """What config validation can check from the model's files before any GPU time is spent:
    a served model's URL only for engine openai, group-divisible layer widths for int weights, a
    draft directory the project may read that shares the tokenizer, and a config's own checkpoint
    that holds the model's tokenizer and the quantization its weights axis names."""
    draft = (spec.get("speculative") or {}).get("draft_model")
    if is_endpoint(model_path):
        if spec.get("engine") != "openai":
            raise ValueError(f"{field}.model: the model's path is a served model's URL, which only engine 'openai' "
                             f"runs (engine '{spec.get('engine')}' loads a directory); use engine: openai with "
                             "engine_options.base_url, or a model whose path is a model directory")
        if draft:
            model_dir(draft, f"{field}.speculative.draft_model", project)
        return
    target = model_dir(model_path, f"{field}.model", project)
    draft_dir = model_dir(draft, f"{field}.speculative.draft_model", project) if draft else None
    checkpoint = model_dir(spec["checkpoint"], f"{field}.checkpoint", project) if spec.get("checkpoint") else None
    try:
        if spec.get("engine") == "reference":
            # a checkpoint's AWQ was done by its producer: no AWQ search runs on its experts here
            check_reference_family(str(checkpoint or target), None if checkpoint else spec.get("weights"))
        if checkpoint is not None:
            check_checkpoint(str(target), str(checkpoint), spec.get("weights", "fp16"))
        elif spec.get("weights", "fp16") in ("int8", "rtn-int4", "rtn-int3", "rtn-int2", "awq-int4"):
            check_group_divisible(str(target))
        if draft_dir is not None:
            check_draft_tokenizer(str(target), str(draft_dir))
    except ModelPathError as e:  # named as the config named them, never by the real paths they resolved to
        raise ValueError(f"{field}.{e}".replace(f"'{draft_dir}'", f"'{draft}'")
                         .replace(f"'{checkpoint}'", f"'{spec.get('checkpoint')}'")) from None
    except (OSError, ValueError, KeyError, TypeError):
        # unreadable, or not the JSON expected: the same answer as a missing directory
        where, named = ((f"{field}.speculative.draft_model", draft) if draft else
                        (f"{field}.checkpoint", spec["checkpoint"]) if checkpoint else (f"{field}.model", model_path))
        raise unusable(where, named, project) from None


def model_context(path: str) -> int | None:
    """max_position_embeddings from a local model's config.json (no torch needed), if known."""
    try:
        hf_config = json.loads((model_dir(path, "model.path") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    context = hf_config.get("max_position_embeddings")
    return context if isinstance(context, int) else None


def check_window(suite: SuiteSpec, model_path: str, field: str = "perplexity.window") -> None:
    window = suite.perplexity.window
    ctx = model_context(model_path)
    if ctx is not None and window > ctx:
        raise ValueError(f"{field}: {window} exceeds the model's context of {ctx} positions; use a window ≤ {ctx}")


def check_project_room(session: Session, project: Project, kind: str, names: Sequence[str],
                       field: str | None = None) -> None:
    """A project holds at most the settings' number of configs, suites, channels and schedules:
    adding `names` (new ones count, existing ones are updates) past it is refused, naming the
    field and the limit."""
    from sqlalchemy import select

    from app.models import Channel, OptimizationConfig, Schedule

    rooms: dict[str, tuple[type[OptimizationConfig | Suite | Channel | Schedule], str]] = {
        "configs": (OptimizationConfig, "max_configs"), "suites": (Suite, "max_suites"),
        "channels": (Channel, "max_channels"), "schedules": (Schedule, "max_schedules")}
    table, setting = rooms[kind]
    limit = getattr(get_settings(), setting)
    query = select(table.name).where(table.project_id == project.id)
    if table is OptimizationConfig:  # the ablations the service derives (step back one layer) are not the team's
        query = query.where(OptimizationConfig.ablation_of_id.is_(None))
    existing = set(session.scalars(query))
    total = len(existing | set(names))
    if total > limit:
        raise ValueError(f"{field or kind}: project '{project.name}' would hold {total} {kind}, over the limit of "
                         f"{limit} (setting CANARY_{setting.upper()})")


def apply_config_file(session: Session, canary_file: CanaryFile) -> Project:
    """Upsert everything the file declares. Validates every corpus before writing anything."""
    settings = get_settings()
    check_model_path(canary_file.model.path, project=canary_file.project)
    corpora = {}
    for i, suite in enumerate(canary_file.suites):
        check_window(suite, canary_file.model.path, f"suites[{i}].perplexity.window")
        samples = load_corpus(suite.corpus, f"suites[{i}].corpus", settings.max_suite_documents,
                              settings.max_document_chars)
        samples, joined = long_documents(samples, suite, settings.max_document_chars,
                                         f"suites[{i}].perplexity.long_documents")
        if suite.samples > len(samples):
            raise ValueError(
                f"suites[{i}].samples: {suite.samples} > {len(samples)} documents{joined} in corpus "
                f"'{suite.corpus}'; lower samples or add documents"
            )
        if suite.labelled.items:  # the labelled items travel with the documents, in the same suite version
            samples = [*samples, *load_items(suite.labelled.items, f"suites[{i}].labelled.items")]
        corpora[suite.name] = samples
    project = repo.get_or_create_project(session, canary_file.project)
    for kind in ("configs", "suites", "channels", "schedules"):  # with what the project holds already
        check_project_room(session, project, kind, [item.name for item in getattr(canary_file, kind)])
    model = repo.upsert_model(session, project, canary_file.model.name, canary_file.model.path)
    for i, config in enumerate(canary_file.configs):
        check_config_fits_model(config.to_spec().model_dump(), canary_file.model.path, f"configs[{i}]",
                                canary_file.project)
    for i, config in enumerate(canary_file.configs):
        repo.upsert_config(session, project, model, config.name, config.to_spec().model_dump(), config.baseline,
                           field=f"configs[{i}].engine_options")
    for i, suite in enumerate(canary_file.suites):
        repo.upsert_suite(session, project, suite.name, suite.model_dump(exclude={"name"}), corpora[suite.name],
                          field=f"suites[{i}].judge")
    repo.set_thresholds(session, project, canary_file.thresholds.model_dump(), METRIC_DIRECTIONS)
    for i, channel in enumerate(canary_file.channels):
        channel_settings: dict[str, Any] = {"send_resolved": channel.send_resolved}
        if channel.signing_secret:
            channel_settings["signing_secret"] = channel.signing_secret
        repo.upsert_channel(session, project, channel.name, channel.kind, channel.url, channel_settings,
                            field=f"channels[{i}].url")
    for schedule in canary_file.schedules:
        names = [config.name for config in canary_file.configs] if schedule.configs == "all" else list(schedule.configs)
        repo.upsert_schedule(session, project, schedule.name, schedule.cron,
                             repo.get_suite(session, project, schedule.suite), names, schedule.samples)
    return project


def start_run(
    project_name: str,
    suite_name: str,
    config_names: Sequence[str] | None,
    dispatcher: Dispatcher,
    *,
    samples: int | None = None,
    seed: int | None = None,
    trigger: str = "manual",
    idempotency_key: str | None = None,
) -> tuple[int, bool]:
    """Write the run, commit, then enqueue one task per config-run (the broker is not a
    database: the reconciler re-enqueues rows whose message is lost). Returns (run_id, created)."""
    settings = get_settings()
    if samples is not None and samples > settings.max_samples_per_run:
        raise ValueError(f"samples: {samples} exceeds the limit of {settings.max_samples_per_run} per run")
    with session_scope() as s:
        project = repo.get_project(s, project_name)
        suite = repo.get_suite(s, project, suite_name)
        if config_names:
            configs = [repo.get_config(s, project, n) for n in config_names]
        else:
            configs = repo.list_configs(s, project)
        for c in configs:
            check_window(suite.settings, c.model.path)
        queued = repo.queued_config_runs(s, project.id)
        retry = idempotency_key is not None and s.scalar(select(Run.id).where(
            Run.project_id == project.id, Run.idempotency_key == idempotency_key)) is not None
        cap = settings.max_queued_config_runs_per_project
        if cap and not retry and queued + len(configs) > cap:
            raise repo.QueueFull(
                f"project '{project_name}' has {queued} config-runs queued; {len(configs)} more would pass its limit "
                f"of {cap} (CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT): wait for them to run, then start this one")
        run, created = repo.create_run(s, project, suite, configs, n_samples=samples, seed=seed,
                                       trigger=trigger, idempotency_key=idempotency_key)
        run_id = run.id
        sends: list[tuple[int, int]] = []
        if created:
            # past its fair share a project's config-runs wait behind the others' work of the same
            # kind, not in front of it; each keeps its priority for every re-send
            priorities = fair_priorities(trigger, queued, len(run.config_runs), settings.fair_share_queued_config_runs)
            for config_run, priority in zip(run.config_runs, priorities, strict=True):
                config_run.priority = priority
                sends.append((config_run.id, priority))
    for cr_id, priority in sends:
        try:
            dispatcher.send(EXECUTE_CONFIG_RUN, cr_id, priority=priority)
        except Exception as e:  # noqa: BLE001 - the rows are committed; the reconciler re-enqueues them
            log.warning("enqueue of config-run %s failed (%s); the reconciler will retry it", cr_id, e)
    return run_id, created


def cancel_run(session: Session, project: Project, run_id: int, who: str) -> Run:
    """Cancel a run (repo.cancel_run), and let a gate waiting on it decide now (error)."""
    from app.gates import decide

    run = repo.cancel_run(session, project, run_id, who)
    decide(session, run.id)
    return run


def samples_label(run: RunOut, noun: str = "documents") -> str:
    """'12 documents', or '24 documents (topped up from 12)' for a run that drew more after an
    inconclusive pass (workers/top_up.py)."""
    asked, drawn = run.n_samples, run.samples_drawn
    return f"{drawn} {noun}" + (f" (topped up from {asked})" if drawn != asked else "")


DEMO_PROJECT = "demo"  # `canary demo`'s project (app/cli/runs.py DEMO_CONFIG)


def decide_command(project: str, suite: str, trigger: str) -> str:
    """The command that runs a run's undecided configs again on more samples, as its user started
    it: `canary demo` for the demo, `canary gate` for a gate, else `canary run` on the config file.
    `{configs}` and `{samples}` are left for app/summary.verdict_summary to fill in."""
    import shlex

    if project == DEMO_PROJECT:
        return "canary demo --samples {samples}"
    where = f"--suite {shlex.quote(suite)}" + (f" --project {shlex.quote(project)}" if trigger == "gate" else "")
    if trigger == "gate":
        return f"canary gate --candidate {{configs}} {where} --samples {{samples}}"
    return f"canary run -f canary.yaml {where} --configs {{configs}} --samples {{samples}}"


def decide_settings_commands(project: str) -> dict[str, str]:
    """The options of decide_command's command that raise a suite setting, by setting (`{n}` for
    app/summary to fill in): the demo's `--prompts` and `--items`; elsewhere the settings live in
    the team's canary.yaml, so none (the summary names them in words)."""
    if project != DEMO_PROJECT:
        return {}
    return {"generation.prompts": "--prompts {n}", "labelled.max_items": "--items {n}"}


def run_summary(session: Session, run: Run) -> RunOut:
    """The run as the API gives it (app/schemas.RunOut): its configs, comparisons and figures, the
    step-back findings, the verdict for people (`summary`) and each candidate's quality lost against
    speed and memory gained (`trade_off`, app/summary.py). `jsonable` gives it as JSON values."""
    crs = list(run.config_runs)
    names = {cr.config_id: cr.config.name for cr in crs}
    comps = repo.comparisons(session, run.id)
    configs = [
        RunConfigOut(
            config=cr.config.name, spec=public_spec(cr.config.spec), status=cr.status, attempt=cr.attempt,
            progress=ProgressOut(done=cr.progress_done, total=cr.progress_total), error=cr.error,
            ablation_of=names.get(cr.config.ablation_of_id) if cr.config.ablation_of_id else None,
            ablation_axis=cr.config.ablation_axis)
        for cr in crs]
    comparisons = [ComparisonOut.of(c, names.get(c.config_id, str(c.config_id))) for c in comps]
    # each breaching quality ratio of a stacked config whose ablations ran (workers/step_back.py)
    step_back = [StepBackOut.model_validate({"config": names.get(c.config_id, str(c.config_id)),
                                             **(c.details or {})["step_back"]})
                 for c in comps if (c.details or {}).get("step_back")]
    figures = {cr.config.name: FiguresOut.model_validate(cr.figures) for cr in crs if cr.figures}
    run_figures = {name: f.model_dump() for name, f in figures.items()}
    suite = session.get(Suite, run.suite_id)
    project_name = repo.project_name(session, run.project_id)
    baseline = names.get(run.baseline_config_id)
    ablations = [c.config for c in configs if c.ablation_of]
    return RunOut(
        run_id=run.id, status=run.status, verdict=run.verdict, verdict_reason=run.verdict_reason, baseline=baseline,
        suite_id=run.suite_id, trigger=run.trigger, n_samples=run.n_samples, samples_drawn=len(run.sample_keys),
        seed=run.seed, created_at=run.created_at.isoformat() if run.created_at else None,
        finished_at=run.finished_at.isoformat() if run.finished_at else None, configs=configs,
        comparisons=comparisons, figures=figures, step_back=step_back,
        summary=verdict_summary(comparisons, step_back, baseline, ablations, figures=run_figures,
                                decide_with=decide_command(project_name, suite.name if suite else str(run.suite_id),
                                                           run.trigger),
                                decide_settings_with=decide_settings_commands(project_name),
                                decide_cap=min(suite.n_documents if suite else get_settings().max_samples_per_run,
                                               get_settings().max_samples_per_run),
                                drawn=len(run.sample_keys or ())),
        trade_off=trade_off_points(configs, comparisons, run_figures, baseline))
