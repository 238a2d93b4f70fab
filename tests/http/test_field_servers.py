"""Verdicts against field-like servers: every config is `engine: openai` and reaches one real
`canary engine-serve` (continuous batching, fp32) through a perturbing proxy with a seeded
behaviour of known truth (tests/http/perturb.py), the baseline included, and the run goes through
the same service call as `canary run` (start_run, tasks in-process).

    config      proxy behaviour                                        truth
    base        near-tie flips in ~half the answers, drawn per request  (the baseline: a GPU server)
    spec-null   the same, independently (a lossless config)            null
    spec-bug    flips at the most confident token in ~half              regression (confident_divergence)
    empty       a quarter of the answers empty                          regression (empty_answers)
    loop        half the answers loop on one token                      regression (degenerate_answers)
    batched     answers swapped between requests that share the server  regression (batch_divergence)
    cut         half the answers cut to their first quarter                regression (output_length_ratio)

The suite runs 16 prompts at concurrency 8 (two full batches), 8 of them also sent alone. A last
test needs no proxy: engine-serve in bf16, whose batched numerics depend on the batch, against
itself."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run

from tests.http.conftest import start_engine_serve
from tests.http.perturb import (
    confident_flips,
    corrupt_when_batched,
    empty_answers,
    loops,
    near_tie_flips,
    proxy_app,
    truncation,
)
from tests.loopback import free_port, serve_in_thread

MODEL = "builtin:pydoc-target"
FLAGGED = ("warn", "critical")
BEHAVIOURS = {
    "base": lambda: near_tie_flips(0.5, seed=1, per_request=True),
    "spec-null": lambda: near_tie_flips(0.5, seed=2, per_request=True),
    "spec-bug": lambda: confident_flips(0.5, seed=3),
    "empty": lambda: empty_answers(0.25, seed=4),
    "loop": lambda: loops(0.5, seed=5),
    "batched": lambda: corrupt_when_batched(seed=6),
    "cut": lambda: truncation(0.5, seed=7),
}
LOSSLESS = {"spec-null": True, "spec-bug": True}


@pytest.fixture(scope="module")
def sqlite_env_module(tmp_path_factory):
    """tests/conftest.py's sqlite_env for the whole module: one run answers every test."""
    from app.db import upgrade
    from app.settings import get_settings

    url = f"sqlite:///{tmp_path_factory.mktemp('field') / 'canary.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CANARY_DATABASE_URL", url)
        env.setenv("CANARY_EXECUTION", "inline")
        env.setenv("CANARY_ESCALATION", "false")
        env.setenv("CANARY_URL_ALLOWLIST", "127.0.0.1:*,localhost:*")
        env.delenv("CANARY_BROKER_URL", raising=False)
        get_settings.cache_clear()
        upgrade(url)
        yield url
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def field_run(sqlite_env_module):
    proc, upstream = start_engine_serve("--model", MODEL)
    servers, configs = [], []
    try:
        for name, behaviour in BEHAVIOURS.items():
            port = free_port()
            servers.append(serve_in_thread(proxy_app(upstream, generation=behaviour()), port))
            configs.append({"name": name, "engine": "openai", "weights": "fp32", **({"baseline": True} if name == "base"
                                                                                     else {}),
                            **({"lossless": LOSSLESS[name]} if name in LOSSLESS else {}),
                            # a slow CI machine: eight looping answers at once can keep one request
                            # waiting past the 60 s default, which ends the config as an endpoint error
                            "engine_options": {"base_url": f"http://127.0.0.1:{port}/v1", "timeout_s": 300}})
        cfg = {"project": "field", "model": {"name": "served", "path": MODEL}, "configs": configs,
               "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 16, "seed": 3,
                           "scorers": ["perplexity", "generation"], "perplexity": {"window": 64},
                           "generation": {"prompts": 16, "max_new_tokens": 16, "concurrency": 8, "solo_probes": 8}}]}
        with session_scope() as session:
            apply_config_file(session, parse_config(cfg))
        run_id, _ = start_run("field", "s", None, InlineDispatcher())
        with session_scope() as session:
            summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "field"), run_id)))
        yield summary
    finally:
        for server in servers:
            server.should_exit = True
        proc.terminate()
        proc.wait(10)


def comparison(summary: dict, config: str, metric: str) -> dict:
    (found,) = [c for c in summary["comparisons"] if c["config"] == config and c["metric"] == metric]
    return found


def test_a_nondeterministic_null_is_not_a_regression(field_run):
    confident = comparison(field_run, "spec-null", "confident_divergence")
    assert confident["verdict"] not in FLAGGED, confident
    assert confident["details"]["near_tie"]["baseline_repeat"] > 0  # the floor is noisy: the baseline flips too
    exact = comparison(field_run, "spec-null", "lossless_exact_match")
    assert exact["gated"] is False and "judged by confident_divergence" in exact["rule"], exact
    for metric in ("empty_answers", "degenerate_answers", "max_tokens_hits", "output_length_ratio", "batch_divergence"):
        found = comparison(field_run, "spec-null", metric)
        assert found["verdict"] not in FLAGGED, found


def test_confident_flips_are_a_regression_the_null_is_not(field_run):
    bug = comparison(field_run, "spec-bug", "confident_divergence")
    assert bug["verdict"] in FLAGGED, bug
    null = comparison(field_run, "spec-null", "confident_divergence")
    assert bug["estimate"] > null["estimate"] + 0.2
    example = bug["details"]["example"]  # the departure shown is at a confident token: where they part, or later
    assert max(example["gap"], example.get("leaves_greedy_gap", 0)) > 0.25, example
    # over HTTP the baseline model's top token comes with the echo (top_logprobs): every answer's path is
    # read, except one whose first token merges with its prompt's last when read back (not checked)
    assert bug["n"] - 2 <= bug["details"]["greedy_path_checked"] <= bug["n"]
    assert null["details"]["confident_after_near_tie"]["candidate"] == 0, null


def test_empty_answers_are_caught_and_shown(field_run):
    empty = comparison(field_run, "empty", "empty_answers")
    assert empty["verdict"] in FLAGGED and empty["details"]["candidate"] >= 2, empty
    assert empty["details"]["example"]["text"] == ""
    nll = comparison(field_run, "empty", "gen_nll_ratio")
    assert nll["details"]["empty_answers_left_out"]["candidate"] == empty["details"]["candidate"]
    assert "empty_answers" in nll["rule"]
    assert "empty empty_answers" in field_run["verdict_reason"] and "e.g." in field_run["verdict_reason"]


def test_loops_are_caught(field_run):
    loop = comparison(field_run, "loop", "degenerate_answers")
    assert loop["verdict"] in FLAGGED, loop


def test_answers_cut_short_are_caught_by_their_length(field_run):
    cut = comparison(field_run, "cut", "output_length_ratio")
    # half the answers keep a quarter of their 16 tokens: Σ tokens about 1 − ½ · ¾ = 0.625 of the baseline's
    assert cut["verdict"] in FLAGGED and 0.5 < cut["estimate"] < 0.75, cut


def test_corruption_under_concurrency_is_named_a_batching_bug(field_run):
    batched = comparison(field_run, "batched", "batch_divergence")
    assert batched["verdict"] in FLAGGED and batched["n"] == 8, batched
    assert batched["details"]["confident"]["baseline"] <= 1
    # the other configs' answers alone and inside a batch agree beyond their floor
    for config in ("spec-null", "empty", "loop"):
        assert comparison(field_run, config, "batch_divergence")["verdict"] not in FLAGGED



@pytest.fixture(scope="module")
def bf16_run(sqlite_env_module):
    """A real nondeterministic server: engine-serve in bf16 (computed in bf16 on a CPU with native
    bf16, else in fp32 over bf16 weights), whose greedy outputs depend on what shares the batch
    (benchmarks/engine_serve_batching.py measures how often), with a lossless candidate on the
    same server and no proxy."""
    proc, upstream = start_engine_serve("--model", MODEL, "--weights", "bf16")
    served = {"engine": "openai", "weights": "bf16", "engine_options": {"base_url": upstream + "/v1"}}
    cfg = {"project": "bf16", "model": {"name": "served", "path": MODEL},
           "configs": [{"name": "base", "baseline": True, **served}, {"name": "same", "lossless": True, **served}],
           "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 16, "seed": 5,
                       "scorers": ["perplexity", "generation"], "perplexity": {"window": 64},
                       "generation": {"prompts": 16, "max_new_tokens": 24, "concurrency": 8, "solo_probes": 8}}]}
    try:
        with session_scope() as session:
            apply_config_file(session, parse_config(cfg))
        run_id, _ = start_run("bf16", "s", None, InlineDispatcher())
        with session_scope() as session:
            yield jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "bf16"), run_id)))
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_batched_bf16_server_against_itself_is_a_null(bf16_run):
    for metric in ("confident_divergence", "batch_divergence", "empty_answers", "degenerate_answers",
                   "output_length_ratio", "gen_nll_ratio"):
        found = comparison(bf16_run, "same", metric)
        assert found["verdict"] not in FLAGGED, found
    exact = comparison(bf16_run, "same", "lossless_exact_match")
    # where the server disagreed with itself, exactness is reported, not judged
    assert exact["verdict"] not in FLAGGED or not exact["gated"], exact
