"""Aggregate a finished run: paired comparisons of every candidate config against the baseline,
then the run's verdict. Idempotent: comparisons are upserted on (run, config, metric)."""

from __future__ import annotations

import math

import numpy as np

from app import repo
from app.config_file import METRIC_DIRECTIONS, Thresholds as FileThresholds
from app.db import session_scope
from app.models import Run
from evals.perplexity import DocNLL, ppl_ratio
from evals.stats import Comparison, Thresholds, decide, paired_bootstrap_ci

DEFAULTS = FileThresholds()
RUN_VERDICT = {"critical": "fail", "warn": "warn", "inconclusive": "inconclusive", "ok": "pass"}
SEVERITY = ["ok", "inconclusive", "warn", "critical"]


def thresholds(session, run: Run, config_id: int, metric: str) -> Thresholds:
    rule = repo.threshold_for(session, run.project_id, metric, run.model_id, config_id)
    if rule is None:
        default = getattr(DEFAULTS, metric)
        return Thresholds(default.warn, default.critical, METRIC_DIRECTIONS[metric], default.min_n)
    return Thresholds(rule.warn, rule.critical, rule.direction, rule.min_n)


def ttft_comparison(values: list[float], t: Thresholds, seed: int = 0) -> Comparison:
    """Absolute threshold on the candidate's median TTFT (the lower median for even n, the same
    definition for the estimate and every bootstrap resample); CI by bootstrap."""
    n = len(values)
    if n == 0:
        return Comparison("ttft_ms", math.nan, math.nan, math.nan, 0, "inconclusive", "no generations")
    x = np.asarray(values, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    xs = x[order]

    def lower_median(w: np.ndarray) -> np.ndarray:  # w: [R, n] multiplicities
        c = np.cumsum(w[:, order], axis=1)
        return xs[(c >= c[:, -1:] / 2).argmax(axis=1)]

    est = float(lower_median(np.ones((1, n)))[0])
    lo, hi = paired_bootstrap_ci(lower_median, n, seed=seed)
    verdict, rule = decide(est, lo, hi, n, t)
    return Comparison("ttft_ms", est, lo, hi, n, verdict, f"p50 TTFT: {rule}", candidate_value=est)


def acceptance_comparison(drafted: list[int], accepted: list[int], t: Thresholds, seed: int = 0) -> Comparison:
    """Spec-decode acceptance rate Σaccepted / Σdraft tokens over the prompts (vLLM's definition),
    CI by bootstrap over prompts; absolute thresholds (bad below)."""
    d, a = np.asarray(drafted, dtype=np.float64), np.asarray(accepted, dtype=np.float64)
    n = len(d)
    if n == 0 or d.sum() == 0:
        return Comparison("spec_acceptance_rate", math.nan, math.nan, math.nan, n, "inconclusive", "no draft tokens")
    est = float(a.sum() / d.sum())
    lo, hi = paired_bootstrap_ci(lambda w: (w @ a) / np.maximum(w @ d, 1e-12), n, seed=seed)
    verdict, rule = decide(est, lo, hi, n, t)
    return Comparison("spec_acceptance_rate", est, lo, hi, n, verdict, rule, candidate_value=est,
                      details={"num_draft_tokens": int(d.sum()), "num_accepted_tokens": int(a.sum())})


def aggregate_run(run_id: int, dispatcher=None) -> str:
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None or run.status not in ("aggregating",):
            return "skipped"
        crs = list(run.config_runs)
        base = next(cr for cr in crs if cr.config_id == run.baseline_config_id)
        failed = [cr for cr in crs if cr.status == "failed"]
        rows: list[dict] = []
        if base.status != "succeeded":
            repo.finish_run(s, run_id, "failed", "error",
                            f"baseline '{base.config.name}' failed: {base.error}; nothing can be compared")
            return "error"
        base_docs = _docs(s, run_id, base.config_id)
        for cr in crs:
            if cr.status != "succeeded":
                continue
            comps = []
            if cr.config_id != run.baseline_config_id:
                comps.append(ppl_ratio(base_docs, _docs(s, run_id, cr.config_id),
                                       thresholds(s, run, cr.config_id, "ppl_ratio"), seed=run.seed))
            gens = [r for r in repo.sample_results(s, run_id, cr.config_id, "ttft_ms") if r.value is not None]
            if gens:
                comps.append(ttft_comparison([r.value for r in gens], thresholds(s, run, cr.config_id, "ttft_ms"), seed=run.seed))
            spec = [r.extra["spec"] for r in gens if r.extra and r.extra.get("spec")]
            if spec:
                comps.append(acceptance_comparison([x["num_draft_tokens"] for x in spec], [x["num_accepted_tokens"] for x in spec],
                                                   thresholds(s, run, cr.config_id, "spec_acceptance_rate"), seed=run.seed))
            for c in comps:
                rows.append({
                    "config_id": cr.config_id, "metric": c.metric, "estimate": _f(c.estimate), "ci_low": _f(c.ci_low),
                    "ci_high": _f(c.ci_high), "n": c.n, "verdict": c.verdict, "rule": c.rule,
                    "baseline_value": _f(c.baseline_value), "candidate_value": _f(c.candidate_value),
                    "details": c.details or None,
                })
        repo.write_comparisons(s, run_id, rows)
        # A measured critical regression fails the run even when other configs are missing;
        # otherwise missing results make it incomplete (never a pass by omission).
        worst = max((r["verdict"] for r in rows), key=SEVERITY.index, default="ok")
        verdict = RUN_VERDICT[worst]
        reason = _reason(rows, crs)
        if failed:
            names = ", ".join(f"'{cr.config.name}' ({cr.error})" for cr in failed)
            reason = f"missing results for {names}; {reason}"
            if verdict != "fail":
                verdict = "incomplete"
        repo.finish_run(s, run_id, "done", verdict, reason)
        return verdict


def _docs(session, run_id: int, config_id: int) -> list[DocNLL]:
    return [
        DocNLL(r.sample_key, r.value, r.extra["n_tokens"], r.extra["n_words"], r.extra["n_bytes"], r.extra.get("cluster"))
        for r in repo.sample_results(session, run_id, config_id, "nll")
    ]


def _f(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _reason(rows: list[dict], crs) -> str:
    names = {cr.config_id: cr.config.name for cr in crs}
    bad = [f"{names[r['config_id']]} {r['metric']} {r['verdict']} ({r['rule']})" for r in rows if r["verdict"] != "ok"]
    return "; ".join(bad) if bad else "every comparison is ok"
