"""Outbox delivery against a real HTTP receiver on loopback with scripted answers (200, 429 +
Retry-After, 500, 400, 404, a timeout, down then back): exactly one delivery per idempotency
key, retries timed as specified, nothing lost. The clock of the retry schedule is passed in."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import timedelta

import httpx
import pytest
from app.db import session_scope
from app.models import Channel, Notification, Project, aware, utcnow
from app.notify import deliver_due


def add(kind: str, url: str, n: int = 1, project: str = "p", **settings) -> tuple[int, list[int]]:
    with session_scope() as s:
        p = s.query(Project).filter_by(name=project).one_or_none() or Project(name=project)
        s.add(p)
        s.flush()
        ch = Channel(project_id=p.id, name=f"{kind}-{len(s.query(Channel).all())}", kind=kind, url=url, settings=settings or None)
        s.add(ch)
        s.flush()
        ids = []
        for i in range(n):
            row = Notification(channel_id=ch.id, idempotency_key=f"key-{ch.id}-{i}", payload={"text": f"alert {i}"}, status="pending")
            s.add(row)
            s.flush()
            ids.append(row.id)
        return ch.id, ids


@pytest.fixture(params=["sqlite", "postgres"])
def db_env(request, tmp_path, monkeypatch):
    """sqlite_env, or the same on a throwaway PostgreSQL database (its row locks: skip_locked)."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_env")
        return
    import os

    from app.db import upgrade
    from app.settings import get_settings

    from tests.conftest import throwaway_pg_database

    server = os.environ.get("CANARY_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    with throwaway_pg_database(server, "canary_notify") as url:
        monkeypatch.setenv("CANARY_DATABASE_URL", url)
        monkeypatch.setenv("CANARY_EXECUTION", "inline")
        monkeypatch.setenv("CANARY_URL_ALLOWLIST", "127.0.0.1:*,localhost:*")
        monkeypatch.delenv("CANARY_BROKER_URL", raising=False)
        get_settings.cache_clear()
        upgrade(url)
        yield url
        from app.db import get_engine

        get_engine(url).dispose()  # its connections closed before the database is dropped
    get_settings.cache_clear()


def deliver(now=None, **kw) -> dict:
    with session_scope() as s:
        return deliver_due(s, now=now or utcnow(), transport=httpx.AsyncHTTPTransport,
                           deadline_s=kw.pop("timeout", 2.0), sleep=kw.pop("sleep", lambda _: None), **kw)


def row(nid: int) -> Notification:
    with session_scope() as s:
        n = s.get(Notification, nid)
        s.expunge(n)
        return n


def breaker(nid: int) -> tuple[int, object]:
    """The breaker of the row's channel: strikes in a row, and no post before when."""
    with session_scope() as s:
        channel = s.get(Channel, s.get(Notification, nid).channel_id)
        return channel.breaker_strikes, aware(channel.breaker_until)


def test_delivered_once_with_idempotency_key_and_signature(sqlite_env, receiver, monkeypatch):
    monkeypatch.setenv("CANARY_SECRET_P__HOOK", "s3cret")
    _, (nid,) = add("webhook", receiver.url + "/hook", signing_secret="${CANARY_SECRET_P__HOOK}")
    assert deliver() == {"sent": 1, "retry": 0, "dead": 0}
    assert deliver() == {"sent": 0, "retry": 0, "dead": 0}  # sent rows are never posted again
    (req,) = receiver.requests
    assert req["headers"]["idempotency-key"] == row(nid).idempotency_key
    want = "sha256=" + hmac.new(b"s3cret", req["body"], hashlib.sha256).hexdigest()
    assert req["headers"]["x-canary-signature"] == want
    assert json.loads(req["body"]) == {"text": "alert 0"}


def test_429_waits_exactly_retry_after(sqlite_env, receiver):
    receiver.script = [{"status": 429, "retry_after": "7"}]
    _, (nid,) = add("webhook", receiver.url)
    t0 = utcnow()
    assert deliver(now=t0)["retry"] == 1
    n = row(nid)
    assert n.attempts == 1 and "HTTP 429" in n.last_error
    waited = (n.next_attempt_at.replace(tzinfo=None) - t0.replace(tzinfo=None)).total_seconds()
    assert 7 <= waited < 8  # 7 s from the end of the attempt, which took a moment
    assert deliver(now=t0 + timedelta(seconds=6))["sent"] == 0  # not due yet
    assert deliver(now=t0 + timedelta(seconds=8))["sent"] == 1
    assert len(receiver.delivered()) == 1 and row(nid).status == "sent"


def test_5xx_backs_off_exponentially_with_jitter_then_gives_up(sqlite_env, receiver):
    receiver.script = [{"status": 500}] * 3
    _, (nid,) = add("webhook", receiver.url)
    t = utcnow()
    waits = []
    for attempt in (1, 2, 3):
        assert deliver(now=t, max_attempts=3)["dead" if attempt == 3 else "retry"] == 1
        n = row(nid)
        if attempt < 3:
            waits.append((n.next_attempt_at.replace(tzinfo=None) - t.replace(tzinfo=None)).total_seconds())
            t = n.next_attempt_at
    # 2 s then 4 s, each ±50 %, counted from the end of the attempt (a local POST: well under 0.5 s)
    assert 1.0 <= waits[0] <= 3.0 + 0.5 and 2.0 <= waits[1] <= 6.0 + 0.5
    n = row(nid)
    assert n.status == "dead" and n.last_error.startswith("gave up after 3 attempts: HTTP 500")
    assert len(receiver.requests) == 3


def test_other_4xx_is_final(sqlite_env, receiver):
    receiver.script = [{"status": 400}]
    _, (nid,) = add("webhook", receiver.url)
    assert deliver()["dead"] == 1
    assert deliver()["dead"] == 0 and len(receiver.requests) == 1
    assert row(nid).last_error == "HTTP 400: scripted 400"


def test_a_timeout_is_retried(sqlite_env, receiver):
    receiver.script = [{"sleep": 1.5}]
    _, (nid,) = add("webhook", receiver.url)
    t = utcnow()
    assert deliver(now=t, timeout=0.5)["retry"] == 1 and row(nid).last_error.startswith("timed out")
    assert deliver(now=row(nid).next_attempt_at)["sent"] == 1


def test_a_trickling_receiver_is_cut_off_at_the_deadline_and_retried_from_the_end(sqlite_env, receiver, monkeypatch):
    """Security round 3, H3: headers at once, then a byte every 0.3 s for ever never trips a
    per-read timeout; the POST's total deadline (2 s) does, and the retry counts from then."""
    import app.notify

    monkeypatch.setattr(app.notify.random, "uniform", lambda a, b: 1.0)  # backoff exactly 2 s after attempt 1
    receiver.script = [{"drip": 0.3}]
    _, (nid,) = add("webhook", receiver.url)
    t = utcnow()
    start = time.monotonic()
    assert deliver(now=t, timeout=2.0)["retry"] == 1
    took = time.monotonic() - start
    assert 1.9 < took < 4.0, took
    n = row(nid)
    assert n.last_error == "timed out (no whole answer within 2 s)"
    # due 2 s after the attempt ended, not 2 s after it began
    assert (aware(n.next_attempt_at) - t).total_seconds() >= 2.0 + 1.9


def test_a_huge_reply_is_not_read(sqlite_env, receiver):
    """Security round 3, M1: a 500 with a 200 MB body; the notifier reads at most 4 KB of it and
    closes, so the process never holds the body, and the stored error is short."""
    import tracemalloc

    receiver.script = [{"status": 500, "bytes": 200_000_000}]
    _, (nid,) = add("webhook", receiver.url)
    tracemalloc.start()
    try:
        assert deliver(timeout=30.0)["retry"] == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16_000_000, peak  # bytes allocated at the peak, the receiver's own included: not the 200 MB body
    error = row(nid).last_error
    assert error.startswith("HTTP 500: xxxx") and len(error) < 300, error


def test_receiver_text_cannot_forge_a_log_line(sqlite_env, receiver, caplog):
    """Security round 3, L5: a reply's newline is escaped in the stored error and the log."""
    receiver.script = [{"status": 400, "text": "bad\n[2026-01-01 00:00:00 ERROR/MainProcess] FORGED"}]
    _, (nid,) = add("webhook", receiver.url)
    with caplog.at_level("WARNING"):
        assert deliver()["dead"] == 1
    assert "\n" not in row(nid).last_error and "bad\\n[2026" in row(nid).last_error
    assert not any(line.startswith("[2026") for r in caplog.records for line in r.getMessage().splitlines())


def test_receiver_down_then_back_loses_nothing_and_delivers_once_per_key(db_env, receiver):
    from tests.http.receiver import Receiver
    from tests.loopback import refused_port, serve_in_thread

    with refused_port() as port:  # held until the receiver comes back on it
        _, ids = add("webhook", f"http://127.0.0.1:{port}/hook", n=3)
        t = utcnow()
        # connection refused: the first is retried, the other two wait for its retry untried
        assert deliver(now=t)["retry"] == 1
    assert {row(i).status for i in ids} == {"pending"}
    assert [row(i).attempts for i in ids] == [1, 0, 0]
    assert breaker(ids[0]) == (1, aware(row(ids[0]).next_attempt_at))  # the channel rests until that retry
    back = Receiver()
    server = serve_in_thread(back.app, port)
    try:
        later = t + timedelta(minutes=5)
        assert deliver(now=later)["sent"] == 3
        assert deliver(now=later + timedelta(minutes=5))["sent"] == 0
    finally:
        server.should_exit = True
    keys = [r["headers"]["idempotency-key"] for r in back.requests]
    assert sorted(keys) == sorted(row(i).idempotency_key for i in ids) and len(set(keys)) == 3


def test_slack_needs_ok_and_is_paced_one_per_second(sqlite_env, receiver):
    _, ids = add("slack", receiver.url + "/services/T/B/X", n=3)
    slept = []
    assert deliver(sleep=slept.append)["sent"] == 3
    assert len(slept) == 2 and all(0.9 <= x <= 1.0 for x in slept)  # the 2nd and 3rd wait out the second


def test_discord_404_disables_the_channel(sqlite_env, receiver):
    receiver.script = [{"status": 404}]
    cid, ids = add("discord", receiver.url + "/api/webhooks/1/tok", n=2)
    counts = deliver()
    assert counts["dead"] == 2 and len(receiver.requests) == 1  # the second is not even tried
    assert receiver.requests[0]["query"] == "wait=true"
    with session_scope() as s:
        assert s.get(Channel, cid).enabled is False


def test_unset_secret_reference_waits_for_the_operator(sqlite_env, receiver, monkeypatch):
    monkeypatch.delenv("CANARY_SECRET_P__NOPE_URL", raising=False)
    _, (nid,) = add("webhook", "${CANARY_SECRET_P__NOPE_URL}")
    assert deliver()["retry"] == 1
    assert "refers to ${CANARY_SECRET_P__NOPE_URL}, which is not set" in row(nid).last_error
    monkeypatch.setenv("CANARY_SECRET_P__NOPE_URL", receiver.url)
    assert deliver(now=row(nid).next_attempt_at)["sent"] == 1


@pytest.mark.parametrize("kind", ["slack", "teams", "discord", "webhook", "alertmanager"])
def test_payload_shapes(kind):
    from datetime import UTC, datetime

    from app.channels import AlertMessage, build

    msg = AlertMessage("firing", {"project": "p", "model": "m", "config": "int4", "metric": "ppl_ratio", "severity": "critical"},
                       "fp1", 1.0574, 1.0497, 1.066, 100, "fp16", 110.76, 117.12, "CI low 1.05 ≥ critical 1.03", 7,
                       "http://dash", datetime(2026, 1, 1, tzinfo=UTC))
    p = build(kind, msg)
    text = json.dumps(p, ensure_ascii=False)
    assert "ppl_ratio" in text and "1.057" in text and "1.05–1.066" in text and "fp16" in text and "run_id=7" in text
    if kind == "slack":
        assert set(p) == {"text", "blocks"}
    if kind == "teams":
        card = p["attachments"][0]
        assert p["type"] == "message" and card["contentType"] == "application/vnd.microsoft.card.adaptive"
        assert card["content"]["type"] == "AdaptiveCard" and card["content"]["version"] == "1.2"
        assert len(text.encode()) < 28 * 1024
    if kind == "discord":
        assert len(p["content"]) <= 2000 and p["allowed_mentions"] == {"parse": []}
    if kind == "webhook":
        assert p["version"] == "4" and p["status"] == "firing"
        assert set(p["alerts"][0]) >= {"labels", "annotations", "startsAt", "endsAt", "fingerprint"}
    if kind == "alertmanager":
        assert p[0]["labels"]["alertname"] == "canary_ppl_ratio" and "endsAt" not in p[0]


def test_send_time_check_refuses_without_posting(sqlite_env, receiver, monkeypatch):
    from app.db import session_scope
    from app.models import Channel, Notification, Project
    from app.notify import deliver_due
    from app.settings import get_settings

    with session_scope() as s:
        p = Project(name="p")
        s.add(p)
        s.flush()
        ch = Channel(project_id=p.id, name="hook", kind="webhook", url=receiver.url + "/x")
        s.add(ch)
        s.flush()
        s.add(Notification(channel_id=ch.id, idempotency_key="k", payload={"a": 1}, status="pending"))
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "")  # loopback no longer allow-listed when the row is sent
    get_settings.cache_clear()
    with session_scope() as s:
        assert deliver_due(s)["dead"] == 1
        n = s.query(Notification).one()
        assert n.last_error.startswith("refused: channel 'hook' url: host '127.0.0.1' resolves to loopback")
    assert receiver.requests == []


def test_a_never_tried_notification_is_due_for_the_reconciler(sqlite_env):
    # A crash between the outbox commit and the first send leaves a pending row with no next
    # attempt time: the reconciler must see it as due now, or it would wait forever.
    from app.notify import next_due

    with session_scope() as s:
        assert next_due(s) is None
    before = utcnow()
    _, (nid,) = add("webhook", "http://127.0.0.1:9/hook")
    with session_scope() as s:
        assert before <= next_due(s) <= utcnow()
        s.get(Notification, nid).next_attempt_at = before + timedelta(hours=1)
    with session_scope() as s:
        assert next_due(s) == before + timedelta(hours=1)


def test_a_long_slack_section_is_cut_to_slacks_limit():
    from datetime import UTC, datetime

    from app.channels import AlertMessage, build
    from app.channels.slack import SECTION_LIMIT

    rule = "CI low 1.05 ≥ critical 1.03; " * 200  # a verdict reason of 6000 characters
    msg = AlertMessage("firing", {"project": "p", "model": "m", "config": "int4", "metric": "ppl_ratio",
                                  "severity": "critical"}, "fp1", 1.0574, 1.0497, 1.066, 100, "fp16", 110.76, 117.12,
                       rule, 7, "http://dash", datetime(2026, 1, 1, tzinfo=UTC))
    section = build("slack", msg)["blocks"][1]["text"]["text"]
    assert len(section) == SECTION_LIMIT == 3000 and section.endswith("…")
    assert section.startswith(":red_circle: ppl_ratio = 1.057")  # the figure itself survives the cut


def test_a_projects_backlog_does_not_queue_another_projects_alert(db_env, receiver):
    """Security round 4, N3: a noisy project has five rows due before a quiet project's one; the
    pass takes turns by project, so the quiet one is among the first two posts, not the sixth."""
    _, noisy = add("webhook", receiver.url + "/noisy", n=5, project="noisy")
    _, (quiet,) = add("webhook", receiver.url + "/quiet")
    assert deliver(limit=2)["sent"] == 2
    assert [r["path"] for r in receiver.requests] == ["/noisy", "/quiet"]
    assert row(quiet).status == "sent" and [row(i).status for i in noisy].count("sent") == 1
    assert deliver()["sent"] == 4  # the rest in the next pass, oldest first
    assert [r["path"] for r in receiver.requests][2:] == ["/noisy"] * 4


def test_a_dripping_receiver_costs_one_deadline_and_holds_up_no_other_channel(db_env, receiver):
    """A noisy project's receiver drips its answers; its four rows are due before the quiet
    project's. The first one times out and trips the channel: the other three wait for its retry
    untried, and the quiet row is sent in the same pass (before: four deadlines first)."""
    from tests.http.receiver import Receiver
    from tests.loopback import free_port, serve_in_thread

    dripping = Receiver()
    dripping.script = [{"drip": 0.2}] * 4
    port = free_port()
    server = serve_in_thread(dripping.app, port)
    try:
        _, noisy = add("webhook", f"http://127.0.0.1:{port}/hook", n=4, project="noisy")
        _, (quiet,) = add("webhook", receiver.url + "/quiet")
        t = utcnow()
        assert deliver(now=t, timeout=1.0) == {"sent": 1, "retry": 1, "dead": 0}
    finally:
        server.should_exit = True
    assert row(quiet).status == "sent" and len(dripping.requests) == 1
    assert [row(i).attempts for i in noisy] == [1, 0, 0, 0]
    assert breaker(noisy[0]) == (1, aware(row(noisy[0]).next_attempt_at))
    assert deliver(now=t)["retry"] == 0  # nothing of that channel is due before the retry


def test_a_cooling_channel_holds_rows_created_after_it_tripped(db_env, receiver, monkeypatch):
    """The breaker is the channel's, not its rows': a row created while the channel cools down
    waits for the cool-down untried (before: posted at once, another deadline on a dead receiver),
    and next_due names the cool-down's end, not now."""
    import app.notify
    from app.notify import next_due

    monkeypatch.setattr(app.notify.random, "uniform", lambda a, b: 1.0)  # backoffs exactly 2 s, 4 s, 8 s
    receiver.script = [{"status": 503}]
    cid, (first,) = add("webhook", receiver.url + "/hook")
    t = utcnow()
    assert deliver(now=t)["retry"] == 1
    strikes, until = breaker(first)
    assert strikes == 1 and 2.0 <= (until - t).total_seconds() < 3.0
    with session_scope() as s:  # an alert of a later run, on the same channel
        s.add(Notification(channel_id=cid, idempotency_key="later", payload={"text": "later"}, status="pending"))
    with session_scope() as s:
        assert next_due(s) == until  # not now: the new row is held by the channel
    assert deliver(now=t + timedelta(seconds=1)) == {"sent": 0, "retry": 0, "dead": 0}
    assert len(receiver.requests) == 1
    assert deliver(now=until) == {"sent": 2, "retry": 0, "dead": 0}  # half-open: the receiver is back
    assert breaker(first) == (0, None)


def test_the_cool_down_doubles_with_each_strike_in_a_row_and_a_quick_success_resets_it(db_env, receiver,
                                                                                        monkeypatch):
    """Each row gets one attempt (max_attempts=1), so every failure is a new row's first: by its
    own attempts each would rest the channel 2 s, and before, the three were posted in one pass.
    The channel's strikes in a row give 2, 4, 8 s, and one quick 200 closes it."""
    import app.notify

    monkeypatch.setattr(app.notify.random, "uniform", lambda a, b: 1.0)
    receiver.script = [{"status": 500}] * 3
    _, ids = add("webhook", receiver.url + "/hook", n=5)
    t = utcnow()
    rests = []
    for _ in range(3):
        assert deliver(now=t, max_attempts=1) == {"sent": 0, "retry": 0, "dead": 1}
        _, until = breaker(ids[0])
        rests.append(round((until - t).total_seconds()))
        t = until
    assert rests == [2, 4, 8] and len(receiver.requests) == 3
    assert [row(i).status for i in ids] == ["dead"] * 3 + ["pending"] * 2
    assert deliver(now=t)["sent"] == 2 and breaker(ids[0]) == (0, None)


def test_a_slow_but_successful_receiver_rests_for_its_cool_down(db_env, receiver):
    """A receiver that answers 200 after more than half the deadline delivers that row and opens
    the breaker: its next rows wait for the cool-down (before: one pass, then a slow post each
    pass again); a quiet project's row in the same pass is not held."""
    receiver.script = [{"sleep": 0.7}]
    _, slow = add("webhook", receiver.url + "/slow", n=3, project="noisy")
    _, (quiet,) = add("webhook", receiver.url + "/quiet")
    t = utcnow()
    assert deliver(now=t, timeout=1.0) == {"sent": 2, "retry": 0, "dead": 0}
    assert row(slow[0]).status == "sent" and row(quiet).status == "sent"
    strikes, until = breaker(slow[0])
    assert strikes == 1 and until > t
    assert deliver(now=t + timedelta(milliseconds=1)) == {"sent": 0, "retry": 0, "dead": 0}  # still cooling
    assert deliver(now=until, timeout=1.0) == {"sent": 2, "retry": 0, "dead": 0}  # quick now: closed again
    assert breaker(slow[0]) == (0, None)


def test_a_receiver_that_keeps_answering_slowly_keeps_a_short_rest(db_env, receiver, monkeypatch):
    """Slow but delivering, again and again: each slow answer rests the channel one strike's
    cool-down (2 s), not a doubling one, so a backlog still drains (a failure's count doubles)."""
    import app.notify

    monkeypatch.setattr(app.notify.random, "uniform", lambda a, b: 1.0)
    receiver.script = [{"sleep": 0.6}] * 3
    _, ids = add("webhook", receiver.url + "/slow", n=3)
    t = utcnow()
    for _ in range(3):
        assert deliver(now=t, timeout=1.0)["sent"] == 1
        strikes, until = breaker(ids[0])
        assert strikes == 1 and 2.0 <= (until - t).total_seconds() < 3.5
        t = until
    assert [row(i).status for i in ids] == ["sent"] * 3


def test_a_final_answer_closes_the_breaker_a_quick_one_at_least(db_env, receiver, monkeypatch):
    """A 503 opens the breaker; after the cool-down the probe gets a quick 400 (the receiver is up,
    the message is wrong): the row is dead and the breaker closed, so the next row goes at once."""
    import app.notify

    monkeypatch.setattr(app.notify.random, "uniform", lambda a, b: 1.0)
    receiver.script = [{"status": 503}, {"status": 400}]
    _, ids = add("webhook", receiver.url + "/hook", n=2)
    t = utcnow()
    assert deliver(now=t)["retry"] == 1
    _, until = breaker(ids[0])
    assert deliver(now=until) == {"sent": 1, "retry": 0, "dead": 1}
    assert breaker(ids[0]) == (0, None) and [row(i).status for i in ids] == ["dead", "sent"]
