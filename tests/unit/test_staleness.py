"""The canary watches itself (app/staleness.py): a daily schedule created Monday 05:00 owes its
first successful run at Monday 06:00 (the first slot after creation) and is stale once that is
overdue by a period, Tuesday 06:00; a run that succeeds moves the heartbeat. Worked by hand
with a controllable clock; the runs are real rows and the channel a real outbox row."""

from __future__ import annotations

from datetime import datetime, timedelta

from app.config_file import parse_config
from app.db import session_scope
from app.models import Notification, Run, Schedule
from app.schedules import tick
from app.services import apply_config_file
from app.staleness import notify_stale, schedule_health
from sqlalchemy import select, update

from tests.unit.test_schedules import T0, Recorder, config

H = timedelta(hours=1)


def _setup() -> None:
    cfg = {**config(), "channels": [{"name": "oncall", "kind": "webhook", "url": "http://127.0.0.1:9/hook"}]}
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg))
        s.execute(update(Schedule).values(created_at=T0))  # Monday 05:00


def _health(now):
    with session_scope() as s:
        (h,) = schedule_health(s, now)
        return h


def _notify(now) -> list[tuple[str, str]]:
    with session_scope() as s:
        ids = notify_stale(s, now)
        return [(n.payload["status"], n.payload["text"] if "text" in n.payload else str(n.payload))
                for n in s.scalars(select(Notification).where(Notification.id.in_(ids)))]


def _succeed(run_id: int, at: datetime) -> None:
    with session_scope() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status="done", finished_at=at))


def test_a_schedule_with_no_success_is_stale_one_period_after_its_first_due_run(sqlite_env):
    _setup()
    h = _health(T0 + 2 * H)
    assert (h.heartbeat, h.due, h.period, h.last_success_run_id) == (T0, T0 + H, 24 * H, None)
    assert not _health(T0 + 25 * H).stale  # Tuesday 06:00 exactly: overdue by one period, not more
    assert _health(T0 + 25 * H + timedelta(seconds=1)).stale
    assert "no successful run since it was created 2026-03-02 05:00 UTC" in _health(T0 + 26 * H).reason()


def test_a_success_moves_the_heartbeat_and_the_channel_hears_each_change_once(sqlite_env):
    _setup()
    d = Recorder()
    tick(session_scope, d, T0)
    (run_id,) = tick(session_scope, d, T0 + H + timedelta(minutes=1))  # Monday 06:01
    assert _notify(T0 + 2 * H) == []  # not stale: nothing said
    # the run never finishes (a worker that never came back): stale after Tuesday 06:00
    fired = _notify(T0 + 26 * H)
    assert [kind for kind, _ in fired] == ["firing"] and "schedule 'every-morning'" in fired[0][1]
    with session_scope() as s:  # the message's headline names the schedule (it has no model or metric to name)
        [message] = [n.payload for n in s.scalars(select(Notification)) if n.payload["status"] == "firing"]
    assert message["commonAnnotations"]["summary"] == (
        "[FIRING critical] CanaryStale: schedule 'every-morning' of project 'p' has not succeeded for over a period")
    assert message["alerts"][0]["annotations"]["runbook_url"] == "docs/runbooks.md#canarystale"  # app/runbooks.py
    assert _notify(T0 + 27 * H) == []  # still stale: no second message
    _succeed(run_id, T0 + 28 * H)  # Tuesday 09:00 it ends
    h = _health(T0 + 29 * H)
    assert (h.heartbeat, h.due, h.last_success_run_id, h.stale) == (T0 + 28 * H, T0 + 49 * H, run_id, False)
    assert [kind for kind, _ in _notify(T0 + 29 * H)] == ["resolved"]
    assert _notify(T0 + 30 * H) == []


def test_a_stale_schedule_is_a_metric_for_prometheus(sqlite_env):
    from app.prometheus import CanaryCollector
    from prometheus_client import CollectorRegistry, generate_latest

    _setup()
    registry = CollectorRegistry()
    registry.register(CanaryCollector(session_scope))
    text = generate_latest(registry).decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("canary_schedule_")}
    # created 2026-03-02 05:00 and, today, long overdue
    assert values == {'canary_schedule_stale{project="p",schedule="every-morning"}': 1.0,
                      'canary_schedule_last_success_timestamp_seconds{project="p",schedule="every-morning"}':
                          T0.timestamp()}
