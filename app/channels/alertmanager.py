"""Forward to a real Alertmanager: POST {url}/api/v2/alerts with a list of postable alerts
(labels, annotations, startsAt, endsAt, generatorURL). A resolved alert is sent with endsAt set."""

from __future__ import annotations

from app.channels import AlertMessage

PACE_PER_SECOND = 10.0


def payload(msg: AlertMessage) -> list:
    alert = {
        "labels": {"alertname": f"canary_{msg.labels.get('metric')}", **msg.labels},
        "annotations": {"summary": msg.headline(), "description": msg.detail(), **msg.annotations},
        "startsAt": msg.starts_at.isoformat(),
        "generatorURL": msg.link(),
    }
    if msg.ends_at is not None:
        alert["endsAt"] = msg.ends_at.isoformat()
    return [alert]


def url(base: str) -> str:
    return base.rstrip("/") + "/api/v2/alerts"


def succeeded(status: int, body: str) -> bool:
    return 200 <= status < 300
