"""gen_nll_ratio (evals.compare.gen_nll_ratio_comparison) on outputs scored by hand: the ratio of
the perplexities of both sides' outputs under the baseline model, paired by prompt."""

from __future__ import annotations

import math

import pytest
from evals.compare import gen_nll_ratio_comparison
from evals.records import GenerationRecord, read_row
from evals.stats import Thresholds

SEED = Thresholds.seed("gen_nll_ratio")  # warn 1.15, critical 1.30, min_n 10


def scored(values: list[tuple[float, int] | None]) -> dict[str, GenerationRecord]:
    return {f"p{i}": GenerationRecord(f"p{i}", 5.0, "prompt", "out", 3, 2,
                                      baseline_nll=None if v is None else v[0], baseline_nll_tokens=None if v is None else v[1])
            for i, v in enumerate(values)}


def test_garbled_outputs_twice_as_surprising_per_token():
    # candidate: 2.0 nats over 2 tokens (1.0 per token); baseline's own: 1.0 over 2 (0.5): exp(0.5) = 1.6487
    c = gen_nll_ratio_comparison(scored([(2.0, 2)] * 10), scored([(1.0, 2)] * 10), SEED)
    assert c.estimate == pytest.approx(math.exp(0.5)) and c.ci_low == pytest.approx(math.exp(0.5))  # no spread
    assert c.verdict == "critical" and c.n == 10
    assert (c.candidate_value, c.baseline_value) == (pytest.approx(math.e), pytest.approx(math.exp(0.5)))


def test_lengths_differ_so_each_side_is_its_own_rate():
    # candidate Σ 6 nats / Σ 12 tokens = 0.5; baseline Σ 3 / Σ 6 = 0.5 → ratio 1 (though per prompt NLLs differ)
    cand = scored([(1.0, 2), (5.0, 10)] * 5)
    base = scored([(0.5, 1), (2.5, 5)] * 5)
    c = gen_nll_ratio_comparison(cand, base, SEED)
    assert c.estimate == pytest.approx(1.0) and c.verdict == "ok"


def test_unscored_outputs_are_left_out_and_none_at_all_is_said():
    c = gen_nll_ratio_comparison(scored([(2.0, 2)] * 9 + [None]), scored([(2.0, 2)] * 10), SEED)
    assert c.n == 9 and c.verdict == "inconclusive"  # 9 paired prompts < min_n 10
    none = gen_nll_ratio_comparison(scored([None] * 3), scored([(1.0, 2)] * 3), SEED)
    assert none.verdict == "inconclusive" and none.rule == "no output of both sides was scored by the baseline model"


def test_the_score_travels_with_the_generation_row():
    g = scored([(2.5, 4)])["p0"]
    row = g.to_row()
    assert (row["extra"]["baseline_nll"], row["extra"]["baseline_nll_tokens"]) == (2.5, 4)
    assert read_row("generation", "p0", row["value"], row["extra"]) == g
    assert "baseline_nll" not in scored([None])["p0"].to_row()["extra"]  # older rows read back as unscored


def test_paired_timing_ratio_is_the_geometric_mean_of_per_prompt_ratios():
    from evals.compare import paired_timing_ratio

    t = Thresholds.seed("ttft_ratio")  # warn 1.25, critical 1.5
    # ratios 2 and 0.5 alternate: geometric mean exactly 1 (an arithmetic mean would say 1.25)
    c = paired_timing_ratio("ttft_ratio", [(200.0, 100.0), (50.0, 100.0)] * 5, t)
    assert c.estimate == pytest.approx(1.0) and c.n == 10
    assert (c.baseline_value, c.candidate_value) == (100.0, 125.0)  # medians in ms
    # +80 ms on every prompt of a 100 ms baseline: ratio 1.8, no spread → critical
    slow = paired_timing_ratio("ttft_ratio", [(180.0, 100.0)] * 16, t)
    assert slow.estimate == pytest.approx(1.8) and slow.ci_low == pytest.approx(1.8) and slow.verdict == "critical"
    assert paired_timing_ratio("tpot_ratio", [(0.0, 5.0)], t).verdict == "inconclusive"  # no usable pair


def test_paired_timings_resample_whole_batches():
    """Requests in flight together share their server's moment: with two batches of four, one
    twice as slow on the candidate and one even, the CI spans both batches' ratios (resampling
    prompts alone would give a narrow CI around √2)."""
    import math

    from evals.compare import paired_timing_ratio
    from evals.stats import Thresholds

    pairs = [(200.0, 100.0)] * 4 + [(100.0, 100.0)] * 4
    c = paired_timing_ratio("ttft_ratio", pairs, Thresholds(1.25, 1.5, "above", 8), batches=[0] * 4 + [1] * 4)
    assert c.estimate == pytest.approx(math.sqrt(2))
    assert (c.ci_low, c.ci_high) == (1.0, 2.0)  # a resample holds batch 0 twice, both, or batch 1 twice
    assert c.verdict == "inconclusive"
    narrow = paired_timing_ratio("ttft_ratio", pairs, Thresholds(1.25, 1.5, "above", 8))
    assert narrow.ci_low > 1.05 and narrow.ci_high < 1.9  # narrower: prompts taken as independent
