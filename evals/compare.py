"""Every comparison of a candidate config with its baseline: plain values in, a `Comparison` out
(evals/stats.py decides the verdict from the CI). Each function implements one comparison kind
of the metric table (vocabulary/metrics.py); each row's compare target (evals/compare_targets.py) feeds
them the config's typed records.

    metric                comparison         function
    ppl_ratio             paired_ratio       evals.perplexity.ppl_ratio (by position: ppl_ratio_by_position)
    ttft_ms               percentile         ttft_comparison
    spec_acceptance_rate  rate               acceptance_comparison
    kv_cache_usage        peak               peak_comparison
    faithfulness          mean               faithfulness_comparison
    judge_win_rate        mean               judge_win_rate_comparison
    judge_score_delta     paired_difference  judge_score_delta_comparison
    gen_nll_ratio         paired_ratio       gen_nll_ratio_comparison
    term_nll_ratio        paired_ratio       term_nll_ratio_comparison
    ttft_ratio            paired_ratio       paired_timing_ratio
    tpot_ratio            paired_ratio       paired_timing_ratio
    lossless_exact_match  rate (exact)       lossless_exact_comparison (reported only on a server shown noisy)
    confident_divergence, batch_divergence, empty_answers, degenerate_answers, max_tokens_hits,
    early_stops, output_length_ratio: evals/field.py
    exact_match           rate (no gate)     exact_match_comparison
    top1_agreement        mean (no gate)     evals.distribution.top1_agreement_comparison
    kld_mean              mean (no gate)     evals.distribution.kld_comparison
    decode_nll_ratio      paired_ratio       evals.perplexity.ppl_ratio on the decode pass (compare_targets)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from evals.agreement import exact_match, first_divergence
from evals.health import NEAR_TIE_NATS, divergence
from evals.perplexity import ppl_ratio
from evals.positions import answer_totals, bucket_label
from evals.records import DocRecord, FaithfulnessRecord, GenerationRecord, PairwiseRecord, RubricRecord
from evals.stats import TOO_FEW, Thresholds, decide, paired_bootstrap_ci, paired_mean_difference, wilson_interval
from vocabulary.comparison import Comparison, Verdict

__all__ = [
    "acceptance_comparison",
    "exact_match_comparison",
    "faithfulness_comparison",
    "judge_score_delta_comparison",
    "judge_win_rate_comparison",
    "lossless_exact_comparison",
    "mean_comparison",
    "peak_comparison",
    "ppl_ratio",
    "ppl_ratio_by_position",
    "reported",
    "term_nll_ratio_comparison",
    "ttft_comparison",
    "unscored",
]


def unscored(metric: str, why: str) -> Comparison:
    """A metric that could not be computed: inconclusive, with the reason."""
    return Comparison(metric, math.nan, math.nan, math.nan, 0, "inconclusive", why)


def ttft_comparison(values: Sequence[float], t: Thresholds, seed: int = 0) -> Comparison:
    """Absolute threshold on the candidate's median TTFT (the lower median for even n, the same
    definition for the estimate and every bootstrap resample); CI by bootstrap."""
    n = len(values)
    if n == 0:
        return unscored("ttft_ms", "no generations")
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


def acceptance_comparison(drafted: Sequence[int], accepted: Sequence[int], t: Thresholds, seed: int = 0) -> Comparison:
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


def peak_comparison(metric: str, peak: float | None, t: Thresholds, source: str) -> Comparison:
    """One reading (a peak over the config-run) against absolute thresholds: no sampling, so the
    interval is the value itself and n is 1."""
    if peak is None or math.isnan(peak):
        return unscored(metric, f"not reported: {source}")
    # min_n counts samples, and a peak is one reading by nature: it does not apply
    verdict, rule = decide(peak, peak, peak, 1, replace(t, min_n=1))
    return Comparison(metric, peak, peak, peak, 1, verdict, f"peak {rule}", candidate_value=peak,
                      details={"source": source})


def reported(metric: str, est: float, lo: float, hi: float, n: int, min_n: int = 10, **kw: Any) -> Comparison:
    """A metric reported with its CI but no threshold (agreement): never 'ok' on too few samples."""
    if n < min_n:
        why = f"n={n} < min_n={min_n}: {TOO_FEW}"
        return Comparison(metric, est, lo, hi, n, "inconclusive", why, **kw)
    return Comparison(metric, est, lo, hi, n, "ok", "reported: no threshold on this metric", **kw)


def mean_comparison(metric: str, values: Sequence[float], clusters: Sequence, t: Thresholds, seed: int,
                    baseline_value: float | None = None, details: dict | None = None) -> Comparison:
    """Mean of per-sample values with a (clustered) bootstrap CI, against absolute thresholds."""
    n = len(values)
    if n == 0:
        return Comparison(metric, math.nan, math.nan, math.nan, 0, "inconclusive", "no scored samples",
                          details=details or {})
    x = np.asarray(values, dtype=np.float64)
    lo, hi = paired_bootstrap_ci(lambda w: (w @ x) / w.sum(1), n, clusters=list(clusters), seed=seed)
    est = float(x.mean())
    verdict, rule = decide(est, lo, hi, n, t)
    return Comparison(metric, est, lo, hi, n, verdict, rule, baseline_value=baseline_value, candidate_value=est,
                      details=details or {})


def faithfulness_comparison(candidate: Sequence[FaithfulnessRecord], baseline: Sequence[FaithfulnessRecord],
                            t: Thresholds, seed: int) -> Comparison:
    """Mean faithfulness of the candidate's scored answers; the offline approximation is reported
    with its CI but never judged against the threshold (a cosine heuristic is no gate)."""
    scored = [r for r in candidate if r.score is not None]
    base_vals = [r.score for r in baseline if r.score is not None]
    method = candidate[0].method if candidate else ""
    details = {"method": method, "no_statements": sum(r.outcome == "no_statements" for r in candidate),
               "parse_failures": sum(r.outcome == "parse_failure" for r in candidate)}
    base_value = float(np.mean(base_vals)) if base_vals else None
    comp = mean_comparison("faithfulness", [r.score for r in scored if r.score is not None],
                           [r.cluster for r in scored], t, seed, baseline_value=base_value, details=details)
    if not method.startswith("offline"):
        return comp
    comp = reported("faithfulness", comp.estimate, comp.ci_low, comp.ci_high, comp.n, baseline_value=base_value,
                         candidate_value=comp.estimate, details=details, gated=False)
    return Comparison(**{**comp.__dict__, "rule": comp.rule.replace(
        "reported: no threshold on this metric", "offline approximation: reported, not judged against the threshold")})


def judge_win_rate_comparison(verdicts: Sequence[PairwiseRecord], t: Thresholds, seed: int) -> Comparison:
    """Candidate wins + ½ ties over the prompts the judge could decide; parse failures counted, never scored."""
    judged = [r for r in verdicts if r.value is not None]
    consistent = [r.consistent for r in judged]
    return mean_comparison(
        "judge_win_rate", [r.value for r in judged if r.value is not None], [r.cluster for r in judged], t, seed,
        baseline_value=0.5,
        details={"parse_failures": len(verdicts) - len(judged), "ties": sum(r.value == 0.5 for r in judged),
                 "position_consistency": (sum(bool(c) for c in consistent) / len(consistent)) if consistent else None})


def judge_score_delta_comparison(candidate: dict[str, RubricRecord], baseline: dict[str, RubricRecord],
                                 t: Thresholds, seed: int) -> Comparison | None:
    """Rubric score candidate − baseline on prompts both sides were scored on (None: no pair)."""
    keys = [k for k, r in candidate.items() if r.score is not None and k in baseline and baseline[k].score is not None]
    if not keys:
        return None
    b = [float(baseline[k].score) for k in keys]  # type: ignore[arg-type]
    c = [float(candidate[k].score) for k in keys]  # type: ignore[arg-type]
    est, lo, hi = paired_mean_difference(b, c, clusters=[candidate[k].cluster for k in keys], seed=seed)
    verdict, rule = decide(est, lo, hi, len(keys), t)
    return Comparison("judge_score_delta", est, lo, hi, len(keys), verdict, rule, baseline_value=float(np.mean(b)),
                      candidate_value=float(np.mean(c)), details={"parse_failures": len(candidate) - len(keys)})


def paired_timing_ratio(metric: str, pairs: Sequence[tuple[float, float]], t: Thresholds, seed: int = 0,
                        batches: Sequence | None = None) -> Comparison:
    """(candidate, baseline) timings of the same prompts, taken back to back: the geometric mean of
    the per-prompt ratios (a latency is skewed; a log ratio is not), CI by paired bootstrap. batches:
    the batch each prompt ran in; requests in flight together share their server's moment (a stall
    slows the whole batch), so whole batches are resampled."""
    keep = [i for i, (c, b) in enumerate(pairs) if c > 0 and b > 0]
    kept = [pairs[i] for i in keep]
    if not kept:
        return unscored(metric, "no prompt timed on both sides")
    logs = np.log(np.array([c / b for c, b in kept], dtype=np.float64))
    estimate = float(np.exp(logs.mean()))
    clusters = [batches[i] for i in keep] if batches is not None else None
    lo, hi = paired_bootstrap_ci(lambda w: np.exp((w @ logs) / w.sum(1)), len(kept), clusters=clusters, seed=seed)
    verdict, rule = decide(estimate, lo, hi, len(kept), t)
    cand, base = np.array([c for c, _ in kept]), np.array([b for _, b in kept])
    return Comparison(metric, estimate, lo, hi, len(kept), verdict, rule, baseline_value=float(np.median(base)),
                      candidate_value=float(np.median(cand)), details={"median_ms": "baseline_value / candidate_value",
                               # which clock: the client's, the same on every engine (a server's own
                               # per-request timings are in the config's figures, server.request_*)
                               "clock": "client"})


def gen_nll_ratio_comparison(candidate: dict[str, GenerationRecord], baseline: dict[str, GenerationRecord],
                             t: Thresholds, seed: int = 0) -> Comparison:
    """The candidate's outputs against the baseline's own, both scored by the baseline model after
    the same prompts (GenerationRecord.baseline_nll): the ratio of their perplexities, paired by
    prompt, CI by paired bootstrap over prompts. Outputs differ in length, so each side is its own
    Σ NLL / Σ tokens."""
    keys = [k for k, g in candidate.items() if g.baseline_nll is not None and g.baseline_nll_tokens
            and (b := baseline.get(k)) is not None and b.baseline_nll is not None and b.baseline_nll_tokens]
    if not keys:
        return unscored("gen_nll_ratio", "no output of both sides was scored by the baseline model")
    nll_c = np.array([candidate[k].baseline_nll for k in keys], dtype=np.float64)
    tok_c = np.array([candidate[k].baseline_nll_tokens for k in keys], dtype=np.float64)
    nll_b = np.array([baseline[k].baseline_nll for k in keys], dtype=np.float64)
    tok_b = np.array([baseline[k].baseline_nll_tokens for k in keys], dtype=np.float64)
    rate_c, rate_b = nll_c.sum() / tok_c.sum(), nll_b.sum() / tok_b.sum()
    estimate = math.exp(rate_c - rate_b)
    lo, hi = paired_bootstrap_ci(_rate_ratio(nll_c, tok_c, nll_b, tok_b), len(keys), seed=seed)
    verdict, rule = decide(estimate, lo, hi, len(keys), t)
    # an empty answer has no token to score: it is left out of the ratio, and said so (empty_answers judges it)
    empty = {"candidate": sum(not g.text.strip() for g in candidate.values()),
             "baseline": sum(not g.text.strip() for k, g in baseline.items() if k in candidate)}
    if empty["candidate"] or empty["baseline"]:
        rule += (f"; {empty['candidate']} empty candidate and {empty['baseline']} empty baseline answers have no "
                 f"tokens to score, left out (judged by empty_answers)")
    return Comparison("gen_nll_ratio", estimate, lo, hi, len(keys), verdict, rule, baseline_value=math.exp(rate_b),
                      candidate_value=math.exp(rate_c),
                      details={"baseline_nll_per_token": rate_b, "candidate_nll_per_token": rate_c,
                               "empty_answers_left_out": empty})


def gen_nll_ratio_by_position(candidate: Mapping[str, GenerationRecord], baseline: Mapping[str, GenerationRecord],
                              t: Thresholds, seed: int = 0) -> list[dict]:
    """gen_nll_ratio within each bucket of token index in the answer (evals/positions.py
    ANSWER_EDGES): exp(Σ NLL_c / Σ tokens_c − Σ NLL_b / Σ tokens_b) over the prompts whose two
    answers both reach that bucket, each side's tokens as the baseline model read them
    (GenerationRecord.scored), with a paired bootstrap CI over prompts and the verdict
    gen_nll_ratio's thresholds give it. A loss that grows with the answer's length shows in the
    late buckets. Empty where an answer was not read token by token."""
    found: dict[tuple[int, int], list[tuple[float, int, float, int]]] = {}
    for key, b in baseline.items():
        c = candidate.get(key)
        if c is None or c.scored is None or b.scored is None:
            continue
        mine = {(lo, hi): (nll, n) for lo, hi, nll, n in answer_totals([-lp for lp in c.scored.logprobs])}
        for lo, hi, base_nll, base_n in answer_totals([-lp for lp in b.scored.logprobs]):
            if (lo, hi) in mine:
                found.setdefault((lo, hi), []).append((*mine[(lo, hi)], base_nll, base_n))
    out = []
    for (lo, hi), rows in sorted(found.items()):
        nll_c, tok_c, nll_b, tok_b = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
        estimate = math.exp(nll_c.sum() / tok_c.sum() - nll_b.sum() / tok_b.sum())
        ci_low, ci_high = paired_bootstrap_ci(_rate_ratio(nll_c, tok_c, nll_b, tok_b), len(rows), seed=seed)
        verdict, rule = decide(estimate, ci_low, ci_high, len(rows), t)
        out.append({"positions": bucket_label(lo, hi), "lo": lo, "hi": hi, "estimate": estimate, "ci_low": ci_low,
                    "ci_high": ci_high, "n": len(rows), "tokens": int(tok_c.sum()), "baseline_tokens": int(tok_b.sum()),
                    "verdict": verdict, "rule": rule})
    return out


def _rate_ratio(nll_c: np.ndarray, tok_c: np.ndarray, nll_b: np.ndarray, tok_b: np.ndarray
                ) -> Callable[[np.ndarray], np.ndarray]:
    """The resampled ratio exp(Σ w·NLL_c / Σ w·tokens_c − Σ w·NLL_b / Σ w·tokens_b): two sides of
    their own lengths, for paired_bootstrap_ci."""
    return lambda w: np.exp((w @ nll_c) / (w @ tok_c) - (w @ nll_b) / (w @ tok_b))


def _ratio_of_sums(diff: np.ndarray, toks: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The resampled ratio exp(Σ w·ΔNLL / Σ w·tokens), for paired_bootstrap_ci."""
    return lambda w: np.exp((w @ diff) / (w @ toks))


def ppl_ratio_by_position(candidate: Mapping[str, DocRecord], baseline: Mapping[str, DocRecord], t: Thresholds,
                          seed: int = 0) -> list[dict]:
    """The perplexity ratio within each position bucket (evals/positions.py), each with its own
    paired bootstrap CI over source documents and the verdict ppl_ratio's thresholds give it:
    exp((Σ NLL_c − Σ NLL_b) / Σ tokens) over the documents with tokens in that bucket on both
    sides (in equal numbers: the same tokens). Empty when either side kept no buckets."""
    found: dict[tuple[int, int], list[tuple[float, int, str]]] = {}
    for key, b in baseline.items():
        c = candidate.get(key)
        if c is None or not b.positions or not c.positions:
            continue
        mine = {(lo, hi): (nll, n) for lo, hi, nll, n in c.positions}
        for lo, hi, nll_b, n_b in b.positions:
            nll_c, n_c = mine.get((lo, hi), (0.0, -1))
            if n_b and n_c == n_b:
                found.setdefault((lo, hi), []).append((nll_c - nll_b, n_b, b.cluster or key))
    out = []
    for (lo, hi), rows in sorted(found.items()):
        diff = np.array([d for d, _, _ in rows])
        toks = np.array([n for _, n, _ in rows], dtype=np.float64)
        clusters = [k for _, _, k in rows]
        estimate = math.exp(diff.sum() / toks.sum())
        ci_low, ci_high = paired_bootstrap_ci(_ratio_of_sums(diff, toks), len(rows), clusters=clusters, seed=seed)
        verdict, rule = decide(estimate, ci_low, ci_high, len(set(clusters)), t)
        out.append({"positions": bucket_label(lo, hi), "lo": lo, "hi": hi, "estimate": estimate, "ci_low": ci_low,
                    "ci_high": ci_high, "n": len(rows), "tokens": int(toks.sum()), "verdict": verdict, "rule": rule})
    return out


def term_nll_ratio_comparison(candidate: dict[str, DocRecord], baseline: dict[str, DocRecord], t: Thresholds,
                              seed: int = 0) -> Comparison:
    """The perplexity ratio restricted to the suite's domain-term tokens (vocabulary/terms.py):
    exp((Σ term NLL_c − Σ term NLL_b) / Σ term tokens) over the documents that hold a term, both
    sides scoring the same tokens; CI by paired bootstrap over source documents (min_n counts them)."""
    missing = [side for side, docs in (("candidate", candidate), ("baseline", baseline))
               if docs and all(d.term_tokens is None for d in docs.values())]
    if missing:
        return unscored("term_nll_ratio", f"the {' and '.join(missing)}'s engine did not place its tokens in the text "
                                          f"(an HTTP server gives no token offsets), so no term tokens were scored")
    keys = [k for k, b in baseline.items() if b.term_tokens and (c := candidate.get(k)) is not None
            and c.term_tokens is not None]
    unequal = [k for k in keys if candidate[k].term_tokens != baseline[k].term_tokens]
    if unequal:
        return unscored("term_nll_ratio", f"document '{unequal[0]}' has {baseline[unequal[0]].term_tokens} baseline "
                                          f"term tokens but {candidate[unequal[0]].term_tokens} candidate term tokens; "
                                          f"the ratio needs the same tokenizer on both sides")
    if not keys:
        return unscored("term_nll_ratio", "no scored document contains one of the suite's terms")
    diff = np.array([cast(float, candidate[k].term_nll) - cast(float, baseline[k].term_nll) for k in keys])
    toks = np.array([baseline[k].term_tokens for k in keys], dtype=np.float64)
    clusters = [baseline[k].cluster or k for k in keys]
    estimate = math.exp(diff.sum() / toks.sum())
    lo, hi = paired_bootstrap_ci(_ratio_of_sums(diff, toks), len(keys), clusters=clusters, seed=seed)
    verdict, rule = decide(estimate, lo, hi, len(set(clusters)), t)
    base_nll = sum(cast(float, baseline[k].term_nll) for k in keys)
    return Comparison("term_nll_ratio", estimate, lo, hi, len(keys), verdict, rule,
                      baseline_value=math.exp(base_nll / toks.sum()),
                      candidate_value=math.exp((base_nll + diff.sum()) / toks.sum()),
                      details={"term_tokens": int(toks.sum()), "n_clusters": len(set(clusters)),
                               "delta_nll_per_term_token": float(diff.sum() / toks.sum())})


def _paired_outputs(candidate: dict[str, GenerationRecord], baseline: dict[str, GenerationRecord],
                    keys: list[str]) -> tuple[list, list]:
    """Both sides' outputs in a form they share: token ids where both engines gave them, else the
    texts (an HTTP stream gives text only; ids never equal a string)."""
    ids = all(candidate[k].token_ids and baseline[k].token_ids for k in keys)
    pick = (lambda g: g.token_ids) if ids else (lambda g: g.text)
    return [pick(baseline[k]) for k in keys], [pick(candidate[k]) for k in keys]


def exact_match_comparison(candidate: dict[str, GenerationRecord], baseline: dict[str, GenerationRecord],
                           min_n: int = 10) -> Comparison | None:
    """Share of prompts whose output equals the baseline's (token ids where known, else text); Wilson CI."""
    keys = [k for k in candidate if k in baseline]
    if not keys:
        return None
    b, c = _paired_outputs(candidate, baseline, keys)
    em = exact_match(b, c)
    rate = em.rate if em.rate is not None else math.nan
    return reported("exact_match", rate, em.ci[0], em.ci[1], em.n, min_n=min_n, baseline_value=1.0,
                         candidate_value=em.rate, details={"matches": em.matches,
                                                           "mean_first_divergence": em.mean_first_divergence})


def _near_tie(candidate: GenerationRecord, baseline: GenerationRecord, tau: float) -> bool:
    """Whether two outputs of one prompt part at a near-tie of the baseline model (its log-prob gap
    between the two tokens within τ; evals/health.py). False where either side was not scored
    (a divergence that cannot be read counts as confident)."""
    a, b = baseline.scored, candidate.scored
    if a is None or b is None or not a.ids or not b.ids:
        return False
    d = divergence(a, b, tau)
    return d is not None and d.near_tie


def lossless_exact_comparison(candidate: dict[str, GenerationRecord], baseline: dict[str, GenerationRecord],
                              t: Thresholds, repeats: Mapping[str, GenerationRecord] | None = None,
                              tau: float = NEAR_TIE_NATS) -> Comparison | None:
    """A lossless config's greedy outputs against the baseline's: exactness is the claim, so a
    confident divergence (at a token the baseline model was sure of, gap > τ, or one that cannot
    be read) is a defect, not noise: the estimate is the share of outputs equal to the baseline's
    up to near-ties, at least warn below `warn` (1.0 by default), critical when the Wilson
    interval's top is at or below `critical`. A divergence at a near-tie (gap ≤ τ) is counted and
    shown, never gated: a server shared with other requests is not batch-invariant, however the
    canary sends its own (vLLM's own accuracy tests accept exactly these), and a deterministic
    baseline measured quietly has no floor to show it. Every mismatch is listed with its first
    divergent position (token index, or character where the engine gives text only).

    Reported, not judged, where the baseline is shown not to be deterministic (its own second pass
    differs from its first): confident_divergence judges such a config beyond that floor."""
    keys = [k for k in candidate if k in baseline]
    if not keys:
        return None
    b, c = _paired_outputs(candidate, baseline, keys)
    em = exact_match(b, c)
    divergence_at = {k: first_divergence(x, y) for k, x, y in zip(keys, b, c, strict=True)}
    mismatches = {k: d for k, d in divergence_at.items() if d is not None}
    near = sorted(k for k in mismatches if _near_tie(candidate[k], baseline[k], tau))
    confident = len(mismatches) - len(near)
    held = em.n - confident  # outputs equal to the baseline's up to near-ties
    lo, hi = wilson_interval(held, em.n)
    rate = held / em.n if em.n else math.nan
    details: dict = {"matches": em.matches, "first_divergence": mismatches, "near_tie_nats": tau,
                     "near_tie": {"count": len(near), "examples": [{"sample_key": k, "text": candidate[k].text[:120],
                                                                    "baseline_text": baseline[k].text[:120]}
                                                                   for k in near[:3]]},
                     "confident": confident}
    floor = [k for k in keys if k in (repeats or {})]
    unstable = [k for k in floor if (repeats or {})[k].sequence != baseline[k].sequence]
    verdict: Verdict
    if unstable:
        # the baseline disagrees with itself: exactness cannot be asked of the candidate, the
        # confident departures beyond that floor are judged instead (evals/field.py)
        details.update(baseline_self_agreement=(len(floor) - len(unstable)) / len(floor))
        rule = (f"reported: the baseline's own second pass differs on {len(unstable)} of {len(floor)} prompts (a "
                f"server that is not deterministic); judged by confident_divergence")
        return Comparison("lossless_exact_match", rate, lo, hi, em.n, "ok" if em.n >= t.min_n else "inconclusive",
                          rule, baseline_value=1.0, candidate_value=rate, details=details, gated=False)
    ties = (f"; {len(near)} more diverge at a near-tie (log-prob gap ≤ {tau:g}: batch-variant numerics, "
            f"reported, not counted)" if near else "")
    if em.n < t.min_n:
        verdict, rule = "inconclusive", f"n={em.n} < min_n={t.min_n}: {TOO_FEW}"
    elif t.critical is not None and hi <= t.critical:
        verdict = "critical"
        rule = (f"{confident} of {em.n} outputs diverge confidently; Wilson high {hi:.4g} ≤ critical "
                f"{t.critical:g}{ties}")
    elif rate < t.warn:
        verdict = "warn"
        rule = f"{confident} of {em.n} outputs diverge confidently from the baseline's; lossless should be exact{ties}"
    else:
        verdict, rule = "ok", f"{em.matches} of {em.n} outputs identical to the baseline's{ties}"
    return Comparison("lossless_exact_match", rate, lo, hi, em.n, verdict, rule,
                      baseline_value=1.0, candidate_value=rate, details=details)
