"""Every figure the dashboard shows, computed by hand from a tiny input (dashboard/views/common.py)."""

from __future__ import annotations

import math
from datetime import datetime, timezone

import pytest
from dashboard.views.common import (
    clock_time,
    doc_ppl_ratio,
    drop_empty_columns,
    human_time,
    keep_ci_whole,
    label_offsets,
    metric_cell,
    pct_change,
    sparkline,
    worst_first,
    worst_verdict,
    y_domain,
)

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)


def test_ratio_as_percent_change_with_its_ci():
    # (1.045 − 1) × 100 = +4.5; (1.024 − 1) × 100 = +2.4; (1.066 − 1) × 100 = +6.6
    assert pct_change(1.045, 1.024, 1.066) == "+4.5% [+2.4, +6.6]"
    # an improvement and a CI that straddles parity: 0.97 → −3.0, 0.95 → −5.0, 1.01 → +1.0
    assert pct_change(0.97, 0.95, 1.01) == "-3.0% [-5.0, +1.0]"
    assert pct_change(1.0) == "+0.0%"  # parity, never "-0.0%"
    assert pct_change(0.99996, 0.99990, 1.0) == "+0.0% [+0.0, +0.0]"
    assert pct_change(None) == "—"


@pytest.mark.parametrize("unit,spec,est,low,high,text", [
    ("ratio", ".4f", 1.30, 1.20, 1.45, "+30.0% [+20.0, +45.0]"),
    ("fraction", ".2f", 0.82, 0.751, 0.88, "82% [75, 88]"),  # 0.751 × 100 = 75.1 → 75
    ("fraction", ".2f", 0.03, None, None, "3%"),  # a peak: one reading, no CI
    ("ms", ".1f", 43.4, 22.2, 247.0, "43 ms [22, 247]"),
    ("points", "+.2f", -0.25, -0.6, 0.1, "-0.25 [-0.60, +0.10]"),
    ("ratio", ".4f", None, None, None, "—"),
])
def test_metric_cell_per_unit(unit, spec, est, low, high, text):
    assert metric_cell(unit, spec, est, low, high) == text


@pytest.mark.parametrize("when,text", [
    ("2026-11-25T11:59:30+00:00", "just now"),
    ("2026-11-25T11:59:00+00:00", "1 minute ago"),
    ("2026-11-25T09:50:00", "2 hours ago"),  # 2 h 10 min; no offset = UTC, as stored
    ("2026-11-22T11:00:00+00:00", "3 days ago"),  # 3 days 1 hour
    ("2026-11-25T16:00:00+00:00", "in 4 hours"),
    ("2026-11-25T13:00:00+01:00", "just now"),  # 13:00 at UTC+1 is 12:00 UTC
    ("2026-11-25T12:00:20+00:00", "in under a minute"),
    (None, "never"),
])
def test_human_time(when, text):
    assert human_time(when, NOW) == text


def test_sparkline_scales_between_the_series_min_and_max():
    # 1.0 → ▁ (min), 2.0 → █ (max), 1.5 → halfway: 0.5 × 7 = 3.5, half a step up → 4 → ▅;
    # 1.2 → 0.2 × 7 = 1.4 → 1 → ▂; None → a gap
    assert sparkline([1.0, 1.5, None, 2.0, 1.2]) == "▁▅ █▂"
    assert sparkline([1.0, 1.0]) == "▄▄"  # flat: a middle line, not a fake trend
    assert sparkline([]) == ""


def test_document_ppl_ratio_from_two_nll_sums():
    # 100 tokens, NLL 250 vs 240 nats: exp(10 / 100) = 1.10517
    assert doc_ppl_ratio(250.0, 240.0, 100) == pytest.approx(math.exp(0.1))
    assert doc_ppl_ratio(None, 240.0, 100) is None and doc_ppl_ratio(1.0, 1.0, 0) is None


def test_worst_first_by_verdict_then_ppl_ratio_baseline_last():
    rows = [{"config": "fp32", "baseline": True, "verdict": "ok", "ppl_ratio": None},
            {"config": "int8", "verdict": "ok", "ppl_ratio": 1.001},
            {"config": "kv2", "verdict": "inconclusive", "ppl_ratio": 1.02},
            {"config": "int4", "verdict": "warn", "ppl_ratio": 1.02},
            {"config": "spec", "verdict": "critical", "ppl_ratio": 1.0},
            {"config": "int2", "verdict": "critical", "ppl_ratio": 1.06},
            {"config": "broken", "verdict": "measurement_error", "ppl_ratio": None},
            {"config": "fp8", "verdict": "ok", "ppl_ratio": 1.004}]
    assert [r["config"] for r in worst_first(rows)] == ["int2", "spec", "broken", "int4", "kv2", "fp8", "int8", "fp32"]
    assert worst_verdict(["ok", "inconclusive", "warn"]) == "warn"
    assert worst_verdict(["measurement_error", "warn"]) == "measurement_error"
    assert worst_verdict([]) is None


def test_y_domain_gives_one_point_a_sensible_axis():
    # one value 1.0: ±1 % of it → [0.99, 1.01]; a span 1.0–1.2 gets 10 % margins → [0.98, 1.22]
    assert y_domain([1.0]) == pytest.approx([0.99, 1.01])
    assert y_domain([1.0, None, 1.2]) == pytest.approx([0.98, 1.22])
    assert y_domain([0.0]) == pytest.approx([-0.01, 0.01])  # zero still gets a span
    assert y_domain([]) == [0.0, 1.0]


def test_label_offsets_keep_labels_apart():
    # two points at the same place: the first label goes above (−14 px), the second below (+16 px)
    assert label_offsets([1.0, 1.0], [5.0, 5.0], ["int8", "fp8"]) == [-14, 16]
    # far apart on x (0 and 700 px): both above
    assert label_offsets([0.0, 10.0], [5.0, 5.0], ["int8", "fp8"]) == [-14, -14]
    # three on one spot: above, below, further above
    assert label_offsets([1.0] * 3, [2.0] * 3, ["a", "b", "c"]) == [-14, 16, -30]


def test_a_cell_wraps_only_between_its_estimate_and_its_ci():
    # no-break spaces (U+00A0) after the CI's comma and before "ms"; the one ordinary space is before "["
    assert keep_ci_whole("+5.8% [+4.4, +8.7]") == "+5.8% [+4.4,\u00a0+8.7]"
    assert keep_ci_whole("270 ms [138, 400]") == "270\u00a0ms [138,\u00a0400]"
    assert keep_ci_whole("3%") == "3%"


def test_columns_empty_in_every_row_are_left_out():
    import pandas as pd

    df = pd.DataFrame([{"config": "int2", "escalation run": "", "inhibited by": "", "value": "+5.8%"},
                       {"config": "int8", "escalation run": "", "inhibited by": 7, "value": "—"}])
    assert list(drop_empty_columns(df).columns) == ["config", "inhibited by", "value"]  # only "escalation run" is blank
    assert drop_empty_columns(df.iloc[:0]).empty


def test_documents_and_prompts_share_one_column():
    from dashboard.views.overview import sample_counts

    assert sample_counts(12, 10) == "12 / 10"
    assert sample_counts(4, None) == "4 / —"  # a perplexity-only suite
    assert sample_counts(None, None) == "—"  # the baseline: left out when every row is empty


def test_a_gate_took_from_its_request_to_its_verdict():
    from dashboard.views.gates import took

    # 06:40:50.14 → 06:42:48.14 is 118 s = 1 min 58 s
    gate = {"created_at": "2026-11-25T06:40:50.139718", "decided_at": "2026-11-25T06:42:48.142033"}
    assert took(gate) == "1 min 58 s"
    assert took({"created_at": "2026-11-25T06:40:50", "decided_at": "2026-11-25T06:41:32"}) == "42 s"
    assert took({"created_at": "2026-11-25T06:40:50", "decided_at": None}) == ""  # pending


def test_clock_time_for_labels_that_must_not_change_while_the_page_is_open():
    assert clock_time("2026-11-25T06:37:04.831299") == "25 Nov 06:37 UTC"  # stored without an offset: UTC
    assert clock_time("2026-01-05T23:59:59+00:00") == "5 Jan 23:59 UTC"
    assert clock_time(None) == "—"


def test_firing_alerts_group_into_incidents_by_config_and_run():
    """Four firing alerts: int2's ppl warn and critical and its TPOT warn in run 7, kv-fp8's
    empty-answers warn in run 7: two incidents, int2's first (critical), its findings critical
    first, then by label; the earliest fire time; the worst alert's runbook."""
    from dashboard.views.alerts import incidents

    def alert(config, metric, severity, value, fired, runbook):
        return {"labels": {"config": config, "metric": metric}, "severity": severity, "value": value,
                "run_id": 7, "fired_at": fired, "started_at": None, "annotations": {"runbook_url": runbook}}
    rows = [alert("kv-fp8", "empty_answers", "warn", 0.1, "2026-11-29T10:00:00", "r#empty"),
            alert("int2", "tpot_ratio", "warn", 1.3, "2026-11-29T09:00:00", "r#tpot"),
            alert("int2", "ppl_ratio", "warn", 1.3, "2026-11-29T09:30:00", "r#ppl"),
            alert("int2", "ppl_ratio", "critical", 1.3, "2026-11-29T09:30:00", "r#ppl")]
    labels = {"empty_answers": "empty", "tpot_ratio": "TPOT ratio", "ppl_ratio": "ppl ratio"}
    found = incidents(rows, lambda a: labels[a["labels"]["metric"]], lambda a: f"{a['value']:g}")
    assert [(i["config"], i["run"], i["severity"], i["alerts"]) for i in found] == [
        ("int2", 7, "critical", 3), ("kv-fp8", 7, "warn", 1)]
    assert found[0]["findings"] == "ppl ratio 1.3 critical; TPOT ratio 1.3 warn; ppl ratio 1.3 warn"
    assert found[0]["since"] == "2026-11-29T09:00:00" and found[0]["runbook"] == "r#ppl"


def test_run_against_run_by_hand():
    """Runs 3 and 5: int2 went ok → critical (+0.05), int8 stayed ok (−0.001), kv only in run 5 (left out);
    the config whose verdict moved comes first."""
    import pandas as pd
    from dashboard.views.trends import run_diff

    pts = pd.DataFrame([
        {"config": "int2", "run_id": 3, "estimate": 1.02, "ci_low": 1.01, "ci_high": 1.03, "n": 100, "verdict": "ok"},
        {"config": "int8", "run_id": 3, "estimate": 1.002, "ci_low": 1.0, "ci_high": 1.004, "n": 100, "verdict": "ok"},
        {"config": "int2", "run_id": 5, "estimate": 1.07, "ci_low": 1.05, "ci_high": 1.09, "n": 50,
         "verdict": "critical"},
        {"config": "int8", "run_id": 5, "estimate": 1.001, "ci_low": 0.999, "ci_high": 1.003, "n": 50, "verdict": "ok"},
        {"config": "kv", "run_id": 5, "estimate": 1.5, "ci_low": 1.4, "ci_high": 1.6, "n": 50, "verdict": "critical"},
    ])
    diff = run_diff(pts, 3, 5, lambda row: f"{row['estimate']:.3f}")
    assert list(diff.columns) == ["config", "run 3", "run 5", "change", "verdict"]
    assert list(diff["config"]) == ["int2", "int8"]
    assert list(diff["run 5"]) == ["1.070 n=50", "1.001 n=50"] and diff["run 3"].iloc[0] == "1.020 n=100"
    assert diff["change"].round(6).tolist() == [0.05, -0.001]
    assert list(diff["verdict"]) == ["ok → critical", "ok → ok"]


def test_trends_opens_on_the_configs_near_a_threshold_by_hand():
    """ppl_ratio, the project's warn 1.02 (halfway from parity: 1.01), critical 1.03, so off the scale
    beyond 2.06; f has its own warn 1.005 (halfway 1.0025). Newest points: a's CI ends at 1.005
    (far), b's at 1.014 (near), c inconclusive (near), d at 7.0 (collapsed: shown, as a marker along
    the top), e near at run 1 and far at run 2 (its newest counts), f at 1.004 past its own halfway
    (near)."""
    import pandas as pd
    from dashboard.views.trends import near_threshold, off_scale_bound, threshold_lines

    metric = {"name": "ppl_ratio", "unit": "ratio", "direction": "above", "comparison": "paired_ratio",
              "warn": 1.02, "critical": 1.03}

    def point(config, run, estimate, low, high, verdict="ok"):
        return {"config": config, "run_id": run, "estimate": estimate, "ci_low": low, "ci_high": high, "n": 100,
                "verdict": verdict}

    pts = pd.DataFrame([point("a", 2, 1.003, 1.001, 1.005), point("b", 2, 1.009, 1.004, 1.014),
                        point("c", 2, 1.01, 0.99, 1.03, "inconclusive"), point("d", 2, 7.0, 6.5, 7.5, "critical"),
                        point("e", 1, 1.015, 1.012, 1.018), point("e", 2, 1.002, 1.0, 1.004),
                        point("f", 2, 1.002, 1.0, 1.004)])
    rules = [{"config": None, "warn": 1.02, "critical": 1.03}, {"config": "f", "warn": 1.005, "critical": 1.03}]
    lines = threshold_lines(rules, sorted(pts["config"].unique()))
    bound = off_scale_bound(metric, lines)
    assert bound == pytest.approx(2.06)
    assert near_threshold(pts, metric, lines, bound) == ["b", "c", "d", "f"]
    # none on the scale near, or a metric without a parity: every config
    far = pts[pts["config"].isin(["a", "d", "e"])]
    assert near_threshold(far, metric, lines, bound) == ["a", "d", "e"]
    assert near_threshold(pts, {**metric, "comparison": "percentile"}, lines, bound) == list("abcdef")


def test_a_config_edited_since_its_run_is_named_under_the_table():
    """The Overview's API marks a config edited in place after the run that stands for it
    (edited_since_checked): its row's "checked" says so, and one line under the table names it."""
    from dashboard.views.overview import config_rows, edited_line

    def config(name: str, edited: bool) -> dict:
        return {"config": name, "baseline": name == "fp16", "run_id": 4, "comparisons": {}, "figures": {},
                "checked_at": "2026-12-01T10:00:00+00:00", "edited_since_checked": edited}

    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    rows = {r["config"]: r["checked"] for r in config_rows([config("fp16", False), config("int4", True)], [], now)}
    assert rows == {"fp16 (baseline)": "2 hours ago", "int4": "2 hours ago (edited since)"}
    assert edited_line([config("fp16", False), config("int4", True)]) == (
        "int4 was edited after its last run: its row describes the earlier definition. Run it again to measure the "
        "config as it is now.")
    assert edited_line([config("int4", True), config("kv", True)]).startswith(
        "int4, kv were edited after their last run: their rows describe")
    assert edited_line([config("int4", False)]) is None
