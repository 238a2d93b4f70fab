"""Quality by position (evals/positions.py, ppl_ratio's by_position details), worked by hand."""

import math
from dataclasses import replace

import pytest
from engines.protocol import WindowSpec
from evals.compare import gen_nll_ratio_by_position, ppl_ratio_by_position
from evals.health import Scored
from evals.positions import answer_totals, bucket_label, position_buckets, position_nll, token_positions
from evals.records import DocRecord, GenerationRecord
from evals.stats import Thresholds


def test_buckets_split_the_window_at_the_edges_it_reaches():
    assert position_buckets(WindowSpec(64, 64)) == [(0, 64)]
    assert position_buckets(WindowSpec(256, 256)) == [(0, 128), (128, 256)]
    assert position_buckets(WindowSpec(1024, 512)) == [(0, 128), (128, 512), (512, 1024)]


def test_a_token_s_position_is_its_predictor_s_slot_in_its_window():
    # 10 tokens, disjoint windows of 4: seq = [start] + 10; windows (0, 4, 4), (4, 8, 4), then the
    # short last one reaches back a whole window, (6, 10, 2): its 2 new targets from slots 2 and 3
    assert token_positions(10, WindowSpec(4, 4)) == [0, 1, 2, 3, 0, 1, 2, 3, 2, 3]
    # stride 2: (0, 4, 4), then each window scores 2 new targets from slots 2, 3; the last 1
    assert token_positions(7, WindowSpec(4, 2)) == [0, 1, 2, 3, 2, 3, 3]


def test_position_nll_sums_each_bucket():
    # one 130-token window: slots 0–127 log p −1 each, slots 128–129 −2 each
    logprobs = [-1.0] * 128 + [-2.0, -2.0]
    assert position_nll(logprobs, WindowSpec(130, 130)) == ((0, 128, 128.0, 128), (128, 130, 4.0, 2))


def doc(key, *buckets, cluster=None):
    nll = sum(b[2] for b in buckets)
    return DocRecord(key, nll, sum(b[3] for b in buckets), 1, 1, cluster=cluster, positions=tuple(buckets))


def test_ppl_ratio_by_position_by_hand():
    base = {"a": doc("a", (0, 128, 10.0, 10), (128, 256, 5.0, 5)), "b": doc("b", (0, 128, 20.0, 10)),
            "c": doc("c", (0, 128, 7.0, 7))}
    mine = {"a": doc("a", (0, 128, 11.0, 10), (128, 256, 8.0, 5)), "b": doc("b", (0, 128, 23.0, 10)),
            "c": doc("c", (0, 128, 9.0, 8))}  # c: another tokenization (8 tokens, not 7): left out
    t = Thresholds(1.02, 1.05, "above", min_n=1)
    rows = ppl_ratio_by_position(mine, base, t)
    assert [(r["positions"], r["n"], r["tokens"]) for r in rows] == [("0–127", 2, 20), ("128–255", 1, 5)]
    # 0–127: ΔNLL 1 + 3 over 20 tokens → e^0.2; 128–255: ΔNLL 3 over 5 tokens → e^0.6
    assert rows[0]["estimate"] == pytest.approx(math.exp(0.2)) and rows[1]["estimate"] == pytest.approx(math.exp(0.6))
    assert rows[1]["ci_low"] == pytest.approx(math.exp(0.6)) and rows[1]["verdict"] == "critical"  # one document


def test_records_keep_their_buckets_through_a_stored_row():
    d = doc("a", (0, 128, 10.5, 10), (128, 256, 5.25, 5), cluster="src")
    row = d.to_row()
    assert row["extra"]["positions"] == [[0, 128, 10.5, 10], [128, 256, 5.25, 5]]
    assert DocRecord.from_row(row["sample_key"], row["value"], row["extra"]) == d
    old = {k: v for k, v in row["extra"].items() if k != "positions"}  # stored before buckets were kept
    assert DocRecord.from_row("a", 15.75, old).positions == ()
    assert ppl_ratio_by_position({"a": DocRecord.from_row("a", 15.75, old)}, {"a": d}, Thresholds(1.02, 1.05, "above")) == []


def test_an_answer_s_tokens_are_bucketed_by_their_index_in_it():
    # 20 tokens: indexes 0–15 (−log p 1 each), then 16–19 (2 each); a 3-token answer reaches one bucket
    assert answer_totals([1.0] * 16 + [2.0] * 4) == ((0, 16, 16.0, 16), (16, 64, 8.0, 4))
    assert answer_totals([0.5] * 3) == ((0, 16, 1.5, 3),)
    assert answer_totals([]) == ()
    last = answer_totals([0.0] * 16385)[-1]
    assert last[:2] == (16384, 2**31) and last[3] == 1 and bucket_label(*last[:2]) == "16384+"


def answer(key: str, logprobs: list[float]) -> GenerationRecord:
    return GenerationRecord(key, 5.0, "prompt", "out", len(logprobs), 2, baseline_nll=-sum(logprobs),
                            baseline_nll_tokens=len(logprobs), scored=Scored(tuple(range(len(logprobs))), tuple(logprobs)))


def test_gen_nll_ratio_by_position_by_hand():
    # baseline answers: 20 tokens at log p −0.5 (0–15 and 16–19); candidate p0 the same length, clean for its
    # first 16 tokens then −1.5 each; candidate p1 stops after 10 tokens, so only 0–15 pairs for p1
    base = {"p0": answer("p0", [-0.5] * 20), "p1": answer("p1", [-0.5] * 20)}
    mine = {"p0": answer("p0", [-0.5] * 16 + [-1.5] * 4), "p1": answer("p1", [-0.5] * 10),
            "p2": answer("p2", [-9.0] * 3)}  # no baseline answer: left out
    rows = gen_nll_ratio_by_position(mine, base, Thresholds(1.15, 1.30, "above", min_n=1))
    assert [(r["positions"], r["n"], r["tokens"], r["baseline_tokens"]) for r in rows] == [
        ("0–15", 2, 26, 32), ("16–63", 1, 4, 4)]
    # 0–15: both sides 0.5 nats per token → ratio 1; 16–63: 6/4 − 2/4 = 1 nat per token → e
    assert rows[0]["estimate"] == pytest.approx(1.0) and rows[0]["verdict"] == "ok"
    assert rows[1]["estimate"] == pytest.approx(math.e) and rows[1]["ci_low"] == pytest.approx(math.e)
    assert rows[1]["verdict"] == "critical"
    # an answer not read token by token (an older row, an engine that could not score it) has no buckets
    unread = {"p0": GenerationRecord("p0", 5.0, "prompt", "out", 3, 2, baseline_nll=1.0, baseline_nll_tokens=3)}
    assert gen_nll_ratio_by_position(unread, base, Thresholds(1.15, 1.30, "above")) == []


def test_gen_nll_ratio_names_a_late_bucket_the_whole_ratio_averages_away():
    from evals.compare_targets import CompareContext, gen_nll_ratio
    from evals.records import ConfigRecords

    # 12 prompts; the candidate's answers lose 1 nat per token past index 15 (4 of 20 tokens):
    # whole ratio exp((16·0.5 + 4·1.5)/20 − 0.5) = exp(0.2) = 1.2214, warn; 16–63 alone e, critical
    base = replace(ConfigRecords.empty(), generations={f"p{i}": answer(f"p{i}", [-0.5] * 20) for i in range(12)})
    mine = replace(ConfigRecords.empty(),
                   generations={f"p{i}": answer(f"p{i}", [-0.5] * 16 + [-1.5] * 4) for i in range(12)})
    c = gen_nll_ratio(CompareContext(mine=mine, base=base, thresholds=Thresholds.seed))
    assert c is not None and c.estimate == pytest.approx(math.exp(0.2)) and c.verdict == "warn"
    assert [b["positions"] for b in c.details["by_position"]] == ["0–15", "16–63"]
    assert c.rule.endswith("; answer tokens 16–63: critical on their own (2.718 [2.718, 2.718])")


def test_the_run_page_lists_each_candidate_s_buckets():
    from dashboard.views.run_detail import decode_rows, position_rows

    bucket = {"positions": "128–255", "lo": 128, "hi": 256, "estimate": 1.25, "ci_low": 1.1, "ci_high": 1.4, "n": 4,
              "tokens": 310, "verdict": "critical", "rule": ""}
    comparisons = [{"config": "fp16", "metric": "ppl_ratio", "details": {"by_position": [bucket]}},  # the baseline
                   {"config": "kv-late", "metric": "ppl_ratio", "details": {"by_position": [bucket]}},
                   {"config": "kv-late", "metric": "gen_nll_ratio", "details": {}},
                   {"config": "int8", "metric": "ppl_ratio", "details": None}]  # no buckets kept
    run = {"baseline": "fp16", "configs": [], "comparisons": comparisons}
    assert position_rows(run) == [{"config": "kv-late", "scored": "prefill", "positions": "128–255",
                                   "change [95% CI]": "+25.0% [+10.0, +40.0]", "tokens": 310, "n": 4,
                                   "verdict": "critical"}]
    decoded = {"config": "kv-late", "metric": "decode_nll_ratio", "estimate": 1.3, "ci_low": 1.2, "ci_high": 1.4,
               "n": 4, "verdict": "critical",
               "details": {"by_position": [bucket], "prefill_ratio": 1.04, "prefill_decode_gap": 1.25}}
    run["comparisons"].append(decoded)
    assert [r["scored"] for r in position_rows(run)] == ["prefill", "decode"]
    # stored before ppl_ratio: listed after it
    answered = {"config": "kv-late", "metric": "gen_nll_ratio", "estimate": 1.2, "ci_low": 1.1, "ci_high": 1.3,
                "details": {"by_position": [{**bucket, "positions": "16–63", "lo": 16, "hi": 64, "tokens": 48}]}}
    run["comparisons"].insert(0, answered)
    assert [(r["scored"], r["positions"], r["tokens"]) for r in position_rows(run)] == [
        ("prefill", "128–255", 310), ("decode", "128–255", 310), ("answer", "16–63", 48)]
    assert decode_rows(run) == [{"config": "kv-late", "documents": 4, "prefill": "+4.0%",
                                 "decode [95% CI]": "+30.0% [+20.0, +40.0]", "decode ÷ prefill": "1.2500",
                                 "verdict": "critical"}]


def test_the_run_page_lists_each_candidate_s_distribution_figures():
    from dashboard.views.run_detail import distribution_rows

    details = {"tokens": 310, "kld_percentiles": {"p99": 0.0123}, "dp_rms": 0.0105, "same_top": 0.9871,
               "topk_bounds": {"bracketed": 1.0, "width_mean": 0.00021}}
    run = {"comparisons": [
        {"config": "int8", "metric": "kld_mean", "estimate": 0.00042, "ci_low": 0.0003, "ci_high": 0.00055,
         "details": details},
        {"config": "int4", "metric": "kld_mean", "estimate": None, "details": {}},  # too few documents
        {"config": "int8", "metric": "ppl_ratio", "estimate": 1.01, "details": {}},
        # a served candidate: both sides' top 20 only, so the figure is a lower bound
        {"config": "served", "metric": "kld_mean", "estimate": 0.0368, "ci_low": 0.03, "ci_high": 0.04,
         "details": {**details, "kld_bound": "lower", "topk_bounds": None,
                     "by_position": [{"positions": "0–127", "estimate": 0.01213}, {"positions": "128–255",
                                                                                   "estimate": 0.0612}]}}]}
    assert distribution_rows(run) == [{"config": "int8", "tokens": 310, "mean KLD [95% CI]": "0.00042 [0.00030, 0.00055]",
                                       "KLD p99": "0.0123", "Δp RMS": "1.05%", "same top p": "98.7%",
                                       "KLD by position": "—",
                                       "top-20 bounds (self-check)": "100% bracketed, width 0.00021"},
                                      {"config": "served", "tokens": 310, "mean KLD [95% CI]": "≥ 0.03680 [0.03000, 0.04000]",
                                       "KLD p99": "0.0123", "Δp RMS": "1.05%", "same top p": "98.7%",
                                       "KLD by position": "0–127 0.01213 · 128–255 0.0612",
                                       "top-20 bounds (self-check)": "lower bound: both sides' top-20"}]
