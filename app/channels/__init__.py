"""Alert channels: one file per destination, each turning an AlertMessage into the body its
receiver expects (docs/reference.md §9). Delivery, retries and pacing live in app/notify.py."""

from __future__ import annotations

import hashlib
import html
import importlib
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import ModuleType
from typing import Literal, get_args


def escape_markup(text: str) -> str:
    """`&`, `<` and `>` as entities, nothing else: Slack's mrkdwn (and Teams' text) read `<!here>`,
    `<!channel>` and `<@U…>` as mentions, and project, model and config names and the verdict's
    text reach these fields (Slack's formatting reference, "Escaping text")."""
    return html.escape(text, quote=False)


@dataclass(frozen=True)
class AlertMessage:
    status: str  # firing | resolved
    labels: dict[str, str]  # project, model, config, metric, severity
    fingerprint: str
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    baseline: str  # the baseline config's name
    baseline_value: float | None
    candidate_value: float | None
    rule: str  # the verdict rule that fired
    run_id: int
    dashboard_url: str
    starts_at: datetime
    ends_at: datetime | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "warn")

    def headline(self) -> str:
        labels = self.labels
        state = "RESOLVED" if self.status == "resolved" else f"FIRING {self.severity}"
        if labels.get("alertname") == "CanaryStale":  # the canary itself, no model (app/staleness.py)
            what = "succeeds again" if self.status == "resolved" else "has not succeeded for over a period"
            return (f"[{state}] CanaryStale: schedule '{labels.get('config')}' of project '{labels.get('project')}' "
                    f"{what}")
        if labels.get("alertname") == GROUP:  # several alerts of one run (grouped)
            return (f"[{state}] {labels.get('alerts')} alerts of run {self.run_id} on {labels.get('model')} "
                    f"({labels.get('project')}): {labels.get('config')}")
        return (f"[{state}] {labels.get('config')} {labels.get('metric')} on {labels.get('model')} "
                f"({labels.get('project')})")

    def detail(self) -> str:
        """What regressed and by how much, with its CI, baseline vs candidate; or an alert's own
        description (CanaryStale: the canary itself, app/staleness.py)."""
        if "description" in self.annotations:
            return self.annotations["description"] + self.runbook()

        def f(x: float | None) -> str:
            return "—" if x is None else f"{x:.4g}"
        return (f"{self.labels.get('metric')} = {f(self.estimate)} (95% CI {f(self.ci_low)}–{f(self.ci_high)}, "
                f"n={self.n}); baseline {self.baseline}: {f(self.baseline_value)}, candidate "
                f"{self.labels.get('config')}: {f(self.candidate_value)}. "
                f"Rule: {self.rule}. Run {self.run_id}." + self.verdict() + self.step_back() + self.runbook())

    def verdict(self) -> str:
        """Where the alert's config stands on every metric (its verdict-summary line), when firing."""
        line = self.annotations.get("verdict")
        return f" {self.labels.get('config')} overall: {line}." if line else ""

    def step_back(self) -> str:
        """The layer of a stacked config to disable, when its ablations ran (workers/step_back.py)."""
        advice = self.annotations.get("step_back")
        return f" Step back: {advice}." if advice else ""

    def runbook(self) -> str:
        """Where the alert's runbook is (app/runbooks.py), when the alert names one."""
        url = self.annotations.get("runbook_url")
        return f" Runbook: {url}" if url else ""

    def link(self) -> str:
        """The dashboard's page for the run (its project chosen: the dashboard opens on the first
        project otherwise), or its front page."""
        from urllib.parse import urlencode

        base = self.dashboard_url.rstrip("/") + "/"
        project = {"project": self.labels["project"]} if self.labels.get("project") else {}
        if not self.run_id:
            return base + (f"?{urlencode(project)}" if project else "")
        return base + "?" + urlencode({"page": "run", "run_id": self.run_id, **project})


# The one list of channel kinds: each is the module app/channels/<kind>.py (its payload, its
# success test, its pace). The config file's field is this type; KINDS and the delivery's modules
# derive from it (tests/unit/test_chat_mentions.py).
ChannelKind = Literal["slack", "teams", "discord", "webhook", "alertmanager"]
KINDS: tuple[str, ...] = get_args(ChannelKind)


def module(kind: str) -> ModuleType:
    """The channel kind's module (a KeyError naming the kinds for an unknown one)."""
    if kind not in KINDS:
        raise KeyError(f"channel kind {kind!r}: one of {', '.join(KINDS)}")
    return importlib.import_module(f"app.channels.{kind}")


def build(kind: str, msg: AlertMessage) -> dict | list:
    return module(kind).payload(msg)


GROUP = "CanaryRun"  # the alertname of one message that carries several alerts of a run


def grouped(msgs: list[AlertMessage]) -> AlertMessage:
    """One message for several alerts of one run on one channel (an alert storm is one message,
    not one per config and metric): the worst severity in its headline, every config named, and
    each alert's own headline and detail, worst first, as its description."""
    order = sorted(msgs, key=lambda m: (m.status != "firing", m.severity != "critical", m.labels.get("config", "")))
    first = order[0]
    configs = list(dict.fromkeys(m.labels.get("config", "") for m in order))
    labels = {"alertname": GROUP, "project": first.labels.get("project", ""), "model": first.labels.get("model", ""),
              "config": ", ".join(configs), "alerts": str(len(msgs)), "severity": first.severity}
    description = "\n".join(f"{m.headline()}: {m.detail()}" for m in order)
    fingerprint = hashlib.sha256("|".join(sorted(m.fingerprint for m in msgs)).encode()).hexdigest()[:16]
    return replace(first, labels=labels, fingerprint=fingerprint, annotations={"description": description},
                   starts_at=min(m.starts_at for m in msgs))


def build_group(kind: str, msgs: list[AlertMessage]) -> dict | list:
    """The body of one message carrying several alerts of a run: the kind's own group_payload where
    it has one (the webhook: every alert in Alertmanager's list), else its payload of `grouped`."""
    mod = module(kind)
    return mod.group_payload(msgs) if hasattr(mod, "group_payload") else mod.payload(grouped(msgs))
