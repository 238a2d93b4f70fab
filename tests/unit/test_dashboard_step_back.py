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


def test_example_answers_show_each_breaching_generation_finding_beside_the_baseline():
    # empty answers (critical, with the baseline's answer kept), a batching divergence (warn, with the
    # prompt's answer sent alone), an ok finding and an ablation layer's finding (both left out)
    metrics = {**METRICS,
               "empty_answers": {"name": "empty_answers", "label": "empty answers", "unit": "fraction", "fmt": ".1%",
                                 "gated": True, "comparison": "paired_difference"},
               "batch_divergence": {"name": "batch_divergence", "label": "batch divergence", "unit": "fraction",
                                    "fmt": ".1%", "gated": True, "comparison": "paired_difference"}}

    def finding(config, metric, verdict, example):
        return {"config": config, "metric": metric, "estimate": 0.25, "ci_low": 0.1, "ci_high": 0.4, "n": 12,
                "verdict": verdict, "rule": "", "details": {"example": example}}

    run = {**RUN, "comparisons": [
        finding("stack", "batch_divergence", "warn", {"sample_key": "p3", "text": "def f(", "alone": "def g("}),
        finding("stack", "empty_answers", "critical", {"sample_key": "p7", "text": "", "baseline_text": "Return x."}),
        finding("stack", "ppl_ratio", "ok", {"sample_key": "p1", "text": "fine"}),
        finding("stack~kv_cache-only", "empty_answers", "critical", {"sample_key": "p2", "text": ""})]}
    from dashboard.views.run_detail import example_answers

    assert example_answers(run, metrics) == [
        {"config": "stack", "metric": "empty answers", "verdict": "critical", "prompt": "p7", "answer": "",
         "baseline_answer": "Return x.", "alone": None},
        {"config": "stack", "metric": "batch divergence", "verdict": "warn", "prompt": "p3", "answer": "def f(",
         "baseline_answer": None, "alone": "def g("}]
