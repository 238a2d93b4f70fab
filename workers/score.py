"""CPU scorers over a run's generations: LLM-as-judge and RAG faithfulness. They run in the
aggregate task (queue `default`/`cpu`, never on a GPU worker) once every config-run is done,
write per-sample results idempotently (a retried aggregation re-scores nothing already stored),
and report a scorer that failed — with why — instead of failing the run: the other scorers'
results stand."""

from __future__ import annotations

import logging

from app import repo
from app.models import Run, Suite
from evals.faithfulness import JudgeFaithfulness, MissingContexts, OfflineFaithfulness
from evals.judge import JudgeClient, JudgeConfig, JudgeError, pairwise, rubric

log = logging.getLogger(__name__)
WIN_VALUE = {"candidate": 1.0, "tie": 0.5, "baseline": 0.0}
_OFFLINE: dict[float, OfflineFaithfulness] = {}  # the embedder loads once per process


def judge_client(settings: dict) -> JudgeClient:
    """The judge's URL and key name pass the outbound policy again here, at use; every request
    then goes through a transport that checks the URL and pins the address it checked."""
    from workers.outbound import judge_http

    key, transport = judge_http(settings)
    return JudgeClient(JudgeConfig(
        base_url=settings["base_url"], model=settings["model"], api_key=key,
        concurrency=settings.get("concurrency", 4), requests_per_second=settings.get("requests_per_second"),
        timeout_s=settings.get("timeout_s", 30)), transport=transport)


def score_run(session, run: Run) -> dict[str, str]:
    """Run the suite's CPU scorers; returns {scorer: why it failed} for those that failed."""
    suite = session.get(Suite, run.suite_id)
    scorers = suite.spec.get("scorers", [])
    failed: dict[str, str] = {}
    if not {"judge", "faithfulness"} & set(scorers):
        return failed
    samples = {x.key: x for x in repo.suite_samples(session, suite.id, run.suite_version, run.sample_keys)}
    done = [cr for cr in run.config_runs if cr.status == "succeeded"]
    gens = {cr.config_id: {r.sample_key: r for r in repo.sample_results(session, run.id, cr.config_id, "ttft_ms")} for cr in done}
    if "faithfulness" in scorers:
        try:
            _faithfulness(session, run, suite.spec, samples, gens)
        except (JudgeError, MissingContexts, RuntimeError, ValueError) as e:
            failed["faithfulness"] = str(e)
    if "judge" in scorers:
        try:
            _judge(session, run, suite.spec, samples, gens)
        except (JudgeError, ValueError) as e:  # ValueError: the SSRF policy refused the judge URL
            failed["judge"] = str(e)
    return failed


def _faithfulness(session, run: Run, spec: dict, samples: dict, gens: dict) -> None:
    settings = spec.get("faithfulness", {})
    client = None
    if settings.get("method", "offline") == "judge":
        client = judge_client(spec["judge"])
        scorer = JudgeFaithfulness(client)
    else:
        t = settings.get("threshold", 0.6)
        scorer = _OFFLINE.setdefault(t, OfflineFaithfulness(t))
    try:
        for config_id, by_key in gens.items():
            have = {r.sample_key for r in repo.sample_results(session, run.id, config_id, "faithfulness")}
            rows = []
            for key, g in by_key.items():
                if key in have:
                    continue
                sample = samples[key]
                contexts = sample.contexts if sample.contexts is not None else [sample.text]  # a document is its own context
                question = sample.text if sample.kind == "rag" else (g.extra or {}).get("prompt", "")
                if isinstance(scorer, JudgeFaithfulness):
                    res = scorer.score(key, g.extra["text"], contexts, question)
                else:
                    res = scorer.score(key, g.extra["text"], contexts)
                rows.append({"sample_key": key, "metric": "faithfulness", "value": res.score,
                             "extra": {"outcome": res.outcome, "method": res.method, "parse_failures": res.parse_failures,
                                       "statements": [{"statement": st, "supported": ok} for st, ok in res.statements],
                                       "cluster": sample.cluster or key}})
            repo.write_sample_results(session, run.id, config_id, rows)
            session.commit()
    finally:
        if client:
            client.close()


def _judge(session, run: Run, spec: dict, samples: dict, gens: dict) -> None:
    settings = spec["judge"]
    mode = settings.get("mode", "pairwise")
    base = gens.get(run.baseline_config_id, {})
    with judge_client(settings) as client:
        for config_id, by_key in gens.items():
            have = {(r.sample_key, r.metric) for r in repo.sample_results(session, run.id, config_id)}
            todo = [k for k in by_key if k in base]

            def one(key: str, config_id=config_id, by_key=by_key, have=have) -> list[dict]:
                sample, g = samples[key], by_key[key]
                question = (g.extra or {}).get("prompt", "")
                rows = []
                if mode in ("pairwise", "both") and config_id != run.baseline_config_id and (key, "judge_pairwise") not in have:
                    v = pairwise(client, key, question, base[key].extra["text"], g.extra["text"], sample.reference)
                    rows.append({"sample_key": key, "metric": "judge_pairwise", "value": WIN_VALUE.get(v.winner),
                                 "extra": {"winner": v.winner, "consistent": v.consistent, "orders": list(v.orders),
                                           "parse_failures": v.parse_failures, "rationale": v.rationale,
                                           "cluster": sample.cluster or key}})
                if mode in ("rubric", "both") and (key, "judge_score") not in have:
                    r = rubric(client, key, question, g.extra["text"], sample.reference)
                    rows.append({"sample_key": key, "metric": "judge_score", "value": r.score,
                                 "extra": {"stated": r.stated, "weighted": r.weighted, "parse_failures": r.parse_failures,
                                           "rationale": r.rationale, "outcome": "scored" if r.score is not None else "parse_failure",
                                           "cluster": sample.cluster or key}})
                return rows

            rows = [row for batch in client.map(one, todo) for row in batch]
            repo.write_sample_results(session, run.id, config_id, rows)
            session.commit()
        log.info("judge usage for run %s: %s", run.id, client.usage)
