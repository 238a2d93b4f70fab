"""The outbound policy (docs/reference.md §10) on every URL-taking surface — engine base_url,
engine_options.metrics_url, judge base_url, channel url — through the API (a real `canary serve`)
and through the config file (`canary run -f`'s apply, and the CLI itself): the hostile URL list
is refused everywhere, secrets come only from allowed variable names, stored rows are checked
again at send time with the checked address pinned, and no response echoes user:password@."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.figures import report
from tests.loopback import canary_serve

# loopback in its numeric disguises, metadata, private, CGNAT, ULA, link-local, and the IPv6
# forms that embed an IPv4 address (6to4, NAT64, Teredo, IPv4-mapped)
HOSTILE = [
    "http://169.254.169.254/latest/meta-data/",
    "http://127.0.0.1:8000/v1",
    "http://127.1/v1",
    "http://2130706433/v1",
    "http://0x7f000001/v1",
    "http://0177.0.0.1/v1",
    "http://localhost:8000/v1",
    "http://[::1]/v1",
    "http://[::ffff:127.0.0.1]/v1",
    "http://[::ffff:169.254.169.254]/v1",
    "http://0.0.0.0/v1",
    "http://[::]/v1",
    "http://10.0.0.5/v1",
    "http://172.16.5.4/v1",
    "http://192.168.1.1/v1",
    "http://100.64.0.1/v1",
    "http://[fd00::1]/v1",
    "http://[fe80::1]/v1",
    "http://[2002:a9fe:a9fe::]/v1",
    "http://[2002:7f00:1::]/v1",
    "http://[64:ff9b::a9fe:a9fe]/v1",
    "http://[64:ff9b::7f00:1]/v1",
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/v1",  # Teredo, client 127.0.0.1
    "http://[2001:0:4136:e378:8000:63bf:5601:5601]/v1",  # Teredo, client 169.254.169.254
]
PUBLIC = "http://8.8.8.8/v1"  # a public address: accepted (nothing is contacted at create)
BAD_SECRET_NAMES = ["CANARY_DATABASE_URL", "CANARY_BROKER_URL", "DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "HOME"]
SURFACES = ("engine base_url", "engine metrics_url", "judge base_url", "channel url")
DOCS = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components intelligently. " * 3} for i in range(4)]


def api_request(surface: str, url: str, i: int) -> tuple[str, str, dict, str]:
    """(method, path, body, the field the refusal must name) creating an object with `url` on `surface`."""
    if surface == "engine base_url":
        return "POST", "/configs", {"name": f"c{i}", "model": "tiny", "engine": "openai", "engine_options": {"base_url": url}}, "base_url"
    if surface == "engine metrics_url":
        return "POST", "/configs", {"name": f"c{i}", "model": "tiny", "engine": "openai",
                                    "engine_options": {"base_url": PUBLIC, "metrics_url": url}}, "metrics_url"
    if surface == "judge base_url":
        return "POST", "/suites", {"name": f"s{i}", "documents": DOCS, "samples": 4, "scorers": ["perplexity", "generation", "judge"],
                                   "judge": {"base_url": url, "model": "judge"}}, "judge.base_url"
    return "PUT", "/channels", {"name": f"h{i}", "kind": "webhook", "url": url}, "url"


def secret_request(surface: str, name: str, i: int) -> tuple[str, str, dict]:
    if surface == "engine api_key_env":
        return "POST", "/configs", {"name": f"k{i}", "model": "tiny", "engine": "openai",
                                    "engine_options": {"base_url": PUBLIC, "api_key_env": name}}
    if surface == "judge api_key_env":
        return "POST", "/suites", {"name": f"j{i}", "documents": DOCS, "samples": 4, "scorers": ["perplexity", "generation", "judge"],
                                   "judge": {"base_url": PUBLIC, "model": "judge", "api_key_env": name}}
    if surface == "channel ${VAR} url":
        return "PUT", "/channels", {"name": f"v{i}", "kind": "webhook", "url": "${" + name + "}"}
    return "PUT", "/channels", {"name": f"g{i}", "kind": "webhook", "url": PUBLIC + "/hook", "signing_secret": "${" + name + "}"}


SECRET_SURFACES = ("engine api_key_env", "judge api_key_env", "channel ${VAR} url", "channel signing_secret")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outbound")
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp / 'api.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_URL_ALLOWLIST": ""}  # loopback too is refused here
    env.pop("CANARY_BROKER_URL", None)
    with canary_serve(env, str(tmp / "api.log")) as base:
        http = httpx.Client(base_url=f"{base}/api/v1/projects/o", timeout=30)
        assert http.post(f"{base}/api/v1/projects", json={"name": "o"}).status_code == 201
        assert http.post("/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        yield http


def test_hostile_urls_and_secret_names_are_refused_by_the_api_on_every_surface(api, request):
    tried = refused = 0
    wrong = []
    for s, surface in enumerate(SURFACES):
        for u, url in enumerate(HOSTILE):
            method, path, body, field = api_request(surface, url, s * 100 + u)
            r = api.request(method, path, json=body)
            tried += 1
            if r.status_code == 422 and field in r.text and "public addresses only" in r.text:
                refused += 1
            else:
                wrong.append((surface, url, r.status_code, r.text[:200]))
        # the control: a public URL is accepted on the same surface
        method, path, body, _ = api_request(surface, PUBLIC, s * 100 + 99)
        assert api.request(method, path, json=body).status_code in (200, 201), surface
    names_tried = names_refused = 0
    for s, surface in enumerate(SECRET_SURFACES):
        for n, name in enumerate(BAD_SECRET_NAMES):
            method, path, body = secret_request(surface, name, s * 100 + n)
            r = api.request(method, path, json=body)
            names_tried += 1
            if r.status_code == 422 and f"'{name}' is not an allowed secret variable" in r.text and "CANARY_SECRET_" in r.text:
                names_refused += 1
            else:
                wrong.append((surface, name, r.status_code, r.text[:200]))
        method, path, body = secret_request(surface, "CANARY_SECRET_O__OK", s * 100 + 99)
        r = api.request(method, path, json=body)
        assert r.status_code in (200, 201), (surface, r.text)
    report(request.config, "outbound policy", f"API: hostile URLs {refused}/{tried} refused on {len(SURFACES)} surfaces "
                                              f"({len(HOSTILE)} URLs each); disallowed secret names {names_refused}/{names_tried} refused "
                                              f"on {len(SECRET_SURFACES)} surfaces")
    assert wrong == []


def test_configs_never_echo_user_and_password(api):
    r = api.post("/configs", json={"name": "creds", "model": "tiny", "engine": "openai",
                                   "engine_options": {"base_url": "http://ops:PASSWORD1@8.8.8.8/v1",
                                                      "metrics_url": "http://ops:PASSWORD2@8.8.8.8/metrics"}})
    assert r.status_code == 201, r.text
    for got in (r.text, api.get("/configs").text, api.get("/configs/creds").text, api.get("/overview").text):
        assert "PASSWORD" not in got and "ops:" not in got
    assert api.get("/configs/creds").json()["spec"]["engine_options"]["base_url"] == "http://***@8.8.8.8/v1"


# -- the config file ------------------------------------------------------------------------------
def canary_file(tmp_path, surface: str | None = None, url: str | None = None, secret: tuple[str, str] | None = None) -> dict:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    cand = {"name": "served", "engine": "openai", "engine_options": {"base_url": PUBLIC}}
    suite = {"name": "s", "corpus": str(corpus), "samples": 4}
    data = {"project": "f", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "fp16", "baseline": True}, cand], "suites": [suite], "channels": []}
    if surface == "engine base_url":
        cand["engine_options"]["base_url"] = url
    elif surface == "engine metrics_url":
        cand["engine_options"]["metrics_url"] = url
    elif surface == "judge base_url":
        suite.update(scorers=["perplexity", "generation", "judge"], judge={"base_url": url, "model": "judge"})
    elif surface == "channel url":
        data["channels"] = [{"name": "h", "kind": "webhook", "url": url}]
    if secret:
        where, name = secret
        if where == "engine api_key_env":
            cand["engine_options"]["api_key_env"] = name
        elif where == "judge api_key_env":
            suite.update(scorers=["perplexity", "generation", "judge"], judge={"base_url": PUBLIC, "model": "judge", "api_key_env": name})
        elif where == "channel ${VAR} url":
            data["channels"] = [{"name": "h", "kind": "webhook", "url": "${" + name + "}"}]
        else:
            data["channels"] = [{"name": "h", "kind": "webhook", "url": PUBLIC + "/hook", "signing_secret": "${" + name + "}"}]
    return data


def apply(data: dict) -> None:
    from app.config_file import parse_config
    from app.db import session_scope
    from app.services import apply_config_file

    with session_scope() as s:
        apply_config_file(s, parse_config(data))


FILE_FIELDS = {"engine base_url": "configs[1].engine_options.base_url", "engine metrics_url": "configs[1].engine_options.metrics_url",
               "judge base_url": "suites[0].judge.base_url", "channel url": "channels[0].url"}


def test_hostile_urls_and_secret_names_are_refused_by_the_config_file_on_every_surface(sqlite_env, tmp_path, monkeypatch, request):
    from app.config_file import ConfigFileError
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")
    get_settings.cache_clear()
    apply(canary_file(tmp_path))  # the control: the file with public URLs applies
    tried = refused = 0
    wrong = []
    for surface in SURFACES:
        for url in HOSTILE:
            tried += 1
            try:
                apply(canary_file(tmp_path, surface, url))
                wrong.append((surface, url, "accepted"))
            except (ValueError, ConfigFileError) as e:
                if str(e).startswith(FILE_FIELDS[surface] + ": host") and "public addresses only" in str(e):
                    refused += 1
                else:
                    wrong.append((surface, url, str(e)))
    names_tried = names_refused = 0
    for surface in SECRET_SURFACES:
        for name in BAD_SECRET_NAMES:
            names_tried += 1
            try:
                apply(canary_file(tmp_path, secret=(surface, name)))
                wrong.append((surface, name, "accepted"))
            except ConfigFileError as e:
                if f"'{name}' is not an allowed secret variable" in str(e):
                    names_refused += 1
                else:
                    wrong.append((surface, name, str(e)))
        apply(canary_file(tmp_path, secret=(surface, "CANARY_SECRET_F__OK")))
    report(request.config, "outbound policy", f"config file: hostile URLs {refused}/{tried} refused on {len(SURFACES)} surfaces; "
                                              f"disallowed secret names {names_refused}/{names_tried} refused on {len(SECRET_SURFACES)} surfaces")
    assert wrong == []


def test_canary_run_f_names_the_field_and_the_fix_in_one_line(tmp_path):
    import yaml

    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", "CANARY_EXECUTION": "inline", "CANARY_URL_ALLOWLIST": ""}
    env.pop("CANARY_BROKER_URL", None)
    for data, want in (
        (canary_file(tmp_path, secret=("engine api_key_env", "CANARY_DATABASE_URL")),
         "configs[1].engine_options: api_key_env: 'CANARY_DATABASE_URL' is not an allowed secret variable"),
        (canary_file(tmp_path, "engine metrics_url", "http://[2002:a9fe:a9fe::]/metrics"),
         ("configs[1].engine_options.metrics_url: host '2002:a9fe:a9fe::' resolves to link-local address 169.254.169.254 "
          "(embedded in 6to4 address 2002:a9fe:a9fe::)")),
    ):
        f = tmp_path / "canary.yaml"
        f.write_text(yaml.safe_dump(data))
        out = subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", str(f)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=180, check=False)
        text = (out.stdout + out.stderr).strip()
        assert out.returncode == 2, text
        assert text.startswith("error:") and len(text.splitlines()) <= 2, text  # "error: <file> is invalid:" + the field's line
        [line] = [line for line in text.splitlines() if want in line]
        assert "CANARY_SECRET_" in line or "CANARY_URL_ALLOWLIST" in line  # how to fix it
        assert "Traceback" not in text


def test_a_literal_channel_url_with_credentials_is_refused_in_production(monkeypatch):
    from app.config_file import ChannelEntry
    from app.settings import get_settings
    from pydantic import ValidationError

    literal = ["https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX", "https://ops:pw@hooks.example.com/alert",
               "https://hooks.example.com/alert?token=abc", "https://discord.com/api/webhooks/1/abc"]
    monkeypatch.setenv("CANARY_ENVIRONMENT", "production")
    get_settings.cache_clear()
    try:
        for url in literal:
            with pytest.raises(ValidationError, match=r"in production give the URL as an \$\{ENV_VAR\} reference, e.g. \$\{CANARY_SECRET_"):
                ChannelEntry(name="c", kind="webhook", url=url)
        assert ChannelEntry(name="c", kind="slack", url="${CANARY_SECRET_SLACK_WEBHOOK_URL}")
        assert ChannelEntry(name="c", kind="alertmanager", url="http://alertmanager:9093")  # no credential in it
        monkeypatch.setenv("CANARY_ENVIRONMENT", "dev")
        get_settings.cache_clear()
        assert all(ChannelEntry(name="c", kind="webhook", url=url) for url in literal)  # dev: allowed (and masked)
    finally:
        get_settings.cache_clear()


# -- at send time ---------------------------------------------------------------------------------
def fake_dns(answers: dict[str, list[str]]):
    calls: list[str] = []

    def resolve(host, port, proto=0):
        calls.append(host)
        ip = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
        return [(socket.AF_INET, socket.SOCK_STREAM, proto, "", (ip, port))]

    resolve.calls = calls
    return resolve


def test_the_transport_checks_the_url_and_connects_to_the_address_it_checked(receiver, monkeypatch):
    """rebind.test resolves (in this fake DNS) to the allow-listed 127.0.0.1 once, then to a
    private address: the transport checks once and connects to the address it checked — the
    name never reaches the system resolver (which does not know it) — with Host kept."""
    from app.settings import get_settings
    from app.ssrf import PinnedTransport, UnsafeURL

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "127.0.0.1:*")  # by address only
    get_settings.cache_clear()
    dns = fake_dns({"rebind.test": ["127.0.0.1", "10.0.0.7"]})
    with httpx.Client(transport=PinnedTransport("channel url", resolve=dns)) as c:
        for _ in range(3):
            assert c.post(f"http://rebind.test:{receiver.port}/hook", content=b"x").status_code == 200
    assert dns.calls == ["rebind.test"]  # checked once per transport, pinned for its requests
    assert [r["headers"]["host"] for r in receiver.requests] == [f"rebind.test:{receiver.port}"] * 3
    # a new transport checks again
    with httpx.Client(transport=PinnedTransport("channel url", resolve=dns)) as c, \
            pytest.raises(UnsafeURL, match=r"resolves to private address 10.0.0.7"):
        c.post(f"http://rebind.test:{receiver.port}/hook", content=b"x")
    assert len(receiver.requests) == 3
    get_settings.cache_clear()


def test_stored_rows_are_checked_again_when_a_worker_uses_them(receiver, monkeypatch, sqlite_env):
    """Rows written before the policy (or straight into the database): the worker's engine, judge
    and notifier refuse them, and the listener sees nothing."""
    from app.db import session_scope
    from app.models import Channel, Notification, Project
    from app.notify import deliver_due
    from app.secret_names import SecretNotAllowed
    from app.settings import get_settings
    from app.ssrf import UnsafeURL
    from engines.spec import OptimizationSpec
    from workers.outbound import check_engine, engine_options, judge_http

    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "localhost:*")  # the listener's name is allowed, its address is not
    monkeypatch.setenv("CANARY_SECRET_ENGINE", "engine-key")
    monkeypatch.setenv("CANARY_SECRET_OTHER__SIGN", "other-signing-key")
    get_settings.cache_clear()
    listener = f"http://127.0.0.1:{receiver.port}"
    refusals = 0
    for opts, err in (({"base_url": listener + "/v1"}, UnsafeURL),
                      ({"base_url": f"http://localhost:{receiver.port}/v1", "metrics_url": listener + "/metrics"}, UnsafeURL),
                      ({"base_url": f"http://localhost:{receiver.port}/v1", "api_key_env": "CANARY_DATABASE_URL"}, SecretNotAllowed)):
        with pytest.raises(err):
            check_engine(OptimizationSpec(engine="openai", engine_options=opts), "p")
        refusals += 1
    for judge, err in (({"base_url": listener + "/v1", "model": "j"}, UnsafeURL),
                       ({"base_url": f"http://localhost:{receiver.port}/v1", "model": "j", "api_key_env": "HOME"}, SecretNotAllowed),
                       ({"base_url": f"http://localhost:{receiver.port}/v1", "model": "j",
                         "api_key_env": "CANARY_SECRET_OTHER__SIGN"}, SecretNotAllowed)):
        with pytest.raises(err):
            judge_http(judge, "p")
        refusals += 1
    # the engine's own transport refuses too, even when handed a URL the pre-check never saw
    from engines.openai import OpenAIEngine

    spec = OptimizationSpec(engine="openai", engine_options={"base_url": listener + "/v1", "api_key_env": "CANARY_SECRET_ENGINE"})
    with pytest.raises(UnsafeURL, match=r"engine_options.base_url / metrics_url: host '127.0.0.1' resolves to loopback"):
        OpenAIEngine("m", spec, **engine_options(spec))
    spec = OptimizationSpec(engine="openai", engine_options={"base_url": f"http://localhost:{receiver.port}/v1",
                                                              "api_key_env": "CANARY_DATABASE_URL"})
    with pytest.raises(SecretNotAllowed):
        OpenAIEngine("m", spec, **engine_options(spec))
    # channels: a ${VAR} off the allow-list is dead, not retried; nothing is posted
    monkeypatch.setenv("HOOK_URL", listener + "/hook")
    with session_scope() as s:
        p = Project(name="p")
        s.add(p)
        s.flush()
        for name, url, settings in (("by-name", "${HOOK_URL}", None), ("signed", listener + "/hook", {"signing_secret": "${CANARY_DATABASE_URL}"}),
                                    # another project's secret to an allowed host (security round 3, H1)
                                    ("cross", f"http://localhost:{receiver.port}/hook", {"signing_secret": "${CANARY_SECRET_OTHER__SIGN}"})):
            ch = Channel(project_id=p.id, name=name, kind="webhook", url=url, settings=settings)
            s.add(ch)
            s.flush()
            s.add(Notification(channel_id=ch.id, idempotency_key=f"k-{name}", payload={"a": 1}, status="pending"))
    with session_scope() as s:
        assert deliver_due(s) == {"sent": 0, "retry": 0, "dead": 3}
        errors = sorted(n.last_error for n in s.query(Notification).all())
    assert all(e.startswith("refused: channel '") for e in errors), errors
    # sorted: by-name, cross, signed
    assert ["is not a secret of project 'p'" in e for e in errors] == [False, True, False], errors
    assert all("is not an allowed secret variable" in e for e in errors[::2]), errors
    assert receiver.requests == []
    get_settings.cache_clear()


def test_judge_errors_never_name_user_and_password():
    """A judge's failure becomes a scorer's reason, which the API shows."""
    from evals.judge import JudgeClient, JudgeConfig, JudgeError

    cfg = JudgeConfig(base_url="http://ops:PASSWORD1@127.0.0.1:9/v1?key=QKEY", model="j", max_http_retries=0)
    with JudgeClient(cfg) as c, pytest.raises(JudgeError) as e:
        c.chat([{"role": "user", "content": "hi"}])
    assert "127.0.0.1:9/v1" in str(e.value) and "PASSWORD1" not in str(e.value) and "QKEY" not in str(e.value)
