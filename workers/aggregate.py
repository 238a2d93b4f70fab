"""Aggregate a finished run: read its sample records once, compare every candidate config with
the baseline (each row of the metric table, vocabulary/metrics.py, through its compare target), write the
comparisons, set the run's verdict and the gate's in the same transaction, then evaluate the
alert rules. Idempotent: comparisons are upserted on (run, config, metric)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

from sqlalchemy import update
from sqlalchemy.orm import Session

from app import repo
from app.alert_evaluation import escalate, evaluate_run
from app.db import session_scope
from app.dispatch import EXECUTE_CONFIG_RUN, NOTIFY, Dispatcher, priority_of, stored_priority
from app.gates import decide as decide_gate
from app.models import AlertRule, ConfigRun, Run, Suite
from app.settings import get_settings
from engines.protocol import SAMPLING_EPS
from engines.spec import OptimizationSpec, lossless_against
from evals import compare_targets
from evals.compare_targets import CompareContext
from evals.health import NEAR_TIE_NATS
from evals.records import RunRecords
from evals.stats import TOO_FEW, Thresholds
from vocabulary.comparison import Comparison
from vocabulary.figures import RunFigures
from vocabulary.metrics import RUN_VERDICT, VERDICT_ORDER, Direction, informational, worst_verdict
from vocabulary.suite import SuiteSpec
from workers import producers, step_back, top_up  # noqa: F401 - producers: the record kinds rows are read by


class RunThresholds:
    """The thresholds of one run's configs: the most specific enabled rule (config over model over
    project) from one read of the project's rules, else the metric's seed default."""

    def __init__(self, rules: list[AlertRule]):
        self.rules = rules

    def __call__(self, config_id: int, metric: str) -> Thresholds:
        rule = repo.most_specific_rule(self.rules, metric, config_id)
        if rule is None:
            return Thresholds.seed(metric)
        # the column holds "above" | "below" (the API and the config file validate it)
        return Thresholds(rule.warn, rule.critical, cast(Direction, rule.direction), rule.min_n)


def config_comparisons(run: Run, cr: ConfigRun, table: RunRecords, thresholds: RunThresholds,
                       failed_scorers: dict[str, str], scorers: list[str], greedy: bool = False,
                       tau: float = NEAR_TIE_NATS) -> list[Comparison]:
    """Every comparison of one config (the baseline included, for the metrics judged on their own):
    the metric table's rows, each comparing through its own target (evals/compare_targets.py).
    greedy: the suite generates greedily, so a lossless config's outputs must equal the baseline's
    (beyond the baseline's own noise floor); tau: the suite's near-tie gap in nats."""
    is_base = cr.config_id == run.baseline_config_id
    context = CompareContext(
        mine=table[cr.config_id], base=table[run.baseline_config_id],
        thresholds=lambda metric: thresholds(cr.config_id, metric), seed=run.seed, is_base=is_base,
        figures=RunFigures.from_json(cr.figures) if cr.figures else None, failed_scorers=failed_scorers,
        scorers=scorers, greedy=greedy, lossless=greedy and not is_base and _lossless(run, cr), tau=tau)
    return compare_targets.config_comparisons(context)


def _lossless(run: Run, cr: ConfigRun) -> bool:
    """A config whose greedy outputs must equal the baseline's (engines.spec.lossless_against)."""
    base = next(c for c in run.config_runs if c.config_id == run.baseline_config_id)
    return lossless_against(OptimizationSpec.model_validate(cr.config.spec),
                            OptimizationSpec.model_validate(base.config.spec))


def aggregate_run(run_id: int, dispatcher: Dispatcher | None = None) -> str:
    """Comparisons, the run's verdict, then alert evaluation (and, with a dispatcher, delivery
    and escalation)."""
    verdict, alerts = aggregate_pass(run_id)
    if alerts is not None:
        after_commit(run_id, alerts, dispatcher)
    return verdict


def aggregate_pass(run_id: int) -> tuple[str, dict | None]:
    """One aggregation pass, under the run's aggregation lock: a second pass that the reconciler
    sends while this one still scores (a long judge pass) finds it held and skips. Returns the
    verdict and the alert evaluation, None when nothing was evaluated."""
    with repo.aggregation_lock(run_id) as held:
        if not held:
            return "skipped", None
        return _aggregate_pass(run_id)


def finish_run(session: Session, run_id: int, status: str, verdict: str, reason: str | None,
               only_if: Sequence[str] | None = None) -> bool:
    """The run's outcome and, in the same transaction, the durable verdict of a gate on it."""
    if not repo.finish_run(session, run_id, status, verdict, reason, only_if=only_if):
        return False
    decide_gate(session, run_id)
    return True


def _aggregate_pass(run_id: int) -> tuple[str, dict | None]:
    from workers.score import score_run, scoring_inputs

    with session_scope() as session:  # whether the run is ready, and what it recorded
        run = session.get(Run, run_id)
        if run is None or run.status not in ("aggregating",):
            return "skipped", None
        config_runs = list(run.config_runs)
        if any(cr.status not in repo.TERMINAL for cr in config_runs):
            # config-runs queued again (a top-up, a step back): back to running; their last one aggregates
            session.execute(update(Run).where(Run.id == run_id, Run.status == "aggregating").values(status="running"))
            return "skipped", None
        base = next(cr for cr in config_runs if cr.config_id == run.baseline_config_id)
        if base.status != "succeeded":
            finish_run(session, run_id, "failed", "error",
                       f"baseline '{base.config.name}' failed: {base.error}; nothing can be compared")
            return "error", None
        table = RunRecords.from_rows(repo.sample_rows(session, run_id))  # the run's records, read once
        scoring = scoring_inputs(session, run)
    # judge / faithfulness on this (CPU) worker, added to the table, with no transaction open while a
    # judge answers (each config's scores commit on their own)
    failed_scorers = score_run(scoring, table) if scoring is not None else {}
    with session_scope() as session:
        run = session.get(Run, run_id)
        if run is None or run.status not in ("aggregating",):  # cancelled while the judge scored
            return "skipped", None
        config_runs = list(run.config_runs)
        # an ablation that failed only takes its advice away (workers/step_back.py), never the verdict
        failed = [cr for cr in config_runs if cr.status == "failed" and not step_back.is_ablation(cr.config)]
        suite = session.get(Suite, run.suite_id)
        settings = suite.settings if suite else SuiteSpec()
        scorers, generation = settings.scorers, settings.generation
        thresholds = RunThresholds(repo.alert_rules(session, run.project_id, run.model_id))
        rows: list[Comparison] = []
        for cr in config_runs:
            if cr.status != "succeeded":
                continue
            rows += [replace(c, config_id=cr.config_id)
                     for c in config_comparisons(run, cr, table, thresholds, failed_scorers, scorers,
                                                 greedy=generation.temperature < SAMPLING_EPS,
                                                 tau=generation.near_tie_nats)]
        topped = top_up.plan(session, run, suite, rows)
        if topped.execute:  # a candidate undecided: more samples for it and the baseline, before any verdict
            return "top-up", {"notifications": [], "escalate": [], "execute": topped.execute}
        added = step_back.plan(session, run, rows)
        if added:  # a stacked config breaches: its layers alone, on the same samples, before any verdict
            execute = repo.add_config_runs(session, run, added)
            return "step-back", {"notifications": [], "escalate": [], "execute": execute}
        advice = step_back.attach(run, rows)
        repo.write_comparisons(session, run_id, rows)
        ablations = {cr.config_id for cr in config_runs if step_back.is_ablation(cr.config)}
        judged = [r for r in rows if r.config_id not in ablations]
        # A measured critical regression fails the run even when other configs are missing;
        # otherwise missing results make it incomplete (never a pass by omission).
        verdict = RUN_VERDICT[worst_verdict(r.verdict for r in judged if not informational(r))]
        reason = _reason(judged, config_runs) + top_up.reason(run, suite) + topped.refused
        if not any(not informational(r) for r in judged) and not failed:
            # nothing compared (no candidate, no samples, only reported figures): never a pass, and
            # no alert resolves on it (app/alert_evaluation.py reads comparisons only)
            verdict = "error"
            reason = ("nothing was compared: the run has no candidate result a threshold judges (no candidate "
                      "config, no samples, or only reported figures); it is not a pass")
        config_names = {cr.config_id: cr.config.name for cr in config_runs}
        reason += "".join(f"; step back {config_names[config_id]}: {found.advice()}"
                          for config_id, found in advice.items())
        if failed:
            names = ", ".join(f"'{cr.config.name}' ({cr.error})" for cr in failed)
            reason = f"missing results for {names}; {reason}"
            if verdict != "fail":
                verdict = "incomplete"
        finish_run(session, run_id, "done", verdict, reason)
        alerts = evaluate_run(session, run)
    return verdict, alerts


def after_commit(run_id: int, alerts: dict, dispatcher: Dispatcher | None) -> None:
    """Deliver what the evaluation queued and escalate newly firing alerts, or start the ablations
    of a step back — after the commit, so the tasks and the escalation run see the rows."""
    if dispatcher is None:
        return
    if alerts.get("execute"):  # a top-up's config-runs (workers/top_up.py), a stacked config's ablations (step_back.py)
        with session_scope() as session:
            trigger = repo.run_trigger(session, run_id)
            # each at the priority it was first sent with (a new ablation: its run's trigger's)
            priorities = {config_run.id: stored_priority(config_run.priority, trigger)
                          for config_run in repo.config_runs_by_id(session, alerts["execute"])}
        for config_run_id in alerts["execute"]:
            dispatcher.send(EXECUTE_CONFIG_RUN, config_run_id, priority=priorities.get(config_run_id,
                                                                                      priority_of(trigger)))
    if alerts["notifications"]:
        dispatcher.send(NOTIFY)
    if alerts["escalate"] and get_settings().escalation:
        escalate(session_scope, run_id, alerts["escalate"], dispatcher)


def _example(row: Comparison) -> str:
    """One answer that shows a generation finding (evals/field.py), quoted: what an empty answer,
    a loop or a confident departure looks like on this run."""
    example = row.details.get("example")
    if not example or row.verdict not in ("warn", "critical"):
        return ""
    return f", e.g. {example['sample_key']}: {json.dumps(example['text'][:60], ensure_ascii=False)}"


def _reason(rows: list[Comparison], config_runs: Iterable[ConfigRun]) -> str:
    """The run verdict's reason, worst first: each breaching comparison with its rule, then the
    comparisons that had too few samples to decide, in one clause (`int8 ttft_ratio, gen_nll_ratio`)."""
    # looked up by Comparison.config_id (int | None; set on every row of a run)
    names: dict[int | None, str] = {cr.config_id: cr.config.name for cr in config_runs}
    notable = sorted((r for r in rows if r.verdict != "ok" and not informational(r)),
                     key=lambda r: -VERDICT_ORDER[r.verdict])
    parts: list[str] = []
    few: dict[str, list[str]] = {}
    for r in notable:
        if r.verdict == "inconclusive" and TOO_FEW in (r.rule or ""):
            few.setdefault(names[r.config_id], []).append(r.metric)
        else:
            parts.append(f"{names[r.config_id]} {r.metric} {r.verdict} ({r.rule}){_example(r)}")
    if few:
        parts.append(f"{TOO_FEW} (n < min_n): " + "; ".join(f"{c} {', '.join(ms)}" for c, ms in few.items()))
    return "; ".join(parts) if parts else "every comparison is ok"
