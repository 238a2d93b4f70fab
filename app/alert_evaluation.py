"""Evaluate a finished run's comparisons against the alert rules: write Alert transitions, queue
Notifications in the outbox (idempotent by key), and escalate a newly firing regression to one
immediate, larger run of that config (CANARY_ESCALATION_SAMPLES documents of the suite). The state
machine itself is app/alerting.py."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from app import repo
from app.alerting import (
    SEVERITY_VERDICTS,
    AlertState,
    SilenceRule,
    evaluate,
    fingerprint,
    idempotency_key,
    should_notify,
)
from app.channels import AlertMessage, build, build_group
from app.dispatch import Dispatcher
from app.models import Alert, AlertRule, Channel, ComparisonRow, Notification, Run, Silence, Suite, aware, utcnow
from app.runbooks import alert_runbook
from app.schemas import ComparisonOut
from app.settings import get_settings
from app.summary import config_line, judged

log = logging.getLogger(__name__)
ACTIVE = ("pending", "firing")


def _state(alert: Alert | None, labels: dict[str, str]) -> AlertState:
    if alert is None:
        return AlertState(labels)
    times = (alert.started_at, alert.fired_at, alert.resolved_at, alert.last_notified_at)
    return AlertState(dict(alert.labels), alert.state, alert.consecutive, alert.value, *(aware(t) for t in times))


def _latest(session: Session, project_id: int, fp: str) -> Alert | None:
    return session.scalar(select(Alert).where(Alert.project_id == project_id, Alert.fingerprint == fp)
                          .order_by(Alert.id.desc()).limit(1))


def evaluate_run(session: Session, run: Run, now: datetime | None = None) -> dict[str, list]:
    """Returns {"notifications": [ids], "escalate": [(config_name, [alert ids])]}."""
    now = aware(now or utcnow())
    names = {config_run.config_id: config_run.config.name for config_run in run.config_runs}
    model = run.config_runs[0].config.model if run.config_runs else None
    project_name = repo.project_name(session, run.project_id)
    baseline = names.get(run.baseline_config_id, "baseline")
    channels = list(session.scalars(select(Channel).where(Channel.project_id == run.project_id,
                                                          Channel.enabled.is_(True))))
    silences = [SilenceRule(tuple(silence.matchers), aware(silence.starts_at), aware(silence.ends_at))
                for silence in session.scalars(select(Silence).where(Silence.project_id == run.project_id))]
    comparisons = list(session.scalars(select(ComparisonRow).where(ComparisonRow.run_id == run.id)))
    rules = repo.alert_rules(session, run.project_id, run.model_id)  # read once for every comparison
    verdicts = _config_verdicts(comparisons, names, {config_run.config.name: config_run.figures or {}
                                                     for config_run in run.config_runs})
    specs = {config_run.config_id: (config_run.figures or {}).get("config_digest") for config_run in run.config_runs}
    touched: list[tuple[Alert, AlertState, str | None, ComparisonRow]] = []
    for comparison in comparisons:
        if comparison.config_id == run.baseline_config_id or not comparison.gated:
            continue
        if comparison.config.ablation_of_id is not None:  # one layer of a stacked config: diagnosis, not a deploy
            continue
        rule = repo.most_specific_rule(rules, comparison.metric, comparison.config_id)
        if rule is None or not rule.enabled:
            continue
        for severity in ("warn", "critical") if rule.critical is not None else ("warn",):
            labels = {"project": project_name, "model": model.name if model else "",
                      "config": names[comparison.config_id], "metric": comparison.metric, "severity": severity}
            fp = fingerprint(labels)
            row = _latest(session, run.project_id, fp)
            prev = _state(row, labels)
            measured = definition(specs.get(comparison.config_id), specs.get(run.baseline_config_id))
            edited = _raised_on(row) not in (None, measured) and measured is not None
            verdict, held = _weighed(row, comparison, severity, edited)
            new, transition = evaluate(prev, verdict, comparison.estimate, rule.for_runs, now)
            if transition in ("pending", "firing") and (row is None or row.state in ("resolved", "inactive")):
                row = repo.open_alert(session, run.project_id, rule.id, fp, labels, new.state, severity,
                                      new.started_at)
            if row is None or (transition is None and row.state not in ACTIVE):
                continue  # a resolved or inactive episode keeps the run and annotations it ended with
            if held:  # the episode keeps its state, run, value, CI and n: the evidence that raised it
                row.annotations = {**(row.annotations or {}), "held": held}
                continue
            # the run the episode fired on (the Trends page marks it there): later runs re-check it, not fire it
            fired_run = str(run.id) if transition == "firing" else (row.annotations or {}).get("fired_run")
            row.state, row.consecutive, row.value = new.state, new.consecutive, new.value
            row.fired_at, row.resolved_at, row.run_id = new.fired_at, new.resolved_at, run.id
            row.annotations = {"rule": comparison.rule, "ci": f"[{comparison.ci_low}, {comparison.ci_high}]",
                               # the evidence that raised it, until a run of a config edited since replaces it
                               "n": str(comparison.n),
                               "raised_n": str(comparison.n if edited else _raised_n(row) or comparison.n),
                               # (an alert raised before runs kept their definition stays without one)
                               **({"raised_on": on} if (on := measured if edited else _raised_on(row) or (
                                   None if _raised_n(row) else measured)) else {}),
                               **({"fired_run": fired_run} if fired_run else {}), **_step_back(comparison)}
            touched.append((row, new, transition, comparison))
    session.flush()
    firing = [st for _, st, _, _ in touched if st.state == "firing"]
    notification_ids = []
    settings = get_settings()
    # per channel and kind (firing, resolved): the alerts this run announces there, grouped below
    outgoing: dict[tuple[int, str], list[tuple[Alert, str, AlertMessage]]] = {}
    for row, st, transition, comparison in touched:
        for channel in channels:
            kind = should_notify(st, transition, now, send_resolved=(channel.settings or {}).get("send_resolved", True),
                                 silences=silences, others=firing)
            if kind is None:
                continue
            key = idempotency_key(channel.id, st, kind, now)
            if session.scalar(select(Notification.id).where(Notification.idempotency_key == key)) is not None:
                continue
            msg = AlertMessage(status=kind, labels=dict(st.labels), fingerprint=st.fingerprint,
                               estimate=comparison.estimate, ci_low=comparison.ci_low, ci_high=comparison.ci_high,
                               n=comparison.n, baseline=baseline,
                               baseline_value=comparison.baseline_value, candidate_value=comparison.candidate_value,
                               rule=comparison.rule, run_id=run.id, dashboard_url=settings.dashboard_url,
                               annotations={**_step_back(comparison),
                                            "runbook_url": alert_runbook(st.labels, settings.runbook_url),
                                            **({"verdict": verdicts[st.labels["config"]]}
                                               if st.labels["config"] in verdicts and kind == "firing" else {})},
                               starts_at=st.fired_at or st.started_at or now,
                               ends_at=st.resolved_at if kind == "resolved" else alertmanager_ends_at(channel, now))
            outgoing.setdefault((channel.id, kind), []).append((row, key, msg))
    by_id = {channel.id: channel for channel in channels}
    for (channel_id, _kind), items in outgoing.items():
        channel = by_id[channel_id]
        if channel.kind == "alertmanager" or len(items) == 1:
            # Alertmanager groups alerts itself (and the refresher re-sends each one's own body)
            for row, key, msg in items:
                notification_ids.append(repo.queue_notification(session, channel.id, key, build(channel.kind, msg),
                                                                row.id).id)
        else:  # one message per run and channel: an alert storm is one message, every alert inside
            key = hashlib.sha256("|".join(sorted(key for _, key, _ in items)).encode()).hexdigest()[:40]
            if session.scalar(select(Notification.id).where(Notification.idempotency_key == key)) is None:
                payload = build_group(channel.kind, [msg for _, _, msg in items])
                notification_ids.append(repo.queue_notification(session, channel.id, key, payload,
                                                                items[0][0].id).id)
        for row, _, _ in items:
            row.last_notified_at = now
    return {"notifications": notification_ids, "escalate": _escalations(session, run, touched)}


def _raised_n(alert: Alert | None) -> int:
    """The samples of the run that raised an active alert (0 for none; a later breaching run, an
    escalation's larger one included, does not raise the bar): what a later run must have at least
    to resolve it or to say it is no longer this severe."""
    if alert is None or alert.state not in ACTIVE:
        return 0
    return int((alert.annotations or {}).get("raised_n") or (alert.annotations or {}).get("n") or 0)


def definition(config_digest: str | None, baseline_digest: str | None) -> str | None:
    """What a comparison measured: the config and its baseline as their config-runs loaded them
    (their figures' config_digest, vocabulary.figures.spec_digest); None when a run did not keep them."""
    if config_digest is None or baseline_digest is None:
        return None
    return f"{config_digest}/{baseline_digest}"


def _raised_on(alert: Alert | None) -> str | None:
    """The definition (`definition`) the evidence that raised an active alert measured."""
    if alert is None or alert.state not in ACTIVE:
        return None
    return (alert.annotations or {}).get("raised_on")


def _weighed(alert: Alert | None, comparison: ComparisonRow, severity: str,
             edited: bool = False) -> tuple[str, str | None]:
    """The verdict the alert's state machine sees, and why it was held. A run with fewer samples
    than the evidence that raised an active alert never resolves or downgrades it (a 12-sample gate
    after a 100-sample nightly): its not-breaching verdict counts as no data, and the alert says so.
    A breaching verdict always counts, and so does any run of a config (or baseline) `edited` in
    place since the alert was raised: the larger run's evidence is about a config that no longer
    exists."""
    raised = _raised_n(alert)
    if comparison.verdict in SEVERITY_VERDICTS[severity] or not raised or comparison.n >= raised or edited:
        return comparison.verdict, None
    return "inconclusive", (f"run {comparison.run_id} said {comparison.verdict} at n={comparison.n}, fewer samples "
                            f"than the n={raised} that raised this alert: kept as it was")


def _config_verdicts(comparisons: list[ComparisonRow], names: dict[int, str],
                     figures: dict[str, dict]) -> dict[str, str]:
    """Each candidate's line of the verdict summary (app/summary.py), e.g. 'drop or fix: ppl ratio
    +5.90% [+4.50, +8.20] critical; TTFT ratio +30% [...] warn (reference engine on cpu)': an alert
    on one metric then says where its config stands on all of them, quality and speed, in the words
    of every other surface."""
    rows: dict[str, list[ComparisonOut]] = {}
    for c in comparisons:
        rows.setdefault(names[c.config_id], []).append(ComparisonOut.of(c, names[c.config_id]))
    out = {}
    for config, found in rows.items():
        line = config_line(config, judged(found), figures=figures.get(config))
        if line is not None:
            out[config] = f"{line.group}: {line.findings}"
    return out


def _step_back(comparison: ComparisonRow) -> dict[str, str]:
    """{"step_back": the layer to disable, with each layer's share} when the comparison's stacked
    config stepped back (workers/step_back.py), else nothing."""
    found = (comparison.details or {}).get("step_back")
    return {"step_back": found["advice"]} if found else {}


def _escalations(session: Session, run: Run, touched: list) -> list[tuple[str, list[int]]]:
    """The configs to escalate, each with the alerts that newly fire for it in this run: one
    escalation per regression, not per severity. A (config, metric) whose active alert already
    has an escalation run (a warn that turns critical) takes that run instead of a new one.
    Escalation runs themselves never escalate."""
    if run.trigger == "alert":
        return []
    escalating = select(Alert).where(Alert.project_id == run.project_id, Alert.state.in_(ACTIVE),
                                     Alert.escalation_run_id.is_not(None))
    escalated = {(alert.labels.get("config"), alert.labels.get("metric")): alert.escalation_run_id
                 for alert in session.scalars(escalating)}
    by_config: dict[str, list[int]] = {}
    for row, st, transition, _ in touched:
        if transition != "firing" or row.escalation_run_id is not None:
            continue
        earlier = escalated.get((st.labels["config"], st.labels["metric"]))
        if earlier is not None:
            row.escalation_run_id = earlier
            continue
        by_config.setdefault(st.labels["config"], []).append(row.id)
    return list(by_config.items())


def escalate(session_factory: Callable[[], AbstractContextManager[Session]], run_id: int,
             escalations: list[tuple[str, list[int]]], dispatcher: Dispatcher) -> list[int]:
    """One immediate run per config with newly firing alerts (trigger 'alert', queued behind
    gates): the suite's first CANARY_ESCALATION_SAMPLES documents, not the whole corpus. Every
    alert of it keeps the run id, so a later evaluation of the same firing never escalates twice."""
    from app.services import start_run

    settings = get_settings()
    started = []
    with session_factory() as session:
        run = cast(Run, session.get(Run, run_id))  # the run that raised the alerts
        suite = cast(Suite, session.get(Suite, run.suite_id))  # a foreign key: the row exists
        project = repo.project_name(session, run.project_id)
        full = len(repo.suite_samples(session, suite.id, run.suite_version))
        suite_name = suite.name
    for config, alert_ids in escalations:
        with session_factory() as session:
            if all(cast(Alert, session.get(Alert, alert_id)).escalation_run_id is not None for alert_id in alert_ids):
                continue
        new_run, _ = start_run(project, suite_name, [config], dispatcher,
                               samples=min(full, settings.escalation_samples, settings.max_samples_per_run),
                               trigger="alert", idempotency_key=f"escalation-{min(alert_ids)}")
        with session_factory() as session:
            for alert_id in alert_ids:
                alert = cast(Alert, session.get(Alert, alert_id))  # the alerts this run raised
                if alert.escalation_run_id is None:
                    alert.escalation_run_id = new_run
        started.append(new_run)
    return started


def alertmanager_ends_at(channel: Channel, now: datetime) -> datetime | None:
    """A firing alert's endsAt for an Alertmanager channel: 4 resend intervals ahead (as Prometheus
    sets it), so it stays active while the refresher re-sends it and resolves on its own only if
    the canary stops. Other channels take no endsAt for a firing alert."""
    if channel.kind != "alertmanager":
        return None
    return now + timedelta(seconds=4 * get_settings().alertmanager_resend_seconds)


def refresh_alertmanager(session: Session, now: datetime | None = None) -> list[int]:
    """Re-send every firing alert to each Alertmanager channel that was told of it, with endsAt
    moved ahead (Alertmanager resolves an alert whose endsAt passed, or after resolve_timeout —
    5 minutes — when none was given). One notification per (channel, alert, resend slot); returns
    the ids queued. The payload is the last one the channel was sent for the alert."""
    now = aware(now or utcnow())
    interval = get_settings().alertmanager_resend_seconds
    slot = int(now.timestamp() // interval)
    queued: list[int] = []
    channels = session.scalars(select(Channel).where(Channel.kind == "alertmanager", Channel.enabled.is_(True)))
    for channel in channels:
        silences = [SilenceRule(tuple(silence.matchers), aware(silence.starts_at), aware(silence.ends_at))
                    for silence in session.scalars(select(Silence).where(Silence.project_id == channel.project_id))]
        firing = list(session.scalars(select(Alert).where(Alert.project_id == channel.project_id,
                                                          Alert.state == "firing")))
        for alert in firing:
            if any(silence.mutes(alert.labels, now) for silence in silences):
                continue  # a silence here mutes it; the last endsAt lets it lapse in Alertmanager
            last = session.scalar(select(Notification).where(Notification.channel_id == channel.id,
                                                             Notification.alert_id == alert.id)
                                  .order_by(Notification.id.desc()).limit(1))
            if last is None or not isinstance(last.payload, list) or not last.payload:
                continue  # never announced on this channel (inhibited, or muted when it fired)
            key = hashlib.sha256(f"{channel.id}|{alert.id}|refresh|{slot}".encode()).hexdigest()[:40]
            if session.scalar(select(Notification.id).where(Notification.idempotency_key == key)) is not None:
                continue
            payload = [{**last.payload[0], "endsAt": (now + timedelta(seconds=4 * interval)).isoformat()}]
            queued.append(repo.queue_notification(session, channel.id, key, payload, alert.id).id)
    return queued


__all__ = ["ACTIVE", "AlertRule", "escalate", "evaluate_run", "refresh_alertmanager"]
