"""The labelled scorer over an OpenAI-compatible server: a real `canary engine-serve` serving the
tiny model in fp32, asked the built-in task's items through the openai engine, answers each item as
the reference engine in-process does. Over HTTP the engine cannot place the server's tokens in the
text, so a choice's Σ log p is the whole text's log-likelihood less the prompt's own
(vocabulary/labelled.py continuation_loglikelihood)."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run

pytestmark = pytest.mark.integration


def test_a_served_model_answers_the_items_as_the_in_process_engine_does(sqlite_env, engine_serve):
    cfg = {
        "project": "lab-http", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "local", "baseline": True, "weights": "fp32"},
                    {"name": "served", "engine": "openai", "weights": "fp32",
                     "engine_options": {"base_url": engine_serve + "/v1", "served_model": "pydoc-target"}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 2, "seed": 1,
                    "scorers": ["perplexity", "labelled"], "perplexity": {"window": 256},
                    "labelled": {"items": "builtin:pydoc-next-word", "max_items": 24}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run("lab-http", "s", None, InlineDispatcher())
    with session_scope() as session:
        run = repo.get_run(session, repo.get_project(session, "lab-http"), run_id)
        summary = jsonable(run_summary(session, run))
        rows = {cr.config.name: {r.sample_key: r for r in repo.sample_results(session, run_id, cr.config_id, "item")}
                for cr in run.config_runs}
    assert summary["status"] == "done", summary
    local, served = rows["local"], rows["served"]
    assert len(local) == len(served) == 24
    gap = max(abs(a - b) for k in local for a, b in zip(local[k].extra["scores"], served[k].extra["scores"], strict=True))
    assert gap < 1e-3, gap  # float32 logits on both sides, summed over a few tokens
    assert {k: r.value for k, r in local.items()} == {k: r.value for k, r in served.items()}
    flips = next(c for c in summary["comparisons"] if c["config"] == "served" and c["metric"] == "task_flips")
    assert flips["estimate"] == 0 and flips["n"] == 24
