"""Step back one layer (docs/scorers.md). A config is *stacked* when two or more of its axes differ
from the baseline's (engines.spec.changed_axes). When the aggregation finds a stacked config warn or
critical on a quality ratio (evals.step_back.LOSS_METRICS), the run gains one config-run per
single-optimization ablation — the baseline with one axis of the stacked config, on its engine —
on the same samples and seed, and goes back to 'running'. The run's last aggregation compares the
ablations with the baseline like any config and apportions the stacked config's loss among them
(evals/step_back.py); the verdict, the alerts and the gate summary name the layer to disable.

The run (and a gate on it) waits for the ablations: each is one more config-run of the suite's
documents, and a failed one is terminal like any other, so the wait is bounded by the config-runs'
leases and attempts; a failed ablation gives no advice, and never changes the verdict.

A config in the run with the ablation's exact spec (say the team also runs `awq-int4` alone) is
used as that layer; otherwise the service derives a config named `<stacked>~<axis>-only`
(app.repo.upsert_ablation), kept out of the project's config list, the verdict and the alerts.
`step_back: false` on a config opts it out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from sqlalchemy.orm import Session

from app import repo
from app.models import ConfigRun, OptimizationConfig, Run
from engines.spec import (
    ConfigNotAvailable,
    OptimizationSpec,
    axis_value,
    changed_axes,
    lossless_against,
    single_axis_ablation,
)
from evals.step_back import LOSS_METRICS, Layer, StepBack
from vocabulary.comparison import Comparison
from vocabulary.metrics import VERDICT_ORDER

log = logging.getLogger(__name__)
BREACH = ("warn", "critical")


def is_ablation(config: OptimizationConfig) -> bool:
    return config.ablation_of_id is not None


def _ablation_specs(run: Run, config_run: ConfigRun) -> dict[str, OptimizationSpec] | None:
    """{axis: its ablation's spec} of a stacked config that may step back, else None."""
    if config_run.config_id == run.baseline_config_id or is_ablation(config_run.config):
        return None
    base = next(cr for cr in run.config_runs if cr.config_id == run.baseline_config_id)
    base_spec = OptimizationSpec.model_validate(base.config.spec)
    spec = OptimizationSpec.model_validate(config_run.config.spec)
    axes = changed_axes(spec, base_spec)
    if spec.step_back is False or len(axes) < 2:
        return None
    out = {}
    for axis in axes:
        ablation = single_axis_ablation(spec, base_spec, axis)
        try:
            ablation.check_available()
        except ConfigNotAvailable as e:  # the engine cannot run one layer alone: no advice rather than half of one
            log.info("config '%s' cannot step back on %s: %s", config_run.config.name, axis, e)
            return None
        out[axis] = ablation
    return out


def _source(run: Run, stacked: OptimizationConfig, axis: str, spec: OptimizationSpec) -> ConfigRun | None:
    """The run's config-run that measures one layer alone: the derived ablation, else a config of
    the run with exactly that spec, else another stacked config's ablation with that spec (two
    stacked configs that share a layer, say the same KV cache, measure it once)."""
    for config_run in run.config_runs:
        config = config_run.config
        if config.ablation_of_id == stacked.id and config.ablation_axis == axis:
            return config_run
    same = [config_run for config_run in run.config_runs if config_run.config_id != run.baseline_config_id
            and OptimizationSpec.model_validate(config_run.config.spec).model_dump() == spec.model_dump()]
    return next((cr for cr in same if not is_ablation(cr.config)), same[0] if same else None)


def _breaching(rows: list[Comparison], config_id: int) -> list[Comparison]:
    return [r for r in rows if r.config_id == config_id and r.metric in LOSS_METRICS and r.verdict in BREACH]


def would_step_back(run: Run, config_run: ConfigRun, rows: list[Comparison]) -> bool:
    """Whether this config-run's config breaches as a stacked config that can step back."""
    return (config_run.status == "succeeded" and bool(_breaching(rows, config_run.config_id))
            and _ablation_specs(run, config_run) is not None)


def plan(session: Session, run: Run, rows: list[Comparison]) -> list[OptimizationConfig]:
    """The ablations this run still lacks for its breaching stacked configs (derived configs,
    created or updated); empty when every layer already has a config-run in the run, whatever
    became of it, so a run steps back at most once."""
    needed: list[OptimizationConfig] = []
    planned: set[str] = set()  # the specs this pass adds: a layer two stacked configs share runs once
    for config_run in list(run.config_runs):
        if config_run.status != "succeeded" or not _breaching(rows, config_run.config_id):
            continue
        specs = _ablation_specs(run, config_run)
        for axis, spec in (specs or {}).items():
            key = spec.model_dump_json()
            if _source(run, config_run.config, axis, spec) is None and key not in planned:
                planned.add(key)
                needed.append(repo.upsert_ablation(session, config_run.config, axis, spec.model_dump()))
    return needed


def attach(run: Run, rows: list[Comparison]) -> dict[int, StepBack]:
    """Each breaching loss comparison of a stacked config whose every ablation succeeded gets its
    step-back in details["step_back"] (the row replaced in `rows`); returns each such config's worst
    one (by verdict, then ratio), for the run's reason. Nothing where an ablation is missing, failed or unscored."""
    by_key = {(r.config_id, r.metric): r for r in rows}
    worst: dict[int, StepBack] = {}
    found: dict[tuple[int | None, str], StepBack] = {}
    for config_run in run.config_runs:
        breaching = _breaching(rows, config_run.config_id) if config_run.status == "succeeded" else []
        specs = _ablation_specs(run, config_run) if breaching else None
        if not specs:
            continue
        base_spec = OptimizationSpec.model_validate(
            next(cr for cr in run.config_runs if cr.config_id == run.baseline_config_id).config.spec)
        stacked_spec = OptimizationSpec.model_validate(config_run.config.spec)
        sources = {axis: _source(run, config_run.config, axis, spec) for axis, spec in specs.items()}
        if any(source is None or source.status != "succeeded" for source in sources.values()):
            continue
        ranked = sorted(breaching, key=lambda r: (-VERDICT_ORDER[r.verdict],
                                                  -(r.estimate if math.isfinite(r.estimate) else 0)))
        for row in ranked:
            layers = []
            for axis, source in sources.items():
                assert source is not None  # checked above
                alone = by_key.get((source.config_id, row.metric))
                if alone is None or alone.estimate is None or not math.isfinite(alone.estimate) \
                        or alone.estimate <= 0:
                    break
                layers.append(Layer(axis, axis_value(stacked_spec, axis), source.config.name, alone.estimate,
                                    alone.verdict, lossless_against(specs[axis], base_spec), None))
            else:
                if row.estimate is None or not math.isfinite(row.estimate) or row.estimate <= 0:
                    continue
                step_back = StepBack.from_ratios(row.metric, row.estimate, layers)
                found[(row.config_id, row.metric)] = step_back
                worst.setdefault(config_run.config_id, step_back)
    rows[:] = [replace(r, details={**r.details, "step_back": found[(r.config_id, r.metric)].as_dict()})
               if (r.config_id, r.metric) in found else r for r in rows]
    return worst
