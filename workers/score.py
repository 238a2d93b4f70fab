"""CPU scorers over a run's generations: LLM-as-judge and RAG faithfulness. They run in the
aggregate task (queue `default`/`cpu`, never on a GPU worker) once every config-run is done,
from inputs read in a transaction that closes before the first judge call (`Scoring`), and
write per-sample results idempotently, each config's in a transaction of its own (a retried
aggregation re-scores nothing already stored),
and report a scorer that failed — with why — instead of failing the run: the other scorers'
results stand."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app import repo
from app.db import session_scope
from app.models import Project, Run, Suite, SuiteSample
from evals.faithfulness import JudgeFaithfulness, MissingContexts, OfflineFaithfulness
from evals.judge import JudgeClient, JudgeConfig, JudgeError, pairwise, rubric
from evals.records import (
    ConfigRecords,
    FaithfulnessRecord,
    GenerationRecord,
    PairwiseRecord,
    RubricRecord,
    RunRecords,
)
from vocabulary.suite import JudgeSettings, SuiteSpec

log = logging.getLogger(__name__)
_OFFLINE: dict[float, OfflineFaithfulness] = {}  # the embedder loads once per process


def judge_client(settings: JudgeSettings, project: str | None) -> JudgeClient:
    """The judge's URL and key name pass the outbound policy again here, at use; every request
    then goes through a transport that checks the URL and pins the address it checked."""
    from workers.outbound import judge_http

    if settings.base_url is None or settings.model is None:  # the suite's schema requires both with a judge
        raise JudgeError("judge: the suite names no judge.base_url and judge.model")
    key, transport = judge_http(settings.model_dump(), project)
    return JudgeClient(JudgeConfig(
        base_url=settings.base_url, model=settings.model, api_key=key, concurrency=settings.concurrency,
        requests_per_second=settings.requests_per_second, timeout_s=settings.timeout_s), transport=transport)


@dataclass(frozen=True)
class Scoring:
    """What the CPU scorers need of a run, read in one short transaction (`scoring_inputs`): no
    transaction stays open while a judge answers, and each config's scores commit on their own."""

    run_id: int
    baseline_config_id: int
    project: str  # whose secrets the judge may name
    spec: SuiteSpec
    samples: dict[str, SuiteSample]  # the run's samples by key (loaded; read after the session closed)
    config_ids: list[int]  # the config-runs that succeeded


def scoring_inputs(session: Session, run: Run) -> Scoring | None:
    """The run's scoring inputs; None when its suite runs no CPU scorer."""
    suite = session.get(Suite, run.suite_id)
    assert suite is not None  # a foreign key: the row exists
    spec = suite.settings
    if not any(spec.runs(name) for name in RUN_SCORERS):
        return None
    samples = {x.key: x for x in repo.suite_samples(session, suite.id, run.suite_version, run.sample_keys)}
    project = session.get(Project, run.project_id)
    assert project is not None  # a foreign key: the row exists
    return Scoring(run.id, run.baseline_config_id, project.name, spec, samples,
                   [cr.config_id for cr in run.config_runs if cr.status == "succeeded"])


def score_run(scoring: Scoring, table: RunRecords) -> dict[str, str]:
    """Run the suite's CPU scorers over the run's records (`table`, read once by the aggregation;
    what they score is stored and added to it); returns {scorer: why it failed} for those that failed."""
    failed: dict[str, str] = {}
    gens = {config_id: table[config_id].generations for config_id in scoring.config_ids}
    for name, (score, errors) in RUN_SCORERS.items():
        if scoring.spec.runs(name):
            try:
                score(scoring, gens, table)
            except errors as e:
                failed[name] = str(e)
    return failed


def _store(scoring: Scoring, config_id: int, records: list, table: RunRecords) -> None:
    """One config's scores in a transaction of their own: a retried aggregation re-scores none of them."""
    with session_scope() as session:
        repo.write_sample_results(session, scoring.run_id, config_id, [r.to_row() for r in records])
    for record in records:
        table[config_id].add(record)


def _faithfulness(scoring: Scoring, gens: dict[int, dict[str, GenerationRecord]], table: RunRecords) -> None:
    spec, samples = scoring.spec, scoring.samples
    client = None
    if spec.faithfulness.method == "judge":
        client = judge_client(spec.judge, scoring.project)
        scorer: JudgeFaithfulness | OfflineFaithfulness = JudgeFaithfulness(client)
    else:
        threshold = spec.faithfulness.threshold
        scorer = _OFFLINE.setdefault(threshold, OfflineFaithfulness(threshold))
    try:
        for config_id, by_key in gens.items():
            have = table[config_id].faithfulness
            records = []
            for key, gen in by_key.items():
                if key in have:
                    continue
                sample = samples[key]
                # a document is its own context
                contexts = sample.contexts if sample.contexts is not None else [sample.text]
                question = sample.text if sample.kind == "rag" else gen.prompt
                if isinstance(scorer, JudgeFaithfulness):
                    res = scorer.score(key, gen.text, contexts, question)
                else:
                    res = scorer.score(key, gen.text, contexts)
                statements = tuple((st, bool(ok)) for st, ok in res.statements)
                records.append(FaithfulnessRecord(key, res.score, res.outcome, res.method, res.parse_failures,
                                                  statements, sample.cluster or key))
            _store(scoring, config_id, records, table)
    finally:
        if client:
            client.close()


def _judge(scoring: Scoring, gens: dict[int, dict[str, GenerationRecord]], table: RunRecords) -> None:
    samples, mode = scoring.samples, scoring.spec.judge.mode
    base = gens.get(scoring.baseline_config_id, {})
    with judge_client(scoring.spec.judge, scoring.project) as client:
        for config_id, by_key in gens.items():
            mine = table[config_id]
            todo = [k for k in by_key if k in base]

            def one(key: str, config_id: int = config_id, by_key: dict[str, GenerationRecord] = by_key,
                    mine: ConfigRecords = mine) -> list:
                sample, gen = samples[key], by_key[key]
                records: list = []
                candidate = config_id != scoring.baseline_config_id
                if mode in ("pairwise", "both") and candidate and key not in mine.pairwise:
                    v = pairwise(client, key, gen.prompt, base[key].text, gen.text, sample.reference)
                    records.append(PairwiseRecord(key, v.winner, v.consistent, tuple(v.orders), v.parse_failures,
                                                  v.rationale, sample.cluster or key))
                if mode in ("rubric", "both") and key not in mine.rubric:
                    score = rubric(client, key, gen.prompt, gen.text, sample.reference)
                    records.append(RubricRecord(key, score.score, score.stated, score.weighted, score.parse_failures,
                                                score.rationale, sample.cluster or key))
                return records

            _store(scoring, config_id, [rec for batch in client.map(one, todo) for rec in batch], table)
        log.info("judge usage for run %s: %s", scoring.run_id, client.usage)


# the run's CPU scorers, by the suite scorer that switches each on (vocabulary/suite.py), in the order they run,
# with the errors that fail the scorer (not the run). ValueError: the SSRF policy refused the judge URL
RUN_SCORERS: dict[str, tuple[Callable[[Scoring, dict[int, dict[str, GenerationRecord]], RunRecords], None],
                             tuple[type[Exception], ...]]] = {
    "faithfulness": (_faithfulness, (JudgeError, MissingContexts, RuntimeError, ValueError)),
    "judge": (_judge, (JudgeError, ValueError)),
}
