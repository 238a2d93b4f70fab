"""Discord webhook: POST …?wait=true with {"content" ≤ 2000 chars, "embeds", "allowed_mentions":
{"parse": []}} (an alert must never ping @everyone); 429 with Retry-After; a 404 means the
webhook was deleted, so the channel is disabled."""

from __future__ import annotations

from app.channels import AlertMessage

PACE_PER_SECOND = 1.0
DISABLE_ON = (404,)


def payload(msg: AlertMessage) -> dict:
    color = 0x2EB67D if msg.status == "resolved" else (0xE01E5A if msg.severity == "critical" else 0xECB22E)
    return {
        "content": msg.headline()[:2000],
        "embeds": [{"title": msg.headline()[:256], "description": msg.detail()[:4096], "url": msg.link(),
                    "color": color}],
        "allowed_mentions": {"parse": []},
    }


def url(base: str) -> str:
    return base if "wait=" in base else base + ("&" if "?" in base else "?") + "wait=true"


def succeeded(status: int, body: str) -> bool:
    return 200 <= status < 300
