"""Generic JSON receiver: the Alertmanager webhook body (version "4"), with an Idempotency-Key
header and an HMAC-SHA256 signature of the exact body bytes
(`X-Canary-Signature: sha256=<hex>`) when the channel has a signing secret."""

from __future__ import annotations

import hashlib
import hmac

from app.channels import AlertMessage, grouped

PACE_PER_SECOND = 10.0
SIGNATURE_HEADER = "X-Canary-Signature"


def alert_entry(msg: AlertMessage) -> dict:
    return {
        "status": msg.status,
        "labels": dict(msg.labels),
        "annotations": {"summary": msg.headline(), "description": msg.detail(), **msg.annotations},
        "startsAt": msg.starts_at.isoformat(),
        "endsAt": msg.ends_at.isoformat() if msg.ends_at else "0001-01-01T00:00:00Z",
        "generatorURL": msg.link(),
        "fingerprint": msg.fingerprint,
    }


def payload(msg: AlertMessage) -> dict:
    return {
        "version": "4",
        "groupKey": f"{{}}:{{fingerprint=\"{msg.fingerprint}\"}}",
        "truncatedAlerts": 0,
        "status": msg.status,
        "receiver": "inference-canary",
        "groupLabels": {"fingerprint": msg.fingerprint},
        "commonLabels": dict(msg.labels),
        "commonAnnotations": {"summary": msg.headline()},
        "externalURL": msg.dashboard_url,
        "alerts": [alert_entry(msg)],
    }


def group_payload(msgs: list[AlertMessage]) -> dict:
    """Several alerts of one run in one body, as Alertmanager groups them: grouped by run, the
    labels every alert shares as commonLabels, each alert its own entry."""
    head = grouped(msgs)
    common = dict(set.intersection(*(set(m.labels.items()) for m in msgs)))
    return {
        "version": "4",
        "groupKey": f"{{}}:{{run=\"{head.run_id}\"}}",
        "truncatedAlerts": 0,
        "status": "firing" if any(m.status == "firing" for m in msgs) else "resolved",
        "receiver": "inference-canary",
        "groupLabels": {"run": str(head.run_id)},
        "commonLabels": common,
        "commonAnnotations": {"summary": head.headline()},
        "externalURL": head.dashboard_url,
        "alerts": [alert_entry(m) for m in msgs],
    }


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def succeeded(status: int, body: str) -> bool:
    return 200 <= status < 300
