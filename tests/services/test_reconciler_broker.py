"""The reconciler re-sends only what the broker lost (security round 4, N5), read from a real Redis
broker that Celery's own client wrote to: a backlog waiting its turn (in a queue, or delivered to a
worker and not yet acknowledged) is left alone, a lost message is re-sent once, at the priority
its config-run was first sent with. Nothing consumes this Redis database (tests/services/conftest.py
SPARE_REDIS_URL), so the messages stay where the test puts them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from app.broker import _first_arg, held_args, queue_keys
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import EXECUTE_CONFIG_RUN, CeleryDispatcher
from app.models import ConfigRun, utcnow
from app.services import apply_config_file, start_run
from sqlalchemy import select, update
from workers.tasks import reconcile

from tests.services.conftest import SPARE_REDIS_URL


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, task, *args, priority=3):
        self.sent.append((task, args[0], priority))


@pytest.fixture
def broker(sqlite_env, monkeypatch):
    import redis
    from app.settings import get_settings

    client = redis.Redis.from_url(SPARE_REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as e:
        from tests.conftest import service_unavailable

        service_unavailable("Redis", SPARE_REDIS_URL, e)
    client.flushdb()
    monkeypatch.setenv("CANARY_BROKER_URL", SPARE_REDIS_URL)
    monkeypatch.setenv("CANARY_EXECUTION", "celery")
    monkeypatch.setenv("CANARY_FAIR_SHARE_QUEUED_CONFIG_RUNS", "2")
    get_settings.cache_clear()
    yield client
    client.flushdb()
    get_settings.cache_clear()


def test_a_waiting_backlog_is_left_alone_and_a_lost_message_is_resent_at_its_priority(broker):
    from app.settings import get_settings

    with session_scope() as s:
        apply_config_file(s, parse_config({
            "project": "noisy", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "base", "baseline": True}, {"name": "int8", "weights": "int8"},
                        {"name": "rtn", "weights": "rtn-int4"}, {"name": "fp16", "weights": "fp16"}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4}]}))
    # the project's first run, four config-runs: its fair share (2) at priority 3, the rest one step behind
    run_id, _ = start_run("noisy", "s", None, CeleryDispatcher(get_settings()))
    with session_scope() as s:
        rows = list(s.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id).order_by(ConfigRun.id)))
        ids = [r.id for r in rows]
        assert [r.priority for r in rows] == [3, 3, 6, 6]
    assert held_args(SPARE_REDIS_URL, EXECUTE_CONFIG_RUN).waiting == set(ids)
    # every one waited past requeue_after_seconds (a backlog): none is lost, none is sent again
    old = utcnow() - timedelta(hours=1)
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.run_id == run_id).values(enqueued_at=old))
    assert reconcile(dispatcher=Recorder()) == 0
    # a worker took the third one and has not acknowledged it: still held, in `unacked`
    from kombu import Connection

    with Connection(SPARE_REDIS_URL, transport_options={"priority_steps": [0, 3, 6, 9]}) as conn:
        queue = conn.SimpleQueue("gpu")
        taken = [queue.get(timeout=5) for _ in range(3)]  # priority 3 first, then the first of 6
        taken_ids = [m.payload[0][0] if isinstance(m.payload, list) else None for m in taken]
        assert taken_ids[:2] == ids[:2]
        for message in taken[:2]:
            message.ack()  # those two ran: their rows are no longer queued
        with session_scope() as s:
            s.execute(update(ConfigRun).where(ConfigRun.id.in_(ids[:2])).values(status="succeeded"))
        # the fourth message is lost (a broker restart without persistence, a flushed key)
        lost = ids[3]
        for key in queue_keys("gpu"):
            for item in broker.lrange(key, 0, -1):
                if _first_arg(json.loads(item), EXECUTE_CONFIG_RUN) == lost:
                    broker.lrem(key, 0, item)
        held = held_args(SPARE_REDIS_URL, EXECUTE_CONFIG_RUN)
        assert (held.waiting, held.unacked) == (set(), {ids[2]})  # the unacknowledged one
        recorder = Recorder()
        assert reconcile(dispatcher=recorder) == 1
        assert recorder.sent == [(EXECUTE_CONFIG_RUN, lost, 6)]  # its own priority, not its trigger's 3
        queue.close()


def test_without_a_readable_broker_the_reconciler_resends_by_age(sqlite_env):
    # the embedded default has no broker: a config-run queued past the cutoff is re-sent, as before
    with session_scope() as s:
        apply_config_file(s, parse_config({
            "project": "p", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "base", "baseline": True}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4}]}))
    run_id, _ = start_run("p", "s", None, Recorder())
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.run_id == run_id).values(enqueued_at=utcnow() - timedelta(hours=1)))
    recorder = Recorder()
    assert reconcile(dispatcher=recorder) == 1 and recorder.sent[0][2] == 3
    assert held_args(None, EXECUTE_CONFIG_RUN) is None and held_args("amqp://x", EXECUTE_CONFIG_RUN) is None


def test_a_message_spent_on_another_projects_turn_is_not_counted_lost(broker):
    """Noisy's message for A ran quiet's Q in its place (repo.fair_pick). A stays queued without a message of its own; Q's message, still waiting, is the turn A
    gets. The reconciler counts it: nothing is re-sent (before: A re-sent, one message too many)."""
    from app.settings import get_settings

    with session_scope() as s:
        for name in ("noisy", "quiet"):
            apply_config_file(s, parse_config({
                "project": name, "model": {"name": "tiny", "path": "builtin:pydoc-target"},
                "configs": [{"name": "base", "baseline": True}],
                "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4}]}))
    dispatcher = CeleryDispatcher(get_settings())
    noisy_run, _ = start_run("noisy", "s", None, dispatcher)
    quiet_run, _ = start_run("quiet", "s", None, dispatcher)
    with session_scope() as s:
        (a,) = s.scalars(select(ConfigRun.id).where(ConfigRun.run_id == noisy_run))
        (q,) = s.scalars(select(ConfigRun.id).where(ConfigRun.run_id == quiet_run))
    # A's message was taken and acknowledged, Q ran in its place and finished
    for key in queue_keys("gpu"):
        for item in broker.lrange(key, 0, -1):
            if _first_arg(json.loads(item), EXECUTE_CONFIG_RUN) == a:
                broker.lrem(key, 0, item)
    old = utcnow() - timedelta(hours=1)
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id == q).values(status="succeeded"))
        s.execute(update(ConfigRun).where(ConfigRun.id == a).values(enqueued_at=old))
    recorder = Recorder()
    assert reconcile(dispatcher=recorder) == 0 and recorder.sent == []
    # Q's message gone too (the broker lost it): now A is lost, and re-sent once
    for key in queue_keys("gpu"):
        broker.delete(key)
    assert reconcile(dispatcher=recorder) == 1 and recorder.sent == [(EXECUTE_CONFIG_RUN, a, 3)]
