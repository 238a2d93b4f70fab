"""Run detail's step-back section from a hand-made run response: the layers' rows as shown, and
the ablations kept out of the breaching table and the candidates."""

from __future__ import annotations

from dashboard.views.run_detail import ablations, candidates_worst_first, comparison_rows, step_back_rows

METRICS = {"ppl_ratio": {"name": "ppl_ratio", "label": "ppl ratio", "unit": "ratio", "fmt": ".4f", "gated": True,
                         "comparison": "paired_ratio"}}


def comparison(config, estimate, verdict):
    return {"config": config, "metric": "ppl_ratio", "estimate": estimate, "ci_low": estimate - 0.01,
            "ci_high": estimate + 0.01, "n": 4, "verdict": verdict, "rule": "", "details": {}}


RUN = {
    "baseline": "fp16",
    "configs": [{"config": "fp16"}, {"config": "stack"},
                {"config": "stack~kv_cache-only", "ablation_of": "stack", "ablation_axis": "kv_cache"},
                {"config": "stack~weights-only", "ablation_of": "stack", "ablation_axis": "weights"}],
    "comparisons": [comparison("stack", 1.6, "critical"), comparison("stack~kv_cache-only", 1.5, "critical"),
                    comparison("stack~weights-only", 1.002, "ok")],
    "step_back": [{"config": "stack", "metric": "ppl_ratio", "stacked_ratio": 1.6, "interaction": 0.05,
                   "disable": "kv_cache", "advice": "disable kv_cache int2",
                   "layers": [{"axis": "kv_cache", "value": "int2", "config": "stack~kv_cache-only", "ratio": 1.5,
                               "verdict": "critical", "lossless": False, "share": 0.99509},
                              {"axis": "weights", "value": "int8", "config": "stack~weights-only", "ratio": 1.002,
                               "verdict": "ok", "lossless": False, "share": 0.00491}]}],
}


def test_layers_have_their_own_section_and_are_no_candidates():
    assert ablations(RUN) == {"stack~kv_cache-only", "stack~weights-only"}
    breaching, rest = comparison_rows(RUN, METRICS)
    assert [r["config"] for r in breaching] == ["stack"] and rest == []
    assert candidates_worst_first(RUN, METRICS) == ["stack"]
    # shares to a tenth of a percent: 0.99509 → 99.5 %, 0.00491 → 0.5 %; ratios to 4 significant digits
    assert step_back_rows(RUN["step_back"][0]) == [
        {"layer": "kv_cache int2", "ppl_ratio alone": "1.5", "verdict": "critical", "share of the loss": "99.5 %",
         "run alone as": "stack~kv_cache-only"},
        {"layer": "weights int8", "ppl_ratio alone": "1.002", "verdict": "ok", "share of the loss": "0.5 %",
         "run alone as": "stack~weights-only"}]
