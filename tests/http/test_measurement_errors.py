"""A broken measurement is an error, not a verdict (evals/sanity.py), fed in only through the
public interfaces: an `engine: openai` config whose server answers prompt log-probs that are all
0 (a perturbing proxy in front of a real `canary engine-serve`) would read as a perplexity ratio
far below 1, a great result. Its comparison is a measurement_error naming the check, the run is
incomplete, and a gate on it does not pass."""

from __future__ import annotations

import pytest

from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.gates import gate_verdict
from app.services import apply_config_file, run_summary, start_run
from tests.http.conftest import start_engine_serve
from tests.http.perturb import proxy_app, zero_logprobs
from tests.loopback import free_port, serve_in_thread

MODEL = "builtin:pydoc-target"


@pytest.fixture(scope="module")
def engine_serve():
    proc, base = start_engine_serve("--model", MODEL)  # served under the model's path, as a config names it
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def zeroing_proxy(engine_serve):
    port = free_port()
    server = serve_in_thread(proxy_app(engine_serve, zero_logprobs), port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


def test_all_zero_logprobs_are_a_measurement_error_and_the_run_is_incomplete(sqlite_env, engine_serve, zeroing_proxy):
    served = {"engine": "openai", "weights": "fp32"}
    cfg = {
        "project": "sane", "model": {"name": "served", "path": MODEL},
        "configs": [{"name": "direct", "baseline": True, **served,
                     "engine_options": {"base_url": engine_serve + "/v1"}},
                    {"name": "zeroed", **served, "engine_options": {"base_url": zeroing_proxy + "/v1"}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 1, "scorers": ["perplexity"],
                    "perplexity": {"window": 64}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run("sane", "s", None, InlineDispatcher())
    with session_scope() as session:
        summary = run_summary(session, repo.get_run(session, repo.get_project(session, "sane"), run_id))
    (ppl,) = [c for c in summary["comparisons"] if c["metric"] == "ppl_ratio"]
    assert ppl["config"] == "zeroed" and ppl["verdict"] == "measurement_error", ppl
    assert ppl["rule"].startswith("measurement error: logprobs: the candidate's log-probs are all 0"), ppl["rule"]
    assert ppl["details"]["measurement_error"] == "logprobs"
    assert summary["verdict"] == "incomplete" and "logprobs" in summary["verdict_reason"]
    assert gate_verdict(summary["verdict"], {"inconclusive": "pass"}) == "error"  # never a pass, whatever the policy
