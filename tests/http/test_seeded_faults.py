"""Seeded faults fed in only through the public interfaces: `engine: openai` configs whose server
is a perturbing proxy (tests/http/perturb.py) in front of a real `canary engine-serve`, beside a
baseline that talks to the same server directly.

- Prompt log-probs that are all 0 would read as a perplexity ratio far below 1, a great result.
  It is a measurement_error naming the check; the run is incomplete and a gate does not pass.
- Generated text garbled after the model (a sampler or detokenizer bug) leaves the prompt
  log-probs exact, so the perplexity ratio is 1. The baseline model scoring the outputs
  (gen_nll_ratio) and the lossless exact match (same weights, same KV) both catch it.
- A TTFT regression of +80 ms on a server whose p50 is about 100 ms stays far inside the absolute
  budget (2000 ms), but the paired ttft_ratio flags it at the default number of prompts, while
  tpot_ratio, which the delay does not touch, stays near 1."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.gates import gate_verdict
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run

from tests.http.conftest import start_engine_serve
from tests.http.perturb import garble, proxy_app, zero_logprobs
from tests.loopback import free_port, serve_in_thread

MODEL = "builtin:pydoc-target"


@pytest.fixture(scope="module")
def engine_serve():
    proc, base = start_engine_serve("--model", MODEL)  # served under the model's path, as a config names it
    yield base
    proc.terminate()
    proc.wait(10)


def _proxy(app):
    port = free_port()
    server = serve_in_thread(app, port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


@pytest.fixture(scope="module")
def zeroing_proxy(engine_serve):
    yield from _proxy(proxy_app(engine_serve, fault=zero_logprobs))


@pytest.fixture(scope="module")
def garbling_proxy(engine_serve):
    yield from _proxy(proxy_app(engine_serve, stream_fault=garble(0.3, seed=1)))


def _run(cfg: dict) -> dict:
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run(cfg["project"], "s", None, InlineDispatcher())
    with session_scope() as session:
        return jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, cfg["project"]), run_id)))


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
    summary = _run(cfg)
    (ppl,) = [c for c in summary["comparisons"] if c["metric"] == "ppl_ratio"]
    assert ppl["config"] == "zeroed" and ppl["verdict"] == "measurement_error", ppl
    assert ppl["rule"].startswith("measurement error: logprobs: the candidate's log-probs are all 0"), ppl["rule"]
    assert ppl["details"]["measurement_error"] == "logprobs"
    assert summary["verdict"] == "incomplete" and "logprobs" in summary["verdict_reason"]
    assert gate_verdict(summary["verdict"], {"inconclusive": "pass"}) == "error"  # never a pass, whatever the policy


def test_garbled_output_with_exact_prompt_logprobs_is_caught_by_what_reads_the_text(sqlite_env, engine_serve,
                                                                                     garbling_proxy):
    served = {"engine": "openai", "weights": "fp32"}
    cfg = {
        "project": "garble", "model": {"name": "served", "path": MODEL},
        "configs": [{"name": "direct", "baseline": True, **served, "engine_options": {"base_url": engine_serve + "/v1"}},
                    {"name": "garbled", **served, "engine_options": {"base_url": garbling_proxy + "/v1"}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 10, "seed": 2, "perplexity": {"window": 64},
                    "generation": {"prompts": 10, "prompt_words": 8, "max_new_tokens": 12}}],
    }
    summary = _run(cfg)
    got = {c["metric"]: c for c in summary["comparisons"] if c["config"] == "garbled"}
    assert got["ppl_ratio"]["estimate"] == pytest.approx(1.0, abs=1e-9)  # prompt log-probs untouched: blind
    assert got["ppl_ratio"]["verdict"] == "ok"
    gen = got["gen_nll_ratio"]  # the baseline model finds the garbled outputs far less likely than its own
    assert gen["verdict"] == "critical" and gen["ci_low"] >= 1.30, gen
    exact = got["lossless_exact_match"]  # same weights and KV as the baseline: its outputs must be identical
    assert exact["verdict"] in ("warn", "critical") and exact["details"]["first_divergence"], exact
    assert summary["verdict"] == "fail"


def test_an_80_ms_ttft_regression_is_flagged_by_the_paired_ratio(sqlite_env, engine_serve):
    proxies = [_proxy(proxy_app(engine_serve, delay_ms=delay)) for delay in (90, 170)]  # ~100 ms p50, then +80 ms
    base_url, slow_url = (next(p) for p in proxies)
    try:
        served = {"engine": "openai", "weights": "fp32"}
        cfg = {
            "project": "ttft", "model": {"name": "served", "path": MODEL},
            "configs": [{"name": "served", "baseline": True, **served, "engine_options": {"base_url": base_url + "/v1"}},
                        {"name": "slower", **served, "engine_options": {"base_url": slow_url + "/v1"}}],
            # the default number of prompts (16); short outputs keep the test quick; one request at a time,
            # so that the ~100 ms p50 is the server's own and not 8 requests' queueing
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 16, "seed": 4,
                        "perplexity": {"window": 64},
                        "generation": {"prompt_words": 8, "max_new_tokens": 4, "concurrency": 1}}],
        }
        summary = _run(cfg)
    finally:
        for p in proxies:
            next(p, None)
    got = {c["metric"]: c for c in summary["comparisons"] if c["config"] == "slower"}
    assert got["ttft_ms"]["verdict"] == "ok"  # p50 ≈ 180 ms is far inside the 2000 ms budget
    ratio = got["ttft_ratio"]
    assert ratio["n"] == 16 and ratio["baseline_value"] >= 90 and ratio["candidate_value"] >= 170, ratio
    assert ratio["ci_low"] > 1.0 and 1.2 < ratio["estimate"] < 3.0, ratio  # surely slower, by about 80 ms in 100
    if ratio["baseline_value"] <= 130:  # the scenario asked for (a busy host adds its own ms to both sides)
        assert ratio["verdict"] in ("warn", "critical"), ratio
    assert got["tpot_ratio"]["ci_low"] < 1.25  # the delay is before the first token only
    assert not any(c["metric"] in ("ttft_ms", "ttft_ratio") for c in summary["comparisons"] if c["config"] == "served")
