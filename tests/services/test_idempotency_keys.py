"""Idempotency keys of runs and gates against a real API process on PostgreSQL (Celery
execution; no worker, so runs stay queued): a client cannot write the keys of the canary's own
gate and schedule runs."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.conftest import throwaway_pg_database
from tests.loopback import canary_serve
from tests.services.conftest import PG_URL

P = "/api/v1/projects/keys"


@pytest.fixture(scope="module")
def api(redis_url, tmp_path_factory):
    import redis

    broker = redis_url.rsplit("/", 1)[0] + "/14"  # its own Redis database: no test's worker takes these tasks
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
