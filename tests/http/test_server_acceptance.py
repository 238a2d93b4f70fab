"""Spec-decode acceptance over HTTP comes from the server's counter deltas, which any other traffic
on that server moves. They are the run's acceptance only for a config that says its server is
dedicated (engine_options.dedicated_server); otherwise they are reported in figures.server and
not judged. A real `canary engine-serve` with n-gram speculation, two configs pointing at it."""

from __future__ import annotations

import pytest

from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.services import apply_config_file, run_summary, start_run
from tests.http.conftest import start_engine_serve

MODEL = "builtin:pydoc-target"


@pytest.fixture(scope="module")
def servers():
    plain, plain_url = start_engine_serve("--model", MODEL)
    ngram, ngram_url = start_engine_serve("--model", MODEL, "--speculative", '{"method": "ngram", "k": 4}')
    yield plain_url, ngram_url
    for proc in (plain, ngram):
        proc.terminate()
        proc.wait(10)


def test_counter_deltas_are_judged_only_on_a_dedicated_server(sqlite_env, servers):
    plain_url, ngram_url = servers
    ngram = {"engine": "openai", "weights": "fp32", "speculative": {"method": "ngram", "k": 4}}
    cfg = {
        "project": "acc", "model": {"name": "served", "path": MODEL},
        "configs": [{"name": "base", "baseline": True, "engine": "openai", "weights": "fp32",
                     "engine_options": {"base_url": plain_url + "/v1"}},
                    {"name": "shared", **ngram, "engine_options": {"base_url": ngram_url + "/v1"}},
                    {"name": "dedicated", **ngram, "engine_options": {"base_url": ngram_url + "/v1", "dedicated_server": True}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "seed": 5, "perplexity": {"window": 64},
                    "generation": {"prompts": 4, "prompt_words": 12, "max_new_tokens": 16, "paired_timing": False}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run("acc", "s", None, InlineDispatcher())
    with session_scope() as session:
        summary = run_summary(session, repo.get_run(session, repo.get_project(session, "acc"), run_id))
    figures = summary["figures"]
    acceptance = {c["config"]: c for c in summary["comparisons"] if c["metric"] == "spec_acceptance_rate"}

    shared = figures["shared"]["server"]
    assert shared["dedicated"] is False and shared["spec"]["num_drafts"] > 0  # reported ...
    assert "shared" not in acceptance and "spec" not in figures["shared"]  # ... not judged
    assert shared["foreign_traffic_batches"] == 0  # nothing else ran on the server

    dedicated = figures["dedicated"]
    assert dedicated["server"]["dedicated"] is True
    assert acceptance["dedicated"]["estimate"] == pytest.approx(dedicated["spec"]["acceptance_rate"])
    assert dedicated["spec"]["num_draft_tokens"] == dedicated["server"]["spec"]["num_draft_tokens"] > 0
