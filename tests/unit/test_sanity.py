"""Sanity bounds (evals/sanity.py) on hand-made records: each impossible figure is named, each
possible one passes, and the aggregation's verdict order puts measurement_error between warn and
critical with a run verdict of incomplete."""

from __future__ import annotations

import math

from app.alerting import AlertState, evaluate
from engines.protocol import SpeculativeStats
from evals import sanity
from evals.records import DocRecord, GenerationRecord
from evals.stats import Thresholds
from vocabulary.comparison import Comparison
from vocabulary.metrics import RUN_VERDICT, worst_verdict


def doc(key: str, nll: float, n_tokens: int = 5) -> DocRecord:
    return DocRecord(key, nll, n_tokens, 3, 20)


def gen(n_tokens: int, drafts: int, drafted: int, accepted: int) -> GenerationRecord:
    return GenerationRecord("p", 10.0, "prompt", "text", n_tokens, 4, spec=SpeculativeStats(drafts, drafted, accepted))


def test_logprobs_that_cannot_come_from_a_model_are_named():
    assert sanity.logprob_problem([doc("a", 12.0), doc("b", 0.0)]) is None  # one confident document is possible
    assert sanity.logprob_problem([doc("a", 12.0), doc("empty", 0.0, n_tokens=0)]) is None
    assert sanity.logprob_problem([]) is None
    msg = sanity.logprob_problem([doc("a", 0.0), doc("b", 0.0), doc("empty", 0.0, n_tokens=0)], "the candidate's")
    assert msg == ("logprobs: the candidate's log-probs are all 0 (probability 1) on all 2 documents: "
                   "the engine is not returning real log-probs")
    assert sanity.logprob_problem([doc("a", 3.0), doc("b", -0.5)]) == (
        "logprobs: the log-probs sum above 0 (a probability over 1) on 1 of 2 documents (e.g. 'b')")
    assert sanity.logprob_problem([doc("a", math.nan), doc("b", math.inf), doc("c", 1.0)]).startswith(
        "logprobs: the log-probs are NaN or infinite on 2 of 3 documents (e.g. 'a')")


def test_spec_counters_that_other_traffic_or_a_restart_moved_are_named():
    # 2 requests generated 10 + 6 = 16 tokens; 5 drafts of 4 tokens, 12 accepted: possible
    assert sanity.spec_counter_problem([gen(10, 3, 12, 8), gen(6, 2, 8, 4)]) is None
    assert sanity.spec_counter_problem([gen(10, 3, 12, 13)]) == "spec_counters: 13 tokens accepted of 12 drafted (an acceptance above 1)"
    assert sanity.spec_counter_problem([gen(10, 3, 40, 30)]) == (
        "spec_counters: the server counted 3 drafts and 30 accepted tokens while the run's requests generated 10 "
        "tokens: other traffic on the server moved its counters")
    assert sanity.spec_counter_problem([gen(10, -1, 4, 2)]).startswith("spec_counters: a spec-decode counter went down")
    assert sanity.spec_counter_problem([GenerationRecord("p", 1.0, "", "", 3, 1)]) is None  # no spec decoding


def test_an_estimate_outside_its_metrics_range_becomes_a_measurement_error():
    ok = Comparison("ppl_ratio", 1.02, 1.01, 1.03, 12, "ok", "CI high 1.03 < warn 1.15")
    assert sanity.checked(ok) is ok
    assert sanity.checked(Comparison("ppl_ratio", 0.95, 0.9, 1.0, 12, "ok", "r")).verdict == "ok"  # inside [0.9, ∞)
    low = sanity.checked(Comparison("ppl_ratio", 0.0105, 0.01, 0.011, 12, "ok", "CI high 0.011 < warn 1.15"))
    assert low.verdict == "measurement_error" and low.estimate == 0.0105  # the figure stays on the record
    assert low.rule == "measurement error: bounds: ppl_ratio 0.0105 is outside [0.9, ∞), the range a correct measurement falls in"
    assert low.details == {"measurement_error": "bounds"}
    rate = sanity.checked(Comparison("spec_acceptance_rate", 1.25, 1.1, 1.4, 12, "ok", "r"))
    assert rate.rule.startswith("measurement error: bounds: spec_acceptance_rate 1.25 is outside [0, 1]")
    # a problem found by another check comes first
    first = sanity.checked(ok, None, "spec_counters: x")
    assert (first.verdict, first.rule) == ("measurement_error", "measurement error: spec_counters: x")
    assert sanity.checked(Comparison("ttft_ms", math.nan, math.nan, math.nan, 0, "inconclusive", "no generations")).verdict == "inconclusive"


def test_a_measurement_error_keeps_the_run_from_passing_and_the_alerts_as_they_were():
    assert RUN_VERDICT[worst_verdict(["ok", "warn", "measurement_error"])] == "incomplete"
    assert RUN_VERDICT[worst_verdict(["measurement_error", "critical"])] == "fail"  # a measured regression still fails
    firing = AlertState({"severity": "warn", "metric": "ppl_ratio"}, "firing", 2)
    assert evaluate(firing, "measurement_error", 0.01, 1, now=None) == (firing, None)  # no data: not resolved


def test_documents_tokenized_differently_make_a_measurement_error_that_names_the_start_token():
    """A candidate served by a server that adds no start token scores each document with one token
    fewer than an in-process baseline: no ratio is computed from such pairs, and the comparison
    says why and what to set, instead of the aggregation failing the run."""
    from evals.compare_targets import CompareContext, ppl_ratio
    from evals.records import ConfigRecords

    def records(n_tokens: dict[str, int]) -> ConfigRecords:
        recs = ConfigRecords.empty()
        recs.docs.update({k: doc(k, 2.0 * n, n) for k, n in n_tokens.items()})
        return recs

    base = records({"a": 81, "b": 40, "c": 12})
    ctx = CompareContext(mine=records({"a": 80, "b": 39, "c": 12}), base=base, thresholds=Thresholds.seed)
    c = ppl_ratio(ctx)
    assert c.verdict == "measurement_error" and math.isnan(c.estimate)
    assert c.rule == ("measurement error: token counts differ: document 'a' has 81 tokens on the baseline and 80 on this "
                      "config (and 1 more documents); a token perplexity ratio needs the same tokens on both sides, and one "
                      "engine begins the text with a start token the other does not (an engine: openai config can set "
                      "engine_options.start_token_id, or serve /tokenizer_info)")
    assert c.details == {"measurement_error": "token counts differ"}
    same = CompareContext(mine=records({"a": 81, "b": 40, "c": 12}), base=base, thresholds=Thresholds.seed)
    assert ppl_ratio(same).verdict != "measurement_error"
