"""Outbound URL policy (REFERENCE.md §10): webhook, engine and judge URLs are checked when they
are created and again right before each request. Only http(s); every address the host resolves
to (A and AAAA) must be public — no loopback, private, link-local (169.254.169.254), CGNAT
(100.64/10), unique-local (fd00::/8), multicast, reserved or unspecified addresses, and an
IPv4-mapped IPv6 address is judged by its IPv4 — unless the host is on the operator's
allow-list (CANARY_URL_ALLOWLIST, comma-separated host names or IPs; the tests list loopback).
Numeric tricks (127.1, 2130706433, 0x7f000001) resolve to the addresses they stand for and are
judged as such. Redirects are never followed by the clients that use these URLs.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from urllib.parse import urlsplit

CGNAT = ipaddress.ip_network("100.64.0.0/10")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")  # ${VAR}: a secret read from the environment at send time


def mask_url(url: str) -> str:
    """Only scheme and host stay readable: path, query and user info (where webhook tokens and
    passwords live) never leave the server, in responses or in error messages."""
    if ENV_REF.fullmatch(url):
        return url
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "***"
    return f"{u.scheme}://{host}{port}/***" if u.scheme and host else "***"


class UnsafeURL(ValueError):
    pass


def allowlist() -> set[str]:
    from app.settings import get_settings

    return {h.strip().lower() for h in (get_settings().url_allowlist or "").split(",") if h.strip()}


def _bad(ip: ipaddress._BaseAddress) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _bad(ip.ipv4_mapped)
    for attr, what in (("is_loopback", "loopback"), ("is_unspecified", "unspecified"), ("is_link_local", "link-local"),
                       ("is_private", "private"), ("is_multicast", "multicast"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return what
    if isinstance(ip, ipaddress.IPv4Address) and ip in CGNAT:
        return "carrier-grade NAT"
    return None


def check_url(url: str, field: str = "url", resolve=socket.getaddrinfo) -> str:
    """The URL unchanged, or UnsafeURL naming the field and the reason."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:
        raise UnsafeURL(f"{field}: not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise UnsafeURL(f"{field}: only http and https URLs are allowed, not '{parts.scheme or '(none)'}'")
    if not host:
        raise UnsafeURL(f"{field}: the URL has no host")
    allowed = allowlist()
    if host.lower() in allowed:
        return url
    try:
        infos = resolve(host, port or (443 if parts.scheme == "https" else 80), proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise UnsafeURL(f"{field}: host '{host}' does not resolve ({e})") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if str(ip) in allowed:
            continue
        why = _bad(ip)
        if why:
            raise UnsafeURL(f"{field}: host '{host}' resolves to {why} address {ip}; outbound requests go to public "
                            f"addresses only (an operator can allow-list the host in CANARY_URL_ALLOWLIST)")
    return url


def hide_url_logs() -> None:
    """httpx logs every request's full URL at INFO, and a webhook URL is a secret (its path or
    query holds the token): keep those loggers at WARNING in every process of the service."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
