"""Agreement, κ, power and the offline faithfulness approximation, from tiny inputs worked by
hand; the statistics that overlap with scipy are checked against scipy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
from evals.agreement import exact_match, first_divergence, kl_divergence, top1_agreement
from evals.stats import cohen_kappa, minimum_detectable_effect, paired_mean_difference, required_n, wilson_interval


def test_first_divergence_and_exact_match_by_hand():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix diverges where it ends
    em = exact_match([[1, 2, 3], [4, 5], [6], [7, 8]], [[1, 2, 3], [4, 0], [6], [0, 8]])
    assert (em.n, em.matches, em.rate, em.mean_first_divergence) == (4, 2, 0.5, 0.5)  # divergences at 1 and 0
    assert em.ci == wilson_interval(2, 4)


def test_top1_and_kl_by_hand():
    assert top1_agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    p = np.log([[0.5, 0.5], [0.9, 0.1]])
    q = np.log([[0.5, 0.5], [0.5, 0.5]])
    # row 0 identical → 0; row 1: 0.9·ln(0.9/0.5) + 0.1·ln(0.1/0.5) = 0.36806
    np.testing.assert_allclose(kl_divergence(p, q), [0.0, 0.9 * np.log(1.8) + 0.1 * np.log(0.2)], atol=1e-12)
    assert kl_divergence(p, q)[1] == pytest.approx(0.368064, abs=1e-6)


def test_cohen_kappa_by_hand_and_against_scipy_free_formula():
    # p_o = 3/4; rater a: half 1s, rater b: one 1 in four → p_e = .5·.25 + .5·.75 = .5 → κ = .5
    assert cohen_kappa([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx(0.5)
    assert cohen_kappa(["win", "tie", "loss"], ["win", "tie", "loss"]) == 1.0
    assert np.isnan(cohen_kappa([1, 1], [1, 1]))


def test_wilson_matches_scipy():
    for k, n in ((0, 10), (3, 10), (47, 100), (500, 500)):
        ci = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_power_matches_the_normal_formula_from_scipy():
    z = scipy.stats.norm.ppf
    # σ_Δ = 0.3, δ = 0.05: ((1.95996 + 0.84162)·0.3/0.05)² = 282.5 → 283
    assert required_n(0.3, 0.05) == int(np.ceil(((z(0.975) + z(0.8)) * 0.3 / 0.05) ** 2)) == 283
    assert minimum_detectable_effect(0.3, 283) == pytest.approx((z(0.975) + z(0.8)) * 0.3 / np.sqrt(283))
    assert minimum_detectable_effect(0.3, 283) <= 0.05


def test_paired_mean_difference_agrees_with_scipy_bootstrap():
    rng = np.random.default_rng(1)
    base = rng.normal(3.0, 1.0, 300)
    cand = base + rng.normal(-0.2, 0.5, 300)  # paired: the per-sample noise is shared
    est, lo, hi = paired_mean_difference(base, cand, n_resamples=4000)
    ref = scipy.stats.bootstrap((cand - base,), np.mean, method="percentile", n_resamples=4000, random_state=2).confidence_interval
    assert est == pytest.approx(float(np.mean(cand - base)))
    assert lo == pytest.approx(ref.low, abs=0.02) and hi == pytest.approx(ref.high, abs=0.02)
    with pytest.raises(ValueError, match="3 baseline values vs 2 candidate values"):
        paired_mean_difference([1, 2, 3], [1, 2])


def test_offline_faithfulness_is_labelled_and_separates_supported_from_unsupported():
    from evals.faithfulness import OFFLINE_METHOD, MissingContexts, OfflineFaithfulness

    f = OfflineFaithfulness()
    ctx = ["json.dumps serializes a Python object to a JSON formatted string. It accepts an indent argument."]
    r = f.score("s1", "json.dumps serializes a Python object to a JSON string. The weather in Paris is sunny today.", ctx)
    assert r.method == OFFLINE_METHOD and "offline-approximation" in r.method
    assert [ok for _, ok in r.statements] == [True, False] and r.score == 0.5
    assert f.score("s2", "", ctx).outcome == "no_statements"
    with pytest.raises(MissingContexts, match="sample 's3'"):
        f.score("s3", "text here", ["  "])
