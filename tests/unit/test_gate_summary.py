"""The gate's summary (PR comment, GitHub job summary) from a hand-made run summary: every
figure below is worked out by hand from the inputs."""

from __future__ import annotations

from app.gates import gains, summary_markdown
from app.models import Gate
from app.schemas import ComparisonOut

from tests.summaries import run_out


def comparison(metric, estimate, low, high, n, verdict, rule, informational=False, config="int4"):
    return ComparisonOut(config=config, metric=metric, estimate=estimate, ci_low=low, ci_high=high, n=n, verdict=verdict,
                         rule=rule, baseline_value=None, candidate_value=None, details={}, gated=not informational)


SUMMARY = {
    "run_id": 7, "n_samples": 50, "verdict_reason": "ppl_ratio critical", "baseline": "fp16",
    "comparisons": [
        comparison("exact_match", 0.9, 0.8, 0.95, 40, "ok", "", informational=True),
        comparison("ttft_ratio", 0.8, 0.75, 0.86, 40, "ok", "warn > 1.2"),
        comparison("ppl_ratio", 1.045, 1.024, 1.066, 50, "critical", "critical > 1.03"),
        comparison("ppl_ratio", 1.0, 1.0, 1.0, 50, "ok", "", config="fp16"),  # another config: left out
    ],
    "figures": {
        "int4": {"tokens_per_second": 180.0, "weight_bytes": 100_000_000, "kv_bytes_per_token": 4096,
                 "peak_device_bytes": None},
        "fp16": {"tokens_per_second": 100.0, "weight_bytes": 400_000_000, "kv_bytes_per_token": 4096,
                 "peak_device_bytes": 900_000_000},
    },
}


def test_summary_leads_with_the_verdict_suite_and_the_worst_change_with_its_ci():
    gate = Gate(candidate="int4", baseline="fp16", verdict="fail")
    md = summary_markdown(gate, run_out(**SUMMARY), "http://dash:8501/", "daily")
    lines = md.splitlines()
    assert lines[0] == "<!-- inference-canary gate: candidate=int4 suite=daily -->"  # the sticky comment's marker
    assert lines[1] == "## ❌ inference-canary gate: **fail**"
    assert lines[3] == ("`int4` vs baseline `fp16` on suite `daily` (50 documents), run 7. "
                        "[Open the run](http://dash:8501/?page=Run+detail&run_id=7)")
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| metric")]
    # worst first, informational last; ratios as % change: 1.045 → +4.50 %, CI 1.024..1.066 → +2.40..+6.60;
    # ttft 0.8 → −20.00 %; exact match 0.9 → 90.0 % [80.0, 95.0]
    assert table == ["| ppl_ratio | +4.50% [+2.40, +6.60] | 50 | critical | critical > 1.03 |",
                     "| ttft_ratio | -20.00% [-25.00, -14.00] | 40 | ok | warn > 1.2 |",
                     "| exact_match | 90.0% [80.0, 95.0] | 40 | ok (informational) |  |"]
    # 180 / 100 tokens/s = 1.80×; 400 MB / 100 MB = 4.00× smaller; KV per token equal (1.00×); no peak on one side
    assert ("**Speed and memory:** throughput 1.80× the baseline's (180 vs 100 tokens/s); "
            "weights 4.00× smaller (100.0 MB vs 400.0 MB); KV cache per token 1.00× the baseline's "
            "(4,096 B vs 4,096 B).") in lines
    assert lines[-1] == "Reason: ppl_ratio critical"
    # the decision with the gate's default exit codes, then the verdict for people (app/summary.py)
    # as every surface prints it, above the table: its group and its worst quality finding
    assert lines[5:11] == ["**Decision:** deploy blocked: fail (exit 1)", "", "```text", "drop or fix (1):",
                           "  int4: ppl ratio +4.50% [+2.40, +6.60] critical", "```"]


def test_a_pending_gate_and_a_run_without_figures():
    md = summary_markdown(Gate(candidate="int4", baseline="fp16", verdict=None),
                          run_out(**{**SUMMARY, "comparisons": [], "figures": {}, "verdict_reason": None}), "http://d",
                          "s")
    assert md.splitlines()[1] == "## ⏳ inference-canary gate: **pending**" and "|" not in md and "Speed" not in md
    assert gains({"int4": {"tokens_per_second": None}}, "int4", "fp16") == []


def test_a_reused_baseline_is_named_with_its_run_and_its_throughput_said_to_be_timed_there():
    figures = {**SUMMARY["figures"], "fp16": {**SUMMARY["figures"]["fp16"], "reused_from_run": 5}}
    md = summary_markdown(Gate(candidate="int4", baseline="fp16", verdict="fail"), run_out(**{**SUMMARY, "figures": figures}),
                          "http://d", "daily")
    assert "throughput 1.80× the baseline's (180 vs 100 tokens/s, the baseline's timed in run 5)" in md
    assert md.splitlines()[-1].startswith("Baseline `fp16`: the results of run 5, reused (")
    assert "reused" not in summary_markdown(Gate(candidate="int4", baseline="fp16", verdict="fail"),
                                            run_out(**SUMMARY), "http://d", "daily")
