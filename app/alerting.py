"""The alert state machine (Prometheus / Alertmanager semantics, docs/reference.md §9), pure and
clock-driven so that every transition and every send / don't-send rule is testable.

Evaluation happens once per run, per (rule, config) and per severity: a warn alert's condition
is "the comparison's verdict is warn or critical", a critical alert's is "critical" — two alerts
with the same labels except `severity`, like two Prometheus rules.

    inactive ──true──▶ pending ──true for `for_runs` consecutive runs──▶ firing ──false──▶ resolved
        ▲                 │false (no notification)                          │true
        └─────────────────┘                                                 └─ stays firing
A `for_runs` of 1 fires on the first run. An inconclusive comparison, or a measurement error (a
figure that cannot be right, evals/sanity.py), is "no data": the state and the consecutive count
stay as they were.

Notifications (per channel): send when an alert starts firing; while it keeps firing, again only
after repeat_interval; send its resolution if the channel has send_resolved; never while it is
pending, silenced (a silence whose matchers all match, between its start and end), or inhibited
(a firing critical alert with the same labels except severity mutes the warn one).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from vocabulary.metrics import NO_DATA_VERDICTS

REPEAT_INTERVAL = timedelta(hours=4)  # Alertmanager's default
SEVERITY_VERDICTS = {"warn": ("warn", "critical"), "critical": ("critical",)}


def fingerprint(labels: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class AlertState:
    labels: dict[str, str]
    state: str = "inactive"  # inactive | pending | firing | resolved
    consecutive: int = 0
    value: float | None = None
    started_at: datetime | None = None  # this episode's first true evaluation
    fired_at: datetime | None = None
    resolved_at: datetime | None = None
    last_notified_at: datetime | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)


def evaluate(prev: AlertState, verdict: str, value: float | None, for_runs: int,
             now: datetime) -> tuple[AlertState, str | None]:
    """Next state after one run's comparison verdict; the second item names the transition
    ("pending", "firing", "resolved", "inactive") or is None when nothing changed."""
    if verdict in NO_DATA_VERDICTS:
        return prev, None
    breaching = verdict in SEVERITY_VERDICTS[prev.labels["severity"]]
    state = prev.state
    if breaching:
        if state in ("inactive", "resolved"):
            consecutive = 1
            if consecutive >= for_runs:
                return AlertState(prev.labels, "firing", consecutive, value, now, now), "firing"
            return AlertState(prev.labels, "pending", consecutive, value, now), "pending"
        if state == "pending":
            consecutive = prev.consecutive + 1
            if consecutive >= for_runs:
                return replace(prev, state="firing", consecutive=consecutive, value=value, fired_at=now), "firing"
            return replace(prev, consecutive=consecutive, value=value), None
        return replace(prev, consecutive=prev.consecutive + 1, value=value), None  # firing stays firing
    if state == "pending":
        return AlertState(prev.labels), "inactive"  # never fired: back to inactive, no notification
    if state == "firing":
        return replace(prev, state="resolved", value=value, resolved_at=now), "resolved"
    return prev, None


@dataclass(frozen=True)
class SilenceRule:
    matchers: tuple[dict[str, str], ...]  # {"name", "value", "isRegex": "true"|"false"}
    starts_at: datetime
    ends_at: datetime

    def mutes(self, labels: dict[str, str], now: datetime) -> bool:
        if not self.starts_at <= now < self.ends_at:
            return False
        for matcher in self.matchers:
            value = labels.get(matcher["name"], "")
            if str(matcher.get("isRegex", "false")).lower() == "true":
                if not re.fullmatch(matcher["value"], value):
                    return False
            elif value != matcher["value"]:
                return False
        return True


def inhibited(alert: AlertState, firing: list[AlertState]) -> bool:
    """A warn alert is muted while a critical alert with the same other labels fires."""
    if alert.labels.get("severity") != "warn":
        return False
    rest = {k: v for k, v in alert.labels.items() if k != "severity"}
    return any(other.state == "firing" and other.labels.get("severity") == "critical"
               and {k: v for k, v in other.labels.items() if k != "severity"} == rest for other in firing)


def should_notify(alert: AlertState, transition: str | None, now: datetime, *, send_resolved: bool,
                  silences: list[SilenceRule], others: list[AlertState],
                  repeat_interval: timedelta = REPEAT_INTERVAL) -> str | None:
    """The notification kind to send ("firing" | "resolved") or None, after one evaluation."""
    if any(silence.mutes(alert.labels, now) for silence in silences):
        return None
    if alert.state == "firing":
        if inhibited(alert, others):
            return None
        if transition == "firing" or alert.last_notified_at is None:
            return "firing"
        return "firing" if now - alert.last_notified_at >= repeat_interval else None
    if transition == "resolved" and send_resolved and alert.last_notified_at is not None:
        return "resolved"  # only what was announced is resolved
    return None


def idempotency_key(channel_id: int, alert: AlertState, kind: str, now: datetime,
                    repeat_interval: timedelta = REPEAT_INTERVAL) -> str:
    """One key per (channel, alert episode, kind, repeat slot): a retried evaluation of the same
    run produces the same key, so the outbox holds the notification once."""
    episode = (alert.started_at or now).isoformat()
    slot = int((now - (alert.fired_at or now)) / repeat_interval) if kind == "firing" else 0
    raw = f"{channel_id}|{alert.fingerprint}|{episode}|{kind}|{slot}"
    return hashlib.sha256(raw.encode()).hexdigest()[:40]
