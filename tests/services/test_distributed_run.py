"""A run driven through the HTTP API to its verdict, executed by a real Celery worker process
over Redis, with results in Postgres."""

import os
import re

import pytest

P = "/api/v1/projects/svc"


@pytest.fixture(scope="module")
def project(stack):
    http = stack.http
    assert http.post("/api/v1/projects", json={"name": "svc"}).status_code == 201
    assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    for body in (
        {"name": "fp16", "model": "tiny", "baseline": True, "weights": "fp16"},
        {"name": "int4", "model": "tiny", "weights": "rtn-int4"},
        {"name": "gpu-only", "model": "tiny", "weights": "fp16", "engine_options": {"device": "cuda"}},
    ):
        r = http.post(f"{P}/configs", json=body)
        assert r.status_code == 201, r.text
    r = http.post(f"{P}/suites", json={
        "name": "daily", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 3,
        "perplexity": {"window": 128}, "generation": {"prompts": 2, "prompt_words": 8, "max_new_tokens": 4},
    })
    assert r.status_code == 201, r.text
    return "svc"


def test_run_reaches_verdict_in_the_worker_process(stack, project):
    r = stack.http.post(f"{P}/runs", json={"suite": "daily"})
    assert r.status_code == 202, r.text
    run = stack.wait_run(project, r.json()["run_id"])
    assert run["status"] == "done", stack.tail("worker")
    by_name = {c["config"]: c for c in run["configs"]}
    assert by_name["fp16"]["status"] == by_name["int4"]["status"] == "succeeded"
    assert by_name["gpu-only"]["status"] == "failed" and "engine_options.device" in by_name["gpu-only"]["error"]
    assert run["verdict"] == "incomplete" and "gpu-only" in run["verdict_reason"]
    ratio = next(c for c in run["comparisons"] if c["config"] == "int4" and c["metric"] == "ppl_ratio")
    assert ratio["n"] == 12 and ratio["ci_low"] <= ratio["estimate"] <= ratio["ci_high"]
    assert ratio["verdict"] in ("ok", "warn", "critical", "inconclusive")
    # The work ran in the Celery worker, not in the API process.
    assert "canary.execute_config_run" in stack.tail("worker", 400)
    # time in queue from the enqueue time the API stamped on each message (workers/base.py): one
    # worker process runs the three config-runs one after the other, so the later ones waited
    waits = [float(w) for w in re.findall(r"canary\.execute_config_run\[\d+\] started after ([0-9.]+) s in queue",
                                          stack.tail("worker", 400))]
    assert len(waits) >= 3 and max(waits) >= 1.0, waits
    assert run["figures"]["int4"]["weight_bytes"] < run["figures"]["fp16"]["weight_bytes"]

    page = stack.http.get(f"{P}/runs/{run['run_id']}/samples", params={"config": "int4", "metric": "nll", "limit": 5}).json()
    assert page["total"] == 12 and len(page["items"]) == 5
    assert all(item["extra"]["n_tokens"] > 0 for item in page["items"])
    rest = stack.http.get(f"{P}/runs/{run['run_id']}/samples", params={"config": "int4", "metric": "nll", "offset": 5, "limit": 100}).json()
    keys = {i["sample_key"] for i in page["items"]} | {i["sample_key"] for i in rest["items"]}
    assert len(keys) == 12


def test_idempotency_key_returns_the_same_run(stack, project):
    headers = {"Idempotency-Key": "ci-build-42"}
    a = stack.http.post(f"{P}/runs", json={"suite": "daily", "configs": ["int4"]}, headers=headers)
    b = stack.http.post(f"{P}/runs", json={"suite": "daily", "configs": ["int4"]}, headers=headers)
    assert a.status_code == 202 and b.status_code == 200
    assert a.json()["run_id"] == b.json()["run_id"]
    run = stack.wait_run(project, a.json()["run_id"])
    assert [c["config"] for c in run["configs"]] == ["fp16", "int4"]  # the baseline is always included
    # 2 prompts are fewer than min_n = 10: the TTFT comparisons cannot decide, and the run says so.
    assert run["verdict"] == "inconclusive" and "too few samples" in run["verdict_reason"]


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/configs", {"name": "x", "model": "tiny", "weights": "int5"}, 422, "did you mean 'int8'"),
        ("/configs", {"name": "x", "model": "tiny", "kv_cache": "kivi-2"}, 422, "not available in engine 'transformers'"),
        ("/configs", {"name": "int4", "model": "tiny", "weights": "rtn-int4"}, 409, "already exists"),
        ("/configs", {"name": "x", "model": "nope"}, 404, "model 'nope' not found"),
        ("/models", {"name": "m2", "path": "/does/not/exist"}, 422, "is not a usable path to a model directory"),
        ("/suites", {"name": "big", "corpus": "builtin:pydoc-heldout", "samples": 100000}, 422, "samples: 100000 >"),
        ("/suites", {"name": "empty", "documents": [], "samples": 1}, 422, "no documents"),
        ("/suites", {"name": "dup", "documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "samples": 1}, 422, "duplicate id 'a'"),
        ("/runs", {"suite": "nope"}, 404, "suite 'nope' not found"),
        ("/runs", {"suite": "daily", "samples": 1000}, 422, "samples: 1000 > "),
        ("/runs", {"suite": "daily", "configs": ["int4", "int4"]}, 422, "int4 named more than once"),
        ("/configs", {"name": "x", "model": "tiny", "engine_options": {"batch_size": "abc"}}, 422, "engine_options.batch_size: expected int"),
        ("/suites", {"name": "long", "corpus": "builtin:pydoc-heldout", "perplexity": {"window": 4096}}, 201, None),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(stack, project, path, body, status, needle):
    def stored():
        return [stack.http.get(f"{P}/{what}").json() for what in ("models", "configs", "suites", "runs")]

    before = stored()
    r = stack.http.post(f"{P}{path}", json=body)
    assert r.status_code == status, r.text
    if status < 300:
        return
    assert needle in r.text
    assert stored() == before  # nothing stored changed


def test_window_beyond_the_model_context_is_refused_at_run_start(stack, project):
    # The suite alone cannot know the model; the run joins them and checks config.json.
    stack.http.post(f"{P}/suites", json={"name": "wide", "corpus": "builtin:pydoc-heldout", "samples": 5,
                                         "perplexity": {"window": 4096}})
    r = stack.http.post(f"{P}/runs", json={"suite": "wide"})
    assert r.status_code == 422 and "perplexity.window: 4096 exceeds the model's context of 1024" in r.text


def test_reused_idempotency_key_with_another_request_is_409(stack, project):
    headers = {"Idempotency-Key": "ci-build-43"}
    assert stack.http.post(f"{P}/runs", json={"suite": "daily", "configs": ["int4"], "samples": 10}, headers=headers).status_code == 202
    r = stack.http.post(f"{P}/runs", json={"suite": "daily", "configs": ["int4"], "samples": 11}, headers=headers)
    assert r.status_code == 409 and "different run request" in r.text


def test_unknown_project_is_404(stack):
    r = stack.http.get("/api/v1/projects/nobody/runs")
    assert r.status_code == 404 and "project 'nobody' not found" in r.text


def test_health_and_openapi(stack):
    assert stack.http.get("/healthz").json()["status"] == "ok"
    spec = stack.http.get("/openapi.json").json()
    assert "/api/v1/projects/{project}/runs/{run_id}/samples" in spec["paths"]
    assert os.environ.get("CANARY_EXECUTION") != "celery"  # the API subprocess got it, not the test
