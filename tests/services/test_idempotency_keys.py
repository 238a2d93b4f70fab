"""Idempotency keys of runs and gates against a real API process on PostgreSQL (Celery
execution; no worker, so runs stay queued): a client cannot write the keys of the canary's own
gate and schedule runs, and concurrent requests (or CLIs) with one gate key all get that gate."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.conftest import throwaway_pg_database
from tests.loopback import canary_serve
from tests.services.conftest import PG_URL, SPARE_REDIS_URL

P = "/api/v1/projects/keys"


@pytest.fixture(scope="module")
def api(redis_url, tmp_path_factory):
    import redis

    broker = SPARE_REDIS_URL  # a database no stack's Celery worker consumes (tests/services/conftest.py)
    logs = tmp_path_factory.mktemp("keys")
    with throwaway_pg_database(PG_URL, "canary_keys") as db:
        env = {**os.environ, "CANARY_DATABASE_URL": db, "CANARY_BROKER_URL": broker, "CANARY_EXECUTION": "celery",
               "CANARY_ESCALATION": "false", "CANARY_API_THREADS": "8"}
        env.pop("CANARY_REQUIRE_API_KEYS", None)
        with canary_serve(env, str(logs / "api.log")) as base:
            http = httpx.Client(base_url=base, timeout=60)
            assert http.post("/api/v1/projects", json={"name": "keys"}).status_code == 201
            assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
            for body in ({"name": "fp32", "model": "tiny", "baseline": True, "weights": "fp32"},
                         {"name": "int8", "model": "tiny", "weights": "int8"}):
                assert http.post(f"{P}/configs", json=body).status_code == 201
            r = http.post(f"{P}/suites", json={"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12,
                                               "scorers": ["perplexity"], "perplexity": {"window": 64}})
            assert r.status_code == 201, r.text
            yield http
        redis.Redis.from_url(broker).flushdb()


def test_a_manual_run_cannot_take_a_gate_or_schedule_key(api):
    for key in ("gate:3f9c2ab", "schedule:1:2026-01-01T00:00:00+00:00"):
        r = api.post(f"{P}/runs", json={"suite": "s", "configs": ["int8"]}, headers={"Idempotency-Key": key})
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("Idempotency-Key: keys starting with 'gate:' or 'schedule:'"), r.text
        assert "POST …/gates" in r.json()["detail"]
    assert api.get(f"{P}/runs").json() == []  # nothing was started
    # the gate with that key starts its own run, with the gate's trigger
    gate = api.post(f"{P}/gates", json={"candidate": "int8", "suite": "s"}, headers={"Idempotency-Key": "3f9c2ab"})
    assert gate.status_code == 202, gate.text
    [run] = api.get(f"{P}/runs").json()
    assert run["run_id"] == gate.json()["run_id"] and run["trigger"] == "gate"
    # any other key still works
    manual = api.post(f"{P}/runs", json={"suite": "s", "configs": ["int8"]},
                      headers={"Idempotency-Key": "gate-3f9c2ab"})
    assert manual.status_code == 202 and manual.json()["trigger"] == "manual"


def test_concurrent_gates_with_one_key_get_the_same_gate(api):
    """Six CI retries of one step race: every answer is 2xx with the one gate (no 409), and one
    gate and one run exist."""
    import threading

    n, start, answers = 6, threading.Barrier(6), []

    def post(key: str) -> None:
        with httpx.Client(base_url=str(api.base_url), timeout=60) as http:
            start.wait()
            answers.append(http.post(f"{P}/gates", json={"candidate": "int8", "suite": "s"},
                                     headers={"Idempotency-Key": key}))

    for round_ in range(3):  # three keys: a race that happens to serialize once still counts
        answers.clear()
        threads = [threading.Thread(target=post, args=(f"race-{round_}",)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in answers) == [200] * (n - 1) + [202], [(r.status_code, r.text[:200])
                                                                               for r in answers]
        assert len({(r.json()["gate_id"], r.json()["run_id"]) for r in answers}) == 1
    gates = api.get(f"{P}/gates").json()
    assert sum(g["gate_id"] == answers[0].json()["gate_id"] for g in gates) == 1


def test_concurrent_gate_clis_with_one_key_exit_0_with_the_same_gate(api):
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "app.cli", "gate", "--api", str(api.base_url), "--project", "keys", "--suite", "s",
           "--candidate", "int8", "--idempotency-key", "cli-race", "--no-wait", "--json"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = [(p.wait(120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in outs] == [0] * 6, [err[-300:] for _, _, err in outs]
    assert len({json.loads(out)["gate_id"] for _, out, _ in outs}) == 1
