"""Alerting endpoints over real HTTP on the embedded default: bad input is a 4xx naming the
field, channel URLs are masked, silences can be created and expired."""

from __future__ import annotations

import pytest

from tests.unit.test_api_embedded import server  # noqa: F401 - the uvicorn fixture

pytestmark = pytest.mark.integration  # a uvicorn server per test


@pytest.fixture
def project(server):  # noqa: F811
    http, _ = server
    assert http.post("/projects", json={"name": "a"}).status_code == 201
    assert http.post("/projects/a/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    assert http.post("/projects/a/configs", json={"name": "fp16", "model": "tiny", "baseline": True}).status_code == 201
    docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components. " * 3} for i in range(10)]
    assert http.post("/projects/a/suites", json={"name": "s", "documents": docs, "samples": 10}).status_code == 201
    return http


@pytest.mark.parametrize("path,body,field,needle", [
    ("/projects/a/channels", {"name": "c", "kind": "slack", "url": "ftp://hooks.example/x"}, "url", "is not an http(s) URL"),
    ("/projects/a/channels", {"name": "c", "kind": "pager", "url": "https://x"}, "kind", "slack"),
    ("/projects/a/channels", {"name": "c", "kind": "webhook", "url": "https://x", "signing_secret": "hunter2"}, "signing_secret", "ENV_VAR"),
    ("/projects/a/alert-rules", {"metric": "perplexity", "warn": 1.1}, "metric", "unknown metric 'perplexity'"),
    ("/projects/a/alert-rules", {"metric": "ppl_ratio", "warn": 1.3, "critical": 1.1}, None, "critical 1.1 must be ≥ warn 1.3"),
    ("/projects/a/schedules", {"name": "d", "cron": "0 25 * * *", "suite": "s"}, "cron", "not a valid five-field cron expression"),
])
def test_bad_alerting_input_is_a_422_naming_the_field(project, path, body, field, needle):
    r = project.put(path, json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any((field is None or field in d["loc"]) and needle in d["msg"] for d in detail), detail


def test_a_client_run_cannot_take_the_priority_of_a_gate_or_an_escalation(project):
    """POST …/runs says how a run was started; gate runs go first in the queue and escalations last,
    so a client may say manual or schedule only (security round 3: `trigger: gate` was a way to jump
    every other tenant's queue)."""
    for trigger, needle in (("gate", "start a gate with POST …/gates"), ("alert", "escalations start on their own"),
                            ("nightly", "'manual' or 'schedule'")):
        r = project.post("/projects/a/runs", json={"suite": "s", "trigger": trigger})
        assert r.status_code == 422, r.text
        assert any("trigger" in d["loc"] and needle in d["msg"] for d in r.json()["detail"]), r.text
    assert project.get("/projects/a/runs").json() == []  # nothing was started


def test_unknown_names_are_404(project):
    r = project.post("/projects/a/gates", json={"candidate": "nope", "suite": "s"})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    r = project.put("/projects/a/schedules", json={"name": "d", "cron": "0 6 * * *", "suite": "s", "configs": ["ghost"]})
    assert r.status_code == 404 and "ghost" in r.json()["detail"]


def test_channel_urls_are_masked_and_silences_expire(project):
    r = project.put("/projects/a/channels", json={"name": "ops", "kind": "slack", "url": "https://hooks.slack.test/services/T0/B0/SECRETTOKEN"})
    assert r.status_code == 200 and r.json()["url"] == "https://hooks.slack.test/***"
    assert "SECRETTOKEN" not in project.get("/projects/a/channels").text
    r = project.put("/projects/a/channels", json={"name": "q", "kind": "webhook", "url": "https://user:pw@hooks.test:8443?token=QTOKEN",
                                                  "signing_secret": "${CANARY_SECRET_A__HOOK}"})
    assert r.json()["url"] == "https://hooks.test:8443/***" and r.json()["signing_secret_set"] is True
    assert "QTOKEN" not in project.get("/projects/a/channels").text and "pw@" not in project.get("/projects/a/channels").text
    r = project.post("/projects/a/silences", json={"matchers": [{"name": "config", "value": "int.*", "isRegex": True}],
                                                   "duration_minutes": 60, "author": "ana", "comment": "known int4 regression"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    expired = project.delete(f"/projects/a/silences/{sid}").json()
    assert expired["ends_at"] <= project.get("/projects/a/silences").json()[0]["ends_at"]
    bad = project.post("/projects/a/silences", json={"matchers": [{"name": "config", "value": "(", "isRegex": True}],
                                                     "duration_minutes": 5, "author": "a", "comment": "c"})
    assert bad.status_code == 422 and "not a valid regular expression" in bad.json()["detail"]
    rule = project.put("/projects/a/alert-rules", json={"metric": "ppl_ratio", "warn": 1.02, "critical": 1.05, "for_runs": 2, "config": "fp16"})
    assert rule.status_code == 200 and rule.json()["for_runs"] == 2


def test_a_rejected_channel_body_is_not_echoed(project):
    # FastAPI's default 422 repeats the input; a channel body carries its webhook URL and secret
    r = project.put("/projects/a/channels", json={"name": "c", "kind": "pager", "url": "https://hooks.test/T0/ECHOTOKEN",
                                                  "signing_secret": "${CANARY_SECRET_S}", "extra": "ECHOSECRET"})
    assert r.status_code == 422 and {"kind", "extra"} <= {d["loc"][-1] for d in r.json()["detail"]}
    assert "ECHOTOKEN" not in r.text and "ECHOSECRET" not in r.text


def test_a_resting_channel_says_until_when_and_a_new_url_closes_its_breaker(project, tmp_path):
    """GET …/channels shows a channel's open breaker (app/notify.py opened it: its receiver failed
    or was slow); re-applying the same channel keeps it resting, pointing it at another URL closes it."""
    from datetime import UTC, datetime, timedelta

    import sqlalchemy as sa

    body = {"name": "ops", "kind": "webhook", "url": "https://hooks.test/one"}
    assert project.put("/projects/a/channels", json=body).json()["resting_until"] is None
    until = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5)
    db = sa.create_engine(f"sqlite:///{tmp_path / 'api.db'}")
    with db.begin() as conn:  # as the notifier leaves it after a third failure in a row
        conn.execute(sa.text("UPDATE channels SET breaker_strikes = 3, breaker_until = :u WHERE name = 'ops'"),
                     {"u": until.replace(tzinfo=None)})
    (shown,) = project.get("/projects/a/channels").json()
    assert datetime.fromisoformat(shown["resting_until"]) == until and shown["failed_in_a_row"] == 3
    assert datetime.fromisoformat(project.put("/projects/a/channels", json=body).json()["resting_until"]) == until
    resent = project.put("/projects/a/channels", json={**body, "send_resolved": False}).json()
    assert datetime.fromisoformat(resent["resting_until"]) == until  # the same receiver: still resting
    moved = project.put("/projects/a/channels", json={**body, "url": "https://hooks.test/two"}).json()
    assert moved["resting_until"] is None and moved["failed_in_a_row"] == 0
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT breaker_strikes, breaker_until FROM channels")).one() == (0, None)
    db.dispose()
