"""Scheduled evals under a controllable clock: a new schedule waits for its next slot; each slot
runs exactly once (a second beat or a retried tick changes nothing); after beat was down for
days, the missed slots run once, not once per missed tick. Runs are real rows; the dispatcher
only records what it would enqueue."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from app.config_file import ConfigFileError, parse_config
from app.db import session_scope
from app.models import Run
from app.schedules import latest_slot, tick
from app.services import apply_config_file
from sqlalchemy import select

T0 = datetime(2026, 3, 2, 5, 0, tzinfo=UTC)  # a Monday, 05:00


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, task, *args, priority=3):
        self.sent.append((task, args))


def config(cron: str = "0 6 * * *") -> dict:
    return {"project": "p", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "fp16", "baseline": True}, {"name": "int4", "weights": "rtn-int4"}],
            "suites": [{"name": "daily", "corpus": "builtin:pydoc-heldout", "samples": 100}],
            "schedules": [{"name": "every-morning", "cron": cron, "suite": "daily", "configs": ["int4"]}]}


def runs() -> list[tuple[str, int, str]]:
    with session_scope() as s:
        return [(r.trigger, r.n_samples, r.idempotency_key) for r in s.scalars(select(Run).order_by(Run.id))]


def test_latest_slot_by_hand():
    assert latest_slot("0 6 * * *", T0) == T0 - timedelta(hours=23)  # yesterday 06:00
    assert latest_slot("0 6 * * *", T0 + timedelta(hours=1)) == T0 + timedelta(hours=1)  # exactly on the slot
    assert latest_slot("0 3 * * 0", T0) == datetime(2026, 3, 1, 3, 0, tzinfo=UTC)  # weekly: Sunday 03:00


def test_each_slot_runs_exactly_once_and_missed_slots_once(sqlite_env):
    with session_scope() as s:
        apply_config_file(s, parse_config(config()))
    d = Recorder()
    assert tick(session_scope, d, T0) == []  # first sight: the schedule waits for its next slot
    assert tick(session_scope, d, T0 + timedelta(minutes=59)) == []
    first = tick(session_scope, d, T0 + timedelta(hours=1, minutes=1))  # 06:01: today's slot is due
    assert len(first) == 1
    assert tick(session_scope, d, T0 + timedelta(hours=1, minutes=2)) == []  # the next minute's tick
    assert tick(session_scope, d, T0 + timedelta(hours=1, minutes=1)) == []  # a second beat, same instant
    # beat down for three days: Tuesday, Wednesday and Thursday 06:00 were missed → one run
    late = tick(session_scope, d, T0 + timedelta(days=3, hours=2))
    assert len(late) == 1
    assert tick(session_scope, d, T0 + timedelta(days=3, hours=2, minutes=1)) == []
    got = runs()
    assert [(t, n) for t, n, _ in got] == [("schedule", 100), ("schedule", 100)]
    assert got[1][2].endswith((T0 + timedelta(days=3, hours=1)).isoformat())  # the latest missed slot
    assert len([x for x in d.sent if x[0] == "canary.execute_config_run"]) == 4  # baseline + int4, twice


@pytest.mark.parametrize("cron", ["0 6 * *", "61 6 * * *", "every day", "0 6 * * * *"])
def test_a_cron_that_does_not_parse_names_the_field(cron):
    with pytest.raises(ConfigFileError, match=r"schedules\[0\].cron: '.*' is not a valid five-field cron expression"):
        parse_config(config(cron))
