"""The outbound URL policy on the inputs REFERENCE §10 names: loopback in its numeric disguises,
private, link-local metadata, CGNAT, unique-local and IPv4-mapped IPv6 addresses, other schemes;
the operator allow-list. (The check at send time: tests/http/test_notify.py.)"""

from __future__ import annotations

import socket

import pytest

from app.ssrf import UnsafeURL, check_url

REFUSED = [
    ("http://127.0.0.1/hook", "loopback"),
    ("http://127.1/hook", "loopback"),
    ("http://2130706433/hook", "loopback"),  # 127.0.0.1 as one decimal number
    ("http://0x7f000001/hook", "loopback"),
    ("http://localhost:8080/hook", "loopback"),
    ("http://[::1]/hook", "loopback"),
    ("http://[::ffff:127.0.0.1]/hook", "loopback"),  # IPv4-mapped IPv6
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://10.1.2.3/", "private"),
    ("http://192.168.0.10/", "private"),
    ("http://172.16.5.4/", "private"),
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://[fd00::1]/", "private"),
    ("http://0.0.0.0/", "unspecified"),
    ("file:///etc/passwd", "only http and https"),
    ("gopher://example.com/", "only http and https"),
    ("http:///nohost", "no host"),
]


@pytest.mark.parametrize("url,why", REFUSED)
def test_refused(url, why, monkeypatch):
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")
    from app.settings import get_settings

    get_settings.cache_clear()
    with pytest.raises(UnsafeURL, match=why):
        check_url(url, "channels[0].url")
    get_settings.cache_clear()


def fake_dns(ip: str):
    def resolve(host, port, proto=0):
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        return [(fam, socket.SOCK_STREAM, proto, "", (ip, port))]
    return resolve


def test_public_addresses_pass_and_a_rebound_name_is_judged_by_its_address(monkeypatch):
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")
    from app.settings import get_settings

    get_settings.cache_clear()
    assert check_url("https://hooks.slack.com/services/T/B/X", resolve=fake_dns("3.5.140.2"))
    with pytest.raises(UnsafeURL, match="hooks.evil.test' resolves to private address 10.0.0.7"):
        check_url("https://hooks.evil.test/x", "url", resolve=fake_dns("10.0.0.7"))
    get_settings.cache_clear()


def test_allow_list(monkeypatch):
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "alertmanager.internal, 10.0.0.5")
    get_settings.cache_clear()
    assert check_url("http://alertmanager.internal:9093", resolve=fake_dns("10.9.9.9"))
    assert check_url("http://am.internal:9093", resolve=fake_dns("10.0.0.5"))  # allow-listed by address
    with pytest.raises(UnsafeURL):
        check_url("http://other.internal", resolve=fake_dns("10.0.0.6"))
    get_settings.cache_clear()
