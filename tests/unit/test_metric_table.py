"""The metric table (vocabulary/metrics.py) is the one home of a metric: the config file's thresholds,
the API's catalogue, the Prometheus gauges and the comparison each metric gets all come from it.
Figures here are worked by hand."""

import math
import subprocess
import sys

import pytest
from app.config_file import ConfigFileError, Thresholds, parse_config
from engines.protocol import SpeculativeStats
from evals.compare import peak_comparison
from evals.records import DocRecord, GenerationRecord, PairwiseRecord, RunRecords
from evals.stats import Thresholds as StatThresholds
from vocabulary.metrics import METRICS, RUN_VERDICT, VERDICTS, gated_metrics, get_metric, worst_verdict

BASE = {"project": "m", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp16", "baseline": True}, {"name": "int8", "weights": "int8"}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout"}]}  # scorers: perplexity, generation


def test_the_config_files_thresholds_are_the_tables_gated_rows_with_their_seeds():
    seeds = Thresholds().model_dump()
    assert set(seeds) == set(gated_metrics())
    for name, m in gated_metrics().items():
        assert (seeds[name]["warn"], seeds[name]["critical"], seeds[name]["min_n"]) == (m.warn, m.critical, m.min_n)
    assert seeds["ppl_ratio"]["warn"] == 1.15 and seeds["kv_cache_usage"]["critical"] == 0.95  # docs/design.md's seeds


@pytest.mark.parametrize(("thresholds", "message"), [
    ({"ppl_ratoi": {"warn": 1.1}}, "unknown metric 'ppl_ratoi'; did you mean 'ppl_ratio'?"),
    ({"exact_match": {"warn": 0.9}}, "'exact_match' is informational"),
    # the suite runs no judge: nothing would ever produce judge_win_rate
    ({"judge_win_rate": {"warn": 0.45}}, "thresholds.judge_win_rate: no suite runs the 'judge' scorer"),
    ({"faithfulness": {"warn": 0.7}}, "thresholds.faithfulness: no suite runs the 'faithfulness' scorer"),
    # no config decodes speculatively: nothing would ever produce an acceptance rate
    ({"spec_acceptance_rate": {"warn": 0.6}}, "thresholds.spec_acceptance_rate: no config uses speculative decoding"),
    # int8 against fp16 is not lossless: nothing would ever produce lossless_exact_match
    ({"lossless_exact_match": {"warn": 1.0}}, "thresholds.lossless_exact_match: no config is lossless against"),
    ({"term_nll_ratio": {"warn": 1.2}}, "thresholds.term_nll_ratio: no suite lists perplexity.terms"),
])
def test_a_threshold_that_could_never_apply_is_refused_naming_it(thresholds, message):
    with pytest.raises(ConfigFileError) as err:
        parse_config({**BASE, "thresholds": thresholds})
    assert message in str(err.value)


def test_every_requirement_of_the_table_is_checked_by_the_config_file():
    from app.config_file import _REQUIREMENTS

    assert {m.requires for m in METRICS.values() if m.requires} <= set(_REQUIREMENTS)
    assert METRICS["spec_acceptance_rate"].requires == "speculative"


@pytest.mark.parametrize(("config", "suite", "thresholds"), [
    # a config that decodes speculatively produces spec_acceptance_rate
    ({"name": "ngram", "engine": "reference", "speculative": {"method": "ngram"}}, {},
     {"spec_acceptance_rate": {"warn": 0.6}}),
    # fp16 weights and KV as the baseline's, another engine option: lossless, and the suite is greedy by default
    ({"name": "same", "engine_options": {"batch_size": 2}}, {}, {"lossless_exact_match": {"warn": 1.0}}),
    ({"name": "said", "weights": "int8", "lossless": True}, {}, {"lossless_exact_match": {"warn": 1.0}}),
    ({"name": "int4", "weights": "int8"}, {"perplexity": {"terms": ["builtin:python-identifiers"]}},
     {"term_nll_ratio": {"warn": 1.2}}),
])
def test_a_threshold_on_a_used_axis_is_accepted(config, suite, thresholds):
    data = {**BASE, "configs": [BASE["configs"][0], config], "suites": [{**BASE["suites"][0], **suite}],
            "thresholds": thresholds}
    assert parse_config(data).thresholds.model_fields_set == set(thresholds)


def test_a_lossless_config_with_a_sampling_suite_gives_no_lossless_exact_match():
    data = {**BASE, "configs": [BASE["configs"][0], {"name": "same", "engine_options": {"batch_size": 2}}],
            "suites": [{**BASE["suites"][0], "generation": {"temperature": 0.7}}],
            "thresholds": {"lossless_exact_match": {"warn": 1.0}}}
    with pytest.raises(ConfigFileError, match=r"generation\.temperature 0"):
        parse_config(data)


def test_thresholds_on_produced_metrics_are_accepted():
    cfg = parse_config({**BASE, "thresholds": {"ppl_ratio": {"warn": 1.02, "critical": 1.05}, "kv_cache_usage": {"warn": 0.5}}})
    assert cfg.thresholds.ppl_ratio.warn == 1.02 and cfg.thresholds.kv_cache_usage.critical is None


def test_a_refused_threshold_is_one_line_through_a_pipe(tmp_path):
    import yaml

    text = yaml.safe_dump({**BASE, "thresholds": {"judge_win_rate": {"warn": 0.45}}})
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", "-"], input=text, capture_output=True, text=True,
                       cwd=tmp_path, env={"PATH": "", "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}",
                                          "CANARY_EXECUTION": "inline", "PYTHONPATH": sys.path[0] or "."})
    assert r.returncode != 0
    assert "thresholds.judge_win_rate: no suite runs the 'judge' scorer" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr


def test_a_threshold_on_an_unused_axis_is_one_line_through_a_pipe(tmp_path):
    import yaml

    text = yaml.safe_dump({**BASE, "thresholds": {"spec_acceptance_rate": {"warn": 0.6}}})
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", "-"], input=text, capture_output=True, text=True,
                       cwd=tmp_path, env={"PATH": "", "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}",
                                          "CANARY_EXECUTION": "inline", "PYTHONPATH": sys.path[0] or "."})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    # like every refusal of the file: its header, then one line naming the field and the fix
    header, line = (r.stderr + r.stdout).strip().splitlines()
    assert header == "error: <stdin> is invalid:"
    assert line == ("thresholds.spec_acceptance_rate: no config uses speculative decoding, so this threshold "
                         "could never apply; add a config with `speculative` or remove the threshold"), line


def test_unknown_metric_lookup_guesses():
    with pytest.raises(KeyError, match="did you mean 'ttft_ms'"):
        get_metric("ttft")
    assert get_metric("ppl_ratio").alert == "CanaryPerplexityRatioHigh"
    assert get_metric("kv_cache_usage").alert == "CanaryKvCacheUsageHigh"  # derived from the name and direction


def test_verdict_order_and_run_verdicts():
    assert VERDICTS == ("ok", "inconclusive", "warn", "measurement_error", "critical")
    assert worst_verdict(["ok", "warn", "inconclusive"]) == "warn" and worst_verdict([]) == "ok"
    assert [RUN_VERDICT[v] for v in VERDICTS] == ["pass", "inconclusive", "warn", "incomplete", "fail"]


@pytest.mark.parametrize(("peak", "verdict"), [(0.5, "ok"), (0.85, "warn"), (0.9, "warn"), (0.95, "critical"), (0.99, "critical")])
def test_kv_cache_usage_is_one_peak_reading_against_the_seeds(peak, verdict):
    t = StatThresholds.seed("kv_cache_usage")
    c = peak_comparison("kv_cache_usage", peak, StatThresholds(t.warn, t.critical, t.direction, min_n=10), "test")
    assert (c.estimate, c.ci_low, c.ci_high, c.n, c.verdict) == (peak, peak, peak, 1, verdict)  # min_n never applies


def test_an_unreported_peak_is_inconclusive_with_why():
    c = peak_comparison("kv_cache_usage", None, StatThresholds.seed("kv_cache_usage"), "the server has no /metrics")
    assert c.verdict == "inconclusive" and math.isnan(c.estimate) and "the server has no /metrics" in c.rule


def test_spec_stats_add_position_by_position():
    a = SpeculativeStats(2, 8, 5, (2, 2, 1, 0))
    b = SpeculativeStats(1, 2, 1, (1, 0))
    total = a + b
    assert total == SpeculativeStats(3, 10, 6, (3, 2, 1, 0))
    assert total.acceptance_rate == 0.6 and total.mean_acceptance_length == 3.0 and total.per_position_rate == (1.0, 2 / 3, 1 / 3, 0.0)


def test_records_round_trip_through_their_rows():
    doc = DocRecord("d1", 12.5, 10, 4, 30, 7, "os", (1, 2, 3))
    gen = GenerationRecord("p1", 40.0, "Return", " x", 2, 3, (1.5,), 50.0, (9, 8), SpeculativeStats(1, 4, 2, (1, 1, 0, 0)), "batch")
    vote = PairwiseRecord("p1", "tie", True, ("tie", "tie"), 0, "same", "os")
    table = RunRecords.from_rows([(7, r["metric"], r["sample_key"], r["value"], r["extra"])
                                  for r in (doc.to_row(), gen.to_row(), vote.to_row())])
    assert table[7].docs["d1"] == doc and table[7].generations["p1"] == gen and table[7].pairwise["p1"] == vote
    assert vote.value == 0.5 and gen.sequence == (9, 8) and table[8].docs == {}  # another config: empty
    with pytest.raises(ValueError, match=r"sample_results.metric: unknown record kind 'ttft_ms'"):
        RunRecords.from_rows([(7, "ttft_ms", "p1", 40.0, {})])


def test_the_catalogue_route_serves_the_table(sqlite_env):
    from app.api.main import app
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        body = client.get("/api/v1/metrics").json()
        assert [m["name"] for m in body["metrics"]] == list(METRICS)
        kv = next(m for m in body["metrics"] if m["name"] == "kv_cache_usage")
        assert (kv["warn"], kv["critical"], kv["comparison"], kv["direction"], kv["gated"]) == (0.85, 0.95, "peak", "above", True)
        assert body["verdicts"] == list(VERDICTS)
        client.post("/api/v1/projects", json={"name": "m"})
        r = client.get("/api/v1/projects/m/trends", params={"metric": "ppl_ratoi"})
        assert r.status_code == 422 and "ppl_ratio" in r.text
