"""Top up an undecided run (workers/top_up.py), end to end on the embedded default (SQLite, the
task code in this process, the real tiny model). The suite draws 6 of 24 documents and allows 12.
One candidate's ppl_ratio rule asks for 8 paired documents, so at 6 it is inconclusive ("too few
samples"): the run draws 6 more, reruns the baseline and that candidate on all 12, leaves the
decided candidate as it was, and judges on 12. A gate on it waits for the top-up."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.gates import record_gate
from app.models import AlertRule, ConfigRun, Gate, Run, SampleResult
from app.schemas import RunOut, jsonable
from app.services import apply_config_file, run_summary, start_run
from app.settings import get_settings
from engines.zoo import resolve_corpus_path
from sqlalchemy import select
from vocabulary.suite import SuiteSpec
from workers import top_up

from tests.http.test_step_back import StepDispatcher


def canary(corpus: str, max_samples: int | None = 12, weights: str = "rtn-int4", **suite) -> dict:
    return {
        "project": "p",
        "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp16", "baseline": True, "engine": "reference", "weights": "fp16"},
                    {"name": "int8", "engine": "reference", "weights": "int8"},
                    {"name": "int4", "engine": "reference", "weights": weights}],
        "suites": [{"name": "s", "corpus": corpus, "samples": 6, "seed": 5, "scorers": ["perplexity"],
                    "perplexity": {"window": 64}, **({"max_samples": max_samples} if max_samples else {}), **suite}],
        # wide thresholds: both candidates are surely inside them once they have enough documents
        "thresholds": {"ppl_ratio": {"warn": 2.0, "critical": 3.0, "min_n": 3}},
    }


def corpus(tmp_path, n: int = 24) -> str:
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:n]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines))
    return str(path)


def start(tmp_path, max_samples: int | None = 12, weights: str = "rtn-int4", **suite) -> tuple[int, StepDispatcher]:
    with session_scope() as s:
        project = apply_config_file(s, parse_config(canary(corpus(tmp_path), max_samples, weights, **suite)))
        int4 = repo.get_config(s, project, "int4")
        # int4 alone needs 8 paired documents to be judged: at 6 it is 'too few samples'
        s.add(AlertRule(project_id=project.id, metric="ppl_ratio", warn=2.0, critical=3.0, direction="above",
                        min_n=8, config_id=int4.id))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", None, dispatcher, trigger="gate", idempotency_key="gate:t1")
    return run_id, dispatcher


def nll_keys(s, run_id: int, config_id: int) -> set[str]:
    return set(s.scalars(select(SampleResult.sample_key).where(
        SampleResult.run_id == run_id, SampleResult.config_id == config_id, SampleResult.metric == "nll")))


@pytest.mark.integration
def test_an_undecided_candidate_is_topped_up_and_judged_on_twice_the_samples(sqlite_env, tmp_path):
    run_id, dispatcher = start(tmp_path)
    with session_scope() as s:
        gate_id = record_gate(s, repo.get_project(s, "p"), run_id, "int4", "fp16", {"suite": "s"}, "t1").id
        run = s.get(Run, run_id)
        first = list(run.sample_keys)
        before = {cr.config.name: cr.id for cr in run.config_runs}
    assert len(first) == 6
    # three config-runs, then the first aggregation: int4 is undecided, so the run tops up
    assert dispatcher.run_all(until="top-up")[-1] == "top-up"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.status == "running" and run.verdict is None
        assert s.get(Gate, gate_id).verdict is None  # the gate waits
        assert run.n_samples == 6 and len(run.sample_keys) == 12
        assert run.sample_keys[:6] == first and not set(run.sample_keys[6:]) & set(first)
        after = {cr.config.name: (cr.id, cr.status, cr.attempt, cr.attempt_base) for cr in run.config_runs}
    # the decided int8 stays as it was; the baseline and int4 are queued again in their own rows, a
    # new pass beginning at attempt 1: the next claim is attempt 2, so attempt 1 can write no more
    assert after == {"fp16": (before["fp16"], "queued", 1, 1), "int8": (before["int8"], "succeeded", 1, 0),
                     "int4": (before["int4"], "queued", 1, 1)}
    dispatcher.run_all()

    with session_scope() as s:
        run = s.get(Run, run_id)
        ids = {cr.config.name: cr.config_id for cr in run.config_runs}
        assert run.status == "done" and run.verdict == "pass", run.verdict_reason
        assert nll_keys(s, run_id, ids["fp16"]) == set(run.sample_keys)
        assert nll_keys(s, run_id, ids["int4"]) == set(run.sample_keys)
        assert nll_keys(s, run_id, ids["int8"]) == set(first)  # not rerun
        summary = jsonable(run_summary(s, run))
        assert s.get(Gate, gate_id).verdict == "pass"
        assert all(cr.status == "succeeded" for cr in s.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id)))
        # the second pass scored only the 6 documents it added; its figures count all 12
        int4_run = next(cr for cr in s.get(Run, run_id).config_runs if cr.config.name == "int4")
        assert int4_run.progress_total == 6
        docs = repo.sample_results(s, run_id, ids["int4"], "nll")
        nll, tokens = sum(r.value for r in docs), sum(r.extra["n_tokens"] for r in docs)
        assert len(docs) == 12 and int4_run.figures["n_tokens"] == tokens
        assert int4_run.figures["token_ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-9)
        assert any("top-up pass" in note for note in int4_run.figures["notes"])
    comps = {(c["config"], c["metric"]): c for c in summary["comparisons"]}
    assert comps[("int4", "ppl_ratio")]["n"] == 12 and comps[("int4", "ppl_ratio")]["verdict"] == "ok"
    assert comps[("int8", "ppl_ratio")]["n"] == 6  # paired on the documents it ran
    assert summary["n_samples"] == 6 and summary["samples_drawn"] == 12
    assert summary["verdict_reason"].endswith(
        "; topped up from 6 to 12 samples (max_samples 12) after an inconclusive pass")
    RunOut.model_validate(summary)


@pytest.mark.integration
def test_a_top_up_pass_runs_only_the_producers_of_what_is_undecided(sqlite_env, tmp_path):
    """Perplexity decided at 6 documents (min_n 3); the answers' metrics too few at 6 prompts (min_n
    10): the second pass generates the 6 prompts added and scores no document."""
    suite = {"scorers": ["perplexity", "generation"],
             "generation": {"prompts": 6, "prompt_words": 8, "max_new_tokens": 8}}
    with session_scope() as s:
        apply_config_file(s, parse_config(canary(corpus(tmp_path), 12, **suite)))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", None, dispatcher)
    assert "top-up" in dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert len(run.sample_keys) == 12
        int4 = next(cr for cr in run.config_runs if cr.config.name == "int4")
        answered = {r.sample_key for r in repo.sample_results(s, run_id, int4.config_id, "generation")}
        assert answered == set(run.sample_keys)  # 6 prompts in each pass
        assert nll_keys(s, run_id, int4.config_id) == set(run.sample_keys[:6])  # no document added
        assert int4.attempt_base == 1 and int4.progress_total == 6
        # the documents' figures stay the first pass's (no document scored since), over its 6 documents
        docs = repo.sample_results(s, run_id, int4.config_id, "nll")
        nll, tokens = sum(r.value for r in docs), sum(r.extra["n_tokens"] for r in docs)
        assert (int4.figures["n_documents"], int4.figures["n_tokens"]) == (6, tokens)
        assert int4.figures["token_ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-9)
        assert int4.figures["tokens_per_second"] is not None and "pass_scorers" not in int4.figures
        # each pass's batches numbered apart: no timing cluster spans two passes
        batches = {r.sample_key: r.extra["batch"] for r in repo.sample_results(s, run_id, int4.config_id, "generation")}
        first = {batches[k] for k in run.sample_keys[:6]}
        added = {batches[k] for k in run.sample_keys[6:]}
        assert first and added and not first & added


def test_a_top_up_pass_keeps_what_it_did_not_measure_by_hand():
    """A pass that scored no document and generated nothing: its None figures and the documents'
    count and perplexity are the earlier pass's; a peak is the larger; pass_scorers goes."""
    from workers.top_up import with_earlier

    earlier = {"tokens_per_second": 50.0, "kv_cache_usage": 0.4, "token_ppl": 3.0, "n_documents": 6,
               "n_tokens": 100, "concurrency": 4, "pass_scorers": ["perplexity"]}
    new = {"tokens_per_second": None, "kv_cache_usage": 0.2, "token_ppl": None, "n_documents": 12, "n_tokens": 0,
           "concurrency": 4}
    assert with_earlier(new, earlier, documents=False) == {
        "tokens_per_second": 50.0, "kv_cache_usage": 0.4, "token_ppl": 3.0, "n_documents": 6, "n_tokens": 100,
        "concurrency": 4}
    scored = {**new, "token_ppl": 2.5, "n_documents": 12, "n_tokens": 220, "kv_cache_usage": 0.7}
    assert with_earlier(scored, earlier, documents=True) == {**scored, "tokens_per_second": 50.0}
    # the config was edited between the passes: its samples measured two definitions, the run stands for neither
    same = with_earlier({**scored, "config_digest": "aaaa"}, {**earlier, "config_digest": "aaaa"}, documents=True)
    assert same["config_digest"] == "aaaa"
    assert with_earlier({**scored, "config_digest": "bbbb"}, {**earlier, "config_digest": "aaaa"},
                        documents=True)["config_digest"] == "mixed"
    assert with_earlier({**scored, "config_digest": "bbbb"}, earlier, documents=True)["config_digest"] == "bbbb"
    # where the time went: each pass's seconds per part, summed over the passes
    timed = with_earlier({**scored, "seconds": {"engine": 0.5, "perplexity": 2.25}},
                         {**earlier, "seconds": {"engine": 4.0, "generation": 1.5}}, documents=True)
    assert timed["seconds"] == {"engine": 4.5, "perplexity": 2.25, "generation": 1.5}


def test_pass_scorers_by_hand():
    from vocabulary.comparison import Comparison

    def row(metric: str) -> Comparison:
        return Comparison(config_id=2, metric=metric, estimate=1.0, ci_low=0.9, ci_high=1.1, n=6,
                          verdict="inconclusive", rule="n=6 < min_n=10: too few samples to decide")

    assert top_up.pass_scorers([row("ppl_ratio")]) == ["perplexity"]
    assert top_up.pass_scorers([row("degenerate_answers"), row("judge_win_rate")]) == ["generation"]
    assert top_up.pass_scorers([row("term_nll_ratio"), row("ttft_ratio")]) == ["generation", "perplexity"]


@pytest.mark.integration
def test_by_default_an_undecided_run_tops_up_within_the_time_budget(sqlite_env, tmp_path, monkeypatch):
    monkeypatch.setenv("CANARY_TOP_UP_BUDGET_S", "600")
    get_settings.cache_clear()
    run_id, dispatcher = start(tmp_path, max_samples=None)
    assert "top-up" in dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.verdict == "pass" and len(run.sample_keys) == 12, run.verdict_reason
        assert run.verdict_reason.endswith("; topped up from 6 to 12 samples (by default) after an inconclusive pass")


@pytest.mark.parametrize("suite, budget", [({"top_up": False}, "600"), ({}, "0"), ({}, "0.001")],
                         ids=["top_up false", "no budget", "out of time"])
def test_an_undecided_run_stays_inconclusive_when_top_ups_are_off_or_out_of_time(sqlite_env, tmp_path, monkeypatch,
                                                                                 suite, budget):
    monkeypatch.setenv("CANARY_TOP_UP_BUDGET_S", budget)
    get_settings.cache_clear()
    run_id, dispatcher = start(tmp_path, max_samples=None, **suite)
    assert "top-up" not in dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.verdict == "inconclusive" and len(run.sample_keys) == 6
        assert "topped up from" not in run.verdict_reason
        # off (top_up false, or a budget of 0 for the deployment) says nothing; out of time says why
        refused = re.search(r"; not topped up for [\w., -]+: another pass \(about [\d.]+ s\) would take the run, "
                            r"[\d.]+ s old, past its top-up budget of 0.001 s \(CANARY_TOP_UP_BUDGET_S; or set the "
                            r"suite's max_samples\)$", run.verdict_reason)
        assert (refused is not None) == (budget == "0.001"), run.verdict_reason


def test_a_refused_top_ups_seconds_read_at_every_scale_by_hand():
    assert [top_up._seconds(x) for x in (1800.0, 42.4, 9.96, 2.34, 0.001, 0.0)] == ["1800", "42", "10", "2.3",
                                                                                  "0.001", "0"]


def test_the_default_cap_and_the_next_passs_estimate_by_hand():
    """A first draw of 10: by default at most 40 in all (TOP_UP_FACTOR 4), or the suite's
    max_samples, or the drawn ones with top_up false. Two configs to rerun whose last passes took
    10 s and 20 s: adding 10 samples costs about 30 s, adding 5 about 15 s; a config not rerun,
    or not finished, does not count."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    config_runs = [SimpleNamespace(config_id=1, started_at=t0, finished_at=t0 + timedelta(seconds=10)),
                   SimpleNamespace(config_id=2, started_at=t0, finished_at=t0 + timedelta(seconds=20)),
                   SimpleNamespace(config_id=3, started_at=t0, finished_at=t0 + timedelta(seconds=99)),
                   SimpleNamespace(config_id=4, started_at=t0, finished_at=None)]
    run = SimpleNamespace(n_samples=10, sample_keys=[f"k{i}" for i in range(10)], config_runs=config_runs)
    assert top_up.next_pass_seconds(run, [1, 2, 4], 10) == pytest.approx(30.0)
    assert top_up.next_pass_seconds(run, [1, 2], 5) == pytest.approx(15.0)
    suite = SimpleNamespace(settings=SuiteSpec())
    assert top_up.cap(run, suite) == 40
    assert top_up.cap(run, SimpleNamespace(settings=SuiteSpec(max_samples=25))) == 25
    assert top_up.cap(run, SimpleNamespace(settings=SuiteSpec(top_up=False))) == 10


def test_a_comparison_is_topped_up_for_only_when_the_samples_it_needs_fit_the_cap():
    """Prompts are 16 of the run's 100 samples. About 60 prompts would decide it: 60 × 100 / 16 =
    375 samples, within a cap of 400, not within 300. About 20827 would not fit any cap here. Below
    min_n 8 at n=6 of 6 samples: 8 samples, within 12."""
    from vocabulary.comparison import Comparison

    row = {"config_id": 2, "metric": "degenerate_answers", "estimate": 0.06, "ci_low": 0.0, "ci_high": 0.19,
           "n": 16, "verdict": "inconclusive"}
    about = "CI [0, 0.19] straddles warn 0.03: more samples needed (about {} at this effect)"
    assert top_up.reachable(Comparison(**{**row, "rule": about.format(60)}), 100, 400)
    assert not top_up.reachable(Comparison(**{**row, "rule": about.format(60)}), 100, 300)
    assert not top_up.reachable(Comparison(**{**row, "rule": about.format(20827)}), 100, 400)
    assert top_up.reachable(Comparison(**{**row, "n": 6, "rule": "n=6 < min_n=8: too few samples to decide"}), 6, 12)
    # below min_n its min_n counts, not an effect projected from 6 samples
    assert top_up.reachable(Comparison(**{**row, "n": 6, "rule": "n=6 < min_n=8: too few samples to decide; "
                                          + about.format(900)}), 6, 12)
    assert top_up.reachable(Comparison(**{**row, "rule": "CI [0, 0.19] straddles warn 0.03: more samples needed"}),
                            100, 101)  # no figure: tried


def test_top_up_false_with_max_samples_is_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"max_samples: 12 asks for top-ups that top_up: false turns off"):
        parse_config(canary(corpus(tmp_path), max_samples=12, top_up=False))


def test_undecided_takes_only_comparisons_more_samples_can_decide():
    from vocabulary.comparison import Comparison

    row = {"config_id": 2, "metric": "ppl_ratio", "estimate": 1.01, "ci_low": 0.99, "ci_high": 1.03, "n": 6,
           "verdict": "inconclusive"}
    assert top_up.undecided(Comparison(**{**row, "rule": "n=6 < min_n=8: too few samples to decide"}))
    assert top_up.undecided(Comparison(**{**row, "rule": "CI [0.99, 1.03] straddles warn 1.02: more samples needed"}))
    assert not top_up.undecided(Comparison(**{**row, "n": 0, "rule": "no paired documents"}))
    assert not top_up.undecided(Comparison(**{**row, "verdict": "ok", "rule": "CI high 1.01 < warn 1.02"}))
    assert not top_up.undecided(Comparison(**{**row, "metric": "exact_match", "rule": "CI [0.4, 0.6] straddles warn 0.5"}))
    # a gated metric its producer reported without judging it: more samples would not give it a say
    assert not top_up.undecided(Comparison(**{**row, "rule": "CI [0.99, 1.03] straddles warn 1.02", "gated": False}))
    # prompts grow with a top-up (a health metric among them); labelled items and the first few
    # documents the distribution signal reads do not
    straddles = {**row, "rule": "CI [0.0, 0.3] straddles warn 0.03: more samples needed"}
    assert top_up.undecided(Comparison(**{**straddles, "metric": "degenerate_answers"}))
    # the prompts sent alone grow with the prompts a pass adds (workers/producers/generation.py)
    assert top_up.undecided(Comparison(**{**straddles, "metric": "batch_divergence"}))
    assert not top_up.undecided(Comparison(**{**straddles, "metric": "task_recovery"}))
    assert not top_up.undecided(Comparison(**{**straddles, "metric": "kld_mean"}))


def test_max_samples_below_samples_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"max_samples: 4 is below samples \(6\)"):
        parse_config(canary(corpus(tmp_path), max_samples=4))


def test_a_topped_up_config_run_has_a_fresh_attempt_budget_and_its_old_attempt_is_fenced(sqlite_env, tmp_path):
    run_id, dispatcher = start(tmp_path)
    assert dispatcher.run_all(until="top-up")[-1] == "top-up"
    with session_scope() as s:
        fp16 = next(cr.id for cr in s.get(Run, run_id).config_runs if cr.config.name == "fp16")
        # one attempt allowed per pass: the first pass spent it, the second pass may still claim
        assert repo.claim_config_run(s, fp16, "w", 60, max_attempts=1) == 2
    with session_scope() as s:
        assert not repo.heartbeat(s, fp16, 1, 60, 1, 12)  # the first pass's attempt writes nothing more
        assert repo.heartbeat(s, fp16, 2, 60, 1, 12)
        assert repo.claim_config_run(s, fp16, "w2", 60, max_attempts=1) is None  # held, and the budget spent


@pytest.mark.integration
def test_a_config_already_critical_is_not_topped_up(sqlite_env, tmp_path):
    """The config named int4 quantizes to RTN int2 here (about +6 % perplexity on this model) under
    a ppl_ratio rule of warn 1.01 / critical 1.03 that decides at 3 documents: critical at 6. int8
    has the project's rule, now asking for 8 documents: too few at 6. Only int8 tops up."""
    run_id, dispatcher = start(tmp_path, weights="rtn-int2")
    with session_scope() as s:
        rule = s.scalar(select(AlertRule).where(AlertRule.metric == "ppl_ratio", AlertRule.config_id.is_not(None)))
        rule.warn, rule.critical, rule.min_n = 1.01, 1.03, 3
        project_rule = s.scalar(select(AlertRule).where(AlertRule.metric == "ppl_ratio",
                                                        AlertRule.config_id.is_(None)))
        project_rule.min_n = 8
    assert "top-up" in dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        passes = {cr.config.name: cr.attempt_base for cr in run.config_runs}
        assert len(run.sample_keys) == 12 and run.verdict == "fail", run.verdict_reason
    assert passes == {"fp16": 1, "int8": 1, "int4": 0}  # int4 ran once: critical already
    with session_scope() as s:
        int4 = next(cr.config_id for cr in s.get(Run, run_id).config_runs if cr.config.name == "int4")
        assert len(nll_keys(s, run_id, int4)) == 6


def test_a_top_up_keeps_scorer_rows_and_a_stalled_run_sweep_leaves_it_running(sqlite_env, tmp_path):
    run_id, dispatcher = start(tmp_path)
    with session_scope() as s:
        int8 = repo.get_config(s, repo.get_project(s, "p"), "int8").id
        # a judge's score of an output written before the top-up: the output stays the config's (a
        # top-up pass scores only the samples it adds), so the score still applies
        s.add(SampleResult(run_id=run_id, config_id=int8, sample_key=s.get(Run, run_id).sample_keys[0],
                           metric="judge_score", value=7.0))
    assert dispatcher.run_all(until="top-up")[-1] == "top-up"
    with session_scope() as s:
        metrics = set(s.scalars(select(SampleResult.metric).where(SampleResult.run_id == run_id)))
        assert metrics == {"nll", "judge_score"}
        # the reconciler found the run stalled just before the top-up committed: its sweep must not
        # put a run with queued config-runs into 'aggregating'
        repo.reopen_aggregation(s, run_id)
    with session_scope() as s:
        assert s.get(Run, run_id).status == "running"
    dispatcher.run_all()
    with session_scope() as s:
        assert s.get(Run, run_id).verdict == "pass"


def test_a_top_up_pass_sends_as_many_prompts_alone_per_prompt_as_the_first_pass_by_hand():
    from workers.producers.generation import Generation

    def probes(start: int, requests: int, solo_probes: int = 8, prompts: int = 16) -> int:
        producer = Generation.__new__(Generation)  # only the pass's position and its prompts matter here
        producer.start, producer.requests = start, [None] * requests
        return producer.probes(solo_probes, prompts)

    assert probes(0, 16) == 8 and probes(0, 5) == 5  # the first pass: solo_probes, within its prompts
    assert probes(0, 16, solo_probes=0) == 0
    # a top-up pass of 16 (16 → 32) adds 8, one of 48 (32 → 80) 24: half of each, as 8 of 16 first
    assert probes(16, 16) == 8 and probes(32, 48) == 24
    assert probes(16, 5, prompts=16) == 3  # ⌈5 × 8 / 16⌉
    assert probes(16, 16, solo_probes=40) == 16  # never more than the pass's own prompts


def test_an_awq_configs_calibration_documents_are_the_same_in_every_pass_and_never_drawn(sqlite_env, tmp_path):
    """AWQ calibrates on the documents the run's first draw left, in suite order, and a top-up never
    draws the first quarter of the suite of them (where the calibration reads its tokens). Two
    top-ups draw every other document: the calibration text the config-run loads stays the same (a
    top-up pass scores the model the first pass measured) and none of the kept documents is ever
    scored. (Before, the calibration was every document not drawn yet, so it changed with each
    top-up, and a later pass could score a document the first pass's model was calibrated on.)"""
    from app.models import Suite
    from workers.job import load_job

    run_id, _ = start(tmp_path, max_samples=24, weights="awq-int4")
    with session_scope() as s:
        run = s.get(Run, run_id)
        suite = s.get(Suite, run.suite_id)
        awq = next(cr for cr in run.config_runs if cr.config.name == "int4")
        first = load_job(s, awq.id).calibration
        samples = repo.suite_samples(s, suite.id, run.suite_version)
        keys = [sample.key for sample in samples]
        left = [key for key in keys if key not in run.sample_keys]
        assert top_up.calibration_keys(run, keys) == left  # the 18 the first draw left, in suite order
        assert first == [sample.text for sample in samples if sample.key in set(left)]
        kept = top_up.kept_for_calibration(run, keys)
        assert kept == left[:6]  # a quarter of the 24
        assert top_up.room(run, suite, keys) == 18
        for _ in range(2):
            new = top_up.draw_more(run, keys, 6)  # 6 → 12 → 18
            assert new and not set(new) & set(kept)
            repo.top_up_run(s, run, new, [cr.config_id for cr in run.config_runs])
            assert top_up.calibration_keys(run, keys) == left and load_job(s, awq.id).calibration == first
        assert len(run.sample_keys) == 18 and set(run.sample_keys) | set(kept) == set(keys)
        assert top_up.draw_more(run, keys, 6) == []  # nothing left but the kept documents


def test_a_run_without_awq_keeps_no_calibration_documents_by_hand():
    run = SimpleNamespace(sample_keys=["a", "c"], n_samples=2,
                          config_runs=[SimpleNamespace(config=SimpleNamespace(spec={"weights": "rtn-int4"})),
                                       SimpleNamespace(config=SimpleNamespace(
                                           spec={"weights": "awq-int4", "checkpoint": "/ckpt"}))])
    keys = ["a", "b", "c", "d", "e", "f", "g", "h"]
    assert top_up.calibration_keys(run, keys) == top_up.kept_for_calibration(run, keys) == []  # a checkpoint
    run.config_runs.append(SimpleNamespace(config=SimpleNamespace(spec={"weights": "awq-int4"})))
    assert top_up.calibration_keys(run, keys) == ["b", "d", "e", "f", "g", "h"]
    assert top_up.kept_for_calibration(run, keys) == ["b", "d"]
    run.sample_keys = ["a", "c", "b"]  # a top-up drew b (before this rule): the first draw decides, not the run's size
    assert top_up.calibration_keys(run, keys) == ["b", "d", "e", "f", "g", "h"]


def test_awq_never_calibrates_on_a_document_a_labelled_item_is_cut_from(sqlite_env, tmp_path):
    """builtin:pydoc-next-word cuts each item from a held-out document, its answer the word that
    follows there: on a suite whose corpus holds those documents, AWQ calibrates on the documents the
    first draw left less those (a model calibrated on them would have read the items' answers), the
    same in every pass, and the kept quarter is of what it calibrates on."""
    from app.models import Suite
    from workers.job import load_job

    run_id, _ = start(tmp_path, max_samples=24, weights="awq-int4", scorers=["perplexity", "labelled"],
                      labelled={"items": "builtin:pydoc-next-word", "max_items": 8})
    with session_scope() as s:
        run = s.get(Run, run_id)
        suite = s.get(Suite, run.suite_id)
        samples = repo.suite_samples(s, suite.id, run.suite_version)
        items = repo.suite_samples(s, suite.id, run.suite_version, items=True)[:8]
        quoted = top_up.suite_quotes(s, suite, run.suite_version)
        # each item's prompt opens a document of the corpus, and that document is quoted
        assert len(items) == 8 and all(any(d.text.startswith(i.text) and d.key in quoted for d in samples)
                                       for i in items)
        keys = [d.key for d in samples]
        left = [k for k in keys if k not in run.sample_keys and k not in quoted]
        awq = next(cr for cr in run.config_runs if cr.config.name == "int4")
        calibration = load_job(s, awq.id).calibration
        assert calibration == [d.text for d in samples if d.key in set(left)]
        assert not any(i.text in text for i in items for text in calibration)
        kept = top_up.kept_for_calibration(run, keys, quoted)
        assert kept == left[:6] and top_up.room(run, suite, keys, quoted) == 18
        new = top_up.draw_more(run, keys, 6, quoted)
        assert new and not set(new) & set(kept)
        repo.top_up_run(s, run, new, [cr.config_id for cr in run.config_runs])
        assert load_job(s, awq.id).calibration == calibration  # the next pass's model is the same


def test_a_document_is_quoted_by_an_item_prompt_of_40_characters_or_more_by_hand():
    prompt = "Return a new list containing all items from"  # 43 characters
    documents = [("a", prompt + " the iterable in ascending order."), ("b", "Another text. " + prompt + " it."),
                 ("c", "Return a new list containing all items"), ("d", "short prompt here")]
    assert top_up.quoted_documents(documents, [prompt, "short prompt"]) == {"a", "b"}
    assert top_up.quoted_documents(documents, ["short prompt"]) == frozenset()  # too short to be a quote
    assert top_up.quoted_documents(documents, []) == frozenset()
    run = SimpleNamespace(sample_keys=["a"], n_samples=1,
                          config_runs=[SimpleNamespace(config=SimpleNamespace(spec={"weights": "awq-int4"}))])
    assert top_up.calibration_keys(run, ["a", "b", "c", "d"], frozenset({"b"})) == ["c", "d"]
