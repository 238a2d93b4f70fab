"""`canary gate` as a CI job runs it, against a real `canary serve` (the embedded default) that
restarts while the gate waits: heartbeat lines, polls retried with backoff through the outage,
the verdict read from the restarted server, the summary appended to $GITHUB_STEP_SUMMARY; and
/healthz as a JSON 503 naming what is down."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.conftest import ROOT
from tests.loopback import free_port, refused_port, wait_http

P = "/api/v1/projects/g"


def serve(env: dict, port: int, log: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
    return proc


def test_gate_waits_through_an_api_restart(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    # the restarted server's reconciler takes the interrupted config-run back within seconds
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'g.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_LEASE_SECONDS": "3", "CANARY_REQUEUE_AFTER_SECONDS": "2", "CANARY_RECONCILE_SECONDS": "1"}
    env.pop("CANARY_BROKER_URL", None)
    log = str(tmp_path / "api.log")
    first = serve(env, port, log)
    server = first
    try:
        http = httpx.Client(base_url=api, timeout=30)
        assert http.post("/api/v1/projects", json={"name": "g"}).status_code == 201
        assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        for body in ({"name": "fp32", "model": "tiny", "baseline": True, "engine": "reference", "weights": "fp32"},
                     {"name": "int2", "model": "tiny", "engine": "reference", "weights": "rtn-int2"}):
            assert http.post(f"{P}/configs", json=body).status_code == 201
        assert http.post(f"{P}/suites", json={"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 5,
                                              "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
        assert http.put(f"{P}/alert-rules", json={"metric": "ppl_ratio", "warn": 1.01, "critical": 1.02}).status_code == 200
        step_summary = tmp_path / "step-summary.md"
        step_summary.write_text("earlier step\n")
        gate = subprocess.Popen([sys.executable, "-m", "app.cli", "gate", "--api", api, "--project", "g", "--suite", "s",
                                 "--candidate", "int2", "--heartbeat", "1", "--retry-for", "120", "--summary-md",
                                 str(tmp_path / "gate.md")],
                                cwd=ROOT, env={**env, "GITHUB_STEP_SUMMARY": str(step_summary)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        # the gate is posted and waiting: take the API down under it, then bring it back on the same port
        line = gate.stderr.readline()
        assert line.startswith("canary: gate ") and "waiting for the verdict" in line, line
        first.terminate()
        first.wait(30)
        time.sleep(4)
        server = serve(env, port, log)
        out, err = gate.communicate(timeout=300)
        err = line + err
        assert gate.returncode == 1, err  # int2 weights: ≈ 6 % perplexity (CI low ≈ 1.027), past critical
        assert "retrying in 1s" in err and "retrying in 2s" in err, err  # backoff through the outage
        assert "still waiting" in err, err  # heartbeat lines while it waits
        assert any(x.startswith("gate ") and ": fail — candidate int2" in x for x in err.splitlines())
        assert err.splitlines()[-2].startswith("  int2: ppl ratio +")  # the verdict for people, under it
        assert err.splitlines()[-1] == "canary: deploy blocked: fail (exit 1)"
        summary = step_summary.read_text()
        assert summary.startswith("earlier step\n") and "fail" in summary  # appended, not overwritten
        assert (tmp_path / "gate.md").read_text().strip() in summary
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        server.terminate()
        server.wait(30)


def test_healthz_is_a_json_503_naming_what_is_down(tmp_path):
    with refused_port() as db_port, refused_port() as broker_port:
        _healthz_names_what_is_down(tmp_path, db_port, broker_port)


def _healthz_names_what_is_down(tmp_path, db_port: int, broker_port: int) -> None:
    port = free_port()
    log = str(tmp_path / "api.log")
    env = {**os.environ, "CANARY_DATABASE_URL": f"postgresql+psycopg://canary:s3cret@127.0.0.1:{db_port}/canary",
           "CANARY_EXECUTION": "celery", "CANARY_BROKER_URL": f"redis://127.0.0.1:{broker_port}/0"}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--no-upgrade-db"], cwd=ROOT,
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
                time.sleep(0.3)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["status"] == "unavailable" and set(body["down"]) == {"database", "broker"}
        assert "Connection refused" in body["down"]["database"] and "s3cret" not in r.text
        runs = httpx.get(f"http://127.0.0.1:{port}/api/v1/projects/x/runs", timeout=10)
        assert runs.status_code == 503 and "healthz" in runs.json()["detail"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_unreachable_api_has_its_own_exit_code():
    """Nothing listens: the canary itself is down, which CI must tell apart from a config that
    errs (2) or fails (1); one line on stderr, exit 3 (--unreachable-exit-code)."""
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--project", "g", "--candidate", "int8", "--suite", "s",
                        "--api", f"http://127.0.0.1:{port}", "--retry-for", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3, r
    assert r.stderr.strip().count("\n") == 0 and f"the canary API at http://127.0.0.1:{port} is unreachable" in r.stderr
