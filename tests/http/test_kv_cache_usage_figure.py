"""The config-run's kv_cache_usage figure (the metric's producer, workers/execute.py) for an
`engine: openai` config against a real `canary engine-serve`: the peak of the server's own
vllm:kv_cache_usage_perc while the run's requests were in flight, checked against what the
server's gauge can hold for the requests it served (tokens held / the rows it reserves)."""

from __future__ import annotations

import httpx
import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.services import apply_config_file, start_run

from tests.http.conftest import start_engine_serve

PROMPTS, MAX_NEW_TOKENS = 4, 48
MAX_NUM_SEQS = 32  # engine-serve's default --max-num-seqs
MODEL = "builtin:pydoc-target"  # a config's model path, and the name the server serves it under (its default)


@pytest.fixture(scope="module")
def served_zoo_model():
    proc, base = start_engine_serve("--model", MODEL)
    yield base
    proc.terminate()
    proc.wait(10)


def test_an_openai_config_stores_the_servers_peak_kv_cache_usage(sqlite_env, served_zoo_model):
    engine_serve = served_zoo_model
    cfg = {
        "project": "kv", "model": {"name": "served", "path": MODEL},
        "configs": [{"name": "served-fp32", "baseline": True, "engine": "openai", "weights": "fp32",
                     # two in flight on one engine thread: a request is always running while the other waits
                     "engine_options": {"base_url": engine_serve + "/v1", "concurrency": 2}}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": PROMPTS, "seed": 1,
                    "scorers": ["perplexity", "generation"], "perplexity": {"window": 64},
                    "generation": {"prompts": PROMPTS, "prompt_words": 8, "max_new_tokens": MAX_NEW_TOKENS}}],
    }
    with session_scope() as session:
        apply_config_file(session, parse_config(cfg))
    run_id, _ = start_run("kv", "s", None, InlineDispatcher())
    with session_scope() as session:
        run = repo.get_run(session, repo.get_project(session, "kv"), run_id)
        (config_run,) = run.config_runs
        assert config_run.status == "succeeded", config_run.error
        figures = dict(config_run.figures)
        generations = [row.extra for row in repo.sample_results(session, run_id, config_run.config_id, "generation")]
    assert len(generations) == PROMPTS
    ctx = httpx.get(engine_serve + "/v1/models").json()["data"][0]["max_model_len"]

    usage = figures["kv_cache_usage"]
    # the server's gauge is the tokens its rows hold / what it reserves (max_num_seqs rows of a full
    # context, as vLLM's blocks in use / blocks): a whole number of tokens, at most two requests'
    # prompts (with their start tokens) and completions, the client holding two in flight
    reserved = MAX_NUM_SEQS * ctx
    most_held = 2 * (max(g["prompt_tokens"] + g["n_tokens"] for g in generations) + 1)
    assert usage is not None and 0 < usage <= most_held / reserved
    assert abs(usage * reserved - round(usage * reserved)) < 1e-6
    # the openai engine does not know its server's memory: the figure is the server's peak
    assert figures["server"] == {"metrics_url": engine_serve + "/metrics", "max_kv_cache_usage": usage,
                                 "max_num_requests_waiting": figures["server"]["max_num_requests_waiting"],
                                 "max_num_requests_running": figures["server"]["max_num_requests_running"],
                                 "spec": None, "dedicated": False, "foreign_traffic_batches": 0,
                                 # a server started without --enable-per-request-metrics: no timings of its own
                                 "request_ttft_ms_p50": None, "request_queue_ms_p50": None, "request_itl_ms_mean": None}
    # concurrency 2: the client holds at most two requests at the server, decoded together
    assert figures["server"]["max_num_requests_waiting"] in (0.0, 1.0, 2.0)
    assert figures["server"]["max_num_requests_running"] in (1.0, 2.0)
