"""Microsoft Teams through a Workflows webhook: a message with one Adaptive Card 1.2 attachment
(the legacy MessageCard is not accepted); 28 KB at most; throttled above 4 requests/s."""

from __future__ import annotations

from app.channels import AlertMessage, escape_markup

PACE_PER_SECOND = 4.0
MAX_BYTES = 28 * 1024


def payload(msg: AlertMessage) -> dict:
    color = "Good" if msg.status == "resolved" else ("Attention" if msg.severity == "critical" else "Warning")
    return {
        "type": "message",
        "attachments": [{
            "contentType": "application/vnd.microsoft.card.adaptive",
            "content": {
                "type": "AdaptiveCard", "version": "1.2", "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                "body": [
                    {"type": "TextBlock", "text": escape_markup(msg.headline()), "weight": "Bolder", "size": "Medium",
                     "color": color, "wrap": True},
                    {"type": "TextBlock", "text": escape_markup(msg.detail())[:4000], "wrap": True},
                ],
                "actions": [{"type": "Action.OpenUrl", "title": "Open run", "url": msg.link()}],
            },
        }],
    }


def succeeded(status: int, body: str) -> bool:
    return 200 <= status < 300
