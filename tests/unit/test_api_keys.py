"""API keys over real HTTP (uvicorn on loopback, keys required): a key of project A gets 404
for project B's objects on every route, read-only keys cannot write, missing / invalid / revoked
keys get 401, and only a hash of each key is stored."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.loopback import canary_serve

pytestmark = pytest.mark.integration  # a uvicorn server per test


def cli(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp / 'k.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_REQUIRE_API_KEYS": "true"}
    env.pop("CANARY_BROKER_URL", None)
    keys = {}
    for project, flag in (("a", None), ("b", None), ("a", "--read-only")):
        r = cli(env, "keys", "create", "--project", project, *([flag] if flag else []))
        assert r.returncode == 0, r.stderr
        keys[(project, flag is None)] = r.stdout.strip()
    with canary_serve(env, str(tmp / "api.log")) as root:
        base = f"{root}/api/v1"

        def client(key):
            return httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})

        b = client(keys[("b", True)])
        assert b.post("/projects/b/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        assert b.post("/projects/b/configs", json={"name": "fp16", "model": "tiny", "baseline": True}).status_code == 201
        docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components. " * 3} for i in range(10)]
        assert b.post("/projects/b/suites", json={"name": "s", "documents": docs, "samples": 10, "scorers": ["perplexity"]}).status_code == 201
        run = b.post("/projects/b/runs", json={"suite": "s"})
        assert run.status_code == 202, run.text
        yield {"client": client, "keys": keys, "env": env, "db": tmp / "k.db", "run_id": run.json()["run_id"]}


B_ROUTES = ["/projects/b/models", "/projects/b/configs", "/projects/b/suites", "/projects/b/runs", "/projects/b/runs/{run}",
            "/projects/b/runs/{run}/samples", "/projects/b/runs/{run}/worst?config=fp16", "/projects/b/overview", "/projects/b/trends",
            "/projects/b/alerts", "/projects/b/alert-rules", "/projects/b/silences", "/projects/b/channels", "/projects/b/schedules",
            "/projects/b/gates", "/projects/b/gates/1"]


def test_a_key_of_project_a_gets_404_for_every_route_of_project_b(secured):
    a = secured["client"](secured["keys"][("a", True)])
    for route in B_ROUTES:
        r = a.get(route.format(run=secured["run_id"]))
        assert r.status_code == 404 and r.json()["detail"] == "project 'b' not found", (route, r.status_code, r.text)
    for method, route, body in (("post", "/projects/b/runs", {"suite": "s"}), ("put", "/projects/b/channels",
                                {"name": "x", "kind": "slack", "url": "https://x"}), ("post", "/projects/b/gates", {"candidate": "fp16", "suite": "s"})):
        assert getattr(a, method)(route, json=body).status_code == 404
    # the same answer as for a project that does not exist: nothing is revealed
    assert a.get("/projects/nope/runs").json()["detail"] == "project 'nope' not found"
    assert [p["name"] for p in a.get("/projects").json()] == ["a"]  # a key lists its own project only


def test_missing_invalid_and_read_only_keys(secured):
    c = secured["client"]
    r = c(None).get("/projects/b/runs")
    assert r.status_code == 401 and "Bearer" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    assert c("cnry_not-a-key").get("/projects/b/runs").status_code == 401
    ro = c(secured["keys"][("a", False)])
    assert ro.get("/projects/a/runs").status_code == 200
    w = ro.post("/projects/a/models", json={"name": "m", "path": "builtin:pydoc-target"})
    assert w.status_code == 403 and "read-only" in w.json()["detail"]
    assert c(secured["keys"][("b", True)]).post("/projects", json={"name": "c"}).status_code == 403


def test_only_hashes_are_stored_and_revocation_is_immediate(secured):
    keys = secured["keys"]
    dump = "\n".join(str(row) for row in sqlite3.connect(secured["db"]).execute("SELECT * FROM api_keys"))
    assert not any(k in dump for k in keys.values())
    assert all(len(k) >= len("cnry_") + 43 for k in keys.values())  # 32 random bytes, base64url
    listing = cli(secured["env"], "keys", "list", "--project", "a").stdout
    key_id = next(line.split("\t")[0] for line in listing.splitlines() if "\tread\t" in line)
    assert cli(secured["env"], "keys", "revoke", key_id).returncode == 0
    assert secured["client"](keys[("a", False)]).get("/projects/a/runs").status_code == 401
    assert cli(secured["env"], "keys", "revoke", "999").returncode == 2


def test_rate_limit_per_key_answers_429_with_retry_after(tmp_path):
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'r.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_RATE_LIMIT_PER_MINUTE": "5"}
    env.pop("CANARY_BROKER_URL", None)
    k1, k2 = (cli(env, "keys", "create", "--project", p).stdout.strip() for p in ("p1", "p2"))
    with canary_serve(env, str(tmp_path / "api.log")) as root:
        one = httpx.Client(base_url=f"{root}/api/v1", headers={"Authorization": f"Bearer {k1}"})
        other = httpx.Client(base_url=f"{root}/api/v1", headers={"Authorization": f"Bearer {k2}"})
        codes = [one.get("/projects").status_code for _ in range(6)]
        assert codes[:5] == [200] * 5 and codes[5] == 429
        r = one.get("/projects")
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 12 and "5 requests per minute" in r.json()["detail"]
        assert other.get("/projects").status_code == 200  # another key has its own bucket
        # keys are not required here, but a key that is sent is checked (401)
        assert httpx.get(f"{root}/api/v1/projects", headers={"Authorization": "Bearer k1"}).status_code == 401
        assert httpx.get(f"{root}/healthz").status_code == 200  # probes are never limited


def test_metrics_keys_read_metrics_only(secured):
    """`--scope metrics` shows its own project's figures on /metrics, `--scope metrics-all` every
    project's; without a key /metrics has no project in it; metrics keys open no /api route and
    other keys do not open /metrics."""
    env, root = secured["env"], str(secured["client"](None).base_url).removesuffix("/api/v1/")
    mine = cli(env, "keys", "create", "--project", "a", "--scope", "metrics").stdout.strip()
    everyone = cli(env, "keys", "create", "--project", "ops", "--scope", "metrics-all").stdout.strip()
    assert cli(env, "keys", "create", "--project", "a", "--scope", "admin").returncode == 2

    def scrape(key):
        return httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    assert 'project="b"' not in scrape(mine).text and "canary_config_runs_queued" in scrape(mine).text
    assert 'canary_runs{project="b"' in scrape(everyone).text
    anonymous = scrape(None)
    assert anonymous.status_code == 200 and "project=" not in anonymous.text and "canary_build_info" in anonymous.text
    assert scrape("cnry_not-a-key").status_code == 401
    r = scrape(secured["keys"][("b", True)])
    assert r.status_code == 403 and "--scope metrics" in r.json()["detail"]
    r = secured["client"](mine).get("/projects/a/runs")
    assert r.status_code == 403 and "/metrics only" in r.json()["detail"]
    listing = cli(env, "keys", "list", "--project", "a").stdout
    assert "\tmetrics\tactive" in listing
