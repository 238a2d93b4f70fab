"""What one config-run needs, read from the database once per attempt: the frozen `Job` the
worker's task passes around instead of a dict, and the model directory it may load."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app import repo
from app.corpus import ITEM_PREFIX
from app.models import ConfigRun, OptimizationConfig, Project, Run, Suite
from engines.spec import OptimizationSpec
from vocabulary.figures import spec_digest
from vocabulary.labelled import LabelledItem
from vocabulary.suite import SuiteSpec
from workers import top_up


@dataclass(frozen=True)
class Job:
    """What one config-run needs, read from the database once per attempt (`_load_job`)."""

    run_id: int
    config_id: int
    project: str  # the project's name: whose secrets the config may name
    trigger: str  # the run's trigger (a gate may reuse a baseline's rows)
    is_baseline: bool
    spec: OptimizationSpec
    baseline_spec: OptimizationSpec  # the run's baseline config (it scores every config's outputs)
    calibration: list[str] | None  # AWQ calibration text: those the first draw left, less any an item quotes
    # (top_up.calibration_keys)
    suite_version: str
    model_path: str
    suite: SuiteSpec
    samples: tuple[tuple[str, str, str], ...]  # (key, text, cluster) in the run's order
    prompts: int  # generation prompts: the suite's, scaled as a top-up scales the samples
    items: tuple[LabelledItem, ...] = ()  # the labelled scorer's items, the suite's first labelled.max_items
    # (record kind, sample key) the config already holds from an earlier pass of the run: a top-up
    # pass (workers/top_up.py) scores only what comes after them; empty on a first pass
    recorded: frozenset[tuple[str, str]] = frozenset()
    earlier: dict[str, Any] | None = None  # a top-up pass: the figures of the config's pass before it
    # a top-up pass: Σ NLL and Σ tokens of the documents the config holds (its token perplexity counts them)
    recorded_nll: tuple[float, int] = (0.0, 0)
    # vocabulary.figures.spec_digest of the config's spec as stored when this config-run loaded it: kept
    # in its figures, so a reader can tell evidence about the config as it is now from evidence about
    # an earlier definition (a config edited in place, app/api/routes/views.py)
    config_digest: str | None = None

    def runs(self, scorer: str) -> bool:
        """Whether this pass runs a scorer's producer: the suite's scorers, less those a top-up pass
        leaves out (its `pass_scorers`: the producers of what is undecided)."""
        wanted = (self.earlier or {}).get("pass_scorers")
        return self.suite.runs(scorer) and (wanted is None or scorer in wanted)

    def first_unscored(self, kind: str, keys: Sequence[str]) -> int:
        """How many of `keys` (in the run's order) lead with a `kind` record from an earlier pass:
        a top-up appends its samples, so a pass picks up where the config's last one stopped."""
        n = 0
        while n < len(keys) and (kind, keys[n]) in self.recorded:
            n += 1
        return n


def load_job(session: Session, config_run_id: int) -> Job:
    config_run = session.get(ConfigRun, config_run_id)
    assert config_run is not None  # the attempt's claim holds it
    run = session.get(Run, config_run.run_id)
    assert run is not None  # a foreign key: the row exists
    suite = session.get(Suite, run.suite_id)
    assert suite is not None  # a foreign key: the row exists
    spec = OptimizationSpec.model_validate(config_run.config.spec)
    calibration = None
    if top_up.calibrates_on_the_suite(config_run.config.spec):  # domain text the first pass does not score
        samples = repo.suite_samples(session, suite.id, run.suite_version)
        quoted = top_up.suite_quotes(session, suite, run.suite_version)  # no text a labelled item is cut from
        calibrated = set(top_up.calibration_keys(run, [sample.key for sample in samples], quoted))
        calibration = [sample.text for sample in samples if sample.key in calibrated]
    baseline = session.get(OptimizationConfig, run.baseline_config_id)
    order = {key: i for i, key in enumerate(run.sample_keys)}
    settings = suite.settings
    project = session.get(Project, run.project_id)
    assert project is not None  # a foreign key: the row exists
    return Job(
        run_id=run.id,
        project=project.name,
        trigger=run.trigger,
        is_baseline=config_run.config_id == run.baseline_config_id,
        config_id=config_run.config_id,
        spec=spec,
        config_digest=spec_digest(config_run.config.spec),
        baseline_spec=OptimizationSpec.model_validate(baseline.spec) if baseline is not None else spec,
        calibration=calibration,
        suite_version=run.suite_version,
        model_path=config_run.config.model.path,
        suite=settings,
        # in the run's order: a top-up (workers/top_up.py) appends its documents after those drawn first
        samples=tuple(sorted(((sample.key, sample.text, sample.cluster or sample.key) for sample in
                              repo.suite_samples(session, suite.id, run.suite_version, run.sample_keys)),
                             key=lambda sample: order[sample[0]])),
        # a top-up that doubled the samples doubles the prompts too, the first pass's staying first
        prompts=round(settings.generation.prompts * len(run.sample_keys) / max(1, run.n_samples)),
        items=tuple(LabelledItem.from_stored(sample.key.removeprefix(ITEM_PREFIX), sample.text,
                                             sample.reference or "{}")
                    for sample in repo.suite_samples(session, suite.id, run.suite_version, items=True)
                    [: settings.labelled.max_items]) if settings.runs("labelled") else (),
        # a pass after the first (attempt_base moved: repo.top_up_run) adds to what the config holds
        recorded=repo.recorded_keys(session, run.id, config_run.config_id) if config_run.attempt_base else frozenset(),
        earlier=(config_run.figures or {}) if config_run.attempt_base else None,
        recorded_nll=repo.recorded_nll(session, run.id, config_run.config_id) if config_run.attempt_base else (0.0, 0),
    )


def served_model_tokenizer(job: Job) -> str | None:
    """For an openai config: the config's model directory, checked against the project's model
    root as loadable_model checks it, whose own tokenizer names the prompts' start token where the
    server names none (engines/openai.py); None when model.path is only the served model's name."""
    from app.model_paths import model_dir

    try:
        return str(model_dir(job.model_path, "model.path", job.project))
    except ValueError:
        return None


def loadable_model(job: Job, spec: OptimizationSpec | None = None) -> tuple[pathlib.Path, OptimizationSpec]:
    """The model directory to load, checked again at use against the project's model root (the
    row may predate the root, or a symlink may have moved since it was created), and the config's
    spec with its draft model (if any) checked the same way, or the config's own checkpoint in
    the model's place: each named by the real path the check resolved, so what loads is what was
    checked, whatever a symlink points at by then (app/model_paths.py). spec: another config of
    the job's run (its baseline) in the job's own place."""
    from app.model_paths import model_dir

    spec = spec or job.spec
    draft = getattr(spec.speculative, "draft_model", None)
    if draft:
        real = model_dir(draft, "speculative.draft_model", job.project)
        spec = spec.model_copy(update={"speculative": spec.speculative.model_copy(update={"draft_model": str(real)})})
    if spec.checkpoint:  # the config's own quantized weights of the model: loaded in its place
        real = model_dir(spec.checkpoint, "checkpoint", job.project)
        return real, spec.model_copy(update={"checkpoint": str(real)})
    return model_dir(job.model_path, "model.path", job.project), spec
