"""The run report's HTML (app/report.py) from a hand-made run summary: self-contained, every name
escaped, the plot's axis chosen and its labels kept apart as worked out by hand."""

from __future__ import annotations

import re

import pytest
from app.report import _label_dy, render, trade_off_svg
from app.schemas import ComparisonOut, RunOut

from tests.summaries import run_out


def summary(name: str = "int2") -> RunOut:
    comparisons = [ComparisonOut.model_validate(c) for c in (
        {"config": name, "metric": "ppl_ratio", "estimate": 1.06, "ci_low": 1.045, "ci_high": 1.08, "n": 12,
         "verdict": "critical", "rule": "CI low 1.045 ≥ critical 1.03"},
        {"config": name, "metric": "tpot_ratio", "estimate": 0.5, "ci_low": 0.4, "ci_high": 0.625, "n": 10,
         "verdict": "ok", "rule": "CI high 0.625 < warn 1.25"},
    ) for c in [{**c, "baseline_value": None, "candidate_value": None, "details": {}, "gated": True}]]
    return run_out(run_id=3, verdict="fail", verdict_reason=f"{name} ppl_ratio critical", baseline="fp32",
                   created_at="2026-11-26T06:00:00", finished_at="2026-11-26T06:01:00", comparisons=comparisons,
                   configs=[{"config": "fp32"}, {"config": name}])


def test_the_report_is_self_contained_and_escapes_every_name():
    html = render(summary("<img src=x onerror=alert(1)>"), "p&q", "daily", {})
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html and "project p&amp;q" in html
    assert "<script" not in html and "href=" not in html and "src=x" not in html.replace("&lt;img src=x", "")
    # the verdict for people: its group, then the config with its ppl ratio as % change with the CI
    assert "drop or fix (1):\n  &lt;img src=x onerror=alert(1)&gt;: ppl ratio +6.00% [+4.50, +8.00] critical" in html


def test_trade_off_points_and_the_plot():
    """TPOT ratio 0.5 [0.4, 0.625] → speed gain 1/0.5 = 2× [1/0.625, 1/0.4] = [1.6, 2.5]; ppl 1.06 →
    +6 % loss [+4.5, +8]. Losses of +6 % and 0 % are within 10× of their median: a linear axis; a
    +596 % collapse beside +1 % and +2 % is not: a symmetric log axis."""
    points = [p.model_dump() for p in summary().trade_off]
    assert points[0]["config"] == "fp32 (baseline)" and points[0]["speed"] == 1.0
    cand = points[1]
    assert (round(cand["speed"], 6), round(cand["speed_low"], 6), round(cand["speed_high"], 6)) == (2.0, 1.6, 2.5)
    assert (round(cand["loss"], 6), round(cand["loss_low"], 6), round(cand["loss_high"], 6)) == (6.0, 4.5, 8.0)
    assert "symmetric log" not in trade_off_svg(points)
    def point(name, loss):
        return {**cand, "config": name, "loss": loss, "loss_low": loss, "loss_high": loss}
    wide = [points[0], point("a", 1.0), point("b", 2.0), point("collapsed", 596.0)]
    assert "symmetric log scale" in trade_off_svg(wide)
    assert "No speed figures" in trade_off_svg(points[:1])  # the baseline alone: nothing to plot



def test_the_plot_has_round_ticks_and_the_perplexity_thresholds():
    """Ticks by hand: 0 to 7 in at most 6 ticks → a raw step of 1.4, rounded up to 2: 0, 2, 4, 6;
    −0.3 to 0.95 → raw 0.25 → 0.25: −0.25 … 0.75. The y axis of the tested points (+6 % [+4.5, +8]
    and the baseline's 0) with warn 1.01 and critical 1.03 drawn as +1 % and +3 % lines."""
    from app.report import round_ticks, threshold_lines
    from app.report_context import ReportContext, Threshold

    assert round_ticks(0, 7) == [0, 2, 4, 6]
    assert round_ticks(-0.3, 0.95) == [-0.25, 0, 0.25, 0.5, 0.75]
    assert round_ticks(1.55, 2.55) == [1.6, 1.8, 2.0, 2.2, 2.4]
    rule = Threshold("ppl_ratio", "ppl ratio", "above", 1.01, 1.03, 10, "project rule", ("every candidate",))
    ctx = ReportContext([rule, Threshold("tpot_ratio", "TPOT ratio", "above", 1.1, 1.25, 10, "seed", ("x",))], [], [])
    assert threshold_lines(ctx) == [("warn 1.01", pytest.approx(1.0)), ("critical 1.03", pytest.approx(3.0))]
    svg = trade_off_svg([p.model_dump() for p in summary().trade_off], lines=threshold_lines(ctx))
    labels = re.findall(r"text-anchor='end'>([^<]+)%</text>", svg)
    assert labels == ["0", "+2", "+4", "+6", "+8"]  # y: -0.64 … 8.64 drawn, round steps of 2
    assert re.findall(r"text-anchor='middle'>([^<]+)×</text>", svg) == ["1", "1.5", "2", "2.5"]
    assert svg.count("stroke-dasharray='6 4'") == 2 and ">warn 1.01</text>" in svg and ">critical 1.03</text>" in svg
    # the seed thresholds (1.15, 1.30) lie far above a healthy run's points: the axis stays the points'
    # (linear, the same ticks as without lines) and each is named at the top edge instead
    seed = [("warn 1.15", 15.0), ("critical 1.3", 30.0)]
    plain = trade_off_svg([p.model_dump() for p in summary().trade_off])
    far = trade_off_svg([p.model_dump() for p in summary().trade_off], lines=seed)
    assert re.findall(r"text-anchor='end'>([^<]+)%</text>", far) == re.findall(r"text-anchor='end'>([^<]+)%</text>",
                                                                               plain)
    assert "symmetric log" not in far and "stroke-dasharray='6 4'" not in far
    assert ">warn 1.15 ↑ (off the axis)</text>" in far and ">critical 1.3 ↑ (off the axis)</text>" in far
    # two ppl rules: each line names its configs
    other = Threshold("ppl_ratio", "ppl ratio", "above", 1.05, None, 10, "config rule", ("int2",))
    assert [label for label, _ in threshold_lines(ReportContext([rule, other], [], []))] == [
        "warn 1.01 (every candidate)", "critical 1.03 (every candidate)", "warn 1.05 (int2)"]
    assert threshold_lines(None) == []

def test_labels_of_points_on_one_spot_are_kept_apart():
    """Three labels of 10 characters (65 px wide, 12 high) at one point: above (−6), below (+14),
    then further above (−20); a label far to the right keeps its place above."""
    placed: list = []
    assert [_label_dy(placed, 100, 100, 10) for _ in range(3)] == [-6.0, 14.0, -20.0]
    assert _label_dy(placed, 300, 100, 10) == -6.0


def test_quality_by_position_and_the_decode_gap():
    """ppl_ratio's bucket 128–255 at 1.25 [1.1, 1.4] reads +25.00% [+10.00, +40.00]; the decode pass's
    the same; a gap of 1.25 prints with four decimals. No buckets: a line says so."""
    from app.report import _positions

    bucket = {"positions": "128–255", "estimate": 1.25, "ci_low": 1.1, "ci_high": 1.4, "tokens": 310,
              "verdict": "critical"}
    s = summary("kv-late")
    s.comparisons[0].details = {"by_position": [bucket]}
    s.comparisons.append(ComparisonOut.model_validate(
        {"config": "kv-late", "metric": "decode_nll_ratio", "estimate": 1.3, "ci_low": 1.2, "ci_high": 1.4, "n": 4,
         "verdict": "critical", "rule": "", "baseline_value": None, "candidate_value": None, "gated": False,
         "details": {"by_position": [bucket], "prefill_ratio": 1.04, "prefill_decode_gap": 1.25}}))
    s.comparisons.insert(0, ComparisonOut.model_validate(  # stored first, listed after the documents' rows
        {"config": "kv-late", "metric": "gen_nll_ratio", "estimate": 1.1, "ci_low": 1.0, "ci_high": 1.2, "n": 12,
         "verdict": "ok", "rule": "", "baseline_value": None, "candidate_value": None, "gated": True,
         "details": {"by_position": [{**bucket, "positions": "16–63", "tokens": 48}]}}))
    html = _positions(s)
    cells = "<td>128–255</td><td>+25.00% [+10.00, +40.00]</td><td>310</td><td class='v critical'>critical</td>"
    assert f"<td>kv-late</td><td>prefill</td>{cells}" in html and f"<td>kv-late</td><td>decode</td>{cells}" in html
    assert ("<td>kv-late</td><td>answer</td><td>16–63</td><td>+25.00% [+10.00, +40.00]</td><td>48</td>"
            in html)  # the generated answers' tokens 16–63
    assert html.index("<td>prefill</td>") < html.index("<td>decode</td>") < html.index("<td>answer</td>")
    assert "Decode ÷ prefill on the documents scored both ways: kv-late 1.2500." in html
    assert "<h2>Quality by position in the context and in the answer</h2>" in render(s, "p", "daily", {})
    assert "No position buckets" in _positions(summary())


def test_next_token_distributions_in_the_report():
    """kld_mean 0.00042 [0.0003, 0.00055] with p99 0.0123, Δp RMS 0.0105 → 1.05%, same top 0.9871
    [0.98, 0.992] → 98.7% [98.0, 99.2]; not measured: a line says how to measure it."""
    from app.report import _distributions

    s = summary("int8")
    s.comparisons.append(ComparisonOut.model_validate(
        {"config": "int8", "metric": "kld_mean", "estimate": 0.00042, "ci_low": 0.0003, "ci_high": 0.00055, "n": 8,
         "verdict": "ok", "rule": "", "baseline_value": None, "candidate_value": None, "gated": False,
         "details": {"tokens": 310, "kld_percentiles": {"p99": 0.0123}, "dp_rms": 0.0105, "same_top": 0.9871,
                     "same_top_ci": [0.98, 0.992], "topk_bounds": {"bracketed": 1.0, "width_mean": 0.00021}}}))
    html = _distributions(s)
    assert ("<td>int8</td><td>310</td><td>0.00042 [0.00030, 0.00055]</td><td>0.0123</td><td>1.05%</td>"
            "<td>98.7% [98.0, 99.2]</td><td>—</td><td>100% bracketed, width 0.00021</td>") in html
    assert "distribution_samples is 0" in _distributions(summary())
    # a served candidate (both sides' top 20 only): a lower bound, said so
    served = s.comparisons[-1].model_copy(update={"details": {**s.comparisons[-1].details, "kld_bound": "lower",
                                                              "topk_bounds": None, "by_position": [
                                                                  {"positions": "0–127", "estimate": 0.0002},
                                                                  {"positions": "128–255", "estimate": 0.0009}]}})
    s.comparisons[-1] = served
    assert ("<td>≥ 0.00042 [0.00030, 0.00055]</td><td>0.0123</td><td>1.05%</td><td>98.7% [98.0, 99.2]</td>"
            "<td>0–127 0.0002 · 128–255 0.0009</td><td>lower bound: both sides' top-20</td>") in _distributions(s)


def test_task_accuracy_in_the_report():
    """200 items, 110 right on both sides, 10 right→wrong and 10 wrong→right: accuracy 55.0% → 55.0%,
    recovery 1.000 [0.930, 1.075] inconclusive, flips 10.0% [6.6, 14.9] warn, McNemar p 1."""
    from app.report import _tasks

    s = summary("int4")
    details = {"items": 200, "baseline_accuracy": 0.55, "candidate_accuracy": 0.55, "baseline_ci": [0.481, 0.617],
               "candidate_ci": [0.481, 0.617], "right_to_wrong": 10, "wrong_to_right": 10, "mcnemar_p": 1.0,
               "unpaired_z_p": 1.0}
    for metric, est, lo, hi, verdict in (("task_recovery", 1.0, 0.93, 1.075, "inconclusive"),
                                         ("task_flips", 0.1, 0.0657, 0.1494, "warn")):
        s.comparisons.append(ComparisonOut.model_validate(
            {"config": "int4", "metric": metric, "estimate": est, "ci_low": lo, "ci_high": hi, "n": 200,
             "verdict": verdict, "rule": "", "baseline_value": 0.55, "candidate_value": 0.55, "gated": True,
             "details": details}))
    html = _tasks(s)
    assert ("<td>int4</td><td>200</td><td>55.0% → 55.0% [48.1, 61.7]</td>"
            "<td class='v inconclusive'>1.000 [0.930, 1.075] (inconclusive)</td><td>10</td><td>10</td>"
            "<td>10.0% [6.6, 14.9] (warn)</td><td>1</td>") in html
    assert "no labelled scorer" in _tasks(summary())
