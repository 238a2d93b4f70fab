"""Next-token distributions against the baseline where the candidate is a server: a real `canary
engine-serve` returns each position's top 20 (echo, `logprobs: 20`, vLLM's
`return_tokens_as_token_ids`), and the run's kld_mean is the lower bound that both sides' top 20
give (evals/distribution.py doc_distribution_topk), said so in its details: the candidate's table
against the baseline's, each stored once by its own config-run and compared at aggregation, so
a gate that reuses the baseline's rows compares with the table they carry. The same model served
in fp32 reads KL ≈ 0 with the same top token everywhere; RTN int2 weights served read a lower
bound at most the in-process KL of the same config, and above the fp32 one."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.models import SampleResult
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from evals.records import read_row
from sqlalchemy import select

from tests.http.conftest import serving

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine_serve_int2():
    yield from serving("--served-model-name", "pydoc-int2", "--weights", "rtn-int2")


def test_a_served_candidate_s_kl_is_the_lower_bound_from_both_top_20s(sqlite_env, engine_serve, engine_serve_int2):
    def served(name, base, model, weights):
        return {"name": name, "engine": "openai", "weights": weights,
                "engine_options": {"base_url": base + "/v1", "served_model": model}}

    cfg = {
        "project": "kl-http", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "local", "baseline": True, "engine": "reference", "weights": "fp32"},
                    {"name": "local-int2", "engine": "reference", "weights": "rtn-int2"},
                    served("served", engine_serve, "pydoc-target", "fp32"),
                    served("served-int2", engine_serve_int2, "pydoc-int2", "rtn-int2")],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 3, "seed": 1,
                    "scorers": ["perplexity"], "perplexity": {"window": 256, "distribution_samples": 3}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run("kl-http", "s", None, InlineDispatcher(), trigger="gate", idempotency_key="g1")
    with session_scope() as session:
        project = repo.get_project(session, "kl-http")
        summary = jsonable(run_summary(session, repo.get_run(session, project, run_id)))
        stored = {(c, r.sample_key): read_row(r.metric, r.sample_key, r.value, r.extra)
                  for c in ("local", "served-int2", "local-int2")
                  for r in session.execute(select(SampleResult).where(
                      SampleResult.run_id == run_id, SampleResult.metric == "nll",
                      SampleResult.config_id == repo.get_config(session, project, c).id)).scalars()}
    assert summary["status"] == "done", summary
    # the baseline and the served candidate store their own top 20 once; the in-process candidate
    # compared whole distributions with the baseline engine's and stores none
    assert {c: sum(r.topk is not None for (cc, _), r in stored.items() if cc == c) for c in
            ("local", "served-int2", "local-int2")} == {"local": 3, "served-int2": 3, "local-int2": 0}
    assert all(r.topk.k == 20 for r in stored.values() if r.topk is not None)
    kld = {c["config"]: c for c in summary["comparisons"] if c["metric"] == "kld_mean"}
    assert set(kld) == {"local-int2", "served", "served-int2"}, [(c["config"], c["metric"]) for c in summary["comparisons"]]
    local, same, lossy = kld["local-int2"], kld["served"], kld["served-int2"]
    assert "kld_bound" not in local["details"] and local["details"]["topk_bounds"]["bracketed"] == 1.0
    for c in (same, lossy):
        assert c["details"]["kld_bound"] == "lower" and "topk_bounds" not in c["details"]
        assert c["details"]["tokens"] == local["details"]["tokens"]  # every scored token, on both paths
    assert same["estimate"] < 1e-6 and same["details"]["same_top"] == 1.0
    # the same weights in-process and served: the server's bound is at most the whole-vocabulary KL,
    # and the figures a top token and the right token's probability give are the same on both paths
    assert 1e-3 < lossy["estimate"] <= local["estimate"] * (1 + 1e-4)
    assert lossy["details"]["same_top"] == pytest.approx(local["details"]["same_top"], abs=1e-9)
    assert lossy["details"]["dp_rms"] == pytest.approx(local["details"]["dp_rms"], rel=1e-3)
    # KLD by position in the window (0–127, 128–255), the same tokens in each bucket on both paths
    buckets = {c: [(b["positions"], b["tokens"]) for b in kld[c]["details"]["by_position"]] for c in kld}
    assert [p for p, _ in buckets["local-int2"]] == ["0–127", "128–255"], buckets
    assert buckets["local-int2"] == buckets["served-int2"] == buckets["served"]
    assert sum(n for _, n in buckets["local-int2"]) == local["details"]["tokens"]
    # a second gate reuses the baseline's rows, its top-k tables with them: the same figures
    again, _ = start_run("kl-http", "s", ["served-int2"], InlineDispatcher(), trigger="gate", idempotency_key="g2")
    with session_scope() as session:
        run = repo.get_run(session, repo.get_project(session, "kl-http"), again)
        second = jsonable(run_summary(session, run))
    assert second["figures"]["local"]["reused_from_run"] == run_id
    (reused,) = [c for c in second["comparisons"] if c["config"] == "served-int2" and c["metric"] == "kld_mean"]
    assert reused["estimate"] == pytest.approx(lossy["estimate"], rel=1e-6)
    print(f"rtn-int2 KLD by position: {[(b['positions'], round(b['estimate'], 5)) for b in local['details']['by_position']]}")
    print(f"rtn-int2 KL: whole vocabulary {local['estimate']:.5f}, served top-20 lower bound {lossy['estimate']:.5f}")


def _refusing(status: int, message: str):
    """A proxy in front of the real engine-serve that answers every echo asking for top-20
    log-probs with `status` (tests/http/perturb.py proxy_app `refuse`); everything else is relayed."""
    from tests.http.perturb import proxy_app

    def refuse(asked: dict):
        return (status, message) if asked.get("echo") and asked.get("logprobs") == 20 else None
    return refuse, proxy_app


@pytest.mark.parametrize("status", [400, 503])
def test_a_baseline_server_that_refuses_top_k_is_noted_and_one_that_errors_fails_the_pass(sqlite_env, engine_serve,
                                                                                       status):
    """A refusal (HTTP 400: vLLM past its --max-logprobs) means the server cannot give top-k: the
    baseline's config-run completes with a note and no candidate gets kld_mean. A server error
    (503) is not a refusal: the pass fails naming it, as the echo for perplexity would, rather than
    leave every candidate of the run silently without kld_mean."""
    from tests.loopback import free_port, serve_in_thread

    refuse, proxy_app = _refusing(status, "requested logprobs of 20 exceeds max_logprobs" if status == 400
                                  else "engine is overloaded")
    port = free_port()
    server = serve_in_thread(proxy_app(engine_serve, refuse=refuse), port)
    try:
        project = f"kl-refused-{status}"
        cfg = {
            "project": project, "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "base", "baseline": True, "engine": "openai", "weights": "fp32",
                         "engine_options": {"base_url": f"http://127.0.0.1:{port}/v1", "served_model": "pydoc-target"}},
                        {"name": "cand", "engine": "openai", "weights": "fp32",
                         "engine_options": {"base_url": engine_serve + "/v1", "served_model": "pydoc-target"}}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 2, "seed": 1,
                        "scorers": ["perplexity"], "perplexity": {"window": 128, "distribution_samples": 2}}],
        }
        with session_scope() as session:
            apply_config_file(session, parse_config(cfg))
        run_id, _ = start_run(project, "s", None, InlineDispatcher())
        with session_scope() as session:
            summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, project), run_id)))
    finally:
        server.should_exit = True
    configs = {c["config"]: c for c in summary["configs"]}
    metrics = {c["metric"] for c in summary["comparisons"]}
    if status == 400:
        assert summary["status"] == "done", summary
        assert configs["base"]["status"] == "succeeded" and "kld_mean" not in metrics and "ppl_ratio" in metrics
        [note] = [n for n in summary["figures"]["base"]["notes"] if "kld_mean" in n]
        assert "HTTP 400" in note and "max_logprobs" in note, note
    else:
        assert configs["base"]["status"] == "failed", configs["base"]
        assert "HTTP 503" in configs["base"]["error"] and "engine is overloaded" in configs["base"]["error"]
        assert summary["status"] != "done" and summary["verdict"] != "pass", summary
