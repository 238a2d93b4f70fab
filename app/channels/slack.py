"""Slack incoming webhook: {"text", "blocks"}; success is HTTP 200 with body "ok"; about one
message per second per webhook, 429 with Retry-After above that."""

from __future__ import annotations

from app.channels import AlertMessage, escape_markup

PACE_PER_SECOND = 1.0
SECTION_LIMIT = 3000  # characters of a section block's text; Slack refuses the message above it
HEADER_LIMIT = 150  # characters of a header block's plain text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def payload(msg: AlertMessage) -> dict:
    if msg.status == "resolved":
        emoji = ":large_green_circle:"
    else:
        emoji = ":red_circle:" if msg.severity == "critical" else ":large_orange_circle:"
    # "text" and mrkdwn parse <!here>-style mentions, so what the alert quotes is escaped there;
    # a plain_text header parses none and is sent as it is
    return {
        "text": escape_markup(f"{msg.headline()}: {msg.detail()}"),  # the notification / fallback text
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": _cut(msg.headline(), HEADER_LIMIT)}},
            {"type": "section", "text": {"type": "mrkdwn",
                                         "text": _cut(f"{emoji} {escape_markup(msg.detail())}", SECTION_LIMIT)}},
            {"type": "actions", "elements": [{"type": "button", "text": {"type": "plain_text", "text": "Open run"},
                                              "url": msg.link()}]},
        ],
    }


def succeeded(status: int, body: str) -> bool:
    return status == 200 and body.strip() == "ok"
