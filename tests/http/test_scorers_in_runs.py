"""Judge, faithfulness and agreement wired into whole runs (embedded default, the real tiny model,
the scripted judge on loopback): per-sample results, comparisons worked out by hand, and a
scorer that fails is reported while the other scorers' results stand."""

from __future__ import annotations

import json

import pytest
from app import repo
from app.config_file import ConfigFileError, parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from fastapi import Request


def config(judge_url: str, scorers: list[str], corpus: str = "builtin:pydoc-heldout", **suite) -> dict:
    return {
        "project": "t",
        "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [
            {"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
            {"name": "fp32-again", "engine": "reference", "weights": "fp32"},  # the same config: must agree exactly
            {"name": "int2", "engine": "reference", "weights": "rtn-int2"},
        ],
        "suites": [{"name": "s", "corpus": corpus, "samples": 10, "seed": 3, "scorers": scorers,
                    "perplexity": {"window": 64, "stride": 64},
                    "generation": {"prompts": 10, "prompt_words": 8, "max_new_tokens": 8},
                    "judge": {"base_url": judge_url, "model": "judge", "mode": "both", "timeout_s": 5}, **suite}],
    }


def run(cfg: dict) -> dict:
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg))
    run_id, _ = start_run("t", "s", None, InlineDispatcher())
    with session_scope() as s:
        return jsonable(run_summary(s, repo.get_run(s, repo.get_project(s, "t"), run_id)))


def comp(summary: dict, config: str, metric: str) -> dict:
    return next(c for c in summary["comparisons"] if c["config"] == config and c["metric"] == metric)


def test_judge_faithfulness_and_agreement_in_a_run(sqlite_env, judge_server):
    summary = run(config(judge_server.base_url, ["perplexity", "generation", "judge", "faithfulness", "agreement"],
                         faithfulness={"method": "judge"}))
    assert summary["status"] == "done"
    # the scripted judge ties every pair (no answer says RIGHT) in both orders: win rate ½ exactly,
    # every verdict position-consistent; it scores every answer 2, so the rubric delta is 0
    for name in ("fp32-again", "int2"):
        w = comp(summary, name, "judge_win_rate")
        assert (w["estimate"], w["n"], w["details"]["ties"], w["details"]["position_consistency"]) == (0.5, 10, 10, 1.0)
        d = comp(summary, name, "judge_score_delta")
        assert (d["estimate"], d["baseline_value"], d["candidate_value"]) == (0.0, 2.0, 2.0)
    # the same config twice agrees exactly; int2 does not
    assert comp(summary, "fp32-again", "exact_match")["estimate"] == 1.0
    assert comp(summary, "fp32-again", "top1_agreement")["estimate"] == 1.0
    assert comp(summary, "int2", "top1_agreement")["estimate"] < 1.0
    # faithfulness by the judge: recompute the mean from the stored per-sample statements
    with session_scope() as s:
        r = repo.get_run(s, repo.get_project(s, "t"), summary["run_id"])
        cid = next(cr.config_id for cr in r.config_runs if cr.config.name == "int2")
        rows = repo.sample_results(s, r.id, cid, "faithfulness")
        by_hand = [sum(x["supported"] for x in row.extra["statements"]) / len(row.extra["statements"])
                   for row in rows if row.extra["outcome"] == "scored"]
        judge_rows = repo.sample_results(s, r.id, cid, "judge_pairwise")
    f = comp(summary, "int2", "faithfulness")
    assert f["estimate"] == pytest.approx(sum(by_hand) / len(by_hand)) and f["n"] == len(by_hand)
    assert f["details"]["method"].startswith("judge")
    assert len(judge_rows) == 10 and {row.extra["winner"] for row in judge_rows} == {"tie"}


def test_a_failing_judge_is_reported_and_the_other_scorers_stand(sqlite_env, judge_server):
    judge_server.script = [{"status": 400}] * 1000
    summary = run(config(judge_server.base_url, ["perplexity", "generation", "judge", "faithfulness"]))
    failed = comp(summary, "int2", "judge_win_rate")
    assert failed["verdict"] == "inconclusive" and "scorer 'judge' failed" in failed["rule"] and "HTTP 400" in failed["rule"]
    assert comp(summary, "int2", "ppl_ratio")["n"] == 10  # perplexity stands
    f = comp(summary, "int2", "faithfulness")  # offline faithfulness needs no judge: it stands too
    assert f["n"] > 0 or f["details"]["no_statements"] > 0
    assert "offline approximation" in f["rule"] and f["details"]["method"].startswith("offline-approximation")
    assert "judge" in summary["verdict_reason"]


def test_a_rag_item_without_contexts_fails_faithfulness_naming_the_sample(sqlite_env, judge_server, tmp_path):
    corpus = tmp_path / "rag.jsonl"
    rows = [{"id": f"q{i}", "text": f"What does function number {i} of the os module return to its caller?",
             "contexts": [f"Function {i} returns a path string."]} for i in range(10)]
    rows[4]["contexts"] = []
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    summary = run(config(judge_server.base_url, ["perplexity", "generation", "faithfulness"], corpus=str(corpus)))
    f = comp(summary, "int2", "faithfulness")
    assert "scorer 'faithfulness' failed: sample 'q4': a RAG item needs at least one non-empty context" in f["rule"]
    assert comp(summary, "int2", "ppl_ratio")["n"] == 10


@pytest.mark.parametrize("suite,message", [
    ({"scorers": ["perplexity", "judge"]}, "'judge' reads the generation scorer's output; add 'generation'"),
    ({"scorers": ["perplexity", "generation", "judge"], "judge": {"model": "m"}}, "judge.base_url and judge.model"),
    ({"judge": {"base_url": "ftp://x", "model": "m"}}, "'ftp://x' is not an http(s) URL"),
])
def test_bad_scorer_settings_name_the_field(suite, message):
    cfg = config("http://127.0.0.1:1/v1", ["perplexity", "generation"])
    cfg["suites"][0].update(suite)
    if "judge" in suite and "base_url" not in suite["judge"]:
        cfg["suites"][0]["judge"] = suite["judge"]
    with pytest.raises(ConfigFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(cfg)


def test_no_database_transaction_is_open_while_the_judge_answers(monkeypatch):
    """The aggregation reads what the judge needs, closes its transaction, and only then calls the
    judge (each config's scores commit on their own): a slow judge holds no Postgres transaction,
    so no lock or connection of the shared database waits on another tenant's judge."""
    import os

    import psycopg
    from app.db import upgrade
    from app.settings import get_settings

    from tests.conftest import throwaway_pg_database
    from tests.http.scripted import ScriptedJudge
    from tests.loopback import free_port, serve_in_thread

    open_transactions: list[int] = []

    class WatchingJudge(ScriptedJudge):
        async def chat(self, request: Request):
            with psycopg.connect(db, autocommit=True) as conn:  # every other session of the run's database
                open_transactions.append(conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'").fetchone()[0])
            return await super().chat(request)

    server_url = os.environ.get("CANARY_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    with throwaway_pg_database(server_url, "canary_judge_tx") as db:
        for name, value in {"CANARY_DATABASE_URL": db, "CANARY_EXECUTION": "inline", "CANARY_ESCALATION": "false",
                            "CANARY_URL_ALLOWLIST": "127.0.0.1:*"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("CANARY_BROKER_URL", raising=False)
        get_settings.cache_clear()
        upgrade(db)
        judge = WatchingJudge()
        port = free_port()
        server = serve_in_thread(judge.app, port)
        try:
            cfg = config(f"http://127.0.0.1:{port}/v1", ["perplexity", "generation", "judge"], samples=4,
                         generation={"prompts": 4, "prompt_words": 8, "max_new_tokens": 8})
            cfg["configs"] = cfg["configs"][::2]  # the baseline and int2
            summary = run(cfg)
        finally:
            server.should_exit = True
            get_settings.cache_clear()
            from app.db import get_engine

            get_engine(db).dispose()  # the pool's connections, before the database is dropped
    assert summary["status"] == "done" and comp(summary, "int2", "judge_win_rate")["n"] == 4, comp(summary, "int2", "judge_win_rate")["rule"]
    # pairwise (both orders) and rubric calls on 4 prompts, each seeing no transaction left open
    assert len(open_transactions) >= 8 and set(open_transactions) == {0}, open_transactions
