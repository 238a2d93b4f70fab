"""From a run to a chat message: a regression fires an alert whose notification reaches a real
receiver once; re-evaluating the same run sends nothing twice; the regression (a warn and a
critical alert) escalates to one immediate run of that config, capped at
CANARY_ESCALATION_SAMPLES documents; the alert list shows one alert per regression; a later clean
run resolves the alert."""

from __future__ import annotations

import json

from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.models import Alert, Notification, Run
from app.services import apply_config_file, start_run
from engines.zoo import resolve_corpus_path
from sqlalchemy import select


def cfg(url: str, corpus: str, int2_weights: str = "rtn-int2") -> dict:
    return {
        "project": "p",
        "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
                    {"name": "cand", "engine": "reference", "weights": int2_weights}],
        "suites": [{"name": "s", "corpus": corpus, "samples": 10, "seed": 1, "scorers": ["perplexity"],
                    "perplexity": {"window": 64}}],
        "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03}},
        "channels": [{"name": "hook", "kind": "webhook", "url": url}],
    }


def small_corpus(tmp_path) -> str:
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:12]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines))
    return str(path)


def test_regression_to_chat_once_escalates_once_and_resolves(sqlite_env, receiver, tmp_path, monkeypatch):
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_ESCALATION", "true")
    monkeypatch.setenv("CANARY_ESCALATION_SAMPLES", "11")  # the suite's corpus holds 12
    get_settings.cache_clear()
    corpus = small_corpus(tmp_path)
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg(receiver.url + "/hook", corpus)))
    d = InlineDispatcher()
    run_id, _ = start_run("p", "s", None, d)
    # int2 is critical: the warn and the critical alert both fire; the critical one inhibits the
    # warn one, so exactly one message goes out
    delivered = receiver.delivered()
    assert len(delivered) == 1
    body = json.loads(delivered[0]["body"])
    assert body["version"] == "4" and body["status"] == "firing"
    labels = body["alerts"][0]["labels"]
    assert labels == {"project": "p", "model": "tiny", "config": "cand", "metric": "ppl_ratio", "severity": "critical"}
    annotations = body["alerts"][0]["annotations"]
    assert "95% CI" in annotations["description"]
    # and where the config stands on every metric: its line of the verdict summary (app/summary.py)
    assert annotations["verdict"].startswith("drop or fix: ppl ratio +") and annotations["verdict"].endswith("critical")
    assert "cand overall: drop or fix: ppl ratio" in annotations["description"]
    with session_scope() as s:
        alerts = {a.severity: a for a in s.scalars(select(Alert))}
        assert {a.state for a in alerts.values()} == {"firing"}
        escalation = alerts["critical"].escalation_run_id
        assert escalation is not None and alerts["warn"].escalation_run_id == escalation  # one regression
        runs = list(s.scalars(select(Run).order_by(Run.id)))
        # one escalation for the regression: a run of that config on 11 of the corpus' 12 documents
        assert [(r.trigger, r.n_samples) for r in runs] == [("manual", 10), ("alert", 11)]
        assert runs[1].id == escalation and sorted(cr.config.name for cr in runs[1].config_runs) == ["cand", "fp32"]
        assert all(r.status == "done" for r in runs)
        n_notifications = s.query(Notification).count()
        # the list, as the dashboard and `canary alerts list` read it: the warn alert is inhibited
        from app import repo
        from app.api.routes.alerting import list_alerts

        project = repo.get_project(s, "p")
        listed = list_alerts(project, s, state=None, limit=100, inhibited=False)
        assert [(a["severity"], a["state"]) for a in listed] == [("critical", "firing")]
        everything = {a["severity"]: a for a in list_alerts(project, s, state=None, limit=100, inhibited=True)}
        assert everything["warn"]["inhibited_by"] == everything["critical"]["id"]
        assert everything["critical"]["inhibited_by"] is None
    # re-evaluating the first run (a retried aggregation) queues and sends nothing new
    from app.alert_evaluation import evaluate_run

    with session_scope() as s:
        again = evaluate_run(s, s.get(Run, run_id))
    assert again["notifications"] == [] and len(receiver.delivered()) == 1
    with session_scope() as s:
        assert s.query(Notification).count() == n_notifications
    # the escalation runs were evaluated too: still firing, nothing re-sent within repeat_interval
    # now the candidate is fixed: a clean run resolves both alerts and one resolved message goes out
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg(receiver.url + "/hook", corpus, int2_weights="fp32")))
    start_run("p", "s", None, d)
    bodies = [json.loads(r["body"]) for r in receiver.delivered()]
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[1]["alerts"][0]["labels"]["severity"] == "critical"  # only what was announced resolves
    assert "verdict" not in bodies[1]["alerts"][0]["annotations"]  # a resolved alert carries no verdict line
    with session_scope() as s:
        assert {a.state for a in s.scalars(select(Alert))} == {"resolved"}


def test_an_alert_storm_is_one_message_per_run_and_chat_channel(sqlite_env, receiver, tmp_path):
    """Security round 4, N8: three configs regress in one run. The webhook and Slack channels each
    get one message with every alert inside; Alertmanager, which groups alerts itself, gets each
    alert on its own (its refresher re-sends each one's body)."""
    config = cfg(receiver.url + "/hook", small_corpus(tmp_path))
    config["configs"] += [{"name": "cand-b", "engine": "reference", "weights": "rtn-int2"},
                          {"name": "cand-c", "engine": "reference", "weights": "rtn-int2"}]
    config["channels"] += [{"name": "chat", "kind": "slack", "url": receiver.url + "/slack"},
                           {"name": "am", "kind": "alertmanager", "url": receiver.url + "/am"}]
    with session_scope() as s:
        apply_config_file(s, parse_config(config))
    run_id, _ = start_run("p", "s", None, InlineDispatcher())
    by_path: dict[str, list] = {}
    for request in receiver.delivered():
        by_path.setdefault(request["path"], []).append(json.loads(request["body"]))
    assert len(by_path["/hook"]) == 1 and len(by_path["/slack"]) == 1
    hook = by_path["/hook"][0]
    assert sorted(a["labels"]["config"] for a in hook["alerts"]) == ["cand", "cand-b", "cand-c"]
    assert {a["labels"]["severity"] for a in hook["alerts"]} == {"critical"}  # the warn ones are inhibited
    assert hook["commonLabels"] == {"project": "p", "model": "tiny", "metric": "ppl_ratio", "severity": "critical"}
    assert hook["groupLabels"] == {"run": str(run_id)}
    slack = by_path["/slack"][0]
    assert f"3 alerts of run {run_id}" in slack["text"] and "cand, cand-b, cand-c" in slack["text"]
    assert slack["text"].count("FIRING critical") == 4  # the headline, then each alert's own
    assert len(by_path["/am/api/v2/alerts"]) == 3 and all(len(body) == 1 for body in by_path["/am/api/v2/alerts"])
