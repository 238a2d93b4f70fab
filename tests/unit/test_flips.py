"""Task accuracy with flips, paired (evals/flips.py), worked by hand."""

import pytest
from evals.flips import mcnemar_exact_p, paired_accuracy, unpaired_z_p


def test_mcnemar_exact_by_hand():
    assert mcnemar_exact_p(0, 0) == 1.0  # nothing flipped: no evidence
    assert mcnemar_exact_p(3, 0) == pytest.approx(2 / 8)  # 2 · P(X ≤ 0), X ~ Bin(3, ½)
    assert mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact_p(4, 1) == pytest.approx(2 * (1 + 5) / 32)  # 2 · (C(5,0) + C(5,1)) / 2⁵ = 0.375
    assert mcnemar_exact_p(5, 5) == 1.0  # capped at 1
    with pytest.raises(ValueError, match="flip counts must be ≥ 0"):
        mcnemar_exact_p(-1, 2)


def test_mcnemar_equals_scipys_exact_binomial_test():
    from scipy.stats import binomtest

    for b, c in ((30, 12), (7, 3), (100, 80), (1, 9)):
        assert mcnemar_exact_p(b, c) == pytest.approx(binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-9)


def test_a_table_like_lm_eval_pr_3868s_paired_beats_unpaired():
    """lm-eval PR #3868: on n = 220 items the unpaired z-test gives p = 0.080, McNemar p = 0.008.
    The PR does not publish its items; this table (both right 110, right→wrong 30, wrong→right 12,
    both wrong 68) gives both p-values to three decimals."""
    base = [True] * 110 + [True] * 30 + [False] * 12 + [False] * 68
    cand = [True] * 110 + [False] * 30 + [True] * 12 + [False] * 68
    r = paired_accuracy(base, cand)
    assert (r.n, r.baseline_correct, r.candidate_correct, r.right_to_wrong, r.wrong_to_right) == (220, 140, 122, 30, 12)
    assert round(r.unpaired_z_p, 3) == 0.080 and round(r.mcnemar_p, 3) == 0.008
    assert r.recovery == pytest.approx(122 / 140) and r.flips == 42


def test_equal_accuracy_with_many_flips():
    # 5 % of 200 items flip each way: accuracy unchanged, recovery 1, the flips counted apart
    base = [True] * 100 + [True] * 10 + [False] * 10 + [False] * 80
    cand = [True] * 100 + [False] * 10 + [True] * 10 + [False] * 80
    r = paired_accuracy(base, cand)
    assert r.baseline_accuracy == r.candidate_accuracy == 0.55 and r.recovery == 1.0
    assert (r.right_to_wrong, r.wrong_to_right) == (10, 10) and r.mcnemar_p == 1.0
    assert r.baseline_ci == r.candidate_ci and r.baseline_ci[0] < 0.55 < r.baseline_ci[1]


def test_unpaired_z_by_hand_and_bad_input():
    # acc 0.5 vs 0.5: z 0, p 1; se 0 on both sides with equal accuracy: p 1
    assert unpaired_z_p(0.5, 0.5, 11, 11) == pytest.approx(1.0)
    assert unpaired_z_p(1.0, 1.0, 5, 5) == 1.0
    # 0.6 vs 0.4 on 11 each: se = √(2 · 0.24 / 10) = 0.21909; z = 0.91287; p = 0.36131
    assert unpaired_z_p(0.6, 0.4, 11, 11) == pytest.approx(0.36131, abs=1e-5)
    with pytest.raises(ValueError, match="equally long, non-empty"):
        paired_accuracy([True], [True, False])
