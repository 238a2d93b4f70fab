"""The outbound URL policy on the inputs REFERENCE §10 names: loopback in its numeric disguises,
private, link-local metadata, CGNAT, unique-local and IPv4-mapped IPv6 addresses, other schemes;
the operator allow-list. (The check at send time: tests/http/test_notify.py.)"""

from __future__ import annotations

import re
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
    assert_refused(url, "channels[0].url", why, monkeypatch)


def assert_refused(url: str, field: str, pattern: str, monkeypatch) -> None:
    """check_url refuses url with no allow-list, with a reason matching the regex `pattern`."""
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")
    from app.settings import get_settings

    get_settings.cache_clear()
    with pytest.raises(UnsafeURL, match=pattern):
        check_url(url, field)
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
    with pytest.raises(UnsafeURL, match=r"hooks.evil.test' resolves to private address 10.0.0.7"):
        check_url("https://hooks.evil.test/x", "url", resolve=fake_dns("10.0.0.7"))
    get_settings.cache_clear()


def test_allow_list(monkeypatch):
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "alertmanager.internal:9093, 10.0.0.5:9093")
    get_settings.cache_clear()
    assert check_url("http://alertmanager.internal:9093", resolve=fake_dns("10.9.9.9"))
    assert check_url("http://am.internal:9093", resolve=fake_dns("10.0.0.5"))  # allow-listed by address
    with pytest.raises(UnsafeURL):
        check_url("http://other.internal", resolve=fake_dns("10.0.0.6"))
    get_settings.cache_clear()


def allow(monkeypatch, value: str) -> None:
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", value)
    get_settings.cache_clear()


def test_an_allow_listed_host_is_open_on_its_ports_only(monkeypatch):
    """`host:port` opens that port, `host` ports 80 and 443, `host:*` every port: listing the API's
    own machine for one webhook receiver must not open its Postgres and Redis."""
    allow(monkeypatch, "localhost:8080")
    assert check_url("http://localhost:8080/hook")
    for url in ("http://localhost:5432/", "http://localhost:6379/", "http://localhost/", "http://127.0.0.1:8080/"):
        with pytest.raises(UnsafeURL, match="loopback"):
            check_url(url, "channels[0].url")
    with pytest.raises(UnsafeURL, match=re.escape("CANARY_URL_ALLOWLIST allows 'localhost' on port(s) 8080 only, not "
                                                  "5432; outbound requests go to public addresses only (an operator "
                                                  "can allow-list the host and port in CANARY_URL_ALLOWLIST, e.g. "
                                                  "'localhost:5432')")):
        check_url("http://localhost:5432/")

    allow(monkeypatch, "alertmanager.internal,10.0.0.5:9093,[::1]:8080")  # no port: 80 and 443
    dns = fake_dns("10.9.9.9")
    assert check_url("http://alertmanager.internal/", resolve=dns) and check_url("https://alertmanager.internal/",
                                                                                 resolve=dns)
    for url in ("http://alertmanager.internal:9093/", "http://alertmanager.internal:22/"):
        with pytest.raises(UnsafeURL, match=re.escape("private address 10.9.9.9; CANARY_URL_ALLOWLIST allows "
                                                      "'alertmanager.internal' on port")):
            check_url(url, resolve=dns)
    assert check_url("http://am.internal:9093/", resolve=fake_dns("10.0.0.5"))
    with pytest.raises(UnsafeURL, match=re.escape("'10.0.0.5' on port")):
        check_url("http://am.internal:9094/", resolve=fake_dns("10.0.0.5"))
    assert check_url("http://[::1]:8080/")
    with pytest.raises(UnsafeURL, match=re.escape("e.g. '[::1]:8081'")):
        check_url("http://[::1]:8081/")

    allow(monkeypatch, "localhost:*,::1")  # every port; a bare IPv6 address: 80 and 443
    assert check_url("http://localhost:5432/") and check_url("http://[::1]/")
    with pytest.raises(UnsafeURL):
        check_url("http://[::1]:5432/")
    allow(monkeypatch, "")


@pytest.mark.parametrize("entry", ["localhost:http", "localhost:0", "localhost:65536", "[::1]x", ":8080"])
def test_a_malformed_allow_list_entry_stops_the_service(entry):
    from app.settings import Settings
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"CANARY_URL_ALLOWLIST: '.*' is not host, host:port"):
        Settings(url_allowlist=f"hooks.test,{entry}")


# -- IPv6 forms that embed an IPv4 address (docs/reference.md §10): unwrapped before the checks ----------
EMBEDDED = [
    ("http://[2002:a9fe:a9fe::]/", "link-local address 169.254.169.254 (embedded in 6to4"),
    ("http://[2002:7f00:1::]/", "loopback address 127.0.0.1 (embedded in 6to4"),
    ("http://[2002:a00:1::]/", "private address 10.0.0.1 (embedded in 6to4"),
    ("http://[64:ff9b::a9fe:a9fe]/", "link-local address 169.254.169.254 (embedded in NAT64"),
    ("http://[64:ff9b::7f00:1]/", "loopback address 127.0.0.1 (embedded in NAT64"),
    ("http://[64:ff9b:1::a00:1]/", "local-use NAT64"),
    # Teredo: the client's IPv4 is the last 32 bits XOR 0xffffffff
    ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "loopback address 127.0.0.1 (embedded in Teredo"),
    ("http://[2001:0:4136:e378:8000:63bf:5601:5601]/", "link-local address 169.254.169.254 (embedded in Teredo"),
    ("http://[::ffff:169.254.169.254]/", "link-local address 169.254.169.254 (embedded in IPv4-mapped"),
]


@pytest.mark.parametrize("url,why", EMBEDDED)
def test_embedded_ipv4_is_unwrapped(url, why, monkeypatch):
    assert_refused(url, "engine_options.base_url", re.escape(why), monkeypatch)


def test_a_6to4_address_of_a_public_ipv4_passes(monkeypatch):
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")
    from app.settings import get_settings

    get_settings.cache_clear()
    assert check_url("http://[2002:808:808::]/v1")  # 8.8.8.8 inside
    get_settings.cache_clear()


# -- secret names: only from the operator's allow-list ---------------------------------------------
def test_secret_names_come_from_the_allow_list_only(monkeypatch):
    from app.secret_names import SecretNotAllowed, check_secret_name, check_secret_ref, read_secret
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_SECRET_ENV_NAMES", "VLLM_API_KEY")
    monkeypatch.setenv("CANARY_SECRET_JUDGE", "judge-key")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    get_settings.cache_clear()
    try:
        assert check_secret_name("CANARY_SECRET_JUDGE", "judge.api_key_env") == "CANARY_SECRET_JUDGE"
        assert read_secret("CANARY_SECRET_JUDGE", "judge.api_key_env") == "judge-key"
        assert read_secret("VLLM_API_KEY", "engine_options.api_key_env") == "vllm-key"  # listed explicitly
        assert check_secret_ref("https://hooks.example.com/x", "url") == "https://hooks.example.com/x"  # a literal is no name
        for name in ("CANARY_DATABASE_URL", "CANARY_BROKER_URL", "DATABASE_URL", "HOME", "AWS_SECRET_ACCESS_KEY",
                     "CANARY_SECRET_", "CANARY_SECRET_ENV_NAMES", "canary_secret_x"):
            with pytest.raises(SecretNotAllowed, match=r"engine_options.api_key_env: '.*' is not an allowed secret variable.*CANARY_SECRET_"):
                read_secret(name, "engine_options.api_key_env")
        with pytest.raises(SecretNotAllowed, match=r"channels\[0\].url: 'CANARY_DATABASE_URL'"):
            check_secret_ref("${CANARY_DATABASE_URL}", "channels[0].url")
    finally:
        get_settings.cache_clear()


def test_each_secret_belongs_to_projects(monkeypatch):
    """Security round 3, H1: a project names its own variables (CANARY_SECRET_<PROJECT>__…), those
    granted to it, or those listed for all; another team's is refused by name, with the fix."""
    from app.secret_names import (
        SecretNotAllowed,
        check_secret_name,
        project_secret_prefix,
        read_secret,
        secret_allowed,
    )
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_SECRET_ENV_NAMES", "VLLM_API_KEY")
    monkeypatch.setenv("CANARY_SECRET_GRANTS", "CANARY_SECRET_SHARED_JUDGE=*,CANARY_SECRET_HOOK=alpha+beta.team")
    monkeypatch.setenv("CANARY_SECRET_ALPHA__ENGINE_KEY", "alpha-key")
    get_settings.cache_clear()
    try:
        assert project_secret_prefix("beta.team-2") == "CANARY_SECRET_BETA_TEAM_2__"
        assert read_secret("CANARY_SECRET_ALPHA__ENGINE_KEY", "engine_options.api_key_env", "alpha") == "alpha-key"
        allowed = {(name, project): secret_allowed(name, project)
                   for name in ("CANARY_SECRET_ALPHA__ENGINE_KEY", "CANARY_SECRET_HOOK", "CANARY_SECRET_SHARED_JUDGE",
                                "VLLM_API_KEY", "CANARY_SECRET_ENGINE_KEY", "CANARY_SECRET_ALPHA__")
                   for project in ("alpha", "beta.team", "gamma")}
        assert [k for k, ok in allowed.items() if ok] == [
            ("CANARY_SECRET_ALPHA__ENGINE_KEY", "alpha"), ("CANARY_SECRET_HOOK", "alpha"), ("CANARY_SECRET_HOOK", "beta.team"),
            ("CANARY_SECRET_SHARED_JUDGE", "alpha"), ("CANARY_SECRET_SHARED_JUDGE", "beta.team"),
            ("CANARY_SECRET_SHARED_JUDGE", "gamma"), ("VLLM_API_KEY", "alpha"), ("VLLM_API_KEY", "beta.team"),
            ("VLLM_API_KEY", "gamma")]
        with pytest.raises(SecretNotAllowed, match=r"engine_options.api_key_env: 'CANARY_SECRET_ALPHA__ENGINE_KEY' is not a "
                           r"secret of project 'gamma'.*CANARY_SECRET_GAMMA__.*CANARY_SECRET_GRANTS="):
            read_secret("CANARY_SECRET_ALPHA__ENGINE_KEY", "engine_options.api_key_env", "gamma")
        # the form alone, where no project is known yet (a schema's field check)
        assert check_secret_name("CANARY_SECRET_ALPHA__ENGINE_KEY", "api_key_env") == "CANARY_SECRET_ALPHA__ENGINE_KEY"
        monkeypatch.setenv("CANARY_SECRET_SCOPE", "shared")  # one team: every prefixed name serves every project
        get_settings.cache_clear()
        assert secret_allowed("CANARY_SECRET_ALPHA__ENGINE_KEY", "gamma") and secret_allowed("CANARY_SECRET_X", "gamma")
        assert not secret_allowed("CANARY_SECRET_HOOK", "gamma")  # a grant still names its projects
        assert not secret_allowed("CANARY_DATABASE_URL", "gamma")
    finally:
        get_settings.cache_clear()


def test_credentials_in_urls_are_recognised_and_masked():
    from app.ssrf import has_credentials, mask_url, mask_userinfo, public_spec

    assert has_credentials("https://ops:pw@hooks.example.com/x") == "user:password@"
    assert has_credentials("https://hooks.example.com/x?token=abc") == "a query string"
    assert has_credentials("https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX") == "a token in the path"
    assert has_credentials("https://discord.com/api/webhooks/1/abc") == "a token in the path"
    assert has_credentials("http://alertmanager:9093") is None
    assert has_credentials("https://hooks.example.com/alerts") is None
    assert mask_userinfo("http://ops:PASSWORD@vllm:8000/v1") == "http://***@vllm:8000/v1"
    assert mask_userinfo("http://vllm:8000/v1") == "http://vllm:8000/v1"
    assert mask_url("http://ops:pw@[::1]:8000/v1?k=1") == "http://[::1]:8000/***"
    spec = {"engine": "openai", "engine_options": {"base_url": "http://u:PW@e/v1", "metrics_url": "http://u:PW@e/metrics", "concurrency": 2}}
    assert "PW" not in str(public_spec(spec)) and public_spec(spec)["engine_options"]["concurrency"] == 2
    assert "PW" in spec["engine_options"]["base_url"]  # the stored spec is untouched


def test_a_secret_name_has_one_owner_whatever_the_case_or_punctuation(monkeypatch):
    """Security round 4, N1: 'alpha', 'ALPHA' and 'alpha.' read the same slug, and 'alpha--x' one of
    its own (ALPHA_X), so CANARY_SECRET_ALPHA__X__KEY is alpha's and no other project's: the owner is
    the text between the prefix and the first '__', exactly."""
    from app.secret_names import project_secret_prefix, secret_allowed, secret_slug
    from app.settings import get_settings

    get_settings.cache_clear()
    try:
        assert {secret_slug(p) for p in ("alpha", "ALPHA", "Alpha", "alpha.", "alpha_")} == {"ALPHA"}
        assert {secret_slug(p) for p in ("ml-infra", "ml_infra", "ML.Infra", "ml__infra", "ml-.-infra")} == {"ML_INFRA"}
        assert secret_slug("alpha--x") == "ALPHA_X" and project_secret_prefix("alpha--x") == "CANARY_SECRET_ALPHA_X__"
        assert secret_allowed("CANARY_SECRET_ALPHA__X__KEY", "alpha")
        assert not secret_allowed("CANARY_SECRET_ALPHA__X__KEY", "alpha--x")
        assert secret_allowed("CANARY_SECRET_ALPHA_X__KEY", "alpha--x") and not secret_allowed("CANARY_SECRET_ALPHA_X__KEY", "alpha")
        # no slug holds '__' or ends in '_', so no project's prefix begins another's
        for a in ("alpha", "alpha--x", "a.b", "a-b-c", "ab"):
            for b in ("alpha", "alpha--x", "a.b", "a-b-c", "ab"):
                if a != b:
                    assert not project_secret_prefix(b).startswith(project_secret_prefix(a)), (a, b)
    finally:
        get_settings.cache_clear()


def test_a_project_whose_secrets_another_owns_is_refused_and_no_request_carries_its_key(sqlite_env, monkeypatch):
    """N1 over the API and the config file: with 'alpha' present, 'ALPHA' and 'alpha.' are refused
    (422, naming the clash), 'alpha--x' is created with its own slug and cannot name alpha's key."""
    from app.api.main import app
    from app.config_file import parse_config
    from app.db import session_scope
    from app.services import apply_config_file
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CANARY_SECRET_ALPHA__ENGKEY", "sk-alpha-own")
    http = TestClient(app)
    assert http.post("/api/v1/projects", json={"name": "alpha"}).status_code == 201
    for name in ("ALPHA", "alpha.", "Alpha_"):
        r = http.post("/api/v1/projects", json={"name": name})
        assert r.status_code == 422 and "would own the same secret variables as project 'alpha'" in r.json()["detail"], r.text
    config = {"project": "ALPHA", "model": {"name": "m", "path": "builtin:pydoc-target"},
              "configs": [{"name": "fp16", "baseline": True},
                          {"name": "served", "engine": "openai",
                           "engine_options": {"base_url": "http://127.0.0.1:9/v1",
                                              "api_key_env": "CANARY_SECRET_ALPHA__ENGKEY"}}],
              "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 2, "scorers": ["perplexity"]}]}
    with pytest.raises(ValueError, match="would own the same secret variables"), session_scope() as s:
        apply_config_file(s, parse_config(config))
    assert [p["name"] for p in http.get("/api/v1/projects").json()] == ["alpha"]  # nothing else was stored
    assert http.post("/api/v1/projects", json={"name": "alpha--x"}).status_code == 201
    assert http.post("/api/v1/projects/alpha--x/models", json={"name": "m", "path": "builtin:pydoc-target"}).status_code == 201
    r = http.post("/api/v1/projects/alpha--x/configs", json={
        "name": "served", "model": "m", "engine": "openai",
        "engine_options": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "CANARY_SECRET_ALPHA__X__KEY"}})
    assert r.status_code == 422 and "is not a secret of project 'alpha--x'" in r.text and "CANARY_SECRET_ALPHA_X__" in r.text


CREDENTIAL_URLS = {"user:password@": "http://ops:pw@127.0.0.1:9/v1", "a query string": "http://127.0.0.1:9/v1?api_key=sk-1",
                   "a token in the path": "http://127.0.0.1:9/sk0123456789abcdefXYZ/v1",
                   "a fragment": "http://127.0.0.1:9/v1#sk-0123456789"}


def test_literal_credentials_in_engine_and_judge_urls_are_refused_in_production(sqlite_env, monkeypatch):
    """Security round 4, N7: in production the four literal forms in an engine's base_url or
    metrics_url, or a judge's base_url, are a 422 naming the field (as a channel's URL is), and a
    row stored before the rule is refused again at use, before any request; dev keeps them."""
    from app.api.main import app
    from app.settings import get_settings
    from app.ssrf import UnsafeURL
    from engines.spec import OptimizationSpec
    from fastapi.testclient import TestClient
    from workers.outbound import check_engine, judge_http

    monkeypatch.setenv("CANARY_ENVIRONMENT", "production")
    monkeypatch.setenv("CANARY_REQUIRE_API_KEYS", "false")  # the operator's path, no key to make here
    get_settings.cache_clear()
    try:
        http = TestClient(app)
        assert http.post("/api/v1/projects", json={"name": "p"}).status_code == 201
        assert http.post("/api/v1/projects/p/models", json={"name": "m", "path": "builtin:pydoc-target"}).status_code == 201
        for i, (what, url) in enumerate(CREDENTIAL_URLS.items()):
            for key in ("base_url", "metrics_url"):
                options = {"base_url": "http://127.0.0.1:9/v1", key: url}
                r = http.post("/api/v1/projects/p/configs", json={"name": f"c{i}{key}", "model": "m", "engine": "openai",
                                                                  "engine_options": options})
                assert r.status_code == 422 and f"engine_options.{key}" in r.text and f"({what})" in r.text, r.text
                assert "sk-" not in r.text and ":pw@" not in r.text  # never echoed
            r = http.post("/api/v1/projects/p/suites", json={"name": f"s{i}", "corpus": "builtin:pydoc-heldout",
                                                             "samples": 2, "scorers": ["perplexity", "generation", "judge"],
                                                             "judge": {"base_url": url, "model": "j"}})
            assert r.status_code == 422 and "judge.base_url" in r.text and f"({what})" in r.text, r.text
        assert http.get("/api/v1/projects/p/configs").json() == []  # nothing was stored
        # at use: a row written before the rule (or behind the API's back)
        stored = OptimizationSpec(engine="openai", engine_options={"base_url": CREDENTIAL_URLS["a query string"]})
        with pytest.raises(UnsafeURL, match=r"engine_options.base_url: .* carries a credential \(a query string\)"):
            check_engine(stored, "p")
        with pytest.raises(UnsafeURL, match=r"judge.base_url: .* carries a credential \(user:password@\)"):
            judge_http({"base_url": CREDENTIAL_URLS["user:password@"], "model": "j"}, "p")
        monkeypatch.setenv("CANARY_ENVIRONMENT", "dev")  # dev and test keep them (a lab's local server)
        get_settings.cache_clear()
        check_engine(stored, "p")
    finally:
        get_settings.cache_clear()
