"""evals/distribution.py: llama.cpp's --kl-divergence figures and the KL bounds from top-k,
worked by hand on a 3-token vocabulary, and the bounds checked against exact KL on random ones."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from evals.distribution import (
    doc_distribution_topk,
    kl_bounds_from_baseline_topk,
    kl_lower_bound_from_both_topk,
    summarize,
    token_stats,
)

P = np.log([[0.5, 0.3, 0.2]])
Q = np.log([[0.35, 0.45, 0.2]])


def test_one_token_by_hand():
    """KLD = 0.5 ln(0.5/0.35) + 0.3 ln(0.3/0.45) + 0.2 ln 1 = 0.178337 − 0.121640 = 0.056698;
    the right token (1): Δp = 0.45 − 0.3 = 0.15, ln ratio = ln 0.3 − ln 0.45 = −0.405465; the
    argmaxes differ (0 and 1)."""
    s = token_stats(P, Q, [1])
    assert s.kld[0] == pytest.approx(0.056698, abs=1e-6)
    assert s.dp[0] == pytest.approx(0.15) and s.ln_ratio[0] == pytest.approx(-0.405465, abs=1e-6)
    assert not s.same[0]
    with pytest.raises(ValueError, match="for 2 targets"):
        token_stats(P, Q, [1, 2])


def test_bounds_from_the_baseline_s_top_1_by_hand():
    """S = {0}: known part 0.5 ln(0.5/0.35) = 0.178337; tail mass 0.5, each token at most 0.5.
    lower = 0.178337 + 0.5 ln(0.5 / (0.45 + 0.2)) = 0.047155; upper puts the whole 0.5 on the
    smallest q (0.2): 0.178337 + 0.5 ln(0.5/0.2) = 0.636482. Exact 0.056698 lies between."""
    lower, upper = kl_bounds_from_baseline_topk(np.array([[0]]), np.log([[0.5]]), Q)
    assert lower[0] == pytest.approx(0.047155, abs=1e-6) and upper[0] == pytest.approx(0.636482, abs=1e-6)
    both = kl_bounds_from_baseline_topk(np.array([[0, 1, 2]]), P, Q)  # the whole vocabulary: exact
    assert both[0][0] == pytest.approx(0.056698, abs=1e-6) == both[1][0]


def test_lower_bound_from_both_top_k_by_hand():
    """Top-1 each, no token in both: one cell holding everything, KL 0. Top-2 each: tokens 0 and 1
    in both, the rest (0.2 vs 0.2) one cell: 0.056698, the exact value (the rest is one token)."""
    assert kl_lower_bound_from_both_topk([[0]], np.log([[0.5]]), [[1]], np.log([[0.45]]))[0] == pytest.approx(0.0)
    got = kl_lower_bound_from_both_topk([[0, 1]], np.log([[0.5, 0.3]]), [[1, 0]], np.log([[0.45, 0.35]]))
    assert got[0] == pytest.approx(0.056698, abs=1e-6)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_the_bounds_bracket_exact_kl_on_random_distributions(k):
    """600 random pairs over 64 tokens, peaked and flat (Dirichlet α 0.05 to 1), the candidate a
    perturbation of the baseline or unrelated: every bound holds (to float rounding)."""
    rng = np.random.default_rng(k)
    rows = []
    for alpha in (0.05, 0.3, 1.0):
        p = rng.dirichlet([alpha] * 64, size=100)
        near = p * np.exp(rng.normal(0, 0.3, p.shape))
        rows += [(p, near / near.sum(-1, keepdims=True)), (p, rng.dirichlet([alpha] * 64, size=100))]
    for p, q in rows:
        p_log, q_log = np.log(np.maximum(p, 1e-300)), np.log(np.maximum(q, 1e-300))
        exact = token_stats(p_log, q_log, [0] * len(p)).kld
        p_ids, q_ids = np.argsort(-p, -1)[:, :k], np.argsort(-q, -1)[:, :k]
        p_top, q_top = np.take_along_axis(p_log, p_ids, -1), np.take_along_axis(q_log, q_ids, -1)
        lower, upper = kl_bounds_from_baseline_topk(p_ids, p_top, q_log)
        assert (lower <= exact + 1e-9).all() and (exact <= upper + 1e-9).all()
        assert (kl_lower_bound_from_both_topk(p_ids, p_top, q_ids, q_top) <= exact + 1e-9).all()


def test_summary_of_two_tokens_by_hand():
    """KLD 0.1 and 0.3: mean 0.2 ± 0.1 (σ 0.1414 / √2); Δp +0.1 and −0.1: mean 0, RMS 0.1; one
    same top of two: 0.5 with Wilson [0.095, 0.905]; ln ratios 0.2 and 0: ln(PPL_q/PPL_p) 0.1."""
    from evals.distribution import TokenStats

    s = TokenStats(np.array([0.1, 0.3]), np.array([0.1, -0.1]), np.array([True, False]), np.array([0.2, 0.0]))
    got = summarize([s])
    assert got["tokens"] == 2 and got["kld_mean"] == pytest.approx(0.2) and got["kld_err"] == pytest.approx(0.1)
    assert got["kld_percentiles"]["max"] == pytest.approx(0.3) and got["kld_percentiles"]["p50"] == pytest.approx(0.2)
    assert got["dp_mean"] == pytest.approx(0.0) and got["dp_rms"] == pytest.approx(0.1)
    # Δp's quartiles too, as llama-perplexity prints them: −0.1 + 0.75 × 0.2 and −0.1 + 0.25 × 0.2
    assert got["dp_percentiles"]["p75"] == pytest.approx(0.05) and got["dp_percentiles"]["p25"] == pytest.approx(-0.05)
    assert "p75" not in got["kld_percentiles"]
    assert got["same_top"] == 0.5 and got["same_top_ci"] == pytest.approx([0.0945, 0.9055], abs=1e-4)
    assert got["ln_ppl_ratio"] == pytest.approx(0.1) and math.isfinite(got["ln_ppl_ratio_err"])


def test_a_server_s_top_k_on_both_sides_by_hand():
    """What a server gives (each side's top-2, and each side's log-prob of the right token 1):
    tokens 0 and 1 in both lists, the rest (0.2 against 0.2) one cell, so the lower bound is the
    exact 0.056698 here; Δp 0.15, ln ratio −0.405465 and "same top" (0 against 1: no) are exact;
    no upper bound. kld_mean over such documents says its figure is a lower bound."""
    from evals.distribution import kld_comparison
    from evals.records import DocDistribution

    d = doc_distribution_topk(([[0, 1]], np.log([[0.5, 0.3]])), ([[1, 0]], np.log([[0.45, 0.35]])),
                              [math.log(0.3)], [math.log(0.45)])
    assert d.kld[0] == pytest.approx(0.056698, abs=1e-6) == d.kl_lower[0] and d.kl_upper == (math.inf,)
    assert d.dp[0] == pytest.approx(0.15) and d.ln_ratio[0] == pytest.approx(-0.405465, abs=1e-6)
    assert d.same == (0,) and d.k == 2 and not d.exact
    back = DocDistribution.from_json(d.to_json())  # through the database's JSON: 6 significant digits
    assert not back.exact and back.kl_upper == (math.inf,) and back.kld == pytest.approx(d.kld, rel=1e-5)
    c = kld_comparison([("a", d)] * 2, min_n=1)
    assert c.estimate == pytest.approx(0.056698, abs=1e-6) and c.details["kld_bound"] == "lower"
    assert "topk_bounds" not in c.details  # no whole distribution to check the bounds against
    with pytest.raises(ValueError, match="top-k rows 1 and 1 for 2 and 1 targets"):
        doc_distribution_topk(([[0, 1]], np.log([[0.5, 0.3]])), ([[1, 0]], np.log([[0.45, 0.35]])),
                              [0.0, 0.0], [0.0])


def test_stored_top_k_tables_give_the_same_figures_at_aggregation_by_hand():
    """The example above as two stored tables (evals/records.py DocTopK: float32, base64 in the row's
    JSON), each config-run's own, compared at aggregation: the same figures to float32's precision,
    the KLD in its position bucket, and nothing where the two tokenized the document differently."""
    from evals.distribution import doc_distribution_stored
    from evals.records import DocRecord, DocTopK, read_row, tokens_digest

    digest = tokens_digest([7])
    base = DocTopK(2, (0, 1), (math.log(0.5), math.log(0.3)), (math.log(0.3),), (64, 64), digest)
    mine = DocTopK(2, (1, 0), (math.log(0.45), math.log(0.35)), (math.log(0.45),), (64, 64), digest)
    row = DocRecord("doc", 1.2, 1, 1, 4, topk=base).to_row()
    assert isinstance(row["extra"]["topk"]["logprobs"], str)  # packed, not a list of numbers
    back = read_row(row["metric"], row["sample_key"], row["value"], row["extra"]).topk
    assert back.ids == (0, 1) and back.window == (64, 64) and back.tokens == digest
    assert back.logprobs == pytest.approx(base.logprobs, abs=1e-7)  # float32
    d = doc_distribution_stored(back, mine)
    assert d.kld[0] == pytest.approx(0.056698, abs=1e-6) and not d.exact
    assert d.dp[0] == pytest.approx(0.15, abs=1e-6) and d.same == (0,)
    assert d.positions == ((0, 64, pytest.approx(0.056698, abs=1e-6), 1),)
    assert doc_distribution_stored(base, replace(mine, tokens=tokens_digest([8]))) is None


def test_kld_mean_over_documents_and_the_stored_record():
    """Two documents: KLD 0.1, 0.3 and 0.2 → Σ 0.6 over 3 tokens = 0.2 (token-weighted, not the mean
    of the documents' means, 0.2 too here; 0.1 and 0.5 below would differ). The bounds hold on
    every token. The record keeps 6 significant digits through the database's JSON."""
    from evals.distribution import kld_comparison
    from evals.records import DocDistribution, DocRecord

    a = DocDistribution((0.1, 0.3), (0.1, -0.1), (1, 0), (0.2, 0.0), (0.05, 0.2), (0.2, 0.4), 20)
    b = DocDistribution((0.2,), (0.0,), (1,), (0.1,), (0.1,), (0.3,), 20)
    c = kld_comparison([("a", a), ("b", b)], min_n=2)
    assert c.metric == "kld_mean" and c.n == 2 and c.estimate == pytest.approx(0.2) and c.verdict == "ok"
    assert not c.gated  # reported: no say in a verdict, and the overview shows it as not judged
    assert c.details["same_top"] == pytest.approx(2 / 3) and c.details["tokens"] == 3
    assert c.details["topk_bounds"] == pytest.approx({"k": 20, "bracketed": 1.0, "lower_mean": 0.35 / 3,
                                                      "upper_mean": 0.3, "width_mean": 0.3 - 0.35 / 3,
                                                      "unbounded_tokens": 0})
    chunks = kld_comparison([("a", a), ("b", b)], min_n=2, clusters=["src", "src"])  # two chunks of one source
    assert chunks.n == 1 and chunks.verdict == "inconclusive" and chunks.estimate == pytest.approx(0.2)
    skewed = kld_comparison([("a", replace(a, kld=(0.1, 0.5))), ("b", b)], min_n=2)
    assert skewed.estimate == pytest.approx(0.8 / 3)  # not (0.3 + 0.2) / 2
    broken = kld_comparison([("a", replace(a, kl_upper=(0.2, 0.1))), ("b", b)], min_n=2)
    assert broken.details["topk_bounds"]["bracketed"] == pytest.approx(2 / 3)  # a bound that fails shows
    d = DocRecord("a", 3.0, 2, 1, 9, distribution=replace(a, kld=(1 / 3, 0.3)))
    row = d.to_row()
    back = DocRecord.from_row("a", row["value"], row["extra"])
    assert back.distribution is not None and back.distribution.kld == (0.333333, 0.3)
    assert DocRecord.from_row("a", 3.0, {**row["extra"], "distribution": None}).distribution is None


@pytest.mark.integration
def test_the_tiny_model_s_distributions_and_their_bounds():
    """The reference engine's rows are the distributions its rolling log-probs were read from; a
    config against itself has KLD 0 and the same top everywhere; RTN int4 weights against fp32
    have KLD > 0, and the top-20 bounds bracket every token's exact KLD."""
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from engines.zoo import resolve_model_path
    from evals.distribution import doc_distribution

    target = str(resolve_model_path("builtin:pydoc-target"))
    text = "Serialize obj to a JSON formatted str using this conversion table, as json.dumps does."
    docs = [RollingRequest(f"d{i}", f"{i} " + " ".join([text] * (2 + i)), WindowSpec(64, 48)) for i in range(3)]

    def engine(weights: str) -> ReferenceEngine:
        return ReferenceEngine(target, OptimizationSpec(engine="reference", weights=weights,
                                                        engine_options={"device": "cpu"}))

    base, int4 = engine("fp32").next_token_logprobs(docs), engine("rtn-int4").next_token_logprobs(docs)
    for (r, p), (c, q) in zip(base, int4, strict=True):
        assert p.shape == (len(r.token_ids), 4096) and c.token_ids == r.token_ids
        assert p[np.arange(len(r.token_ids)), r.token_ids] == pytest.approx(r.logprobs, abs=1e-5)
        same = doc_distribution(p, p, r.token_ids)
        assert max(same.kld) < 1e-9 and all(same.same) and max(same.dp) == 0
        d = doc_distribution(p, q, r.token_ids)
        kld, lower, upper = map(np.asarray, (d.kld, d.kl_lower, d.kl_upper))
        assert kld.mean() > 1e-4 and (lower <= kld + 1e-9).all() and (kld <= upper + 1e-9).all()


@pytest.mark.integration
def test_on_the_demo_s_configs_every_bound_brackets_the_whole_vocabulary_kl():
    """Each lossy config of the demo (its outlier model) against its fp32 baseline on two
    documents: the baseline's top-20 bounds and the lower bound from both sides' top-20 (what a
    server gives) hold on every token, against KL over the whole 4096-token vocabulary."""
    from app.cli import DEMO_CONFIG
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from engines.zoo import BUILTIN_CORPORA, resolve_model_path
    from evals.distribution import TOP_K, doc_distribution, topk_rows
    from vocabulary.labelled import json_lines

    target = str(resolve_model_path(DEMO_CONFIG["model"]["path"]))
    with open(BUILTIN_CORPORA["pydoc-heldout"], encoding="utf-8") as f:
        texts = [d["text"] for _, (_, d) in zip(range(2), json_lines(f, "corpus"), strict=False)]
    docs = [RollingRequest(f"d{i}", t, WindowSpec(128, 128)) for i, t in enumerate(texts)]

    def rows(**spec):
        return ReferenceEngine(target, OptimizationSpec(engine="reference", **{"weights": "fp32", **spec},
                                                        engine_options={"device": "cpu"})).next_token_logprobs(docs)

    base = rows()
    widths = []
    for config in DEMO_CONFIG["configs"]:
        spec = {k: config[k] for k in ("weights", "kv_cache") if k in config}
        if not spec or config.get("weights") == "awq-int4":  # lossless here; AWQ's search is tests/unit/test_awq.py's
            continue
        for (r, p), (c, q) in zip(base, rows(**spec), strict=True):
            assert c.token_ids == r.token_ids
            d = doc_distribution(p, q, r.token_ids)
            kld, lower, upper = map(np.asarray, (d.kld, d.kl_lower, d.kl_upper))
            assert (lower <= kld + 1e-9).all() and (kld <= upper + 1e-9).all(), config["name"]
            both = doc_distribution_topk(topk_rows(p, TOP_K), topk_rows(q, TOP_K), r.logprobs, c.logprobs)
            assert (np.asarray(both.kld) <= kld + 1e-9).all(), config["name"]
            # Δp from the rolling pass's log-probs against the distributions' rows: both float32 log-probs,
            # which at |log p| ≈ 10 carry ~1e-6 of rounding (one run read 1.008e-6 on one token)
            assert both.dp == pytest.approx(d.dp, abs=1e-5) and both.same == d.same
            widths.append((config["name"], float(kld.mean()), float(lower.mean()), float(upper.mean()),
                           float(np.mean(both.kld))))
    for name, kld, lower, upper, both in widths:  # shown with -s: the figures the note quotes
        print(f"{name:<11} KL {kld:.5f}  baseline top-20 [{lower:.5f}, {upper:.5f}]  both top-20 ≥ {both:.5f}")
    assert len(widths) >= 10


def test_float32_rows_and_underflow_keep_every_figure_finite_and_every_bound_a_bound():
    """A float32 log-softmax whose top token reads exactly 0.0 (logits 25, 7, 0, …): 1 − Σ q of the
    candidate's top-k cancels to 0, which must not blow the lower bound up past the exact KL. A
    probability that underflowed to 0 (log −inf) gives no NaN; a k-th baseline log-prob that
    underflowed gives an infinite upper bound, stored as null and read back as infinity."""
    import torch
    from evals.records import DocDistribution

    p = np.log(np.array([[0.99, 0.009] + [0.001 / 8] * 8]))
    q = torch.log_softmax(torch.tensor([[25.0, 7.0] + [0.0] * 8]), -1).numpy()  # float32
    assert q[0, 0] == 0.0
    exact = token_stats(p, q, [0]).kld
    ids = np.array([[0, 1]])
    lower = kl_lower_bound_from_both_topk(ids, p[:, :2], ids, q[:, :2])
    assert np.isfinite(exact).all() and lower[0] <= exact[0] + 1e-9
    gone = np.array([[0.0, -np.inf, -np.inf]])  # all mass on token 0, on both sides
    s = token_stats(gone, gone, [0])
    assert s.kld[0] == 0.0 and s.dp[0] == 0.0 and s.same[0]
    lo, hi = kl_bounds_from_baseline_topk(np.array([[0, 1]]), np.array([[-1e-3, -800.0]]), np.log([[0.5, 0.3, 0.2]]))
    assert np.isfinite(lo[0]) and hi[0] == math.inf
    d = DocDistribution((0.1,), (0.0,), (1,), (0.0,), (0.05,), (math.inf,), 2)
    assert d.to_json()["kl_upper"] == [None] and DocDistribution.from_json(d.to_json()).kl_upper == (math.inf,)


@pytest.mark.integration
def test_the_transformers_engine_gives_the_same_distributions_as_the_reference_engine():
    """engine: transformers (the default engine) reads whole next-token distributions too, so a run
    whose baseline runs on it compares distributions: the same rows as the reference engine's, on
    the same model and windows, to float32 rounding."""
    from engines.hf import TransformersEngine
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from engines.zoo import resolve_model_path
    from evals.distribution import doc_distribution

    target = str(resolve_model_path("builtin:pydoc-target"))
    docs = [RollingRequest("d", "Serialize obj to a JSON formatted str using this conversion table. " * 3,
                           WindowSpec(32, 24))]
    [(h, p)] = TransformersEngine(target, OptimizationSpec(engine="transformers", weights="fp32")).next_token_logprobs(docs)
    [(r, q)] = ReferenceEngine(target, OptimizationSpec(engine="reference", weights="fp32")).next_token_logprobs(docs)
    assert h.token_ids == r.token_ids and p.shape == q.shape == (len(r.token_ids), 4096)
    assert np.abs(p - q).max() < 1e-4
    assert p[np.arange(len(h.token_ids)), h.token_ids] == pytest.approx(h.logprobs, abs=1e-6)
    assert max(doc_distribution(p, q, r.token_ids).kld) < 1e-6


def test_kld_by_position_by_hand():
    """A 256-token window, its buckets cut at 128 (evals/positions.py). Document a: 130 tokens, KLD 0.01 on each of its
    first 128 (positions 0–127) and 0.5 on the last 2 (128, 129); document b: 128 tokens at 0.03.
    Bucket 0–127: (1.28 + 3.84) ÷ 256 = 0.02; bucket 128–255: 1.0 ÷ 2 = 0.5, from a alone. The
    stored positions survive a round trip through JSON."""
    from engines.protocol import WindowSpec
    from evals.distribution import kld_comparison
    from evals.positions import position_totals
    from evals.records import DocDistribution

    window = WindowSpec(256, 256)

    def doc(klds):
        n = len(klds)
        d = DocDistribution(tuple(klds), (0.0,) * n, (1,) * n, (0.0,) * n, tuple(klds), tuple(klds), 20)
        return DocDistribution.from_json(replace(d, positions=position_totals(d.kld, window)).to_json())

    a, b = doc([0.01] * 128 + [0.5, 0.5]), doc([0.03] * 128)
    assert a.positions == ((0, 128, pytest.approx(1.28), 128), (128, 256, pytest.approx(1.0), 2))
    got = kld_comparison([("a", a), ("b", b)]).details["by_position"]
    assert [(g["positions"], g["tokens"], g["n"]) for g in got] == [("0–127", 256, 2), ("128–255", 2, 1)]
    assert got[0]["estimate"] == pytest.approx(0.02) and got[1]["estimate"] == pytest.approx(0.5)
    assert got[0]["ci_low"] <= 0.02 <= got[0]["ci_high"]
    # one bucket only (every document shorter than 128 tokens): no table, it is the whole figure again
    assert "by_position" not in kld_comparison([("b", doc([0.03] * 100))]).details


def test_a_process_computes_a_baseline_s_distributions_once_for_all_its_candidates(monkeypatch):
    """compared_with_baseline keeps the baseline engine's rows per request: a second candidate in
    the same process asks the baseline nothing and compares with the same rows; another request,
    or another baseline engine, is computed; past KEPT_BYTES the oldest rows go."""
    from engines.protocol import RollingRequest, RollingResult, WindowSpec
    from workers.producers import distributions

    class Engine:  # an in-process engine's next_token_logprobs, counted
        def __init__(self, shift: float):
            self.shift, self.asked = shift, []

        def next_token_logprobs(self, requests):
            self.asked += [r.doc_id for r in requests]
            rows = np.log(np.full((3, 4), 0.25)) - self.shift
            return [(RollingResult(r.doc_id, (1, 2, 3), (-1.0, -1.0, -1.0), (0, 0, 0), 3, 1, ()), rows)
                    for r in requests]

    a, b = (RollingRequest(d, "x y", WindowSpec(8, 8)) for d in ("a", "b"))
    baseline, other, candidate = Engine(0), Engine(1), Engine(0)
    first = distributions.compared_with_baseline(candidate, baseline, [a])
    assert distributions.compared_with_baseline(candidate, baseline, [a]) == first
    assert baseline.asked == ["a"] and candidate.asked == ["a", "a"]
    distributions.compared_with_baseline(candidate, baseline, [b])
    distributions.compared_with_baseline(candidate, other, [a])
    assert baseline.asked == ["a", "b"] and other.asked == ["a"]
    monkeypatch.setattr(distributions, "KEPT_BYTES", 3 * 4 * 8)  # one [3, 4] float64 array
    c = RollingRequest("c", "x y", WindowSpec(8, 8))
    distributions.compared_with_baseline(candidate, baseline, [c])  # kept, and a and b go
    distributions.compared_with_baseline(candidate, baseline, [c, a])
    assert baseline.asked == ["a", "b", "c", "a"]
