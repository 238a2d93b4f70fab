"""early_stops: an answer that ends of its own accord (finish_reason stop) with under half the
tokens of the baseline's answer to the same prompt, judged beyond the baseline's own second
pass. Every figure below is worked out by hand."""

import pytest
from evals.field import early_stop_share, stopped_early
from evals.records import GenerationRecord
from evals.stats import Thresholds


def seed_thresholds(metric: str) -> Thresholds:
    return Thresholds.seed(metric)


def answer(key: str, n: int, finish: str | None = "stop", text: str | None = None) -> GenerationRecord:
    return GenerationRecord(key, 1.0, "prompt", text if text is not None else " ".join(["tok"] * n), n, 4,
                            finish_reason=finish)


def test_what_counts_as_stopping_early():
    base = answer("p", 24, "length")
    assert stopped_early(answer("p", 3), base)  # 3 < 0.5 × 24, ended of its own accord
    assert not stopped_early(answer("p", 12), base)  # exactly half is not under half
    assert stopped_early(answer("p", 11), base)
    assert not stopped_early(answer("p", 3, "length"), base)  # cut by max_tokens: max_tokens_hits' business
    assert not stopped_early(answer("p", 0, text=""), base)  # empty: empty_answers' business
    assert not stopped_early(answer("p", 2), answer("p", 7))  # a baseline answer under 8 tokens says nothing


def test_a_quarter_stopping_after_three_tokens_is_flagged_without_a_floor():
    # 16 prompts, the baseline runs to 24 tokens; the candidate stops after 3 on 4 of them:
    # 4/16 − 0 (no second pass) = 0.25; its bootstrap CI's low end (1/16 = 0.0625) clears warn (0.02)
    # but not critical (0.10): warn, as the rule says
    base = {f"p{i}": answer(f"p{i}", 24, "length") for i in range(16)}
    cand = {k: answer(k, 3 if i < 4 else 24, "stop" if i < 4 else "length") for i, k in enumerate(base)}
    c = early_stop_share(cand, base, {}, seed_thresholds("early_stops"))
    assert c.estimate == pytest.approx(0.25) and c.n == 16
    assert c.details["candidate"] == 4 and c.details["baseline_repeat"] is None and "0 assumed" in c.details["floor"]
    assert c.details["example"] == {"sample_key": "p0", "text": "tok tok tok", "tokens": 3, "baseline_tokens": 24}
    assert c.ci_low == pytest.approx(1 / 16) and c.verdict == "warn", c.rule


def test_the_baseline_second_pass_is_the_floor():
    # a server whose own second pass ends 3 of 16 answers early: a candidate that does the same is ok-ish
    # (3/16 − 3/16 = 0), one that does it on 7 more is not (10/16 − 3/16 = 0.4375)
    base = {f"p{i}": answer(f"p{i}", 20, "length") for i in range(16)}
    repeat = {k: answer(k, 5 if i < 3 else 20, "stop" if i < 3 else "length") for i, k in enumerate(base)}
    same = {k: answer(k, 5 if i in (5, 6, 7) else 20, "stop" if i in (5, 6, 7) else "length") for i, k in enumerate(base)}
    c = early_stop_share(same, base, repeat, seed_thresholds("early_stops"))
    assert c.estimate == pytest.approx(0.0) and c.details["baseline_repeat"] == 3 and c.verdict != "critical"
    worse = {k: answer(k, 5 if i < 10 else 20, "stop" if i < 10 else "length") for i, k in enumerate(base)}
    c = early_stop_share(worse, base, repeat, seed_thresholds("early_stops"))
    assert c.estimate == pytest.approx(10 / 16 - 3 / 16) and c.verdict == "critical"


def test_no_comparison_without_a_reason_for_the_ends_or_a_common_prompt():
    base = {"p": answer("p", 24)}
    assert early_stop_share({"p": answer("p", 3, None)}, base, {}, seed_thresholds("early_stops")) is None
    assert early_stop_share({"q": answer("q", 3)}, base, {}, seed_thresholds("early_stops")) is None
