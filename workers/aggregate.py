"""Aggregate a finished run: paired comparisons of every candidate config against the baseline,
then the run's verdict. Idempotent: comparisons are upserted on (run, config, metric)."""

from __future__ import annotations

import math

import numpy as np

from app import repo
from app.config_file import METRIC_DIRECTIONS, Thresholds as FileThresholds
from app.alerts import escalate, evaluate_run
from app.db import session_scope
from app.dispatch import NOTIFY
from app.settings import get_settings
from app.models import Run
from evals.agreement import exact_match, top1_agreement
from evals.perplexity import DocNLL, ppl_ratio
from evals.stats import Comparison, Thresholds, decide, paired_bootstrap_ci, paired_mean_difference

DEFAULTS = FileThresholds()
RUN_VERDICT = {"critical": "fail", "warn": "warn", "inconclusive": "inconclusive", "ok": "pass"}
SEVERITY = ["ok", "inconclusive", "warn", "critical"]
INFORMATIONAL = {"exact_match", "top1_agreement"}  # reported with CIs; no threshold, no say in the verdict


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


def informational(metric: str, est: float, lo: float, hi: float, n: int, min_n: int = 10, **kw) -> Comparison:
    """A metric reported with its CI but no threshold (agreement): never 'ok' on too few samples."""
    if n < min_n:
        return Comparison(metric, est, lo, hi, n, "inconclusive", f"n={n} < min_n={min_n}: too few samples to decide", **kw)
    return Comparison(metric, est, lo, hi, n, "ok", "reported: no threshold on this metric", **kw)



def mean_comparison(metric: str, values: list[float], clusters: list, t: Thresholds, seed: int,
                    baseline_value: float | None = None, details: dict | None = None) -> Comparison:
    """Mean of per-sample values with a (clustered) bootstrap CI, against absolute thresholds."""
    n = len(values)
    if n == 0:
        return Comparison(metric, math.nan, math.nan, math.nan, 0, "inconclusive", "no scored samples", details=details or {})
    x = np.asarray(values, dtype=np.float64)
    lo, hi = paired_bootstrap_ci(lambda w: (w @ x) / w.sum(1), n, clusters=clusters, seed=seed)
    est = float(x.mean())
    verdict, rule = decide(est, lo, hi, n, t)
    return Comparison(metric, est, lo, hi, n, verdict, rule, baseline_value=baseline_value, candidate_value=est, details=details or {})


def scorer_comparisons(s, run: Run, cr, base_cfg: int, failed: dict[str, str]) -> list[Comparison]:
    """Faithfulness, judge and agreement comparisons for one config (those its suite enables)."""
    out: list[Comparison] = []
    is_base = cr.config_id == base_cfg
    faith = repo.sample_results(s, run.id, cr.config_id, "faithfulness")
    if "faithfulness" in failed:
        out.append(Comparison("faithfulness", math.nan, math.nan, math.nan, 0, "inconclusive", f"scorer 'faithfulness' failed: {failed['faithfulness']}"))
    elif faith:
        scored = [r for r in faith if r.value is not None]
        base_vals = [r.value for r in repo.sample_results(s, run.id, base_cfg, "faithfulness") if r.value is not None]
        method = faith[0].extra.get("method") or ""
        details = {"method": method, "no_statements": sum(r.extra.get("outcome") == "no_statements" for r in faith),
                   "parse_failures": sum(r.extra.get("outcome") == "parse_failure" for r in faith)}
        base_value = float(np.mean(base_vals)) if base_vals else None
        comp = mean_comparison("faithfulness", [r.value for r in scored], [r.extra.get("cluster") for r in scored],
                               thresholds(s, run, cr.config_id, "faithfulness"), run.seed, baseline_value=base_value, details=details)
        if method.startswith("offline"):
            # a cosine heuristic is no gate: reported with its CI, never judged against the threshold
            comp = informational("faithfulness", comp.estimate, comp.ci_low, comp.ci_high, comp.n, baseline_value=base_value,
                                 candidate_value=comp.estimate, details={**details, "informational": True})
            comp = Comparison(**{**comp.__dict__, "rule": comp.rule.replace("reported: no threshold on this metric",
                                                                           "offline approximation: reported, not judged against the threshold")})
        out.append(comp)
    if "judge" in failed and not is_base:
        out.append(Comparison("judge_win_rate", math.nan, math.nan, math.nan, 0, "inconclusive", f"scorer 'judge' failed: {failed['judge']}"))
    pw = repo.sample_results(s, run.id, cr.config_id, "judge_pairwise")
    if pw and not is_base and "judge" not in failed:
        judged = [r for r in pw if r.value is not None]
        consistent = [r.extra.get("consistent") for r in judged]
        out.append(mean_comparison(
            "judge_win_rate", [r.value for r in judged], [r.extra.get("cluster") for r in judged],
            thresholds(s, run, cr.config_id, "judge_win_rate"), run.seed, baseline_value=0.5,
            details={"parse_failures": len(pw) - len(judged), "ties": sum(r.value == 0.5 for r in judged),
                     "position_consistency": (sum(bool(c) for c in consistent) / len(consistent)) if consistent else None}))
    rub = {r.sample_key: r for r in repo.sample_results(s, run.id, cr.config_id, "judge_score")}
    if rub and not is_base and "judge" not in failed:
        base_rub = {r.sample_key: r for r in repo.sample_results(s, run.id, base_cfg, "judge_score")}
        keys = [k for k in rub if rub[k].value is not None and k in base_rub and base_rub[k].value is not None]
        b, c = [base_rub[k].value for k in keys], [rub[k].value for k in keys]
        clusters = [rub[k].extra.get("cluster") for k in keys]
        if keys:
            est, lo, hi = paired_mean_difference(b, c, clusters=clusters, seed=run.seed)
            verdict, rule = decide(est, lo, hi, len(keys), thresholds(s, run, cr.config_id, "judge_score_delta"))
            out.append(Comparison("judge_score_delta", est, lo, hi, len(keys), verdict, rule, baseline_value=float(np.mean(b)),
                                  candidate_value=float(np.mean(c)), details={"parse_failures": len(rub) - len(keys)}))
    suite_scorers = (run_suite_spec(s, run) or {}).get("scorers", [])
    if "agreement" in suite_scorers and not is_base:
        out += agreement_comparisons(s, run, cr.config_id, base_cfg)
    return out


def run_suite_spec(s, run: Run) -> dict:
    from app.models import Suite

    suite = s.get(Suite, run.suite_id)
    return dict(suite.spec) if suite else {}


def agreement_comparisons(s, run: Run, config_id: int, base_cfg: int) -> list[Comparison]:
    out = []
    base = {r.sample_key: r for r in repo.sample_results(s, run.id, base_cfg, "ttft_ms")}
    cand = {r.sample_key: r for r in repo.sample_results(s, run.id, config_id, "ttft_ms")}
    keys = [k for k in cand if k in base]
    if keys:
        # token ids where the engine knows them; the text otherwise (an HTTP server's stream)
        def seq(r):
            return r.extra.get("token_ids") or r.extra.get("text", "")

        em = exact_match([seq(base[k]) for k in keys], [seq(cand[k]) for k in keys])
        out.append(informational("exact_match", em.rate, em.ci[0], em.ci[1], em.n, baseline_value=1.0, candidate_value=em.rate,
                                 details={"matches": em.matches, "mean_first_divergence": em.mean_first_divergence}))
    bdocs = {r.sample_key: r for r in repo.sample_results(s, run.id, base_cfg, "nll")}
    rates, clusters = [], []
    for r in repo.sample_results(s, run.id, config_id, "nll"):
        b = bdocs.get(r.sample_key)
        g_c, g_b = (r.extra or {}).get("greedy_ids"), (b.extra or {}).get("greedy_ids") if b else None
        if g_c and g_b and len(g_c) == len(g_b):
            rates.append(top1_agreement(g_b, g_c))
            clusters.append(r.extra.get("cluster"))
    if rates:
        x = np.asarray(rates)
        lo, hi = paired_bootstrap_ci(lambda w: (w @ x) / w.sum(1), len(x), clusters=clusters, seed=run.seed)
        out.append(informational("top1_agreement", float(x.mean()), lo, hi, len(x), baseline_value=1.0, candidate_value=float(x.mean())))
    return out


def aggregate_run(run_id: int, dispatcher=None) -> str:
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


def _aggregate_pass(run_id: int) -> tuple[str, dict | None]:
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None or run.status not in ("aggregating",):
            return "skipped", None
        crs = list(run.config_runs)
        base = next(cr for cr in crs if cr.config_id == run.baseline_config_id)
        failed = [cr for cr in crs if cr.status == "failed"]
        rows: list[dict] = []
        if base.status != "succeeded":
            repo.finish_run(s, run_id, "failed", "error",
                            f"baseline '{base.config.name}' failed: {base.error}; nothing can be compared")
            return "error", None
        from workers.score import score_run

        failed_scorers = score_run(s, run)  # judge / faithfulness on this (CPU) worker; failures reported per scorer
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
            comps += scorer_comparisons(s, run, cr, run.baseline_config_id, failed_scorers)
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
        worst = max((r["verdict"] for r in rows if not _informational(r)), key=SEVERITY.index, default="ok")
        verdict = RUN_VERDICT[worst]
        reason = _reason(rows, crs)
        if failed:
            names = ", ".join(f"'{cr.config.name}' ({cr.error})" for cr in failed)
            reason = f"missing results for {names}; {reason}"
            if verdict != "fail":
                verdict = "incomplete"
        repo.finish_run(s, run_id, "done", verdict, reason)
        alerts = evaluate_run(s, run)
    return verdict, alerts


def after_commit(run_id: int, alerts: dict, dispatcher) -> None:
    """Deliver what the evaluation queued and escalate newly firing alerts — after the commit,
    so the notify task and the escalation run see the rows."""
    if dispatcher is None:
        return
    if alerts["notifications"]:
        dispatcher.send(NOTIFY)
    if alerts["escalate"] and get_settings().escalation:
        escalate(session_scope, run_id, alerts["escalate"], dispatcher)


def _docs(session, run_id: int, config_id: int) -> list[DocNLL]:
    return [
        DocNLL(r.sample_key, r.value, r.extra["n_tokens"], r.extra["n_words"], r.extra["n_bytes"], r.extra.get("cluster"))
        for r in repo.sample_results(session, run_id, config_id, "nll")
    ]


def _informational(row: dict) -> bool:
    return row["metric"] in INFORMATIONAL or bool((row.get("details") or {}).get("informational"))


def _f(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _reason(rows: list[dict], crs) -> str:
    names = {cr.config_id: cr.config.name for cr in crs}
    bad = [f"{names[r['config_id']]} {r['metric']} {r['verdict']} ({r['rule']})" for r in rows
           if r["verdict"] != "ok" and not _informational(r)]
    return "; ".join(bad) if bad else "every comparison is ok"
