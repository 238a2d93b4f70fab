"""A whole run on the embedded default (SQLite file + in-process tasks), through the same task
code the Celery workers run, on the real tiny model."""

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import EXECUTE_CONFIG_RUN, InlineDispatcher
from app.models import ConfigRun, Run, SampleResult, utcnow
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from sqlalchemy import select, update

pytestmark = pytest.mark.integration  # whole runs of the tiny model

CONFIG = {
    "project": "t",
    "model": {"name": "tiny", "path": "builtin:pydoc-target"},
    "configs": [
        {"name": "fp16", "baseline": True, "weights": "fp16"},
        {"name": "int4", "weights": "rtn-int4"},
        # pinned to a GPU, scheduled on a CPU-only worker: fails at engine load
        {"name": "gpu-only", "weights": "fp16", "engine_options": {"device": "cuda"}},
    ],
    "suites": [
        {"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 7,
         "perplexity": {"window": 128, "stride": 64},
         "generation": {"prompts": 3, "prompt_words": 8, "max_new_tokens": 6}},
    ],
}


@pytest.fixture
def finished_run(sqlite_env):
    with session_scope() as s:
        apply_config_file(s, parse_config(CONFIG))
    dispatcher = InlineDispatcher()
    run_id, created = start_run("t", "s", None, dispatcher)
    assert created
    return run_id, dispatcher


def test_run_reaches_a_verdict_and_a_failed_config_is_reported(finished_run):
    run_id, _ = finished_run
    with session_scope() as s:
        run = repo.get_run(s, repo.get_project(s, "t"), run_id)
        summary = jsonable(run_summary(s, run))
    assert summary["status"] == "done"
    status = {c["config"]: c["status"] for c in summary["configs"]}
    assert status == {"fp16": "succeeded", "int4": "succeeded", "gpu-only": "failed"}
    failed = next(c for c in summary["configs"] if c["config"] == "gpu-only")
    assert "engine_options.device" in failed["error"]
    # The verdict says what is missing; the other configs' results are untouched.
    assert summary["verdict"] == "incomplete"
    assert "gpu-only" in summary["verdict_reason"] and "engine_options.device" in summary["verdict_reason"]
    ratio = next(c for c in summary["comparisons"] if c["config"] == "int4" and c["metric"] == "ppl_ratio")
    assert ratio["n"] == 12 and ratio["ci_low"] <= ratio["estimate"] <= ratio["ci_high"]
    f = summary["figures"]["int4"]
    assert f["weight_bytes"] < summary["figures"]["fp16"]["weight_bytes"] / 2  # embeddings stay 16-bit
    assert f["ttft_ms_p50"] > 0 and f["tokens_per_second"] > 0


def test_stored_ratio_recomputes_from_raw_samples_by_hand(finished_run):
    run_id, _ = finished_run
    with session_scope() as s:
        run = repo.get_run(s, repo.get_project(s, "t"), run_id)
        ids = {cr.config.name: cr.config_id for cr in run.config_runs}
        base = {r.sample_key: r for r in repo.sample_results(s, run_id, ids["fp16"], "nll")}
        cand = {r.sample_key: r for r in repo.sample_results(s, run_id, ids["int4"], "nll")}
        comp = next(c for c in repo.comparisons(s, run_id) if c.config_id == ids["int4"] and c.metric == "ppl_ratio")
        assert set(base) == set(cand) == set(run.sample_keys) and len(base) == 12
        delta = sum(cand[k].value - base[k].value for k in base)
        tokens = sum(base[k].extra["n_tokens"] for k in base)
        assert comp.estimate == pytest.approx(math.exp(delta / tokens))
        ppl_b = math.exp(sum(r.value for r in base.values()) / tokens)
        assert comp.baseline_value == pytest.approx(ppl_b)


def test_redelivered_task_writes_nothing_twice(finished_run):
    run_id, dispatcher = finished_run

    def snapshot(s):
        rows = s.scalars(select(SampleResult).where(SampleResult.run_id == run_id)).all()
        return {(r.config_id, r.sample_key, r.metric): r.value for r in rows if r.metric == "nll"}, len(rows)

    with session_scope() as s:
        before, count = snapshot(s)
        config_id = repo.get_config(s, repo.get_project(s, "t"), "int4").id
        int4 = s.scalar(select(ConfigRun).where(ConfigRun.run_id == run_id, ConfigRun.config_id == config_id))
        # The worker wrote every result, then died before finishing: its lease ran out.
        s.execute(update(ConfigRun).where(ConfigRun.id == int4.id).values(
            status="running", finished_at=None, lease_expires_at=utcnow() - timedelta(seconds=1)))
        s.execute(update(Run).where(Run.id == run_id).values(status="running", verdict=None))
        cr_id = int4.id
    # two configs succeeded: 12 documents + 3 prompts each, and the candidate's run holds the baseline's
    # second pass over its 3 prompts (the noise floor)
    assert count == 2 * (12 + 3) + 3
    dispatcher.send(EXECUTE_CONFIG_RUN, cr_id)  # the broker redelivers the message
    with session_scope() as s:
        after, count_after = snapshot(s)
        cr = s.get(ConfigRun, cr_id)
        assert (cr.status, cr.attempt) == ("succeeded", 2)  # it really ran again
        assert count_after == count and after == pytest.approx(before)  # same rows, same values
        assert repo.get_run(s, repo.get_project(s, "t"), run_id).verdict == "incomplete"


def test_same_seed_draws_same_samples(sqlite_env):
    with session_scope() as s:
        apply_config_file(s, parse_config(CONFIG))
        project = repo.get_project(s, "t")
        suite = repo.get_suite(s, project, "s")
        configs = [repo.get_config(s, project, "fp16")]
        a, _ = repo.create_run(s, project, suite, configs, seed=1)
        b, _ = repo.create_run(s, project, suite, configs, seed=1)
        c, _ = repo.create_run(s, project, suite, configs, seed=2)
        assert a.sample_keys == b.sample_keys != c.sample_keys


def test_bigger_than_corpus_is_refused_without_writing(sqlite_env):
    bad = {**CONFIG, "suites": [{**CONFIG["suites"][0], "samples": 100000}]}
    with pytest.raises(ValueError, match=r"suites\[0\]\.samples: 100000 > \d+ documents"):
        with session_scope() as s:
            apply_config_file(s, parse_config(bad))
    with session_scope() as s:
        with pytest.raises(repo.NotFound):
            repo.get_project(s, "t")


def test_channels_and_schedules_are_stored_with_secrets_left_as_references(sqlite_env):
    from app.models import Channel, Schedule

    cfg = {**CONFIG, "channels": [{"name": "oncall", "kind": "slack", "url": "${CANARY_SECRET_T__SLACK_WEBHOOK_URL}"}],
           "schedules": [{"name": "daily", "cron": "0 6 * * *", "suite": "s"},
                         {"name": "weekly", "cron": "0 7 * * 1", "suite": "s", "configs": ["int4"], "samples": 12}]}
    for _ in range(2):  # applying the same file twice changes nothing
        with session_scope() as s:
            apply_config_file(s, parse_config(cfg))
    with session_scope() as s:
        [ch] = s.scalars(select(Channel)).all()
        assert (ch.kind, ch.url) == ("slack", "${CANARY_SECRET_T__SLACK_WEBHOOK_URL}")
        scheds = {x.name: x for x in s.scalars(select(Schedule))}
        assert scheds["daily"].config_names == ["fp16", "int4", "gpu-only"]
        assert (scheds["weekly"].config_names, scheds["weekly"].samples) == (["int4"], 12)


def test_changed_corpus_adds_a_suite_version_and_old_runs_keep_their_text(sqlite_env, tmp_path):
    import json

    corpus = tmp_path / "c.jsonl"

    def write(word):
        corpus.write_text("\n".join(json.dumps({"id": f"d{i}", "text": f"{word} number {i} of the corpus."}) for i in range(10)))

    write("Document")
    cfg = {**CONFIG, "configs": CONFIG["configs"][:1], "suites": [{"name": "s", "corpus": str(corpus), "samples": 10}]}
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg))
        project = repo.get_project(s, "t")
        run, _ = repo.create_run(s, project, repo.get_suite(s, project, "s"), repo.list_configs(s, project))
        old_version = run.suite_version
    write("Changed")
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg))
        suite = repo.get_suite(s, repo.get_project(s, "t"), "s")
        assert suite.version != old_version
        old = repo.suite_samples(s, suite.id, old_version)
        new = repo.suite_samples(s, suite.id, suite.version)
        assert [x.text.split()[0] for x in old] == ["Document"] * 10
        assert [x.text.split()[0] for x in new] == ["Changed"] * 10


def test_a_run_that_compares_nothing_is_an_error_never_a_pass(sqlite_env):
    """Only the baseline ran: no candidate result, so no threshold judged anything. Reading that as
    a pass would make a broken schedule look healthy (security round 3: the canary watches itself)."""
    with session_scope() as s:
        apply_config_file(s, parse_config({**CONFIG, "configs": CONFIG["configs"][:1],
                                           "suites": [{**CONFIG["suites"][0], "samples": 4, "generation": {"prompts": 0}}]}))
    run_id, _ = start_run("t", "s", ["fp16"], InlineDispatcher())
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert (run.status, run.verdict) == ("done", "error"), (run.status, run.verdict, run.verdict_reason)
        assert run.verdict_reason.startswith("nothing was compared")


def toy_prompt_count(ctx):
    """The compare target of the toy metric below: the number of prompts the candidate answered."""
    from evals.compare import reported

    if ctx.is_base:
        return None
    n = len(ctx.mine.generations)
    return reported("toy_prompt_count", float(n), float(n), float(n), n, min_n=1)


def test_a_metric_added_to_the_table_is_compared_with_no_worker_edit(sqlite_env):
    """A metric is its row and its compare target; the aggregation loops over
    the table, so a toy row registered here reaches the stored comparisons of a real run."""
    from vocabulary.metrics import METRICS, Metric, register_metric

    toy = register_metric(Metric("toy_prompt_count", "prompts", "points", "below", "mean", "generation",
                                 "prompts the candidate answered (a test's toy row)", gated=False,
                                 compare=f"{__name__}:toy_prompt_count"))
    config = {**CONFIG, "configs": CONFIG["configs"][:2],
              "suites": [{**CONFIG["suites"][0], "samples": 4, "generation": {"prompts": 2, "prompt_words": 8,
                                                                            "max_new_tokens": 4}}]}
    try:
        with session_scope() as s:
            apply_config_file(s, parse_config(config))
        run_id, _ = start_run("t", "s", None, InlineDispatcher())
        with session_scope() as s:
            summary = jsonable(run_summary(s, repo.get_run(s, repo.get_project(s, "t"), run_id)))
    finally:
        METRICS.pop(toy.name)
    toys = [c for c in summary["comparisons"] if c["metric"] == "toy_prompt_count"]
    # the candidate answered the suite's 2 prompts; the baseline gets no row (its target returns None)
    assert [(c["config"], c["estimate"], c["n"], c["verdict"]) for c in toys] == [("int4", 2.0, 2, "ok")]
    assert summary["status"] == "done"


def test_a_compare_target_that_cannot_be_imported_names_its_row():
    from vocabulary.metrics import Metric

    row = Metric("toy_missing", "x", "points", "below", "mean", "generation", "a toy", gated=False,
                 compare="evals.compare_targets:no_such_function")
    with pytest.raises(LookupError, match=r"metric toy_missing: compare target 'evals.compare_targets:no_such_function'"):
        row.compare_target()


@dataclass(frozen=True)
class ToyHeadRecord:
    """A toy producer's own record kind: Σ −log p of a document's first words alone."""

    KIND: ClassVar[str] = "toy_head_nll"
    sample_key: str
    nll: float

    def to_row(self) -> dict:
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.nll, "extra": {}}

    @classmethod
    def from_row(cls, sample_key, value, extra):
        return cls(sample_key, float(value))


def toy_head_difference(ctx):
    """The toy metric's compare target: the candidate's mean head NLL less the baseline's, over the
    documents both scored (from the toy producer's own records)."""
    from evals.compare import reported

    mine, base = ctx.mine.kinds.get("toy_head_nll", {}), ctx.base.kinds.get("toy_head_nll", {})
    keys = [k for k in mine if k in base]
    if ctx.is_base or not keys:
        return None
    diffs = [mine[k].nll - base[k].nll for k in keys]
    mean = sum(diffs) / len(diffs)
    return reported("toy_head_difference", mean, min(diffs), max(diffs), len(keys), min_n=1)


def test_a_producer_registered_in_a_test_reaches_the_comparisons_with_no_worker_edit(sqlite_env):
    """A new per-document signal is one producer (its engine requests, its record kind) and one
    metric row: registered here, run by the worker's loop over the suite's producers, read by the
    aggregation and compared, with no file under workers/ naming it."""
    from engines.protocol import RollingRequest
    from evals.records import unregister_record
    from vocabulary.metrics import METRICS, Metric, register_metric
    from vocabulary.suite import SCORER_TABLE, Scorer, register_scorer
    from workers.producers import PRODUCERS, Batch, Producer, register_producer

    calls = []

    class ToyHead(Producer):
        scorer = "toy_head"
        records = (ToyHeadRecord,)

        def total(self):
            return len(self.work.job.samples)

        def batches(self):
            requests = [RollingRequest(key, " ".join(text.split()[:6]), self.work.window)
                        for key, text, _ in self.work.job.samples]
            calls.append(len(requests))
            results = self.work.engine.loglikelihood_rolling(requests)
            yield Batch([ToyHeadRecord(r.doc_id, r.nll).to_row() for r in results], len(results))

    register_scorer(Scorer("toy_head", "a test's toy: the first six words' log-likelihood"))
    register_producer(ToyHead)
    toy = register_metric(Metric("toy_head_difference", "head Δ", "points", "above", "mean", "toy_head",
                                 "a test's toy row: mean head NLL, candidate less baseline", gated=False,
                                 compare=f"{__name__}:toy_head_difference"))
    config = {**CONFIG, "configs": CONFIG["configs"][:2],
              "suites": [{**CONFIG["suites"][0], "samples": 4, "scorers": ["perplexity", "toy_head"]}]}
    try:
        with session_scope() as s:
            apply_config_file(s, parse_config(config))
        run_id, _ = start_run("t", "s", None, InlineDispatcher())
        with session_scope() as s:
            summary = jsonable(run_summary(s, repo.get_run(s, repo.get_project(s, "t"), run_id)))
            stored = s.scalars(select(SampleResult).where(SampleResult.run_id == run_id,
                                                          SampleResult.metric == "toy_head_nll")).all()
    finally:
        METRICS.pop(toy.name)
        PRODUCERS.remove(ToyHead)
        SCORER_TABLE.pop("toy_head")
        unregister_record(ToyHeadRecord)
    assert calls == [4, 4]  # one call per config-run: the baseline's and int4's
    assert len(stored) == 8 and all(r.value > 0 for r in stored)
    toys = [c for c in summary["comparisons"] if c["metric"] == "toy_head_difference"]
    by_key = {}
    for r in stored:
        by_key.setdefault(r.sample_key, {})[r.config_id] = r.value
    diffs = [v[max(v)] - v[min(v)] for v in by_key.values()]  # int4 is the config created second
    assert [(c["config"], c["n"]) for c in toys] == [("int4", 4)]
    assert toys[0]["estimate"] == pytest.approx(sum(diffs) / 4, abs=1e-9)
