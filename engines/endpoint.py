"""Small helpers about an OpenAI-compatible endpoint: its origin, its URL without credentials, and
the message of an error response."""

from __future__ import annotations

import httpx


def origin(url: str) -> tuple[str, str, int | None]:
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return ("", url, None)
    return (u.scheme, u.host, u.port)


def redact_url(url: str) -> str:
    """The URL without what may be a credential: user:password@ and the query string."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
