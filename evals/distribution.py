"""llama.cpp-grade distribution statistics of a candidate's next-token distributions against the
baseline's (`llama-perplexity --kl-divergence`), and bounds on KL when only the baseline's top-k
log-probs are known.

Per scored token t of a document (p the baseline's distribution, q the candidate's, x_t the
document's next token):
- KLD_t = Σ_v p(v) (log p(v) − log q(v)), in nats;
- Δp_t = q(x_t) − p(x_t), the change in the probability of the right token;
- same_t = argmax p == argmax q ("same top p");
- ln_ratio_t = log p(x_t) − log q(x_t), whose mean is ln(PPL(q) / PPL(p)).

Bounds from the baseline's top-k (k tokens S with their p; the candidate's distribution whole, as
an in-process engine gives it). The tail outside S holds mass R = 1 − Σ_S p, each token at most
m = min_S p (they rank below S). The known part K = Σ_S p log(p/q) is exact; the tail term
Σ_{v∉S} p(v) log(p(v)/q(v)) is convex in the unknown p, so:
- lower: by the log-sum inequality it is at least R log(R / Q_R), Q_R = Σ_{v∉S} q(v);
- upper: its maximum over {0 ≤ p(v) ≤ m, Σ p(v) = R} lies at a vertex, the greedy one: ⌊R/m⌋
  tokens at m on the smallest q(v), the remainder on the next (the larger weights on the larger
  −log q, by rearrangement).
When the candidate is truncated to its top-k too (an HTTP server: vLLM returns at most 20), only
a lower bound exists: a token the baseline ranks high may hold any tiny probability under the
candidate outside its top-k, so KL has no finite upper bound. The lower bound there coarse-grains
the vocabulary into the tokens both top-k lists hold, one cell each, and the rest as one cell;
KL can only shrink under coarse-graining (the data-processing inequality).

Shapes: T scored tokens, V vocabulary, k top-k. numpy only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from evals.agreement import top1_agreement
from evals.records import DocDistribution, DocTopK
from evals.stats import wilson_interval

if TYPE_CHECKING:
    from vocabulary.comparison import Comparison

# the percentiles llama-perplexity prints for KLD, and for Δp, besides the maximum and minimum
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)
TOP_K = 20  # the most top log-probs vLLM returns (--max-logprobs 20): what a stored baseline would keep


@dataclass(frozen=True)
class TokenStats:
    """Per scored token, in the document's order."""

    kld: np.ndarray  # [T] nats
    dp: np.ndarray  # [T] q(x_t) − p(x_t)
    same: np.ndarray  # [T] bool
    ln_ratio: np.ndarray  # [T] log p(x_t) − log q(x_t)


def normalised(log_probs: np.ndarray) -> np.ndarray:
    """Log-probability rows in float64, each normalised again (a float32 log-softmax row sums to 1
    within about 1e-6, enough to turn a near-zero KL negative), with a probability that underflowed
    to 0 kept at e^-1000 so that no term is NaN or infinite."""
    x = np.maximum(np.asarray(log_probs, np.float64), -1000.0)
    top = x.max(-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))


def token_stats(p_log: np.ndarray, q_log: np.ndarray, targets: Sequence[int]) -> TokenStats:
    """p_log, q_log [T, V]: log-probabilities (log-softmax rows, float32 or float64); targets [T]."""
    p_log, q_log = normalised(p_log), normalised(q_log)
    if p_log.shape != q_log.shape or p_log.ndim != 2 or p_log.shape[0] != len(targets):
        raise ValueError(f"distributions {p_log.shape} and {q_log.shape} for {len(targets)} targets")
    rows, x = np.arange(len(targets)), np.asarray(targets)
    lp, lq = p_log[rows, x], q_log[rows, x]
    kld = np.maximum((np.exp(p_log) * (p_log - q_log)).sum(-1), 0.0)  # ≥ 0; below is float64 rounding
    return TokenStats(kld, np.exp(lq) - np.exp(lp), p_log.argmax(-1) == q_log.argmax(-1), lp - lq)


def kl_bounds_from_baseline_topk(top_ids: np.ndarray, top_logprobs: np.ndarray,
                                 q_log: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower [T], upper [T]) on KL(p ‖ q) from the baseline's top-k (ids and log-probs [T, k])
    and the candidate's whole distribution q_log [T, V] (module docstring)."""
    top_ids, top_lp = np.asarray(top_ids), np.asarray(top_logprobs, np.float64)
    q_log = np.asarray(q_log, np.float64)
    lower, upper = np.empty(len(q_log)), np.empty(len(q_log))
    for t in range(len(q_log)):
        p_top = np.exp(top_lp[t])
        known = float((p_top * (top_lp[t] - q_log[t, top_ids[t]])).sum())
        rest = np.ones(q_log.shape[1], bool)
        rest[top_ids[t]] = False
        q_rest = np.exp(q_log[t, rest])
        tail = max(0.0, 1.0 - float(p_top.sum()))
        if tail <= 1e-12 or not q_rest.size:
            lower[t] = upper[t] = known
            continue
        lower[t] = known + tail * math.log(tail / max(float(q_rest.sum()), 1e-300))
        cap = float(p_top.min())  # a tail token ranks below the k-th
        if cap <= 0.0 or tail > cap * q_rest.size:  # an underflowed k-th, or a tail its tokens cannot hold
            upper[t] = math.inf
            continue
        q_sorted = np.sort(q_rest)
        full = min(int(tail // cap), q_sorted.size)
        part = tail - full * cap
        top = float((cap * (math.log(cap) - np.log(np.maximum(q_sorted[:full], 1e-300)))).sum())
        if part > 1e-15 and full < q_sorted.size:
            top += part * (math.log(part) - math.log(max(float(q_sorted[full]), 1e-300)))
        upper[t] = known + top
    return lower, upper


def kl_lower_bound_from_both_topk(p_ids: np.ndarray, p_logprobs: np.ndarray, q_ids: np.ndarray,
                                  q_logprobs: np.ndarray) -> np.ndarray:
    """A lower bound [T] on KL(p ‖ q) when each side gives only its top-k ([T, k] ids and
    log-probs): the tokens in both lists a cell each, every other token one cell."""
    out = np.empty(len(p_ids))
    for t in range(len(p_ids)):
        q_of = dict(zip(np.asarray(q_ids[t]).tolist(), np.asarray(q_logprobs[t], np.float64).tolist(), strict=True))
        both = [(lp, q_of[i]) for i, lp in zip(np.asarray(p_ids[t]).tolist(),
                                               np.asarray(p_logprobs[t], np.float64).tolist(), strict=True)
                if i in q_of]
        value = sum(math.exp(lp) * (lp - lq) for lp, lq in both)
        rest_p = max(0.0, 1.0 - sum(math.exp(lp) for lp, _ in both))
        # 1 − Σ q cancels: a float32 top log-prob of exactly 0.0 leaves nothing, or less, for the rest. Any
        # rest mass at least `floor` keeps the bound a bound (a larger denominator only lowers the term)
        floor = 1e-6 * (len(q_of) + 1)
        rest_q = max(floor, 1.0 - sum(math.exp(lq) for _, lq in both))
        if rest_p > 1e-12:
            value += rest_p * math.log(rest_p / rest_q)
        out[t] = value
    return out


def doc_distribution(p_log: np.ndarray, q_log: np.ndarray, targets: Sequence[int], k: int = TOP_K) -> DocDistribution:
    """One document's figures: token_stats, and the KL bounds a baseline stored as its top-k would give."""
    s = token_stats(p_log, q_log, targets)
    lower, upper = kl_bounds_from_baseline_topk(*topk_rows(p_log, k), normalised(q_log))
    return DocDistribution(tuple(s.kld.tolist()), tuple(s.dp.tolist()), tuple(int(x) for x in s.same),
                           tuple(s.ln_ratio.tolist()), tuple(lower.tolist()), tuple(upper.tolist()), k)


def topk_rows(log_probs: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """A whole distribution [T, V] cut to what a server returns: its k most likely tokens per row,
    (ids [T, k], log-probs [T, k]), most likely first."""
    x = normalised(log_probs)
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1, -1)[:, :k] if k < x.shape[-1] else np.argsort(-x, -1, kind="stable")
    ids = np.take_along_axis(part, np.argsort(-np.take_along_axis(x, part, -1), -1, kind="stable"), -1)
    return ids, np.take_along_axis(x, ids, -1)


def doc_distribution_topk(p_top: tuple[np.ndarray, np.ndarray], q_top: tuple[np.ndarray, np.ndarray],
                          p_target: Sequence[float], q_target: Sequence[float]) -> DocDistribution:
    """One document's figures where a side gives only its top-k per position (an OpenAI-compatible
    server: echo with `logprobs: k`): p_top, q_top (ids [T, k], log-probs [T, k], most likely
    first) and each side's log-prob of the document's own next token [T].

    Δp, ln_ratio and "same top" are exact (each side's top-1 and its target's log-prob are
    known); KL has only the coarse-grained lower bound (kl_lower_bound_from_both_topk), stored as
    kld with exact False and no upper bound."""
    p_ids, p_lp = (np.asarray(a) for a in p_top)
    q_ids, q_lp = (np.asarray(a) for a in q_top)
    lp, lq = np.asarray(p_target, np.float64), np.asarray(q_target, np.float64)
    if not (len(p_ids) == len(q_ids) == len(lp) == len(lq)):
        raise ValueError(f"top-k rows {len(p_ids)} and {len(q_ids)} for {len(lp)} and {len(lq)} targets")
    lower = np.maximum(kl_lower_bound_from_both_topk(p_ids, p_lp, q_ids, q_lp), 0.0)
    same = p_ids[:, 0] == q_ids[:, 0]
    return DocDistribution(tuple(lower.tolist()), tuple((np.exp(lq) - np.exp(lp)).tolist()),
                           tuple(int(x) for x in same), tuple((lp - lq).tolist()), tuple(lower.tolist()),
                           (math.inf,) * len(lower), int(p_ids.shape[1]), exact=False)


def doc_distribution_stored(base: DocTopK, mine: DocTopK) -> DocDistribution | None:
    """A candidate's figures from two stored top-k tables (evals/records.py DocTopK): the
    baseline's, stored once by its own config-run, and the candidate's, as doc_distribution_topk
    reads them, with the KLD by position in the window; None where the two tokenized the document
    differently (nothing pairs)."""
    from engines.protocol import WindowSpec
    from evals.positions import position_totals

    if base.tokens != mine.tokens or base.window != mine.window or len(base.target) != len(mine.target):
        return None
    table = lambda t: (np.asarray(t.ids).reshape(-1, t.k), np.asarray(t.logprobs, np.float64).reshape(-1, t.k))  # noqa: E731
    d = doc_distribution_topk(table(base), table(mine), base.target, mine.target)
    return replace(d, positions=position_totals(d.kld, WindowSpec(*mine.window)))


def stats_of(d: DocDistribution) -> TokenStats:
    return TokenStats(np.asarray(d.kld), np.asarray(d.dp), np.asarray(d.same, bool), np.asarray(d.ln_ratio))


def _percentiles(values: np.ndarray, percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """Linear interpolation between the sorted values, as llama-perplexity's `percentile`."""
    found = {"max": float(values.max())}
    found.update({f"p{p:g}": float(np.percentile(values, p)) for p in percentiles})
    found["min"] = float(values.min())
    return found


def _mean_err(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error (llama-perplexity's ±)."""
    n = len(values)
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def summarize(stats: Sequence[TokenStats]) -> dict:
    """llama-perplexity --kl-divergence's figures over every scored token of the documents:
    mean KLD ± its error and percentiles; Δp mean, RMS and percentiles (in probability, 0.01 = 1
    point); same-top-p with a Wilson 95 % CI; mean ln(PPL(q)/PPL(p)) ± its error."""
    kld = np.concatenate([s.kld for s in stats])
    dp = np.concatenate([s.dp for s in stats])
    same = np.concatenate([s.same for s in stats])
    ln_ratio = np.concatenate([s.ln_ratio for s in stats])
    if not len(kld):
        raise ValueError("no scored tokens")
    n, hits = len(kld), int(same.sum())
    kld_mean, kld_err = _mean_err(kld)
    dp_mean, dp_err = _mean_err(dp)
    ln_mean, ln_err = _mean_err(ln_ratio)  # ln PPL(q) − ln PPL(p) = mean over tokens of log p(x) − log q(x)
    return {
        "tokens": n,
        "kld_mean": kld_mean, "kld_err": kld_err, "kld_percentiles": _percentiles(kld),
        "dp_mean": dp_mean, "dp_err": dp_err, "dp_rms": float(math.sqrt((dp ** 2).mean())),
        "dp_percentiles": _percentiles(dp, DP_PERCENTILES),
        "same_top": hits / n, "same_top_ci": list(wilson_interval(hits, n)),
        "ln_ppl_ratio": ln_mean, "ln_ppl_ratio_err": ln_err,
    }


def kld_comparison(docs: Sequence[tuple[str, DocDistribution]], seed: int = 0, min_n: int = 10,
                   clusters: Sequence[str] | None = None) -> Comparison:
    """kld_mean: Σ KLD ÷ Σ tokens over the documents (key, distribution) a candidate compared,
    with a bootstrap CI over their source documents (clusters; n and min_n count those);
    reported, no threshold (near the baseline KL stops ranking configs). details: `summarize`'s
    figures, and a self-check of the top-k bounds over the documents with whole distributions:
    the share of tokens they bracket (1.0 by construction: both come from the same rows) and
    their mean width. Where a side gave only its top-k (a server), its documents' KLD is the
    lower bound and details["kld_bound"] says "lower"."""
    from evals.compare import reported
    from evals.stats import paired_bootstrap_ci

    groups = list(clusters) if clusters is not None else [key for key, _ in docs]
    sums = np.array([sum(d.kld) for _, d in docs])
    toks = np.array([len(d.kld) for _, d in docs], dtype=np.float64)
    estimate = float(sums.sum() / toks.sum())
    lo, hi = paired_bootstrap_ci(lambda w: (w @ sums) / (w @ toks), len(docs), clusters=groups, seed=seed)
    details = summarize([stats_of(d) for _, d in docs])
    buckets = kld_by_position(docs, groups, seed)
    if len(buckets) > 1:  # one bucket is the whole figure again
        details["by_position"] = buckets
    exact = [d for _, d in docs if d.exact]
    if len(exact) < len(docs):  # a side gave only its top-k: the figure is a lower bound on KL
        details["kld_bound"] = "lower"
    if exact:
        kld = np.concatenate([d.kld for d in exact])
        lower = np.concatenate([d.kl_lower for d in exact])
        upper = np.concatenate([d.kl_upper for d in exact])
        slack = 1e-5 + 1e-4 * np.abs(kld)  # the stored figures' 6 significant digits
        finite = np.isfinite(upper)  # an infinite upper bound (an underflowed k-th log-prob) is counted apart
        details["topk_bounds"] = {
            "k": exact[0].k, "bracketed": float(((lower <= kld + slack) & (kld <= upper + slack)).mean()),
            "lower_mean": float(lower.mean()),
            "upper_mean": float(upper[finite].mean()) if finite.any() else None,
            "width_mean": float((upper - lower)[finite].mean()) if finite.any() else None,
            "unbounded_tokens": int((~finite).sum())}
    return reported("kld_mean", estimate, lo, hi, len(set(groups)), min_n=min_n, gated=False, details=details)


def _mean_of_sums(sums: np.ndarray, toks: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Σ values ÷ Σ tokens under bootstrap weights w [B, n]."""
    return lambda w: (w @ sums) / (w @ toks)


def kld_by_position(docs: Sequence[tuple[str, DocDistribution]], clusters: Sequence[str], seed: int = 0
                    ) -> list[dict]:
    """Mean KLD within each position bucket of the windows (evals/positions.py; DocDistribution
    positions), Σ KLD ÷ Σ tokens over the documents with tokens there, each with its own bootstrap
    CI over source documents: a KV loss that starts deep in the context shows in the late buckets."""
    from evals.positions import bucket_label
    from evals.stats import paired_bootstrap_ci

    found: dict[tuple[int, int], list[tuple[float, int, str]]] = {}
    for (_, d), cluster in zip(docs, clusters, strict=True):
        for lo, hi, total, n in d.positions:
            if n:
                found.setdefault((lo, hi), []).append((total, n, cluster))
    out = []
    for (lo, hi), rows in sorted(found.items()):
        sums = np.array([t for t, _, _ in rows])
        toks = np.array([n for _, n, _ in rows], dtype=np.float64)
        lo_ci, hi_ci = paired_bootstrap_ci(_mean_of_sums(sums, toks), len(rows), clusters=[c for _, _, c in rows],
                                           seed=seed)
        out.append({"positions": bucket_label(lo, hi), "lo": lo, "hi": hi, "estimate": float(sums.sum() / toks.sum()),
                    "ci_low": lo_ci, "ci_high": hi_ci, "n": len(rows), "tokens": int(toks.sum())})
    return out


def top1_agreement_comparison(pairs: Sequence[tuple[Sequence[int], Sequence[int], str | None]], seed: int,
                              min_n: int = 10) -> Comparison | None:
    """Per-document share of positions whose argmax token matches the baseline's, averaged with a
    clustered bootstrap CI. pairs: (baseline greedy ids, candidate greedy ids, cluster)."""
    rates = [top1_agreement(b, c) for b, c, _ in pairs]
    if not rates:
        return None
    from evals.compare import reported
    from evals.stats import paired_bootstrap_ci

    x = np.asarray(rates)
    lo, hi = paired_bootstrap_ci(lambda w: (w @ x) / w.sum(1), len(x), clusters=[cl for _, _, cl in pairs], seed=seed)
    return reported("top1_agreement", float(x.mean()), lo, hi, len(x), min_n=min_n, baseline_value=1.0,
                    candidate_value=float(x.mean()))
