"""A run driven through the HTTP API to its verdict, executed by a real Celery worker process
over Redis, with results in Postgres."""

import os

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
    assert run["verdict"] in ("pass", "warn", "fail", "inconclusive")


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/configs", {"name": "x", "model": "tiny", "weights": "int5"}, 422, "did you mean 'int8'"),
        ("/configs", {"name": "x", "model": "tiny", "kv_cache": "kivi-2"}, 422, "not available in engine 'transformers'"),
        ("/configs", {"name": "int4", "model": "tiny", "weights": "rtn-int4"}, 409, "already exists"),
        ("/configs", {"name": "x", "model": "nope"}, 404, "model 'nope' not found"),
        ("/models", {"name": "m2", "path": "/does/not/exist"}, 422, "path: model directory"),
        ("/suites", {"name": "big", "corpus": "builtin:pydoc-heldout", "samples": 100000}, 422, "samples: 100000 >"),
        ("/suites", {"name": "empty", "documents": [], "samples": 1}, 422, "no documents"),
        ("/suites", {"name": "dup", "documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "samples": 1}, 422, "duplicate id 'a'"),
        ("/runs", {"suite": "nope"}, 404, "suite 'nope' not found"),
        ("/runs", {"suite": "daily", "samples": 1000}, 422, "samples: 1000 > "),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(stack, project, path, body, status, needle):
    before = stack.http.get(f"{P}/configs").json()
    r = stack.http.post(f"{P}{path}", json=body)
    assert r.status_code == status, r.text
    assert needle in r.text
    assert stack.http.get(f"{P}/configs").json() == before  # nothing stored changed


def test_unknown_project_is_404(stack):
    r = stack.http.get("/api/v1/projects/nobody/runs")
    assert r.status_code == 404 and "project 'nobody' not found" in r.text


def test_health_and_openapi(stack):
    assert stack.http.get("/healthz").json()["status"] == "ok"
    spec = stack.http.get("/openapi.json").json()
    assert "/api/v1/projects/{project}/runs/{run_id}/samples" in spec["paths"]
    assert os.environ.get("CANARY_EXECUTION") != "celery"  # the API subprocess got it, not the test
