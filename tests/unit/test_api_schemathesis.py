"""Schemathesis over the API's OpenAPI schema, in-process against the real app on the embedded
default (a fresh SQLite file, tasks in-process): no operation answers 5xx, and every response
matches the schema (status code, content type, headers, body); invalid input is refused with a
4xx. Path parameters and the names in bodies hit the seeded project, model, configs, suite, run
and silence part of the time, so the fuzzer gets past the 404s into the handlers.

Run-creating operations (POST runs, POST gates) stay in the fuzz at bounded cost: the API's
dispatcher is replaced by a recorder, so a fuzzed run is validated and written but never
executed. One real run, made while seeding, gives the read views real rows. Inputs the fuzzer
does not produce (integers past the database's range, NaN, dates near year 9999, server paths)
are explicit cases below; a last test checks that nothing seeded was lost or changed.

`pytest -s` prints the size of the fuzz: operations, cases, examples per operation, wall time."""

from __future__ import annotations

import collections
import threading
import time
import zlib

import pytest
import schemathesis
from app.api.main import app
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.python.asgi import shutdown_lifespans

EXAMPLES = 25  # fuzzed examples per operation and generation mode (positive, negative), besides coverage cases
RESPONSE_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
                   response_headers_conformance]
CHECKS = [*RESPONSE_CHECKS, negative_data_rejection]  # invalid input (by the schema) must get a 4xx
PROJECT = "fz"
P = f"/api/v1/projects/{PROJECT}"
CASES: collections.Counter[str] = collections.Counter()
FUZZ_TIME: dict[str, float] = {}
STATUSES: collections.Counter[int] = collections.Counter()
SEEDED: dict[str, object] = {}

# The app's own OpenAPI document, not fetched over ASGI at import: the first request to the app
# starts its lifespan (on the embedded default, the reconciler thread), and that must happen inside
# the test's database and dispatcher (the `seeded` fixture), not with the import-time defaults.
schema = schemathesis.openapi.from_dict(app.openapi())
schema.app = app  # requests go to the app in-process over ASGI, as with openapi.from_asgi


class RecordingDispatcher:
    """Tasks the API sends (config-runs of fuzzed runs, the reconciler's ticks) are recorded, never run."""

    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, task: str, *args, priority: int = 3) -> None:
        self.sent.append((task, *args))


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def database_url(request, tmp_path_factory):
    """The embedded default's SQLite file, or a fresh database on the test PostgreSQL server
    (which, unlike SQLite, enforces column lengths and integer ranges)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('schemathesis') / 'canary.db'}"
        return
    import os

    from app.db import get_engine

    from tests.conftest import throwaway_pg_database

    with throwaway_pg_database(os.environ.get("CANARY_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"),
                               "canary_fuzz") as url:
        yield url
        get_engine(url).dispose()


@pytest.fixture(scope="module")
def seeded(database_url):
    from app.db import upgrade
    from app.dispatch import EXECUTE_CONFIG_RUN, InlineDispatcher
    from app.services import start_run
    from app.settings import get_settings
    from fastapi.testclient import TestClient

    url = database_url
    for counter in (CASES, STATUSES, FUZZ_TIME, SEEDED):
        counter.clear()
    dispatcher = RecordingDispatcher()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CANARY_DATABASE_URL", url)
        mp.setenv("CANARY_EXECUTION", "inline")
        mp.setenv("CANARY_ESCALATION", "false")
        mp.setenv("CANARY_RATE_LIMIT_PER_MINUTE", "0")  # thousands of requests a minute; the limiter has its own test
        mp.setenv("CANARY_URL_ALLOWLIST", "")
        for name in ("CANARY_BROKER_URL", "CANARY_REQUIRE_API_KEYS", "CANARY_MAX_SAMPLES_PER_RUN"):
            mp.delenv(name, raising=False)
        get_settings.cache_clear()
        upgrade(url)
        http = TestClient(app)  # no `with`: no lifespan while seeding
        assert http.post("/api/v1/projects", json={"name": PROJECT}).status_code == 201
        assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
        for body in ({"name": "fp16", "model": "tiny", "baseline": True, "engine": "reference"},
                     {"name": "int8", "model": "tiny", "weights": "int8", "engine": "reference"}):
            r = http.post(f"{P}/configs", json=body)
            assert r.status_code == 201, r.text
        docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components intelligently. " * 3} for i in range(10)]
        r = http.post(f"{P}/suites", json={"name": "s", "documents": docs, "samples": 10, "scorers": ["perplexity"],
                                          "perplexity": {"window": 64}})
        assert r.status_code == 201, r.text
        # one real run, executed here and now, so that runs, samples, worst and overview read real rows
        t0 = time.monotonic()
        run_id, _ = start_run(PROJECT, "s", None, InlineDispatcher())
        seed_run_s = time.monotonic() - t0
        run = http.get(f"{P}/runs/{run_id}").json()
        assert run["status"] == "done" and run["comparisons"], run
        r = http.post(f"{P}/silences", json={"matchers": [{"name": "config", "value": "int8"}], "duration_minutes": 60,
                                             "author": "a", "comment": "seed"})
        assert r.status_code == 201, r.text
        SEEDED.update(project=PROJECT, run_id=run_id, silence_id=r.json()["id"], config="int8", suite="s", model="tiny",
                      snapshot=snapshot(http, run_id))
        for where in ("app.api.main", "app.api.routes.runs", "app.api.routes.gates"):  # the API's three senders
            mp.setattr(f"{where}.get_dispatcher", lambda background=False: dispatcher)
        yield {"http": http, "dispatcher": dispatcher}
        shutdown_lifespans()  # stops the reconciler thread that the first fuzzed request started
        for t in threading.enumerate():
            if t.name == "canary-reconciler":
                t.join(timeout=5)
                assert not t.is_alive(), "the app's reconciler thread outlived the test"
    get_settings.cache_clear()
    sent = collections.Counter(task for task, *_ in dispatcher.sent)
    fuzz_s = FUZZ_TIME.get("end", 0.0) - FUZZ_TIME.get("start", 0.0)
    print(f"\nschemathesis on {url.split(':')[0]}: {len(CASES)} operations, {sum(CASES.values())} cases, {EXAMPLES} fuzzed examples per operation "
          f"and mode (plus coverage cases) in {fuzz_s:.1f} s; seeding with one real run: {seed_run_s:.1f} s; "
          f"config-runs enqueued by fuzzed runs and gates, never executed: {sent[EXECUTE_CONFIG_RUN]}")
    print("  status codes: " + ", ".join(f"{code}: {n}" for code, n in sorted(STATUSES.items())))
    for label, n in sorted(CASES.items()):
        print(f"  {n:4d}  {label}")


def snapshot(http, run_id: int) -> dict:
    """What the fuzzer may not change: it can add objects, never alter or lose the seeded ones
    (configs and suites are create-only; runs are immutable once done)."""
    return {"models": [m for m in http.get(f"{P}/models").json() if m["name"] == "tiny"],
            "configs": {c["name"]: c["spec"] for c in http.get(f"{P}/configs").json() if c["name"] in ("fp16", "int8")},
            "suites": [s for s in http.get(f"{P}/suites").json() if s["name"] == "s"],
            "run": http.get(f"{P}/runs/{run_id}").json(),
            "samples": http.get(f"{P}/runs/{run_id}/samples", params={"limit": 1000}).json()}


def _sometimes(value, real):
    """The generated value or the seeded object's, chosen by the generated value (reproducible)."""
    return real if zlib.crc32(repr(value).encode()) % 2 == 0 else value


# Inputs in which a seeded value replaced a generated one. In a negative case that replacement
# may have been the invalid part, leaving a valid request: such a case is held to the response
# checks only, not to "invalid input must be rejected".
SUBSTITUTED: set[str] = set()


def _substitute(values: dict, names) -> dict:
    changed = False
    for name, real in names:
        if name in values:
            new = _sometimes(values[name], SEEDED[real])
            changed |= new != values[name]
            values[name] = new
    if changed:
        SUBSTITUTED.add(repr(values))
    return values


@schema.hook
def map_path_parameters(ctx, path_parameters):
    if path_parameters and SEEDED:
        _substitute(path_parameters, (("project", "project"), ("run_id", "run_id"), ("silence_id", "silence_id"), ("name", "config")))
    return path_parameters


@schema.hook
def map_body(ctx, body):
    if isinstance(body, dict) and SEEDED:
        _substitute(body, (("suite", "suite"), ("model", "model"), ("candidate", "config")))
    return body


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_api_conforms_to_its_schema(case, seeded):
    CASES[case.operation.label] += 1
    FUZZ_TIME.setdefault("start", time.monotonic())
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    substituted = repr(case.path_parameters) in SUBSTITUTED or repr(case.body) in SUBSTITUTED
    STATUSES[case.call_and_validate(checks=RESPONSE_CHECKS if negative and substituted else CHECKS).status_code] += 1
    FUZZ_TIME["end"] = time.monotonic()


BIG = 2**70  # past SQLite's 64-bit and PostgreSQL's INTEGER range
SILENCE = {"matchers": [{"name": "config", "value": "int8"}], "author": "a", "comment": "c"}
EXPLICIT = [
    # (method, path, path parameters, query, body, status, words the answer must contain)
    ("GET", "/runs/{run_id}", {"run_id": BIG}, None, None, 422, ["run_id", "less than or equal"]),
    ("GET", "/runs/{run_id}/samples", {"run_id": 2**40}, None, None, 422, ["run_id"]),
    ("GET", "/runs/{run_id}/worst", {"run_id": BIG}, {"config": "int8"}, None, 422, ["run_id"]),
    ("GET", "/runs", {}, {"offset": BIG}, None, 422, ["offset"]),
    ("GET", "/gates/{gate_id}", {"gate_id": BIG}, None, None, 422, ["gate_id"]),
    ("DELETE", "/silences/{silence_id}", {"silence_id": 2**63}, None, None, 422, ["silence_id"]),
    ("PUT", "/alert-rules", {}, None, {"metric": "ppl_ratio", "warn": 1.1, "min_n": BIG}, 422, ["min_n"]),
    ("PUT", "/schedules", {}, None, {"name": "d", "cron": "0 6 * * *", "suite": "s", "samples": 2**40}, 422, ["samples"]),
    ("PUT", "/schedules", {}, None, {"name": "d", "cron": "0 6 * * *", "suite": "s", "samples": 5001}, 422,
     ["samples", "exceeds the limit of 5000"]),
    ("POST", "/runs", {}, None, {"suite": "s", "samples": BIG}, 422, ["samples"]),
    ("POST", "/runs", {}, None, {"suite": "s", "configs": ["int8"] * 257}, 422, ["configs"]),
    ("POST", "/runs", {}, None, {"suite": "s" * 129}, 422, ["suite"]),
    ("POST", "/gates", {}, None, {"candidate": "int8", "suite": "s", "samples": BIG}, 422, ["samples"]),
    ("POST", "/silences", {}, None, {**SILENCE, "starts_at": "9999-12-31T23:00:00Z", "duration_minutes": 120}, 422,
     ["duration_minutes", "year 9999"]),
    ("POST", "/models", {}, None, {"name": "m", "path": "0" * 1000}, 422, ["path", "not a usable path"]),
    ("POST", "/configs", {}, None, {"name": "c", "model": "tiny", "engine": "reference",
                                    "speculative": {"method": "draft", "draft_model": "0" * 1000}}, 422, ["draft_model", "not a usable path"]),
    ("POST", "/suites", {}, None, {"name": "etc", "corpus": "/etc", "samples": 1}, 422, ["corpus", "builtin corpora only"]),
    ("POST", "/suites", {}, None, {"name": "items", "corpus": "builtin:pydoc-heldout", "samples": 1,
                                   "scorers": ["perplexity", "labelled"], "labelled": {"items": "/etc/passwd"}}, 422,
     ["labelled.items", "built-in tasks only"]),
    ("POST", "/suites", {}, None, {"name": "noitems", "corpus": "builtin:pydoc-heldout", "samples": 1,
                                   "scorers": ["perplexity", "labelled"]}, 422, ["labelled.items"]),
    ("POST", "/suites", {}, None, {"name": "ctx", "samples": 1, "documents": [{"id": "a", "text": "t", "contexts": ["x" * 200_001]}]},
     422, ["documents[0].reference, contexts", "limit of 200000"]),
    ("POST", "/suites", {}, None, {"name": "j", "samples": 1, "documents": [{"id": "a", "text": "t"}],
                                   "judge": {"base_url": "https://" + "j" * 3000}}, 422, ["base_url"]),
]


@pytest.mark.parametrize("method,path,params,query,body,status,words", EXPLICIT, ids=[f"{m} {p} {w[0]}" for m, p, *_, w in EXPLICIT])
def test_out_of_range_input_is_a_4xx_naming_the_field(seeded, method, path, params, query, body, status, words):
    op = schema[f"/api/v1/projects/{{project}}{path}"][method]
    case = op.Case(path_parameters={"project": PROJECT, **params}, query=query, **({"body": body} if body is not None else {}))
    r = case.call_and_validate(checks=RESPONSE_CHECKS)
    assert r.status_code == status and all(w in r.text for w in words), r.text


@pytest.mark.parametrize("raw,field", [(b'{"metric": "ppl_ratio", "warn": NaN}', "warn"),
                                       (b'{"metric": "ppl_ratio", "warn": 1.1, "critical": Infinity}', "critical")])
def test_nan_and_infinity_are_refused_not_stored(seeded, raw, field):
    # JSON parsers accept NaN and Infinity: they were stored (SQLite turns NaN into NULL: a bogus 409)
    # and could not be echoed back in the 422's "input"
    http = seeded["http"]
    before = http.get(f"{P}/alert-rules").json()
    r = http.put(f"{P}/alert-rules", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], r.text
    schema["/api/v1/projects/{project}/alert-rules"]["PUT"].Case(body={}).validate_response(r, checks=RESPONSE_CHECKS)
    assert http.get(f"{P}/alert-rules").json() == before


def test_silence_times_without_a_zone_are_utc(seeded):
    http = seeded["http"]
    r = http.post(f"{P}/silences", json={**SILENCE, "starts_at": "2030-01-01T00:00:00", "ends_at": "2030-01-02T00:00:00Z"})
    assert r.status_code == 201, r.text  # was a 500: a naive and an aware datetime cannot be compared
    assert (r.json()["starts_at"], r.json()["ends_at"]) == ("2030-01-01T00:00:00+00:00", "2030-01-02T00:00:00+00:00")


def test_a_nul_character_is_a_4xx_on_every_backend(seeded):
    # PostgreSQL cannot store U+0000 in text or JSON (SQLite can): it was a 500 there
    http = seeded["http"]
    before = http.get(f"{P}/silences").json()
    r = http.post(f"{P}/silences", json={**SILENCE, "duration_minutes": 60, "matchers": [{"name": "config", "value": "int8\u0000"}]})
    assert r.status_code in (201, 422), r.text
    if r.status_code == 422:
        assert "NUL" in r.text and http.get(f"{P}/silences").json() == before
    else:
        http.delete(f"{P}/silences/{r.json()['id']}")


def test_body_that_is_not_utf8_is_a_documented_400(seeded):
    r = seeded["http"].post(f"{P}/runs", content=b'{"suite": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    schema["/api/v1/projects/{project}/runs"]["POST"].Case(body={}).validate_response(r, checks=RESPONSE_CHECKS)


def test_nothing_seeded_was_lost_or_changed(seeded):
    assert snapshot(seeded["http"], SEEDED["run_id"]) == SEEDED["snapshot"]
