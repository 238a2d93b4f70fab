"""Integration with the real thing: a canary alert pushed to a real Alertmanager (Debian's
prometheus-alertmanager) and read back from its API v2; a real Prometheus scraping the API's
/metrics and evaluating deploy/prometheus/canary-rules.yml. Without the binaries these skip
loudly — under CI=true they fail (.ci/run installs them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from app.auth import create_key
from app.channels import AlertMessage, build
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.models import Channel, ComparisonRow, Notification, Project
from app.notify import deliver_due
from app.services import apply_config_file, start_run

from tests.conftest import ROOT
from tests.http.test_alert_flow import cfg, small_corpus
from tests.loopback import free_port, serve_in_thread, wait_http


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (Debian: apt-get install prometheus prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(f"CI=true: {msg}", pytrace=False)
        pytest.skip(f"SKIPPED LOUDLY: {msg}")
    return path


@pytest.fixture
def alertmanager(tmp_path):
    exe = binary("prometheus-alertmanager")
    port = free_port()
    conf = tmp_path / "am.yml"
    conf.write_text("route:\n  receiver: 'null'\nreceivers:\n  - name: 'null'\n")
    log = str(tmp_path / "am.log")
    proc = subprocess.Popen([exe, f"--config.file={conf}", f"--storage.path={tmp_path / 'am-data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/-/ready", proc, log)
    yield url
    proc.terminate()
    proc.wait(10)


def test_alert_reaches_a_real_alertmanager(sqlite_env, alertmanager):
    msg = AlertMessage("firing", {"project": "p", "model": "tiny", "config": "int4", "metric": "ppl_ratio", "severity": "critical"},
                       "fp", 1.0574, 1.0497, 1.066, 100, "fp16", 110.76, 117.12, "CI low 1.05 ≥ critical 1.03", 3,
                       "http://dash", datetime.now(UTC))
    with session_scope() as s:
        p = Project(name="p")
        s.add(p)
        s.flush()
        ch = Channel(project_id=p.id, name="am", kind="alertmanager", url=alertmanager)
        s.add(ch)
        s.flush()
        s.add(Notification(channel_id=ch.id, idempotency_key="k1", payload=build("alertmanager", msg), status="pending"))
    with session_scope() as s:
        assert deliver_due(s)["sent"] == 1
    alerts = httpx.get(alertmanager + "/api/v2/alerts").json()
    assert len(alerts) == 1
    a = alerts[0]
    assert a["labels"] == {"alertname": "canary_ppl_ratio", "project": "p", "model": "tiny", "config": "int4",
                           "metric": "ppl_ratio", "severity": "critical"}
    assert a["status"]["state"] == "active" and "95% CI 1.05–1.066" in a["annotations"]["description"]


def test_prometheus_scrapes_metrics_and_fires_the_rules(sqlite_env, tmp_path, receiver):
    """Prometheus sends a metrics key with `authorization: {credentials_file: …}` (as
    deploy/prometheus/prometheus.yml does); a second job scraping without credentials is up too
    but ingests no project's data."""
    exe = binary("prometheus")
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg(receiver.url, small_corpus(tmp_path))))
    start_run("p", "s", ["cand"], InlineDispatcher())
    with session_scope() as s:
        # the latest run's figure is exposed (the critical alert escalated to a full-suite run)
        comp = max((c for c in s.query(ComparisonRow).all() if c.metric == "ppl_ratio"), key=lambda c: c.run_id)
        want = comp.estimate
        _, key = create_key(s, "p", "prometheus", "metrics")
        _, other_key = create_key(s, "other", "prometheus", "metrics")  # another project's metrics key sees none of p
    (tmp_path / "metrics.key").write_text(key + "\n")
    (tmp_path / "other.key").write_text(other_key + "\n")
    from app.api.main import app

    api_port = free_port()
    server = serve_in_thread(app, api_port)
    prom_port = free_port()
    conf = tmp_path / "prometheus.yml"
    target = {"static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]}
    conf.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "deploy/prometheus/canary-rules.yml")],
        "scrape_configs": [
            {"job_name": "canary", "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "metrics.key")}, **target},
            {"job_name": "other", "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "other.key")}, **target},
            {"job_name": "anonymous", **target},
        ],
    }))
    proc = subprocess.Popen([exe, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=open(tmp_path / "prom.log", "w"),
                            stderr=subprocess.STDOUT)
    prom = f"http://127.0.0.1:{prom_port}"

    def query(q: str) -> list:
        return httpx.get(prom + "/api/v1/query", params={"query": q}).json()["data"]["result"]

    try:
        wait_http(prom + "/-/ready", proc, str(tmp_path / "prom.log"))
        deadline = time.time() + 60
        got, firing, up = None, [], {}
        while time.time() < deadline and (got is None or not firing or len(up) < 3 or query('canary_build_info{job="anonymous"}') == []):
            r = query('canary_ppl_ratio{job="canary",config="cand"}')
            if r:
                got = float(r[0]["value"][1])
            alerts = httpx.get(prom + "/api/v1/alerts").json()["data"]["alerts"]
            firing = [a for a in alerts if a["labels"]["alertname"] == "CanaryRegressionCritical" and a["state"] == "firing"]
            up = {x["metric"]["job"]: x["value"][1] for x in query("up")}
            time.sleep(0.5)
        assert up == {"canary": "1", "other": "1", "anonymous": "1"}, up  # every target scraped
        assert got == pytest.approx(want, rel=1e-12)  # the stored comparison, through a real scrape
        assert firing and firing[0]["labels"]["config"] == "cand" and firing[0]["labels"]["metric"] == "ppl_ratio"
        # without credentials, and with another project's key: nothing of project p is ingested
        leaked = {job: query(f'{{job="{job}",project="p"}}') for job in ("anonymous", "other")}
        anon = {x["metric"]["__name__"] for x in query('{job="anonymous",__name__=~"canary_.*"}')}
        print(f"\nscrapes: up {up}; canary_ppl_ratio via the metrics key {got}; series of project p without a key "
              f"{len(leaked['anonymous'])}, with another project's key {len(leaked['other'])}; canary_* names without a key {sorted(anon)}")
        assert leaked == {"anonymous": [], "other": []}
        assert anon == {"canary_build_info", "canary_rate_limit_buckets", "canary_rate_limit_buckets_max"}
        text = httpx.get(f"http://127.0.0.1:{api_port}/metrics", headers={"Authorization": f"Bearer {key}"}).text
        for name in ("canary_runs{", "canary_config_runs_queued", "canary_config_run_duration_seconds{quantile=",
                     "canary_verdict{", "# TYPE canary_ttft_p50_seconds gauge", "canary_alerts_firing{"):
            assert name in text
        plain = httpx.get(f"http://127.0.0.1:{api_port}/metrics").text
        assert 'project="p"' not in plain and "canary_runs" not in plain and "process_cpu_seconds_total" in plain
    finally:
        proc.terminate()
        proc.wait(10)
        server.should_exit = True


def test_a_firing_alert_stays_active_in_alertmanager_past_its_endsat_until_the_canary_resolves_it(
        sqlite_env, alertmanager, tmp_path, monkeypatch):
    """Alertmanager resolves an alert whose endsAt has passed (or, with none, after resolve_timeout,
    5 minutes). The canary sends endsAt 4 resend intervals ahead and re-sends firing alerts every
    interval (the canary.refresh_alerts task), so the alert stays active across several intervals —
    here 1 s, compressed from the default 60 s — and goes when the canary sends its resolution."""
    from app.dispatch import REFRESH_ALERTS
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_ALERTMANAGER_RESEND_SECONDS", "1")
    get_settings.cache_clear()
    corpus = small_corpus(tmp_path)

    def run(weights: str) -> None:
        config = cfg("", corpus, int2_weights=weights)
        config["channels"] = [{"name": "am", "kind": "alertmanager", "url": alertmanager}]
        with session_scope() as s:
            apply_config_file(s, parse_config(config))
        start_run("p", "s", None, InlineDispatcher())

    def active() -> list[dict]:
        return [a for a in httpx.get(alertmanager + "/api/v2/alerts").json() if a["status"]["state"] == "active"]

    run("rtn-int2")  # critical: the critical alert fires (and inhibits the warn one)
    (first,) = active()
    assert first["labels"]["alertname"] == "canary_ppl_ratio" and first["labels"]["severity"] == "critical"
    first_ends = datetime.fromisoformat(first["endsAt"].replace("Z", "+00:00"))
    assert 2 < (first_ends - datetime.now(UTC)).total_seconds() <= 4.5  # 4 intervals ahead, not open-ended
    dispatcher = InlineDispatcher()
    while datetime.now(UTC) < first_ends + timedelta(seconds=3):  # well past the first endsAt
        dispatcher.send(REFRESH_ALERTS)
        time.sleep(0.5)
    (still,) = active()
    assert still["fingerprint"] == first["fingerprint"]
    assert datetime.fromisoformat(still["endsAt"].replace("Z", "+00:00")) > first_ends + timedelta(seconds=3)
    with session_scope() as s:  # one re-send per interval, each delivered
        refreshes = s.query(Notification).filter(Notification.payload.isnot(None)).count()
        assert 5 <= refreshes <= 20 and s.query(Notification).filter(Notification.status != "sent").count() == 0

    run("fp32")  # the regression is gone: the canary resolves the alert and says so
    assert active() == []


def test_promtool_finds_nothing_to_lint_in_metrics(sqlite_env, tmp_path, receiver):
    """The API's /metrics after a run with generation figures, through `promtool check metrics`
    (Prometheus' own linter: base units, no reserved labels on gauges, summaries complete)."""
    from app.api.main import app
    from fastapi.testclient import TestClient

    exe = binary("promtool")
    config = cfg(receiver.url, small_corpus(tmp_path))
    config["suites"][0]["scorers"] = ["perplexity", "generation"]
    config["suites"][0]["generation"] = {"prompts": 4, "prompt_words": 6, "max_new_tokens": 4}
    with session_scope() as s:
        apply_config_file(s, parse_config(config))
        _, key = create_key(s, "p", "prometheus", "metrics")
    start_run("p", "s", None, InlineDispatcher())
    text = TestClient(app).get("/metrics", headers={"Authorization": f"Bearer {key}"}).text
    assert "canary_ppl_ratio{" in text and "canary_ttft_p50_seconds{" in text
    assert "# TYPE canary_config_run_duration_seconds summary" in text and "canary_config_run_duration_seconds_count " in text
    r = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
