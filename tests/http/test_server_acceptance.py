"""Spec-decode acceptance over HTTP comes from the server's counter deltas, which any other traffic
on that server moves. They are the run's acceptance only for a config that says its server is
dedicated (engine_options.dedicated_server); otherwise they are reported in figures.server and
not judged. Where the server reports each request's own figures (vLLM's
--per-request-spec-decode-metrics summary, which `canary engine-serve` speaks too), those are the
acceptance, on a shared server as well, whatever else runs there. A real `canary engine-serve`
with n-gram speculation, configs pointing at it; the openai SDK as the client where a user's
client reads the figures."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
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


@pytest.fixture(scope="module")
def per_request_server():
    proc, url = start_engine_serve("--model", MODEL, "--speculative", '{"method": "ngram", "k": 4}',
                                   "--per-request-spec-decode-metrics", "summary")
    yield url
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
        summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "acc"), run_id)))
    figures = summary["figures"]
    acceptance = {c["config"]: c for c in summary["comparisons"] if c["metric"] == "spec_acceptance_rate"}

    shared = figures["shared"]["server"]
    assert shared["dedicated"] is False and shared["spec"]["num_drafts"] > 0  # reported ...
    assert "shared" not in acceptance and figures["shared"]["spec"] is None  # ... not judged
    assert shared["foreign_traffic_batches"] == 0  # nothing else ran on the server

    dedicated = figures["dedicated"]
    assert dedicated["server"]["dedicated"] is True
    assert acceptance["dedicated"]["estimate"] == pytest.approx(dedicated["spec"]["acceptance_rate"])
    assert dedicated["spec"]["num_draft_tokens"] == dedicated["server"]["spec"]["num_draft_tokens"] > 0


def test_each_response_carries_its_own_acceptance_read_by_the_openai_sdk(per_request_server):
    """The summary object as vLLM sends it, on a plain and a streamed completion: its histogram
    counts steps by accepted drafts, so Σ j·histogram[j] is the accepted tokens and Σ histogram the
    steps, and the canary's reader turns it back into the same counters."""
    import openai
    from engines.server_metrics import spec_from_response

    client = openai.OpenAI(base_url=per_request_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "os.path.join(a, b) joins paths; os.path.join(a, b, c) joins"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    figures = plain.model_extra["metrics"]["speculative_decoding"]
    histogram = figures["acceptance_histogram"]
    assert len(histogram) == figures["num_spec_tokens"] + 1 == 5
    assert sum(histogram) == figures["num_spec_steps"] > 0
    assert sum(j * n for j, n in enumerate(histogram)) == figures["num_accepted_draft_tokens"]
    assert figures["draft_acceptance_rate"] == pytest.approx(figures["num_accepted_draft_tokens"]
                                                             / figures["num_draft_tokens"])
    stats = spec_from_response(plain.model_dump())
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        figures["num_spec_steps"], figures["num_draft_tokens"], figures["num_accepted_draft_tokens"])
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    last = streamed[-1]  # the usage chunk, no choices: the figures ride there, as in vLLM
    assert last.choices == [] and last.model_extra["metrics"]["speculative_decoding"] == figures
    assert all("metrics" not in (chunk.model_extra or {}) for chunk in streamed[:-1])
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
    assert "metrics" not in (two.model_extra or {})  # n > 1: no per-request figures, as vLLM


def test_per_request_figures_are_the_acceptance_on_a_shared_server_whatever_else_runs(sqlite_env,
                                                                                    per_request_server):
    """A config on a server it shares (not dedicated): the acceptance is judged from the responses'
    own figures; a stranger's requests during the run move the server's counters, which are
    flagged as foreign and do not change the judged figure."""
    import threading

    import httpx

    stop = threading.Event()

    def stranger():  # another team's traffic on the same server
        with httpx.Client(base_url=per_request_server + "/v1", timeout=60) as http:
            while not stop.is_set():
                http.post("/completions", json={"model": MODEL, "prompt": "import sys; sys.path", "max_tokens": 16,
                                                "temperature": 0})

    cfg = {
        "project": "acc2", "model": {"name": "served", "path": MODEL},
        "configs": [{"name": "base", "baseline": True, "engine": "reference", "weights": "fp32"},
                    {"name": "shared", "engine": "openai", "weights": "fp32", "speculative": {"method": "ngram", "k": 4},
                     "engine_options": {"base_url": per_request_server + "/v1"}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "seed": 5, "perplexity": {"window": 64},
                    "generation": {"prompts": 4, "prompt_words": 12, "max_new_tokens": 16, "paired_timing": False}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    other = threading.Thread(target=stranger, daemon=True)
    other.start()
    try:
        run_id, _ = start_run("acc2", "s", None, InlineDispatcher())
    finally:
        stop.set()
        other.join(60)
    with session_scope() as session:
        summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "acc2"), run_id)))
    figures = summary["figures"]["shared"]
    acceptance = next(c for c in summary["comparisons"] if c["config"] == "shared"
                      and c["metric"] == "spec_acceptance_rate")
    assert acceptance["verdict"] != "measurement_error" and acceptance["n"] == 4  # one per request
    assert acceptance["estimate"] == pytest.approx(figures["spec"]["acceptance_rate"])
    assert figures["server"]["dedicated"] is False
    assert figures["server"]["foreign_traffic_batches"] >= 1  # the stranger moved the counters ...
    assert figures["server"]["spec"]["num_draft_tokens"] > figures["spec"]["num_draft_tokens"]  # ... not ours
