"""Outbound URL policy (docs/reference.md §10): webhook, engine, metrics and judge URLs are checked
when they are created and again at send time. Only http(s); every address the host resolves to
(A and AAAA) must be public — no loopback, private, link-local (169.254.169.254), CGNAT
(100.64/10), unique-local (fd00::/8), multicast, reserved or unspecified addresses. IPv6 forms
that embed an IPv4 address are judged by the address they embed: IPv4-mapped (::ffff:0:0/96),
6to4 (2002::/16), NAT64 (64:ff9b::/96) and Teredo (2001::/32, the client's address) — unless
the host and port are on the operator's allow-list (CANARY_URL_ALLOWLIST, comma-separated
`host` for ports 80 and 443, `host:port`, or `host:*` for any port; names or IPs; the tests list
loopback). Numeric tricks (127.1, 2130706433, 0x7f000001) resolve to the
addresses they stand for and are judged as such. Redirects are never followed by the clients
that use these URLs.

At send time the check runs inside an httpx transport (`PinnedTransport`,
`AsyncPinnedTransport`): it resolves and checks the host, then connects to the address it
checked (the Host header and TLS SNI / certificate name stay the original host's), so a DNS
answer cannot change between the check and the connect.

Secrets named by configuration (`api_key_env`, a channel's `${VAR}`) are app/secret_names.py's;
its names are imported here too, where the configuration checks below use them.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import httpx

from app.secret_names import ENV_REF, check_secret_name

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    # socket.getaddrinfo or a stand-in (tests): (host, port, proto=…) → entries whose [4][0] is an address
    Resolve = Callable[..., Sequence[tuple[Any, ...]]]

CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix: the last 32 bits are the IPv4 address
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215 local-use translation: never a public destination
SIXTOFOUR = ipaddress.ip_network("2002::/16")
TEREDO = ipaddress.ip_network("2001::/32")


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
    host = f"[{host}]" if ":" in host else host
    return f"{u.scheme}://{host}{port}/***" if u.scheme and host else "***"


def mask_userinfo(url: str) -> str:
    """The URL with its user:password@ replaced by ***@ (the rest, path and query, kept): for URLs
    that are configuration rather than secrets, such as an engine's base_url."""
    if not isinstance(url, str) or "@" not in url:
        return url
    try:
        u = urlsplit(url)
    except ValueError:
        return "***"
    if u.username is None and u.password is None:
        return url
    return url.replace(u.netloc, "***@" + u.netloc.rpartition("@")[2], 1)


def has_credentials(url: str) -> str | None:
    """What in a literal URL looks like a credential (user info, a token in the path or query), or None."""
    try:
        u = urlsplit(url)
    except ValueError:
        return None
    if u.username or u.password:
        return "user:password@"
    if u.query:
        return "a query string"
    # webhook tokens live in the path: Slack /services/T/B/X, Discord /api/webhooks/id/token,
    # Teams …/IncomingWebhook/…; any path segment of 16+ token characters counts
    if any(re.fullmatch(r"[A-Za-z0-9_\-+=.~%]{16,}", unquote(seg) or "") for seg in u.path.split("/")) or \
            u.path.startswith(("/services/", "/api/webhooks/")):
        return "a token in the path"
    return None


class UnsafeURL(ValueError):
    pass


DEFAULT_PORTS = frozenset({80, 443})  # what an entry without a port allows


def parse_allowlist(value: str) -> dict[str, frozenset[int] | None]:
    """CANARY_URL_ALLOWLIST as {host name or address: the ports it may be reached on, None for any}.
    Entries: `host` (ports 80 and 443 only), `host:port`, `host:*` (any port); IPv6 addresses bare
    or in brackets, `[::1]:8080`. A listed internal host is one service, not every service on its
    machine: without a port, `localhost` would open Postgres and Redis on 5432 and 6379 too."""
    allowed: dict[str, frozenset[int] | None] = {}
    for entry in (e.strip().lower() for e in (value or "").split(",")):
        if not entry:
            continue
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            if rest and not rest.startswith(":"):
                raise ValueError(f"CANARY_URL_ALLOWLIST: '{entry}' is not host, host:port or host:*")
            port = rest[1:] or None
        elif entry.count(":") > 1:  # a bare IPv6 address: no port
            host, port = entry, None
        else:
            host, _, port_text = entry.partition(":")
            port = port_text if ":" in entry else None
        if not host or (port is not None and port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ValueError(f"CANARY_URL_ALLOWLIST: '{entry}' is not host, host:port (1-65535) or host:*")
        ports = None if port == "*" else DEFAULT_PORTS if port is None else frozenset({int(port)})
        known = allowed.get(host, frozenset())
        allowed[host] = None if ports is None or known is None else known | ports
    return allowed


def allowlist() -> dict[str, frozenset[int] | None]:
    from app.settings import get_settings

    return parse_allowlist(get_settings().url_allowlist)


def _allowed_on(allowed: dict[str, frozenset[int] | None], host: str, port: int) -> bool:
    if host not in allowed:
        return False
    ports = allowed[host]
    return ports is None or port in ports


def embedded_ipv4(ip: ipaddress._BaseAddress) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 address stands for, with the form's name, or None."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "IPv4-mapped"
    if ip in SIXTOFOUR and ip.sixtofour is not None:  # always set inside 2002::/16
        return ip.sixtofour, "6to4"
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64"
    if ip in TEREDO and ip.teredo is not None:  # always set inside 2001::/32
        return ip.teredo[1], "Teredo"  # the client's address (stored XOR 0xffffffff)
    return None


def _bad(ip: ipaddress._BaseAddress) -> str | None:
    """Why the address is no public destination ("loopback address 127.0.0.1 (embedded in 6to4
    address 2002:7f00:1::)"), or None."""
    inner = embedded_ipv4(ip)
    if inner is not None:
        why = _bad(inner[0])
        if why:
            return f"{why} (embedded in {inner[1]} address {ip})"
    if isinstance(ip, ipaddress.IPv6Address) and ip in NAT64_LOCAL:
        return f"local-use NAT64 address {ip}"
    for attr, what in (("is_loopback", "loopback"), ("is_unspecified", "unspecified"), ("is_link_local", "link-local"),
                       ("is_private", "private"), ("is_multicast", "multicast"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return f"{what} address {ip}"
    if isinstance(ip, ipaddress.IPv4Address) and ip in CGNAT:
        return f"carrier-grade NAT address {ip}"
    return None


def resolve_checked(url: str, field: str = "url", resolve: Resolve | None = None) -> tuple[str, list[str] | None]:
    """(host, the addresses it may be reached at) — None for an allow-listed host name, which is
    connected to as named — or UnsafeURL naming the field and the reason."""
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
    port = port or (443 if parts.scheme == "https" else 80)
    if _allowed_on(allowed, host.lower(), port):
        return host, None
    try:
        infos = (resolve or socket.getaddrinfo)(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise UnsafeURL(f"{field}: host '{host}' does not resolve ({e})") from None
    ips: list[str] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])  # an IPv6 address may carry %scope
        if not _allowed_on(allowed, str(ip), port):
            why = _bad(ip)
            if why:
                entry = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                listed = [(name, ports) for name in (host.lower(), str(ip)) if (ports := allowed.get(name))]
                where = "".join(f"; CANARY_URL_ALLOWLIST allows '{name}' on port(s) "
                                f"{', '.join(map(str, sorted(ports)))} only, not {port}" for name, ports in listed[:1])
                raise UnsafeURL(f"{field}: host '{host}' resolves to {why}{where}; outbound requests go to public "
                                f"addresses only (an operator can allow-list the host and port in "
                                f"CANARY_URL_ALLOWLIST, e.g. '{entry}')")
        if str(ip) not in ips:
            ips.append(str(ip))
    if not ips:
        raise UnsafeURL(f"{field}: host '{host}' resolves to no address")
    return host, ips


def check_url(url: str, field: str = "url", resolve: Resolve | None = None) -> str:
    """The URL unchanged, or UnsafeURL naming the field and the reason."""
    resolve_checked(url, field, resolve)
    return url


# -- checks of stored configuration, at create -----------------------------------------------------
def refuse_literal_credentials(url: str, field: str) -> None:
    """In production (CANARY_ENVIRONMENT=production), an engine's or a judge's literal URL that
    carries a credential (user info, a query string, a token in the path, a fragment) is refused,
    as a channel's is: it would be stored in plain text and shown to read-only keys. The key goes
    in the workers' environment, named by api_key_env."""
    from app.settings import get_settings

    if get_settings().environment != "production":
        return
    try:
        fragment = urlsplit(url).fragment
    except ValueError:
        fragment = ""
    secret = has_credentials(url) or ("a fragment" if fragment else None)
    if secret:
        raise UnsafeURL(f"{field}: '{mask_url(url)}' carries a credential ({secret}), which would be stored in plain "
                        "text and shown to read-only keys; in production give the URL without it and put the key in "
                        "the workers' environment, named by api_key_env")


def check_engine_options(opts: dict | None, field: str = "engine_options", project: str | None = None) -> None:
    opts = opts or {}
    for key in ("base_url", "metrics_url"):
        if opts.get(key) is not None:
            refuse_literal_credentials(str(opts[key]), f"{field}.{key}")
            check_url(str(opts[key]), f"{field}.{key}")
    if opts.get("api_key_env") is not None:
        check_secret_name(str(opts["api_key_env"]), f"{field}.api_key_env", project)


def check_judge(judge: dict | None, field: str = "judge", project: str | None = None) -> None:
    judge = judge or {}
    if judge.get("base_url") is not None:
        refuse_literal_credentials(str(judge["base_url"]), f"{field}.base_url")
        check_url(str(judge["base_url"]), f"{field}.base_url")
    if judge.get("api_key_env") is not None:
        check_secret_name(str(judge["api_key_env"]), f"{field}.api_key_env", project)


# -- the check at send time, with the checked address pinned ----------------------------------------
class _Pins:
    """Per transport: the address each (scheme, host, port) was checked at, reused for every
    request of the transport's life (one client, one batch of requests)."""

    def __init__(self, field: str, resolve: Resolve | None = None) -> None:
        self.field, self.resolve = field, resolve
        self.pins: dict[tuple[str, str, int | None], str | None] = {}

    def prepare(self, request: httpx.Request) -> httpx.Request:
        url = request.url
        key = (url.scheme, url.host, url.port)
        if key not in self.pins:
            _, ips = resolve_checked(str(url), self.field, self.resolve)
            self.pins[key] = ips[0] if ips else None
        ip = self.pins[key]
        if ip is None or ip == url.host:  # allow-listed by name, or already the address
            return request
        request.url = url.copy_with(host=ip)  # the Host header keeps the name
        if url.scheme == "https":  # SNI and the certificate check use the name, not the address
            request.extensions = {**request.extensions, "sni_hostname": url.host}
        return request


class PinnedTransport(httpx.HTTPTransport):
    """An httpx transport that checks every request's URL against the policy and connects to the
    address it checked. ``field`` names the URL in the UnsafeURL it raises."""

    def __init__(self, field: str = "url", resolve: Resolve | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self._pins = _Pins(field, resolve)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return super().handle_request(self._pins.prepare(request))


class AsyncPinnedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, field: str = "url", resolve: Resolve | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self._pins = _Pins(field, resolve)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await super().handle_async_request(self._pins.prepare(request))


def hide_url_logs() -> None:
    """httpx logs every request's full URL at INFO, and a webhook URL is a secret (its path or
    query holds the token): keep those loggers at WARNING in every process of the service."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def public_spec(spec: dict | None) -> dict | None:
    """A stored config spec as responses show it: URLs in engine_options without user:password@."""
    if not isinstance(spec, dict) or not isinstance(spec.get("engine_options"), dict):
        return spec
    opts = {k: mask_userinfo(v) if isinstance(v, str) else v for k, v in spec["engine_options"].items()}
    return {**spec, "engine_options": opts}
