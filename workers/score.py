"""CPU scorers over a run's generations: LLM-as-judge and RAG faithfulness. They run in the
aggregate task (queue `default`/`cpu`, never on a GPU worker) once every config-run is done,
write per-sample results idempotently (a retried aggregation re-scores nothing already stored),
and report a scorer that failed — with why — instead of failing the run: the other scorers'
results stand."""

from __future__ import annotations

import logging

from app import repo
from app.models import Project, Run, Suite
from evals.faithfulness import JudgeFaithfulness, MissingContexts, OfflineFaithfulness
from evals.judge import JudgeClient, JudgeConfig, JudgeError, pairwise, rubric
from evals.records import FaithfulnessRecord, GenerationRecord, PairwiseRecord, RubricRecord, RunRecords
from evals.suite import JudgeSettings, SuiteSpec

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


def _project(session, run: Run) -> str:
    """The name of the project that owns the run: whose secrets its judge may name."""
    return session.get(Project, run.project_id).name


def score_run(session, run: Run, table: RunRecords) -> dict[str, str]:
    """Run the suite's CPU scorers over the run's records (`table`, read once by the aggregation;
    what they score is stored and added to it); returns {scorer: why it failed} for those that failed."""
    suite = session.get(Suite, run.suite_id)
    spec = suite.settings
    scorers = spec.scorers
    failed: dict[str, str] = {}
    if not {"judge", "faithfulness"} & set(scorers):
        return failed
    samples = {x.key: x for x in repo.suite_samples(session, suite.id, run.suite_version, run.sample_keys)}
    done = [cr for cr in run.config_runs if cr.status == "succeeded"]
    gens = {cr.config_id: table[cr.config_id].generations for cr in done}
    if "faithfulness" in scorers:
        try:
            _faithfulness(session, run, spec, samples, gens, table)
        except (JudgeError, MissingContexts, RuntimeError, ValueError) as e:
            failed["faithfulness"] = str(e)
    if "judge" in scorers:
        try:
            _judge(session, run, spec, samples, gens, table)
        except (JudgeError, ValueError) as e:  # ValueError: the SSRF policy refused the judge URL
            failed["judge"] = str(e)
    return failed


def _store(session, run: Run, config_id: int, records: list, table: RunRecords) -> None:
    repo.write_sample_results(session, run.id, config_id, [r.to_row() for r in records])
    session.commit()
    for record in records:
        table[config_id].add(record)


def _faithfulness(session, run: Run, spec: SuiteSpec, samples: dict, gens: dict[int, dict[str, GenerationRecord]],
                  table: RunRecords) -> None:
    client = None
    if spec.faithfulness.method == "judge":
        client = judge_client(spec.judge, _project(session, run))
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
            _store(session, run, config_id, records, table)
    finally:
        if client:
            client.close()


def _judge(session, run: Run, spec: SuiteSpec, samples: dict, gens: dict[int, dict[str, GenerationRecord]],
           table: RunRecords) -> None:
    mode = spec.judge.mode
    base = gens.get(run.baseline_config_id, {})
    with judge_client(spec.judge, _project(session, run)) as client:
        for config_id, by_key in gens.items():
            mine = table[config_id]
            todo = [k for k in by_key if k in base]

            def one(key: str, config_id=config_id, by_key=by_key, mine=mine) -> list:
                sample, gen = samples[key], by_key[key]
                records: list = []
                if mode in ("pairwise", "both") and config_id != run.baseline_config_id and key not in mine.pairwise:
                    v = pairwise(client, key, gen.prompt, base[key].text, gen.text, sample.reference)
                    records.append(PairwiseRecord(key, v.winner, v.consistent, tuple(v.orders), v.parse_failures,
                                                  v.rationale, sample.cluster or key))
                if mode in ("rubric", "both") and key not in mine.rubric:
                    score = rubric(client, key, gen.prompt, gen.text, sample.reference)
                    records.append(RubricRecord(key, score.score, score.stated, score.weighted, score.parse_failures,
                                                score.rationale, sample.cluster or key))
                return records

            _store(session, run, config_id, [rec for batch in client.map(one, todo) for rec in batch], table)
        log.info("judge usage for run %s: %s", run.id, client.usage)
